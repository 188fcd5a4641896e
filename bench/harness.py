"""Interleaving and statistics shared by the microbenchmarks under bench/.

The machine these run on is shared and noisy, so every benchmark follows the
same rules, kept here once:

- **interleaved rounds**: each round runs every configuration once, in an order
  rotated from round to round, so a slow minute hits all of them alike and no
  configuration always runs first (cold) or last;
- **warm-up outside the timing**: ``warmup`` whole rounds run first and are
  dropped;
- **ratios per round**: a ratio against a baseline is taken between samples of
  the same round (measured seconds apart), then summarised;
- **medians with min/max and the spread**: every figure is reported as
  ``median (min..max)`` and its spread ``(max - min) / median``.

``python bench/harness.py agree A.json B.json`` compares two ``--json`` outputs
of the same script and flags every ratio whose medians differ by more than 10%.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Stat:
    """Summary of the samples of one figure."""

    median: float
    min: float
    max: float
    n: int

    @property
    def spread(self) -> float:
        """(max - min) / median: how far apart the rounds were."""
        return (self.max - self.min) / self.median if self.median else math.inf

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "spread": self.spread}

    def fmt(self, digits: int = 2, unit: str = "") -> str:
        f = f"{{:.{digits}f}}"
        return f"{f.format(self.median)}{unit} ({f.format(self.min)}..{f.format(self.max)}) ±{100 * self.spread / 2:.0f}%"


def stat(samples: Iterable[float]) -> Stat:
    xs = list(samples)
    if not xs:
        raise ValueError("no samples")
    return Stat(statistics.median(xs), min(xs), max(xs), len(xs))


def across_processes(figures: list[dict]) -> dict:
    """One figure measured in several fresh processes (each a ``stat(...).as_dict()``):
    the median of the process medians with min..max and spread across processes,
    every process's median (``per_process``) and the median spread within a
    process (``within_spread``)."""
    meds = [f["median"] for f in figures]
    within = statistics.median(f["spread"] for f in figures)
    return {**stat(meds).as_dict(), "per_process": meds, "within_spread": within}


def ratios(num: list[float], den: list[float]) -> Stat:
    """Per-round num/den (samples of the same round), summarised."""
    return stat(a / b for a, b in zip(num, den, strict=True) if b)


CLOCK_NAME = os.environ.get("BENCH_CLOCK", "cpu")
if CLOCK_NAME not in ("cpu", "wall"):
    raise SystemExit(f"BENCH_CLOCK={CLOCK_NAME!r}: use cpu or wall")
#: seconds (float) and nanoseconds (int) of the chosen clock
clock = time.process_time if CLOCK_NAME == "cpu" else time.perf_counter
clock_ns = time.process_time_ns if CLOCK_NAME == "cpu" else time.perf_counter_ns
#: the calling thread's CPU time (wall with BENCH_CLOCK=wall): for work that runs on
#: one thread while other threads of the same process (a worker's save thread) run too
thread_clock = time.thread_time if CLOCK_NAME == "cpu" else time.perf_counter


def rate(fn: Callable[[], int], min_s: float) -> float:
    """Units per second of repeating ``fn`` (it returns the units it moved) for at least ``min_s``."""
    done, t0 = 0, clock()
    while True:
        done += fn()
        dt = clock() - t0
        if dt >= min_s:
            return done / dt


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Median microseconds of ``calls`` back-to-back calls of ``fn``."""
    out = []
    for _ in range(calls):
        t0 = clock_ns()
        fn()
        out.append((clock_ns() - t0) / 1e3)
    return statistics.median(out)


def interleave(cases: Mapping[str, Callable[[], float]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run every case once per round (order rotated each round); ``warmup``
    rounds first, dropped. Each case returns its own sample (a rate, a time)."""
    names = list(cases)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            sample = cases[name]()
            if r >= warmup:
                out[name].append(sample)
    return out


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def env_info() -> dict[str, object]:
    """What the reader needs to judge the figures: load and cores."""
    return {"loadavg": [round(x, 2) for x in load_average()], "cpus": os.cpu_count(), "clock": CLOCK_NAME}


# -- agreement of two runs ------------------------------------------------------------
def _medians(obj: object, path: str = "") -> dict[str, float]:
    """Every ``{"median": ...}`` under a key containing 'ratio' in a JSON tree, by path."""
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        if "median" in obj and "ratio" in path:
            out[path] = float(obj["median"])
        for k, v in obj.items():
            out.update(_medians(v, f"{path}/{k}"))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(_medians(v, f"{path}/{i}"))
    return out


def agree(a: object, b: object, tol: float = 0.10) -> list[tuple[str, float, float, float]]:
    """(path, median A, median B, relative difference) of every ratio in both runs."""
    ma, mb = _medians(a), _medians(b)
    rows = []
    for path in sorted(set(ma) & set(mb)):
        x, y = ma[path], mb[path]
        rows.append((path, x, y, abs(x - y) / max(abs(x), abs(y), 1e-12)))
    return rows


def _main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[1] != "agree":
        print("usage: python bench/harness.py agree A.json B.json", file=sys.stderr)
        return 2
    with open(argv[2]) as f:
        a = json.load(f)
    with open(argv[3]) as f:
        b = json.load(f)
    rows = agree(a, b)
    worst = 0.0
    for path, x, y, d in rows:
        worst = max(worst, d)
        print(f"{'OK ' if d <= 0.10 else 'OFF'} {d * 100:5.1f}%  {x:8.3f} {y:8.3f}  {path}")
    print(f"{len(rows)} ratios, {sum(d > 0.10 for *_, d in rows)} differ by more than 10% (worst {worst * 100:.1f}%)")
    return 0 if rows and worst <= 0.10 else 1


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv))
