"""Timed bulk put/exists/get. The numbers are a report, never a verdict: the
test asserts only that every measured object round-trips byte-exact."""

from __future__ import annotations

import time

import pytest

from ascendstore.contract import Status
from ascendstore_conformance.factory import BackendFactory
from ascendstore_conformance.harness import Harness, assert_same, pattern
from ascendstore_conformance.perf import RECORDS, summarize

OK = Status.OK
BATCH = 8
MAX_ROUNDS = 10
#: time budget per (operation, object size), so slow backends stay bounded.
ROUND_BUDGET_S = 0.5


class PerformanceTests:
    def test_performance_report(self, harness: Harness, bound_factory: BackendFactory, request) -> None:
        h = harness
        b = h.backend
        records = request.config.stash.setdefault(RECORDS, [])
        sizes = [
            s for s in (4 << 10, 1 << 20) if s <= min(h.caps.max_object_bytes, bound_factory.max_test_bytes)
        ]
        for size in sizes:
            srcs = [h.source(pattern(f"perf{i}.{size}", size)) for i in range(BATCH)]
            dsts = [h.buffer(size) for _ in range(BATCH)]
            src_regions = [[s.region] for s in srcs]
            dst_regions = [[d.region] for d in dsts]
            timings: dict[str, list[float]] = {"put": [], "exists": [], "get": []}
            keys: list[str] = []
            budget_end = time.monotonic() + ROUND_BUDGET_S
            for r in range(MAX_ROUNDS):  # fresh keys each round: a put of a new object is what is timed
                if r and time.monotonic() > budget_end:
                    break
                if keys:
                    h.remove(keys)
                keys = h.keys(*(f"perf{size}.{r}.{i}" for i in range(BATCH)))
                t0 = time.perf_counter()
                got = b.put(keys, src_regions, h.timeout_s)
                timings["put"].append(time.perf_counter() - t0)
                assert got == [OK] * BATCH, f"put of {BATCH} x {size} bytes returned {got!r}"
            for op, regions in (("exists", None), ("get", dst_regions)):
                budget_end = time.monotonic() + ROUND_BUDGET_S
                for r in range(MAX_ROUNDS * 2):
                    if r and time.monotonic() > budget_end:
                        break
                    t0 = time.perf_counter()
                    got = (
                        b.exists(keys, h.timeout_s) if regions is None else b.get(keys, regions, h.timeout_s)
                    )
                    timings[op].append(time.perf_counter() - t0)
                    assert got == [OK] * BATCH, f"{op} of {BATCH} x {size} bytes returned {got!r}"
            for k, s, d in zip(keys, srcs, dsts, strict=True):
                assert_same(d.read(), s.read(), k)
            h.remove(keys)
            records.extend(summarize(h.name, op, size, BATCH, t) for op, t in timings.items())
        if not sizes:
            pytest.skip("max_object_bytes is below 4 KiB: nothing to measure")
