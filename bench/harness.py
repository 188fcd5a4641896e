"""Interleaving and statistics shared by the microbenchmarks under bench/.

The machine these run on is shared and noisy, so every benchmark follows the
same rules, kept here once:

- **interleaved rounds**: each round runs every configuration once, so a slow
  minute hits all of them alike; the rounds' orders form a Williams square
  (``round_orders``): each configuration runs first equally often, and follows
  each other one equally often, so none always inherits the caches another
  leaves (rotating one order kept every configuration behind the same one);
- **warm-up outside the timing**: ``warmup`` whole rounds run first and are
  dropped;
- **ratios per round**: a ratio against a baseline is taken between samples of
  the same round (measured seconds apart), then summarised;
- **medians with min/max and the spread**: every figure is reported as
  ``median (min..max)`` and its spread ``(max - min) / median``.

``python bench/harness.py agree A.json B.json`` compares two ``--json`` outputs
of the same script and flags every ratio whose medians differ by more than 10%;
where a script also reports its ratios per host level (``split_by_level``), those
are compared and the figures over both levels only shown.
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

import numpy as np

from ascendstore.handoff import HaltPolling, halt_polling


def placed(nbytes: int, offset: int = 0, fill: int = 0) -> np.ndarray:
    """``nbytes`` filled with ``fill``, starting ``offset`` bytes past a 4 KiB boundary.

    Where a caller's buffer starts decides what a copy into it costs: on AMD Zen 4
    glibc's ``memcpy`` of 2 KiB-1 MiB ran 2.5-6x slower into an address 16 past a page
    (where numpy and malloc put a large buffer) than into one on a page or 64 bytes
    past it, as vLLM's KV tensors are. So a bench's buffers sit where vLLM's would."""
    raw = np.full(nbytes + 2 * 4096, fill, dtype=np.uint8)
    start = (4096 - raw.ctypes.data % 4096) % 4096 + offset
    return raw[start:start + nbytes]


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


def gbps_sampler(fn: Callable[[], object], nbytes: int, before: Callable[[], object] | None = None,
                 calls: int = 3) -> Callable[[], float]:
    """A case for ``interleave``: GB/s of ``fn`` (which moves ``nbytes``), the median of
    ``calls`` timed calls, each after an untimed ``before``."""

    def sample() -> float:
        ts = []
        for _ in range(calls):
            if before is not None:
                before()
            t0 = clock()
            fn()
            ts.append(clock() - t0)
        return nbytes / statistics.median(ts) / 1e9

    return sample


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Median microseconds of ``calls`` back-to-back calls of ``fn``."""
    out = []
    for _ in range(calls):
        t0 = clock_ns()
        fn()
        out.append((clock_ns() - t0) / 1e3)
    return statistics.median(out)


def round_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` configurations for successive rounds (a Williams square):
    over the orders each configuration takes each position equally often and
    directly follows each other configuration equally often (n orders for even
    n, 2n for odd). The first order starts with the first two as given.

    Why not rotate one order: a rotation keeps the cyclic order, so each
    configuration always runs right after the same one and inherits the caches
    it leaves. Seen in bench_connector: the raw get always followed the
    connector's put and the connector's get the raw get, and on a host whose
    L3 held the step (32 MiB) the connector's get read 1.38-1.42x the raw
    one's, a carry-over and not the code."""
    if n <= 1:
        return [list(range(n))]
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return rows


def interleave(cases: Mapping[str, Callable[[], float]], rounds: int, warmup: int = 1,
               level: bool = False) -> dict[str, list[float]]:
    """Run every case once per round; ``warmup`` rounds first, in the order
    given, dropped; then ``rounds`` in the orders of ``round_orders`` (from its
    first, which starts with the first two cases as given). Each case returns
    its own sample (a rate, a time).

    ``level``: also probe the host's level (``host_level_us``) just before and
    just after each round, kept per round as ``LEVEL_LO`` and ``LEVEL_HI`` (the
    lower and higher of the two probes) for ``split_by_level``."""
    names = list(cases)
    orders = round_orders(len(names))
    out: dict[str, list[float]] = {n: [] for n in names}
    if level:
        out[LEVEL_LO], out[LEVEL_HI] = [], []
    for r in range(warmup + rounds):
        before = host_level_us() if level else 0.0
        for i in orders[(r - warmup) % len(orders)] if r >= warmup else range(len(names)):
            name = names[i]
            sample = cases[name]()
            if r >= warmup:
                out[name].append(sample)
        if level and r >= warmup:
            after = host_level_us()
            out[LEVEL_LO].append(min(before, after))
            out[LEVEL_HI].append(max(before, after))
    return out


# -- the host's level -------------------------------------------------------------------
# On the shared VM these figures come from, the core runs at two levels that alternate
# within tens of milliseconds, whatever vCPU the process is pinned to: at the slow one
# a pure-Python loop takes 1.6-1.9x as long and a memory-bound native call (the raw
# exists) ~1.3x. A ratio of a call with Python in it to a native baseline then moves
# with the share of rounds each run spent at each level, not with the code. So rounds
# are probed and the ratios also reported per level (``split_by_level``).
LEVEL_LO, LEVEL_HI = "host level lo", "host level hi"
#: a round is at the fast level when both its probes are within this factor of the
#: run's fast level, at the slow level when both are beyond it; else mixed
LEVEL_CUT = 1.3
#: rounds a level needs in a run before ``agree`` compares its figures
LEVEL_MIN_ROUNDS = 5


def _level_loop() -> int:
    s = 0
    for i in range(1000):
        s += i
    return s


def host_level_us() -> float:
    """How fast the core runs plain Python right now: the median of 5 timings (the
    benchmark's clock) of a fixed 1000-step loop, in µs (~17 fast, ~32 slow here)."""
    out = []
    for _ in range(5):
        t0 = clock_ns()
        _level_loop()
        out.append(clock_ns() - t0)
    return statistics.median(out) / 1e3


def split_by_level(runs: Iterable[Mapping[str, list[float]]], figures: Iterable[str],
                   cut: float = LEVEL_CUT) -> dict:
    """Per-round samples of ``figures`` (e.g. per-round ratios) from one or more
    ``interleave(..., level=True)`` runs (each a mapping with ``LEVEL_LO``/``LEVEL_HI``),
    pooled and summarised per host level: ``{"fast": {figure: stat}, "slow": {...},
    "rounds": {"fast": n, "slow": n, "mixed": n}, "fast_level_us": ..., "cut": cut}``
    (a level without rounds is left out). The fast level is the median of the rounds'
    lower probes within ``cut`` of the fastest (one lucky probe does not set the bar),
    taken over all the runs together, so a run that spent every round slow is not
    called fast."""
    runs = list(runs)
    figures = list(figures)
    lows = [x for r in runs for x in r[LEVEL_LO]]
    fastest = min(lows)
    fast_level = statistics.median(x for x in lows if x <= cut * fastest)
    pooled: dict[str, dict[str, list[float]]] = {"fast": {}, "slow": {}}
    counts = {"fast": 0, "slow": 0, "mixed": 0}
    for r in runs:
        for i, (lo, hi) in enumerate(zip(r[LEVEL_LO], r[LEVEL_HI], strict=True)):
            lv = "fast" if hi <= cut * fast_level else "slow" if lo > cut * fast_level else "mixed"
            counts[lv] += 1
            if lv != "mixed":
                for f in figures:
                    pooled[lv].setdefault(f, []).append(r[f][i])
    out: dict = {lv: {f: stat(v).as_dict() for f, v in d.items()} for lv, d in pooled.items() if d}
    return {**out, "rounds": counts, "fast_level_us": fast_level, "cut": cut}


#: writing 1 here makes the kernel compact all free memory (root)
COMPACT = "/proc/sys/vm/compact_memory"


def compact_free_memory(knob: str = COMPACT) -> None:
    """Have the kernel gather free memory into large blocks before a process maps its
    pools and mirrors: the pages a fresh /dev/shm mapping gets otherwise depend on how
    fragmented the host's free memory happens to be, and a copy on 4 KiB pages ran up
    to 2x faster on pages that share their 2 MiB frames (bench_local's ``layout``)."""
    with open(knob, "w") as f:
        f.write("1")


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def env_info() -> dict[str, object]:
    """What the reader needs to judge the figures: load, cores, and whether idle
    vCPUs poll before they halt (a KVM guest that halts at once pays tens of us
    per thread wake-up: every hand-off figure moves with it; ascendstore.handoff)."""
    return {"loadavg": [round(x, 2) for x in load_average()], "cpus": os.cpu_count(), "clock": CLOCK_NAME,
            **halt_polling().as_dict()}


def env_line(before: Mapping[str, object], after: Mapping[str, object]) -> str:
    """The footer every script prints under its table: load around the run, and a
    guest's halt polling where it is off (hand-off figures then carry two VM exits)."""
    line = f"load average before {before['loadavg']}, after {after['loadavg']}"
    if HaltPolling(before.get("cpuidle_driver"), before.get("guest_halt_poll_ns")).off:  # type: ignore[arg-type]
        line += ("; this VM halts idle vCPUs at once (guest_halt_poll_ns=0): every thread hand-off "
                 "pays two wake-ups through the hypervisor (ascendstore doctor)")
    return line


# -- agreement of two runs ------------------------------------------------------------
def _medians(obj: object, path: str = "", mixed: bool = False) -> dict[str, tuple[float, str]]:
    """Every ``{"median": ...}`` under a key containing 'ratio' in a JSON tree, by
    path, with how ``agree`` counts it: "" (compared), "mix" (a figure over rounds
    of both host levels, where the same object has ``ratio_by_level``), "few" (a
    level's figure from fewer than ``LEVEL_MIN_ROUNDS`` rounds)."""
    out: dict[str, tuple[float, str]] = {}
    if isinstance(obj, dict):
        if "median" in obj and "ratio" in path:
            out[path] = (float(obj["median"]), "mix" if mixed else "")
        by_level = obj.get("ratio_by_level")
        for k, v in obj.items():
            if k == "ratio_by_level" and isinstance(v, dict):
                rounds = v.get("rounds", {})
                for lv in ("fast", "slow"):
                    if lv in v:
                        few = rounds.get(lv, 0) < LEVEL_MIN_ROUNDS
                        got = _medians(v[lv], f"{path}/{k}/{lv}")
                        out.update({p: (x, "few" if few else "") for p, (x, _) in got.items()})
            else:
                out.update(_medians(v, f"{path}/{k}", mixed or (isinstance(by_level, dict) and "ratio" in k)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(_medians(v, f"{path}/{i}", mixed))
    return out


#: how far apart two runs' figures may be (relative to the larger)
AGREE_TOL = 0.10


def _apart(x: float, y: float) -> float:
    """Relative difference of two runs' figures, against the larger."""
    return abs(x - y) / max(abs(x), abs(y), 1e-12)


def agree(a: object, b: object, tol: float = AGREE_TOL) -> list[tuple[str, float, float, float, str]]:
    """(path, median A, median B, relative difference, note) of every ratio in both
    runs. Note "" for a compared figure; "mix" or "few" (see ``_medians``) for one
    to show but not to hold to the bound: where a script reports ratios per host
    level, those are what must agree."""
    ma, mb = _medians(a), _medians(b)
    rows = []
    for path in sorted(set(ma) & set(mb)):
        (x, na), (y, nb) = ma[path], mb[path]
        rows.append((path, x, y, _apart(x, y), na or nb))
    return rows


def _absolutes(obj: object, path: str = "") -> dict[str, float]:
    """Every ``{"median": ...}`` under no 'ratio' key: the rates and times a run's
    ratios are formed from (``env_*`` left out: the host's state, not a figure)."""
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        if "median" in obj and isinstance(obj["median"], int | float) and "ratio" not in path:
            out[path] = float(obj["median"])
        for k, v in obj.items():
            if not (k.startswith("env") or "ratio" in k):
                out.update(_absolutes(v, f"{path}/{k}"))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(_absolutes(v, f"{path}/{i}"))
    return out


def moved(a: object, b: object) -> list[tuple[str, float, float, float]]:
    """(path, median A, median B, relative difference) of every absolute figure in
    both runs: which side of a ratio that disagrees moved (the thing measured, or its
    baseline). Shown by ``agree``, never held to a bound: a host's speed may move
    between runs, a ratio formed in one run should not."""
    ma, mb = _absolutes(a), _absolutes(b)
    return [(p, ma[p], mb[p], _apart(ma[p], mb[p])) for p in sorted(set(ma) & set(mb))]


def _main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[1] != "agree":
        print("usage: python bench/harness.py agree A.json B.json", file=sys.stderr)
        return 2
    with open(argv[2]) as f:
        a = json.load(f)
    with open(argv[3]) as f:
        b = json.load(f)
    rows = agree(a, b)
    held = [r for r in rows if not r[4]]
    worst = max((d for *_, d, _ in held), default=0.0)
    for path, x, y, d, note in rows:
        tag = note.upper().ljust(3) if note else ("OK " if d <= AGREE_TOL else "OFF")
        print(f"{tag} {d * 100:5.1f}%  {x:8.3f} {y:8.3f}  {path}")
    info = len(rows) - len(held)
    off = sum(d > AGREE_TOL for *_, d, _ in held)
    print(f"{len(held)} ratios, {off} differ by more than 10% (worst {worst * 100:.1f}%)"
          + (f"; {info} shown, not compared (MIX: rounds of both host levels; FEW: < {LEVEL_MIN_ROUNDS} rounds "
             "at that level)" if info else ""))
    if off:
        # Which side moved: a ratio apart over a baseline that moved while the pool
        # held (or the reverse) is the host, not the code (docs/benchmarking.md).
        figs = moved(a, b)
        for path, x, y, d in figs:
            if d > AGREE_TOL:
                print(f"MOVED {d * 100:5.1f}%  {x:8.3f} {y:8.3f}  {path}")
        print(f"{len(figs)} absolute figures (rates, times), {sum(d > AGREE_TOL for *_, d in figs)} moved by more "
              "than 10% (shown above as MOVED; the others held)")
    return 0 if held and worst <= AGREE_TOL else 1


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv))
