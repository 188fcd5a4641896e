"""Slow stores time out with TIMEOUT, within the timeout; damaged objects read
as CORRUPT; a broken store is not reported healthy. All are planted through
the backend's optional test hooks."""

from __future__ import annotations

import time

from ascendstore.contract import Health, Status
from ascendstore_conformance.harness import Harness, guarded, pattern
from ascendstore_conformance.suite.base import require, require_hook

OK, NOT_FOUND, TIMEOUT, CORRUPT = Status.OK, Status.NOT_FOUND, Status.TIMEOUT, Status.CORRUPT
SLOW_S = 3.0
SHORT_TIMEOUT_S = 0.2
#: the slow store of the late-write test: short, since the test waits it out.
LATE_S = 1.0


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
                # Harness.call fails a call that returns later than timeout_s + margin.
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
                    f"{op}() with timeout_s={SHORT_TIMEOUT_S} against a store delayed {SLOW_S} s returned {got!r} "
                    f"after {took:.2f} s"
                )
        finally:
            delay(0)
        # delay(0) made the store fast again, and the timed-out calls left no damage.
        status, got_bytes = h.get_bytes(key, 4096)
        assert status in (OK, NOT_FOUND), (
            f"get after delay(0) returned {status!r}: delay(0) must turn the slow store off, and a timed-out "
            "call must not leave the store failing"
        )
        if status is OK:
            assert got_bytes == data, "a timed-out call damaged an object"
        status, got_bytes = h.get_bytes(new, 4096)
        assert status in (OK, NOT_FOUND), (
            f"get of the key of a timed-out put returned {status!r} after delay(0) (expected the whole new "
            "object or NOT_FOUND)"
        )
        assert status is NOT_FOUND or got_bytes == pattern("new", 4096), (
            "a timed-out put left a torn object: its key reads OK with other bytes than were put"
        )

    def test_timeout_covers_remove_prefix_and_health(self, harness: Harness) -> None:
        h = harness
        delay = require_hook(h, "delay")
        key = h.key("slow-rp")
        h.put_ok({key: b"slow remove_prefix"})
        delay(SLOW_S)
        try:
            health, took = h.timed("health", timeout_s=SHORT_TIMEOUT_S)
            assert isinstance(health, Health) and health.status is TIMEOUT, (
                f"health(timeout_s={SHORT_TIMEOUT_S}) of a store delayed {SLOW_S} s returned {health!r} after "
                f"{took:.2f} s; the delay hook covers health, which reports TIMEOUT"
            )
            if h.caps.remove_by_prefix:
                result, took = h.timed("remove_prefix", h.key("slow-"), timeout_s=SHORT_TIMEOUT_S)
                assert result == (TIMEOUT, 0), (
                    f"remove_prefix(timeout_s={SHORT_TIMEOUT_S}) of a store delayed {SLOW_S} s returned "
                    f"{result!r} after {took:.2f} s; the delay hook covers remove_prefix"
                )
        finally:
            delay(0)
        health = h.call("health", h.timeout_s)
        assert health.status is OK, f"health() after delay(0) returned {health!r}"

    def test_bounded_calls_are_done_with_their_regions_on_return(self, harness: Harness) -> None:
        h = harness
        require(h, "bounded_calls")
        delay = require_hook(h, "delay")
        key, new = h.keys("late-get", "late-put")
        data, first, second = pattern("late-get", 4096), pattern("late-put", 4096), pattern("changed", 4096)
        h.put_ok({key: data})
        src = h.source(first)
        delay(LATE_S)
        try:
            got, (dst,) = h.get([key], [4096], timeout_s=SHORT_TIMEOUT_S)
            put = h.statuses("put", [new], [[src.region]], timeout_s=SHORT_TIMEOUT_S)
        finally:
            delay(0)
        assert got == [TIMEOUT] and put == [TIMEOUT], f"get and put against a slow store returned {got!r}, {put!r}"
        if h.caps.detaches_calls:
            # Its library call may go on after the TIMEOUT: quiescent() says when it ended,
            # and from then on the regions are the caller's again.
            deadline = time.monotonic() + LATE_S + 2.0
            while not h.backend.quiescent() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert h.backend.quiescent(), "detaches_calls=True but quiescent() never turned True after the call ended"
        else:
            assert h.backend.quiescent(), (
                "bounded_calls=True (and not detaches_calls) but quiescent() says a call still runs after returning")
        at_return = dst.read()
        src.write(second)  # the caller reuses its memory once the call has returned
        time.sleep(LATE_S + 0.5)  # past the time the slow store would have finished
        assert dst.read() == at_return, (
            "a get that returned TIMEOUT wrote into its regions afterwards (after it and its library call had ended)"
        )
        status, stored = h.get_bytes(new, 4096)
        assert status is NOT_FOUND or stored == first, (
            f"a put that returned TIMEOUT read its regions after it (and its library call) had ended (get: {status!r}, "
            f"{'the bytes written after it returned' if stored == second else 'other bytes'})"
        )

    def test_a_put_that_times_out_never_removes_what_was_stored(self, harness: Harness) -> None:
        """A put given up at its deadline may still complete. Whatever it then does,
        an object stored before it stays, whole: replaced by the put's bytes where a
        second put replaces (``overwrite_on_put``), else as it was. A store that turns
        duplicate puts away answers them like stored ones, so a backend that undid
        what a late put answered for would remove objects other engines had stored."""
        h = harness
        delay = require_hook(h, "delay")
        key = h.key("kept-through-late-put")
        first, second = pattern("kept-first", 4096), pattern("kept-second", 4096)
        h.put_ok({key: first})
        src = h.source(second)
        delay(LATE_S)
        try:
            put = h.statuses("put", [key], [[src.region]], timeout_s=SHORT_TIMEOUT_S)
        finally:
            delay(0)
        assert put == [TIMEOUT], f"a put against a slow store returned {put!r}"
        # The caller keeps its memory until the backend is quiescent (the contract).
        deadline = time.monotonic() + LATE_S + 2.0
        while not h.backend.quiescent() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert h.backend.quiescent(), "quiescent() never turned True after the slow call must have ended"
        time.sleep(0.3)  # room for anything the late answer set off
        status, stored = h.get_bytes(key, 4096)
        kept = "the put's bytes or the first" if h.caps.overwrite_on_put else "the first value"
        assert status is OK, (
            f"an object stored before a put that timed out read {status!r} once the put had ended "
            f"(expected {kept}): a late put must not remove what it found")
        assert stored == first or (h.caps.overwrite_on_put and stored == second), (
            f"an object stored before a put that timed out holds other bytes than {kept} after it")

    def test_tiny_timeout_returns_promptly(self, harness: Harness) -> None:
        h = harness
        key = h.key("tiny")
        data = pattern("tiny", 4096)
        h.put_ok({key: data})
        for timeout_s in (1e-6, 0.0):
            # Each call is checked to return within timeout_s + the margin.
            got, (buf,) = h.get([key], [4096], timeout_s=timeout_s)
            assert got[0] in (OK, TIMEOUT), f"get with timeout_s={timeout_s} returned {got!r}"
            if got[0] is OK:
                assert buf.read() == data
            got = h.exists([key], timeout_s=timeout_s)
            assert got[0] in (OK, TIMEOUT), f"exists with timeout_s={timeout_s} returned {got!r}"

    def test_health_reports_a_broken_store(self, harness: Harness) -> None:
        h = harness
        break_store = require_hook(h, "break_store")
        key = h.key("before-break")
        h.put_ok({key: pattern("before-break", 1000)})
        assert h.call("health", h.timeout_s).status is OK
        guarded("break_store()", h.timeout_s, break_store)
        health = h.call("health", h.timeout_s)
        assert isinstance(health, Health) and health.status is not OK, (
            f"health() after break_store() returned {health!r}: health must not say OK when the store "
            "underneath cannot serve"
        )
        put = h.put({h.key("after-break"): pattern("after-break", 1000)})
        assert put[0] is not OK, "a put into a broken store reported OK"
        got, _ = h.get([key], [1000])
        assert got[0] is not OK, "a get from a broken store reported OK"
        assert h.exists([key])[0] is not OK, "exists() on a broken store reported OK"

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
        # A CORRUPT key's regions may hold any bytes (Harness.get checks nothing lands outside them).
        statuses, bufs = h.get([bad, good], [8192, 8192])
        assert statuses == [CORRUPT, OK], f"get of a damaged and an intact object returned {statuses!r}"
        assert bufs[1].read() == items[good]
