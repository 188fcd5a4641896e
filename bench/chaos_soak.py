"""Soak: the real vLLM 0.33 scheduler + worker connector at constant load for a
fixed time, over a ``faulty``-wrapped ``local`` pool that is small enough to
evict and injects a trickle of failures and planted corruption. Samples what
the process holds (RSS, open files by kind, threads, /dev/shm) and reports the
growth between the end of the warm-up and the end of the run.

    .venv/bin/python bench/chaos_soak.py --seconds 600     # `make chaos`
    .venv/bin/python bench/chaos_soak.py --seconds 60      # a quick look

Exit status 1 when a bound is exceeded (RSS growth, any fd/thread/shm growth,
a request that did not finish, or KV that differs from the model's).
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "chaos"))
from chaos_scenarios import BS, exact, faulty_extra, run_timed

from ascendstore.chaos import shm_entries, snapshot
from ascendstore.engine import EngineMetrics

app = typer.Typer(add_completion=False)
MiB = 1 << 20
#: two backend clients (scheduler + worker), each guard starts up to max_stuck + 4 threads on demand
GUARD_THREADS = 2 * 8


@app.command()
def main(
    seconds: float = typer.Option(600, help="length of the run after warm-up"),
    warmup: float = typer.Option(30, help="seconds of load before the baseline sample"),
    sample_every: float = typer.Option(30, help="seconds between samples"),
    batch: int = typer.Option(8, help="requests per wave (constant load)"),
    rss_bound_mib: float = typer.Option(64, help="allowed RSS growth after warm-up"),
    json_out: str = typer.Option("", help="write the samples and the summary here"),
) -> None:
    from ascendstore_vllm.testing import EngineHarness, EngineSpec

    console = Console()
    pool = f"soak-{uuid.uuid4().hex[:8]}"
    # ~40 chunks of 8 KiB fit: the recurring prompts (12 x 6 chunks) do not, so
    # the pool evicts all the time; 2% of gets fail and 2% of objects are damaged.
    extra = faulty_extra(pool, capacity="320KiB", checksum=True, seed=1,
                         fail_rate={"get": 0.02, "put": 0.02}, corrupt_rate=0.02)
    eng = EngineHarness(EngineSpec(extra_config=extra, num_blocks=256, max_num_seqs=16))
    rng = np.random.default_rng(0)
    recurring = [rng.integers(10, 900, 6 * BS + 4).tolist() for _ in range(12)]
    counts = {"requests": 0, "finished": 0, "inexact": 0, "waves": 0, "failed_step_reads": 0}
    samples: list[dict] = []
    base = None
    t_start = time.monotonic()
    t_end = t_start + warmup + seconds
    next_sample = t_start + warmup
    step_times: list[float] = []
    engine_stats: dict[str, float] = {}
    try:
        while time.monotonic() < t_end:
            wave = []
            for i in range(batch):
                # half repeat (pool hits), half new (misses that fill and evict)
                p = recurring[int(rng.integers(0, len(recurring)))] if i % 2 else rng.integers(
                    10, 900, 6 * BS + 4).tolist()
                rid = f"w{counts['waves']}-{i}"
                eng.add_request(rid, p)
                wave.append((rid, p))
            times = run_timed(eng, timeout_s=120)
            step_times.extend(times)
            engine_stats = EngineMetrics.merge(engine_stats, eng.stats_total())
            counts["waves"] += 1
            counts["requests"] += len(wave)
            for w in eng.workers:  # read checks of steps whose loads failed (discarded by vLLM)
                counts["failed_step_reads"] += len(w.read_errors)
                w.read_errors.clear()
            for rid, p in wave:
                counts["finished"] += rid in eng.snapshots
                counts["inexact"] += not exact(eng, rid, p)
                eng.snapshots.pop(rid, None)  # the harness keeps copies; the soak must not
            # keep the harness's own bookkeeping flat (it records every step)
            eng.records.clear()
            eng.finished.clear()
            for d in (eng.tokens, eng.prompt_len, eng.block_ids, eng._computed):
                for rid, _ in wave:
                    d.pop(rid, None)
            eng.scheduler.reset_prefix_cache()
            if time.monotonic() >= next_sample:
                snap = snapshot(shm_prefix="ascendstore")
                base = base or snap
                row = {
                    "t_s": round(time.monotonic() - t_start, 1),
                    "rss_mib": round(snap.rss_bytes / MiB, 1),
                    "fds": snap.fds,
                    "sockets": snap.fd_kinds.get("socket", 0),
                    "threads": snap.threads,
                    "shm_files": len(shm_entries()),
                    **counts,
                }
                samples.append(row)
                console.print(row)
                next_sample += sample_every
    finally:
        eng.close()
    last = snapshot(shm_prefix="ascendstore")
    samples.append({"t_s": round(time.monotonic() - t_start, 1), "rss_mib": round(last.rss_bytes / MiB, 1),
                    "fds": last.fds, "sockets": last.fd_kinds.get("socket", 0), "threads": last.threads,
                    "shm_files": len(shm_entries()), "after_close": True, **counts})
    assert base is not None, "the run ended before the first sample: raise --seconds"
    running = samples[:-1] if len(samples) > 1 else samples
    end, mid = running[-1], running[len(running) // 2]

    def grown(a: dict, b: dict) -> dict:
        return {"rss_mib": round(b["rss_mib"] - a["rss_mib"], 1), "fds": b["fds"] - a["fds"],
                "threads": b["threads"] - a["threads"]}

    growth = grown(running[0], end)
    # reported to tell a leak (keeps growing) from a lazily filled pool (the
    # guards start threads on demand after a timeout, up to their bound)
    growth_2nd_half = grown(mid, end)
    table = Table(title=f"soak: {seconds:.0f} s at {batch} requests/wave after {warmup:.0f} s warm-up")
    for col in ("t_s", "rss_mib", "fds", "sockets", "threads", "shm_files", "requests", "inexact"):
        table.add_column(col, justify="right")
    for r in samples:
        table.add_row(*(str(r[c]) for c in ("t_s", "rss_mib", "fds", "sockets", "threads", "shm_files",
                                             "requests", "inexact")))
    console.print(table)
    leaked_shm = [s for s in shm_entries() if pool in s]
    st = sorted(step_times)
    hit = engine_stats.get("lookup_hit_tokens", 0)
    summary = {
        "counts": counts, "growth_after_warmup": growth, "growth_second_half": growth_2nd_half,
        "pool_shm_left_after_close": leaked_shm,
        "steps": len(st), "step_p50_s": round(st[len(st) // 2], 4), "step_p99_s": round(st[int(len(st) * 0.99)], 4),
        "step_max_s": round(st[-1], 3),
        "hit_rate": round(hit / max(1.0, hit + engine_stats.get("lookup_miss_tokens", 0)), 3),
        "engine": {k: engine_stats.get(k, 0) for k in ("load_ops", "load_failures", "save_ops", "save_failures",
                                                       "save_no_space", "timeouts", "unavailable")},
    }
    console.print(summary)
    if json_out:
        Path(json_out).write_text(json.dumps({"samples": samples, "summary": summary}, indent=1))
    problems = []
    if growth["rss_mib"] > rss_bound_mib:
        problems.append(f"RSS grew {growth['rss_mib']} MiB (> {rss_bound_mib})")
    if growth["fds"] > 0:
        problems.append(f"open files grew: {growth}")
    if growth["threads"] > GUARD_THREADS:
        problems.append(f"threads grew beyond the guards' bounded pools ({GUARD_THREADS}): {growth}")
    if counts["finished"] != counts["requests"] or counts["inexact"]:
        problems.append(f"requests unfinished or inexact: {counts}")
    if leaked_shm:
        problems.append(f"shared memory left after close: {leaked_shm}")
    if problems:
        console.print("[red]SOAK FAILED[/red]: " + "; ".join(problems))
        raise typer.Exit(1)
    console.print("[green]soak OK[/green]")


if __name__ == "__main__":
    app()
