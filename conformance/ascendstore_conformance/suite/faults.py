"""Slow stores time out with TIMEOUT; damaged objects read as CORRUPT.
Both are planted through the backend's optional test hooks."""

from __future__ import annotations

import time

from ascendstore.contract import Status
from ascendstore_conformance.harness import Harness, pattern
from ascendstore_conformance.suite.base import require, require_hook

OK, NOT_FOUND, TIMEOUT, CORRUPT = Status.OK, Status.NOT_FOUND, Status.TIMEOUT, Status.CORRUPT
SLOW_S = 3.0
SHORT_TIMEOUT_S = 0.2


class FaultTests:
    def test_timeout_surfaces_as_timeout_status(self, harness: Harness) -> None:
        h = harness
        delay = require_hook(h, "delay")
        key, new = h.keys("slow", "slow-new")
        data = pattern("slow", 4096)
        h.put_ok({key: data})
        delay(SLOW_S)
        try:
            for op in ("exists", "get", "put", "remove"):
                start = time.monotonic()
                if op == "exists":
                    got = h.exists([key], timeout_s=SHORT_TIMEOUT_S)
                elif op == "get":
                    got, _ = h.get([key], [4096], timeout_s=SHORT_TIMEOUT_S)
                elif op == "put":
                    got = h.put({new: pattern("new", 4096)}, timeout_s=SHORT_TIMEOUT_S)
                else:
                    got = h.remove([key], timeout_s=SHORT_TIMEOUT_S)
                took = time.monotonic() - start
                assert got == [TIMEOUT], (
                    f"{op}() with timeout_s={SHORT_TIMEOUT_S} against a store delayed {SLOW_S} s returned {got!r}"
                )
                # Generous bound: the point is that the call does not wait for the slow store.
                assert took < SLOW_S / 2, f"{op}() with timeout_s={SHORT_TIMEOUT_S} took {took:.2f} s"
        finally:
            delay(0)
        # The store works again and the timed-out calls left no damage.
        status, got_bytes = h.get_bytes(key, 4096)
        assert status in (OK, NOT_FOUND), f"get after the timeouts returned {status!r}"
        if status is OK:
            assert got_bytes == data, "a timed-out call damaged an object"
        status, got_bytes = h.get_bytes(new, 4096)
        assert status is NOT_FOUND or got_bytes == pattern("new", 4096), "a timed-out put left a torn object"

    def test_tiny_timeout_returns_promptly(self, harness: Harness) -> None:
        h = harness
        key = h.key("tiny")
        data = pattern("tiny", 4096)
        h.put_ok({key: data})
        for timeout_s in (1e-6, 0.0):
            got, (buf,) = h.get([key], [4096], timeout_s=timeout_s)
            assert got[0] in (OK, TIMEOUT), f"get with timeout_s={timeout_s} returned {got!r}"
            if got[0] is OK:
                assert buf.read() == data
            got = h.exists([key], timeout_s=timeout_s)
            assert got[0] in (OK, TIMEOUT), f"exists with timeout_s={timeout_s} returned {got!r}"

    def test_corruption_is_detected(self, harness: Harness) -> None:
        h = harness
        require(h, "detects_corruption")
        corrupt = require_hook(h, "corrupt")
        bad, good = h.keys("bad", "good")
        items = {bad: pattern("bad", 8192), good: pattern("good", 8192)}
        h.put_ok(items)
        h.assert_reads(items)  # warm any read cache: detection must not be bypassed by it
        assert corrupt(bad) is True, "corrupt() of a stored key returned False"
        assert corrupt(h.key("absent")) is False, "corrupt() of an absent key returned True"
        statuses, bufs = h.get([bad, good], [8192, 8192])
        assert statuses == [CORRUPT, OK], f"get of a damaged and an intact object returned {statuses!r}"
        assert bufs[1].read() == items[good]
