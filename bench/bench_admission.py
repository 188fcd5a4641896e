"""Save admission on the trace workload: pool hit rate and bytes written with and
without ``admit_after_hits`` / ``save_budget_bytes_per_step``.

Each configuration runs ``ascendstore bench --workload trace`` (vLLM's real
scheduler and connector, the embedded ``local`` pool sized to a fraction of the
workload's working set) in its own process; configurations are interleaved
within each round, so machine load hits all of them alike. Prints, per pool
capacity and configuration, the range over rounds of: pool hit tokens (share of
prompt tokens), prefill saved, bytes written and loaded, and chunks admission
skipped.

    .venv/bin/python bench/bench_admission.py --rounds 2 --capacity 0.5,1.0
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

CONFIGS: dict[str, dict] = {
    "baseline": {},
    "admit_after_hits=2": {"admit_after_hits": 2},
    "budget 32KiB/step": {"save_budget_bytes_per_step": "32KiB"},
    "admit 2 + budget": {"admit_after_hits": 2, "save_budget_bytes_per_step": "32KiB"},
}


def run(cfg: dict, capacity: float, seed: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "ascendstore.cli", "bench", "-w", "trace", "-q", "--seed", str(seed),
           "--pool-capacity", str(capacity), "--kv-transfer-config", json.dumps(cfg), "--json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def span(vals: list[float], fmt: str) -> str:
    lo, hi = min(vals), max(vals)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)} - {fmt.format(hi)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--capacity", default="0.5,1.0", help="pool capacities (fractions of the working set)")
    ap.add_argument("--json", type=Path, help="write every run's figures here")
    args = ap.parse_args()
    caps = [float(c) for c in args.capacity.split(",")]
    rows: dict[tuple[float, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for cap in caps:
                for name, cfg in CONFIGS.items():
                    rep = run(cfg, cap, seed=rnd, out=Path(tmp) / "r.json")
                    cs = rep["connector_stats"]
                    fig = {
                        "round": rnd, "capacity": cap, "config": name,
                        "pool_hit_ratio": rep["hit_tokens"]["pool"] / rep["prompt_tokens"],
                        "saved_ratio": rep["prefill_tokens_saved_ratio"],
                        "bytes_saved": rep["bytes_saved"], "bytes_loaded": rep["bytes_loaded"],
                        "skipped_admission": cs.get("save_skipped_admission", 0),
                        "skipped_budget": cs.get("save_skipped_budget", 0),
                        "kv_mismatches": rep["kv_mismatches"],
                    }
                    print(json.dumps(fig), flush=True)
                    rows.setdefault((cap, name), []).append(fig)
    if args.json:
        args.json.write_text(json.dumps([f for v in rows.values() for f in v], indent=1))
    t = Table(title=f"trace workload, local pool, {args.rounds} rounds (ranges)")
    for col in ("capacity", "config", "pool hit", "prefill saved", "written MiB", "loaded MiB",
                "skipped (admission / budget)"):
        t.add_column(col)
    for (cap, name), figs in rows.items():
        t.add_row(
            f"{cap:.2f}", name,
            span([100 * f["pool_hit_ratio"] for f in figs], "{:.1f}%"),
            span([100 * f["saved_ratio"] for f in figs], "{:.1f}%"),
            span([f["bytes_saved"] / 2**20 for f in figs], "{:.1f}"),
            span([f["bytes_loaded"] / 2**20 for f in figs], "{:.1f}"),
            span([f["skipped_admission"] for f in figs], "{:.0f}") + " / "
            + span([f["skipped_budget"] for f in figs], "{:.0f}"),
        )
    Console().print(t)


if __name__ == "__main__":
    main()
