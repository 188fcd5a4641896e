"""Throughput of the embedded ``local`` pool against memcpy measured in the same run.

Each pool figure includes the copy between the caller's memory and the pool. The
baseline is a single-thread chunked memcpy (``ctypes.memmove`` per object, object
addresses precomputed) of the same bytes between buffers of the same sizes as the
pool's working set, so caches help both sides equally. Bounded: a few seconds.

    .venv/bin/python bench/bench_local.py [--json] [--quick]
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from ascendstore.contract import BackendContext, Region, Status
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions

KiB, MiB = 1 << 10, 1 << 20
BATCH = 32
app = typer.Typer(add_completion=False)


def _rate(fn: Callable[[], int], min_s: float) -> float:
    """GB/s of repeating fn (which returns bytes moved) for at least min_s."""
    done, t0 = 0, time.perf_counter()
    while True:
        done += fn()
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return done / dt / 1e9


def _pair(
    base: Callable[[], int], pool: Callable[[], int], rounds: int, min_s: float
) -> tuple[float, float, float]:
    """Baseline and pool measured alternately (the host is shared and noisy):
    median baseline GB/s, median pool GB/s, median of the per-round ratios."""
    b, p = [], []
    for _ in range(rounds):
        b.append(_rate(base, min_s))
        p.append(_rate(pool, min_s))
    return (
        statistics.median(b),
        statistics.median(p),
        statistics.median(y / x for x, y in zip(b, p, strict=True)),
    )


def _open(**kw) -> LocalBackend:
    opts = LocalOptions(name=f"bench-{uuid.uuid4().hex[:8]}", **kw)
    return LocalBackend.create(opts, BackendContext())


def bench_dram(size: int, checksum: bool, rounds: int, min_s: float, pool_bytes: int) -> dict:
    be = _open(capacity=pool_bytes, page_size=64 * KiB, checksum=checksum, prefault=True)
    try:
        n_keys = (pool_bytes * 3 // 4) // size // BATCH * BATCH
        keys = [f"bench/{size}/{i}" for i in range(n_keys)]
        user = np.random.default_rng(0).integers(0, 255, BATCH * size, dtype=np.uint8)
        mirror = np.zeros(n_keys * size, dtype=np.uint8)  # baseline's stand-in for the pool
        ua = [user.ctypes.data + j * size for j in range(BATCH)]
        ma = [mirror.ctypes.data + i * size for i in range(n_keys)]
        regions = [[Region(a, size)] for a in ua]
        batches = [keys[i : i + BATCH] for i in range(0, n_keys, BATCH)]
        state = {"b": 0}

        def pool_put() -> int:
            b = state["b"] = (state["b"] + 1) % len(batches)
            st = be.put(batches[b], regions, 5.0)
            assert all(s is Status.OK for s in st), st
            return BATCH * size

        def pool_get() -> int:
            b = state["b"] = (state["b"] + 1) % len(batches)
            st = be.get(batches[b], regions, 5.0)
            assert all(s is Status.OK for s in st), st
            return BATCH * size

        def memcpy_in() -> int:
            b = state["b"] = (state["b"] + 1) % len(batches)
            base = b * BATCH
            for j in range(BATCH):
                ctypes.memmove(ma[base + j], ua[j], size)
            return BATCH * size

        def memcpy_out() -> int:
            b = state["b"] = (state["b"] + 1) % len(batches)
            base = b * BATCH
            for j in range(BATCH):
                ctypes.memmove(ua[j], ma[base + j], size)
            return BATCH * size

        for _ in range(len(batches)):  # fill every page once (first touch is not what we measure)
            pool_put()
            memcpy_in()
        out: dict = {}
        out["memcpy_in"], out["put"], out["put_ratio"] = _pair(memcpy_in, pool_put, rounds, min_s)
        out["memcpy_out"], out["get"], out["get_ratio"] = _pair(memcpy_out, pool_get, rounds, min_s)
        # byte-exact check of what the bench measured
        check = np.zeros_like(user)
        be.put(batches[0], regions, 5.0)
        assert all(
            s is Status.OK
            for s in be.get(
                batches[0], [[Region(check.ctypes.data + j * size, size)] for j in range(BATCH)], 5.0
            )
        )
        assert np.array_equal(check, user)
        return out
    finally:
        be.destroy()


def bench_exists(n: int, calls: int) -> float:
    be = _open(capacity=64 * MiB, page_size=4 * KiB, checksum=False, max_keys=4 * n)
    try:
        buf = np.zeros(4096, dtype=np.uint8)
        keys = [f"model@1@0@{i:064x}@bfloat16" for i in range(n)]
        be.put(keys, [[Region(buf.ctypes.data, 4096)]] * n, 5.0)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            st = be.exists(keys, 5.0)
            times.append(time.perf_counter() - t0)
        assert all(s is Status.OK for s in st)
        return statistics.median(times) * 1e6
    finally:
        be.destroy()


def bench_disk(size: int, total: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="ascendstore-bench-", dir=os.environ.get("BENCH_DISK_DIR")) as d:
        be = _open(capacity=16 * MiB, page_size=64 * KiB, checksum=True, disk_path=d, disk_capacity=total * 2)
        try:
            user = np.random.default_rng(1).integers(0, 255, BATCH * size, dtype=np.uint8)
            regions = [[Region(user.ctypes.data + j * size, size)] for j in range(BATCH)]
            n = total // size // BATCH * BATCH
            puts, gets = [], []
            for r in range(rounds):
                keys = [f"disk/{r}/{i}" for i in range(n)]
                t0 = time.perf_counter()
                for i in range(0, n, BATCH):
                    assert all(s is Status.OK for s in be.put(keys[i : i + BATCH], regions, 5.0))
                puts.append(n * size / (time.perf_counter() - t0) / 1e9)
                # the oldest objects are on disk now: read them back (each hit is also promoted)
                t0 = time.perf_counter()
                got = 0
                for i in range(0, n // 2, BATCH):
                    st = be.get(keys[i : i + BATCH], regions, 5.0)
                    got += sum(s is Status.OK for s in st)
                gets.append(got * size / (time.perf_counter() - t0) / 1e9)
            stats = be.stats()
            return {
                "put": statistics.median(puts),
                "get": statistics.median(gets),
                "spills": stats["spills"],
                "disk_hits": stats["disk_hits"],
            }
        finally:
            be.destroy()


@app.command()
def main(
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of a table"),
    quick: bool = typer.Option(False, "--quick", help="fewer, shorter rounds"),
) -> None:
    rounds, min_s = (5, 0.03) if quick else (11, 0.06)
    results: dict = {"batch": BATCH}
    for size, pool in ((64 * KiB, 128 * MiB), (2 * MiB, 256 * MiB)):
        for checksum in (False, True):
            results[f"dram_{size // KiB}KiB_checksum_{'on' if checksum else 'off'}"] = bench_dram(
                size, checksum, rounds, min_s, pool
            )
    results["exists_512_median_us"] = bench_exists(512, 50 if quick else 300)
    results["disk_64KiB"] = bench_disk(64 * KiB, 64 * MiB if quick else 128 * MiB, 1 if quick else 2)
    if as_json:
        print(json.dumps(results, indent=2))
        return
    con = Console(width=120)
    t = Table(title=f"local pool vs memcpy (batches of {BATCH}; GB/s, ratio = pool / memcpy)")
    for col in ("object", "checksum", "memcpy in", "put", "put ratio", "memcpy out", "get", "get ratio"):
        t.add_column(col, justify="right", no_wrap=True)
    for name, r in results.items():
        if name.startswith("dram_"):
            _, size, _, ck = name.split("_")
            t.add_row(
                size,
                ck,
                f"{r['memcpy_in']:.2f}",
                f"{r['put']:.2f}",
                f"{r['put_ratio']:.2f}x",
                f"{r['memcpy_out']:.2f}",
                f"{r['get']:.2f}",
                f"{r['get_ratio']:.2f}x",
            )
    con.print(t)
    d = results["disk_64KiB"]
    con.print(f"exists of 512 keys: median {results['exists_512_median_us']:.1f} us")
    con.print(
        f"disk tier 64 KiB: put {d['put']:.2f} GB/s (every put spills an LRU object), "
        f"get {d['get']:.2f} GB/s (read from disk + promotion), spills {d['spills']}, disk hits {d['disk_hits']}"
    )


if __name__ == "__main__":
    app()
