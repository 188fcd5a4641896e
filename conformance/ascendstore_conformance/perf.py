"""The informational performance report: latency and throughput per operation,
measured by the suite's last test and printed in the terminal summary."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

RECORDS = pytest.StashKey[list["PerfRecord"]]()


@dataclasses.dataclass(frozen=True)
class PerfRecord:
    backend: str
    op: str
    object_bytes: int
    batch: int
    calls: int
    p50_us: float
    p99_us: float
    #: bytes moved per second over all calls (0 for exists).
    gbps: float
    keys_per_s: float


def summarize(backend: str, op: str, object_bytes: int, batch: int, seconds: list[float]) -> PerfRecord:
    ordered = sorted(seconds)
    total = sum(ordered)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    moved = object_bytes * batch * len(ordered) if op != "exists" else 0
    return PerfRecord(
        backend=backend,
        op=op,
        object_bytes=object_bytes,
        batch=batch,
        calls=len(ordered),
        p50_us=statistics.median(ordered) * 1e6,
        p99_us=p99 * 1e6,
        gbps=moved / total / 1e9 if total else 0.0,
        keys_per_s=batch * len(ordered) / total if total else 0.0,
    )


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


def render(records: list[PerfRecord]) -> list[str]:
    lines: list[str] = []
    for backend in dict.fromkeys(r.backend for r in records):
        lines.append(f"backend {backend}")
        lines.append(
            f"  {'op':<7} {'object':>8} {'batch':>5} {'calls':>6} {'p50 us':>9} {'p99 us':>9} "
            f"{'GB/s':>7} {'keys/s':>10}"
        )
        for r in (r for r in records if r.backend == backend):
            gbps = f"{r.gbps:7.2f}" if r.op != "exists" else f"{'-':>7}"
            lines.append(
                f"  {r.op:<7} {_size(r.object_bytes):>8} {r.batch:>5} {r.calls:>6} "
                f"{r.p50_us:9.1f} {r.p99_us:9.1f} {gbps} {r.keys_per_s:10.0f}"
            )
    return lines
