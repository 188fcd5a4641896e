"""Concurrent writers and readers (threads, and another process when the
store is shared): every successful read is one whole written version."""

from __future__ import annotations

import random
import threading
import time

from ascendstore.contract import Status
from ascendstore_conformance.factory import BackendFactory
from ascendstore_conformance.harness import Harness, check_versioned, digest, pattern, versioned
from ascendstore_conformance.suite.base import object_size, require

OK, NOT_FOUND = Status.OK, Status.NOT_FOUND
WRITERS, READERS, VERSIONS = 2, 2, 40
#: reads that overlapped a write, at least: the writers go on past VERSIONS (up to
#: 4x, or OVERLAP_S) until the readers made this many. How the threads interleave is
#: the scheduler's choice; a store that tears must not pass because, this once, few
#: reads ran while a write did (a run that caught a planted tearing store every time
#: let it through once when nothing bounded this).
MIN_OVERLAPS, OVERLAP_S = 20, 10.0
CHILD_TIMEOUT_S = 120.0
#: longest burst (s) the noise thread holds the interpreter for, and longest pause
NOISE_BURST_S = 0.002


def _scheduler_noise(stop: threading.Event) -> None:
    """Holds the interpreter for short bursts of random length while the writers run.

    Overlapping is not enough: a store that copies in steps tears a read only when the
    reader and a writer change pace mid-copy. Where both take steps of equal length, a
    reader that trails a writer copies only new bytes, and one ahead of it only old
    ones, however many reads overlap (a planted tearing store passed 2 runs in 100
    that way, with ~90 overlapping reads each). The bursts delay each thread's next
    step by a random amount, so paces keep changing."""
    rng = random.Random()
    while not stop.is_set():
        until = time.perf_counter() + rng.uniform(0, NOISE_BURST_S)
        while time.perf_counter() < until:
            pass
        time.sleep(rng.uniform(0, NOISE_BURST_S))


class _Overlaps:
    """Counts reads that ran while some write was under way (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = self.finished = self.reads = 0

    def write_starts(self) -> None:
        with self._lock:
            self.started += 1

    def write_ends(self) -> None:
        with self._lock:
            self.finished += 1

    def read_starts(self) -> tuple[int, int]:
        with self._lock:
            return self.started, self.finished

    def read_ends(self, at_start: tuple[int, int]) -> None:
        started, finished = at_start
        with self._lock:
            # a write under way when the read began, or one began before it ended
            if started > finished or self.started > started:
                self.reads += 1


def _reader(h: Harness, key: str, size: int, stop: threading.Event, seen: list, errors: list,
            overlaps: _Overlaps) -> None:
    buf = h.buffer(size)
    region = [[buf.region]]
    while not stop.is_set() and not errors:
        at_start = overlaps.read_starts()
        (status,) = h.backend.get([key], region, h.timeout_s)
        overlaps.read_ends(at_start)
        if status is OK:
            version = check_versioned(buf.read())
            if version is None:
                errors.append(f"torn read of {key!r}: the bytes mix several writes")
            seen.append(version)
        elif status is not NOT_FOUND:
            errors.append(f"get({key!r}) during concurrent writes returned {status!r}")


class ConcurrencyTests:
    def test_concurrent_writers_and_readers(self, harness: Harness) -> None:
        h = harness
        size = object_size(h, 256 << 10)
        shared = h.key("shared")
        h.put_ok({shared: versioned(0, 0, size)})
        errors: list[str] = []
        seen: list = []
        own: dict[str, bytes] = {}
        last: dict[int, int] = {}  # each writer's last version
        stop = threading.Event()
        overlaps = _Overlaps()
        deadline = time.monotonic() + OVERLAP_S

        def writer(w: int) -> None:
            buf = h.buffer(size)
            for seq in range(1, 4 * VERSIONS + 1):
                if seq > VERSIONS and (overlaps.reads >= MIN_OVERLAPS or time.monotonic() > deadline):
                    break
                buf.write(versioned(w, seq, size))
                own_key = h.key(f"own{w}.{seq}")
                own[own_key] = pattern(own_key, 1000 + seq)
                mine = h.source(own[own_key])
                overlaps.write_starts()
                got = h.backend.put([shared, own_key], [[buf.region], [mine.region]], h.timeout_s)
                overlaps.write_ends()
                last[w] = seq
                if got != [OK, OK]:
                    errors.append(f"concurrent put returned {got!r}")

        readers = [
            threading.Thread(target=_reader, args=(h, shared, size, stop, seen, errors, overlaps))
            for _ in range(READERS)
        ]
        writers = [threading.Thread(target=writer, args=(w,)) for w in range(1, WRITERS + 1)]
        noise = threading.Thread(target=_scheduler_noise, args=(stop,))
        for t in [noise, *readers, *writers]:
            t.start()
        for t in writers:
            t.join(CHILD_TIMEOUT_S)
        stop.set()
        for t in [noise, *readers]:
            t.join(CHILD_TIMEOUT_S)
        assert not any(t.is_alive() for t in readers + writers), "concurrent calls did not return"
        assert not errors, errors[0]
        assert seen, "no read succeeded while writers were running"
        # After the writers: one whole final version, and every writer's own keys intact.
        status, final = h.get_bytes(shared, size)
        assert status is OK and final is not None and check_versioned(final), "final value is torn or missing"
        if h.caps.overwrite_on_put:
            assert check_versioned(final) in last.items(), "the final value is not one of the last writes"
        h.assert_reads(own)

    def test_visible_from_another_process(self, harness: Harness, bound_factory: BackendFactory) -> None:
        require(harness, "shared_across_processes")
        from ascendstore_conformance.child import run_child

        items = {harness.key(f"xp{i}"): pattern(f"xp{i}", 5000 * (i + 1)) for i in range(3)}
        harness.put_ok(items)
        absent = harness.key("xp-absent")
        keys = [*items, absent]
        answer = run_child(
            {
                "spec": bound_factory.spec(),
                "op": "read",
                "keys": keys,
                "sizes": [len(items.get(k, b"1")) for k in keys],
            },
            CHILD_TIMEOUT_S,
        )
        assert answer["exists"] == ["OK", "OK", "OK", "NOT_FOUND"], (
            f"another process: exists -> {answer['exists']}"
        )
        assert answer["get"] == ["OK", "OK", "OK", "NOT_FOUND"], f"another process: get -> {answer['get']}"
        assert answer["digests"][:3] == [digest(v) for v in items.values()], (
            "another process read different bytes"
        )

    def test_no_torn_reads_across_processes(self, harness: Harness, bound_factory: BackendFactory) -> None:
        require(harness, "shared_across_processes")
        from ascendstore_conformance.child import Child

        size = object_size(harness, 256 << 10)
        key = harness.key("xp-shared")
        harness.put_ok({key: versioned(0, 0, size)})
        child = Child(
            {
                "spec": bound_factory.spec(),
                "op": "write_versions",
                "key": key,
                "size": size,
                "writer": 7,
                "seconds": 2.0,
                "max_count": 100000,
            }
        )
        buf = harness.buffer(size)
        seen: set = set()
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while child.running() and time.monotonic() < deadline:
            (status,) = harness.backend.get([key], [[buf.region]], harness.timeout_s)
            assert status in (OK, NOT_FOUND), f"get during another process's writes returned {status!r}"
            if status is OK:
                version = check_versioned(buf.read())
                assert version is not None, f"torn read of {key!r} while another process was writing it"
                seen.add(version)
        answer = child.finish(CHILD_TIMEOUT_S)
        assert set(answer["statuses"]) <= {"OK"}, f"the writing process got {set(answer['statuses'])}"
        assert seen, "no read succeeded while the other process was writing"
