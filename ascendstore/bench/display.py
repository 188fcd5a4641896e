"""Terminal table and PNG plots of benchmark reports."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from ascendstore.bench.report import BenchReport


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def report_table(report: BenchReport) -> Table:
    r = report
    t = Table(title=f"ascendstore bench: {r.workload} on {r.backend} ({r.granularity}-granular)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [
        ("requests", f"{r.requests}"),
        ("prompt tokens", f"{r.prompt_tokens}"),
        (
            "hit tokens: device (HBM prefix cache)",
            f"{r.hit_tokens.device}  ({_pct(r.hit_tokens.device / max(1, r.prompt_tokens))})",
        ),
        ("hit tokens: pool", f"{r.hit_tokens.pool}  ({_pct(r.hit_tokens.pool / max(1, r.prompt_tokens))})"),
        ("prefill tokens saved", _pct(r.prefill_tokens_saved_ratio)),
        ("infinite-cache bound", _pct(r.infinite_cache_bound_ratio)),
        ("saved / bound", _pct(r.bound_efficiency)),
        ("pool load errors (recomputed tokens)", f"{r.load_errors}"),
        ("lookup latency p50 / p99", f"{r.lookup_latency_us.p50:.0f} / {r.lookup_latency_us.p99:.0f} us"),
        ("bytes loaded / saved", f"{_bytes(r.bytes_loaded)} / {_bytes(r.bytes_saved)}"),
        ("load / save GB/s (wall)", f"{r.load_gbps:.2f} / {r.save_gbps:.2f}"),
        ("KV bytes verified byte-for-byte", f"{_bytes(r.kv_bytes_verified)}  ({r.kv_mismatches} mismatches)"),
        ("modeled TTFT speedup", f"{r.modeled.ttft_speedup:.2f}x"),
        ("connector overhead ratio", f"{r.connector_overhead_ratio:.3f}  ({r.connector_s:.2f} s wall)"),
        ("wall time", f"{r.wall_s:.1f} s"),
    ]
    b = r.backend_stats
    if "hits" in b:
        tiers = f"{b['hits'] - b.get('disk_hits', 0):.0f} DRAM"
        if "disk_hits" in b:
            tiers += f" / {b['disk_hits']:.0f} disk"
        if "evictions" in b:
            tiers += f", {b['evictions']:.0f} evicted"
        rows.insert(4, ("pool objects hit by tier (backend)", tiers))
    if r.pool_capacity_fraction is not None:
        rows.insert(
            5,
            (
                "pool capacity",
                f"{_pct(r.pool_capacity_fraction)} of working set ({_bytes(r.pool_capacity_bytes or 0)})",
            ),
        )
    g = r.gr
    if g is not None:
        lookups = g["device_hits"] + g["dram_hits"] + g["dram_misses"]
        at = rows.index(("pool load errors (recomputed tokens)", f"{r.load_errors}"))
        rows[at:at] = [
            (
                "GR hits: device / DRAM / miss",
                f"{g['device_hits']} / {g['dram_hits']} / {g['dram_misses']}  "
                f"({_pct((g['device_hits'] + g['dram_hits']) / max(1, lookups))} hit)",
            ),
            ("GR lru_evictions", f"{g['lru_evictions']}"),
            ("GR dram_hits / dram_misses", f"{g['dram_hits']} / {g['dram_misses']}"),
            ("GR swapin_attempts / swapin_successes", f"{g['swapin_attempts']} / {g['swapin_successes']}"),
        ]
    for k, v in rows:
        t.add_row(k, v)
    return t


def sweep_table(reports: Sequence[BenchReport]) -> Table:
    """One row per run: the granularity x pool-capacity comparison."""
    bounds = sorted({_pct(r.infinite_cache_bound_ratio) for r in reports})
    t = Table(title=f"pool granularity x capacity (infinite-cache bound {', '.join(bounds)})")
    cols = ["gran.", "cap.", "device", "pool", "saved"]
    gr = any(r.gr is not None for r in reports)
    if gr:  # the GR three-level hits (requests) and the design's counters
        cols += ["GR d/p/miss", "lru_ev", "swapin"]
    for col in cols:
        t.add_column(col, justify="right", no_wrap=True)
    for r in reports:
        cap = "-" if r.pool_capacity_fraction is None else _pct(r.pool_capacity_fraction)
        row = [
            r.granularity,
            cap,
            _pct(r.hit_tokens.device / max(1, r.prompt_tokens)),
            _pct(r.hit_tokens.pool / max(1, r.prompt_tokens)),
            _pct(r.prefill_tokens_saved_ratio),
        ]
        if gr:
            g = r.gr
            row += (
                [f"{g['device_hits']}/{g['dram_hits']}/{g['dram_misses']}", f"{g['lru_evictions']}",
                 f"{g['swapin_successes']}/{g['swapin_attempts']}"]
                if g is not None else ["-", "-", "-"]
            )
        t.add_row(*row)
    return t


def print_report(report: BenchReport, console: Console | None = None) -> None:
    console = console or Console()
    console.print(report_table(report))
    for note in report.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)


def _rolling(x: np.ndarray, w: int) -> np.ndarray:
    if len(x) == 0:
        return x
    w = max(1, min(w, len(x)))
    c = np.cumsum(np.insert(x.astype(np.float64), 0, 0.0))
    out = np.empty(len(x))
    for i in range(len(x)):
        lo = max(0, i + 1 - w)
        out[i] = c[i + 1] - c[lo]
    return out


def write_plots(report: BenchReport, out_dir: str | Path) -> list[Path]:
    """hit_rate.png (over time), tiers.png (per-tier breakdown), lookup_cdf.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{report.workload} on {report.backend}"
    recs = report.per_request
    paths = []

    # hit rate over (modeled) time: token-weighted rolling window of requests.
    t = np.array([r.scheduled_s for r in recs])
    prompt = np.array([r.prompt_tokens for r in recs])
    w = max(10, len(recs) // 20)
    den = np.maximum(1, _rolling(prompt, w))
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, vals, style in (
        (
            "infinite-cache bound",
            [r.bound_hit for r in recs],
            dict(color="black", linestyle="--", linewidth=1),
        ),
        ("device + pool", [r.device_hit + r.pool_hit for r in recs], dict(color="tab:blue", linewidth=2)),
        ("device only", [r.device_hit for r in recs], dict(color="tab:green", linewidth=1)),
    ):
        ax.plot(t, 100 * _rolling(np.array(vals), w) / den, label=label, **style)
    ax.set_xlabel("modeled time (s)")
    ax.set_ylabel(f"prompt tokens hit (%, last {w} requests)")
    ax.set_ylim(0, 100)
    ax.set_title(f"hit rate over time: {tag}")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "hit_rate.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # per-tier breakdown of all prompt tokens.
    computed = report.prompt_tokens - report.prefill_tokens_saved
    parts = [("device", report.hit_tokens.device), ("pool", report.hit_tokens.pool), ("computed", computed)]
    fig, ax = plt.subplots(figsize=(7, 2.6))
    left = 0.0
    for (label, n), color in zip(parts, ("tab:green", "tab:blue", "tab:gray"), strict=True):
        frac = 100 * n / max(1, report.prompt_tokens)
        ax.barh([0], [frac], left=left, color=color, label=f"{label} {frac:.1f}%")
        left += frac
    ax.axvline(
        100 * report.infinite_cache_bound_ratio,
        color="black",
        linestyle="--",
        label=f"infinite-cache bound {100 * report.infinite_cache_bound_ratio:.1f}%",
    )
    ax.set_xlim(0, 100)
    ax.set_yticks([])
    ax.set_xlabel("share of prompt tokens (%)")
    ax.set_title(f"where prompt KV came from: {tag}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, fontsize=8)
    fig.tight_layout()
    paths.append(out / "tiers.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # lookup latency CDF.
    lat = np.sort(np.asarray(report.lookup_latency_samples_us))
    fig, ax = plt.subplots(figsize=(7, 4))
    if len(lat):
        ax.plot(lat, np.arange(1, len(lat) + 1) / len(lat))
        ax.set_xscale("log")
    ax.set_xlabel("lookup latency (us, log)")
    ax.set_ylabel("fraction of lookups")
    ax.set_title(
        f"lookup latency CDF: {tag} (p50 {report.lookup_latency_us.p50:.0f} us, "
        f"p99 {report.lookup_latency_us.p99:.0f} us)"
    )
    fig.tight_layout()
    paths.append(out / "lookup_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_sweep_plot(reports: Sequence[BenchReport], out_dir: str | Path) -> Path:
    """Pool hit rate and tokens saved vs pool capacity, one line per granularity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"block": "tab:blue", "user": "tab:orange"}
    for gran in sorted({r.granularity for r in reports}):
        rs = sorted(
            (r for r in reports if r.granularity == gran), key=lambda r: r.pool_capacity_fraction or 1.0
        )
        xs = [100 * (r.pool_capacity_fraction or 1.0) for r in rs]
        ax.plot(
            xs,
            [100 * r.prefill_tokens_saved_ratio for r in rs],
            marker="o",
            color=colors.get(gran),
            label=f"{gran}: saved",
        )
        ax.plot(
            xs,
            [100 * r.hit_tokens.pool / max(1, r.prompt_tokens) for r in rs],
            marker="x",
            linestyle=":",
            color=colors.get(gran),
            label=f"{gran}: pool hits",
        )
    if reports:
        ax.axhline(
            100 * reports[0].infinite_cache_bound_ratio,
            color="black",
            linestyle="--",
            label="infinite-cache bound",
        )
    ax.set_xlabel("pool capacity (% of working set)")
    ax.set_ylabel("prompt tokens (%)")
    ax.set_ylim(0, 100)
    ax.set_title(
        "prompt tokens saved vs pool capacity ("
        + ", ".join(sorted({r.granularity for r in reports}))
        + "-granular)"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "granularity_sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
