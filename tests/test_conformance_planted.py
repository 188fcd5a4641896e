"""The conformance suite is itself tested: a correct in-memory reference backend
passes all of it, and each backend below, the reference with one planted bug,
makes it fail in the test(s) meant to catch that bug (while the reference
passes the same tests in the same run)."""

from __future__ import annotations

import ctypes
import dataclasses
import fnmatch
import itertools
import re
import string
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from ascendstore_conformance import BackendConformance, BackendFactory

from ascendstore.contract import (
    Backend,
    BackendContext,
    BackendOptions,
    Capabilities,
    Health,
    Region,
    Status,
)

OK, NOT_FOUND, NO_SPACE, TIMEOUT = Status.OK, Status.NOT_FOUND, Status.NO_SPACE, Status.TIMEOUT
UNAVAILABLE, CORRUPT, INVALID = Status.UNAVAILABLE, Status.CORRUPT, Status.INVALID
SMALL = {"capacity_bytes": 2 << 20}


def gather(regions: Sequence[Region]) -> bytes:
    return b"".join(ctypes.string_at(r.addr, r.length) for r in regions)


def scatter(data: bytes, regions: Sequence[Region]) -> None:
    pos = 0
    for r in regions:
        ctypes.memmove(r.addr, data[pos : pos + r.length], r.length)
        pos += r.length


class MemHooks:
    def __init__(self, store: MemStore) -> None:
        self.store = store

    def delay(self, seconds: float) -> None:
        self.store.slow_s = seconds

    def break_store(self) -> None:
        self.store.broken = True

    def corrupt(self, key: str) -> bool:
        with self.store.lock:
            entry = self.store.objects.get(key)
            if entry is None:
                return False
            data, crc = entry
            self.store.objects[key] = (bytes([data[0] ^ 0xFF]) + data[1:], crc)
            return True


class MemStore(Backend):
    """Correct reference: objects in a dict of this client, under a lock."""

    class Options(BackendOptions):
        capacity_bytes: int = 64 << 20
        #: evict least recently written objects when full, and pin (evicts, pins)
        evict: bool = False

    # Key characters include those of pattern languages (regex, SQL LIKE, glob),
    # so the prefix tests try all of them.
    CAPS = Capabilities(
        detects_corruption=True,
        listing=True,
        max_key_bytes=128,
        max_object_bytes=8 << 20,
        key_extra_chars="@._:-/=+%*?[]",
        bounded_calls=True,
    )

    def __init__(self, options: Options) -> None:
        self.capacity = options.capacity_bytes
        self.evict = options.evict
        self.pins: dict[str, float] = {}  # key -> monotonic end of its lease
        self.objects: dict[str, tuple[bytes, int]] = {}  # key -> (bytes, crc32)
        self.used = 0
        self.lock = threading.RLock()
        self.closed = False
        self.broken = False  # the store underneath is gone (test hook break_store)
        self.slow_s = 0.0

    @classmethod
    def create(cls, options: Options, ctx: BackendContext) -> MemStore:
        return cls(options)

    @property
    def capabilities(self) -> Capabilities:
        return dataclasses.replace(self.CAPS, evicts=True, pins=True) if self.evict else self.CAPS

    def _gate(self, n: int, timeout_s: float) -> list[Status] | None:
        """Statuses for the whole batch when the call cannot proceed."""
        if self.closed or self.broken:
            return [UNAVAILABLE] * n
        return self._slow(n, timeout_s)

    def _slow(self, n: int, timeout_s: float) -> list[Status] | None:
        """The delay hook: never waits past the timeout."""
        if self.slow_s:
            time.sleep(max(0.0, min(self.slow_s, timeout_s)))
            if self.slow_s > timeout_s:
                return [TIMEOUT] * n
        return None

    def _key_ok(self, key: str) -> bool:
        allowed = string.ascii_letters + string.digits + self.capabilities.key_extra_chars
        return 0 < len(key.encode()) <= self.capabilities.max_key_bytes and all(c in allowed for c in key)

    def exists(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        if (early := self._gate(len(keys), timeout_s)) is not None:
            return early
        with self.lock:
            return [OK if k in self.objects else NOT_FOUND if self._key_ok(k) else INVALID for k in keys]

    def put(self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float) -> list[Status]:
        if (early := self._gate(len(keys), timeout_s)) is not None:
            return early
        out = []
        for key, regs in zip(keys, regions, strict=True):
            size = sum(r.length for r in regs)
            if not self._key_ok(key) or size > self.capabilities.max_object_bytes:
                out.append(INVALID)
            else:
                out.append(self._write(key, gather(regs)))
        return out

    def _write(self, key: str, data: bytes) -> Status:
        with self.lock:
            old = len(self.objects[key][0]) if key in self.objects else 0
            while self.evict and self.used - old + len(data) > self.capacity and self._evict_one(key):
                pass
            if self.used - old + len(data) > self.capacity:
                return NO_SPACE
            self.objects[key] = (data, zlib.crc32(data))
            self.used += len(data) - old
            return OK

    def _evict_one(self, keep: str) -> bool:
        """Drop the oldest object that is not pinned (lock held); False if none."""
        now = time.monotonic()
        for k in self.objects:
            if k != keep and not self._pinned(k, now):
                self.used -= len(self.objects.pop(k)[0])
                self.pins.pop(k, None)
                return True
        return False

    def _pinned(self, key: str, now: float) -> bool:
        return self.pins.get(key, 0.0) > now

    def pin(self, keys: Sequence[str], lease_s: float, timeout_s: float) -> list[Status]:
        out = self.exists(keys, timeout_s)
        with self.lock:
            until = time.monotonic() + lease_s
            for k, st in zip(keys, out, strict=True):
                if st is OK:
                    self.pins[k] = max(self.pins.get(k, 0.0), until)
        return out

    def unpin(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        if (early := self._gate(len(keys), timeout_s)) is not None:
            return early
        with self.lock:
            out = [OK if k in self.objects else NOT_FOUND for k in keys]
            for k in keys:
                self.pins.pop(k, None)
        return out

    def get(self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float) -> list[Status]:
        if (early := self._gate(len(keys), timeout_s)) is not None:
            return early
        out = []
        for key, regs in zip(keys, regions, strict=True):
            status, data = self._read(key)
            if status is OK and sum(r.length for r in regs) != len(data):
                status = INVALID
            if status is OK:
                self._scatter(data, regs)
            out.append(status)
        return out

    def _read(self, key: str) -> tuple[Status, bytes]:
        with self.lock:
            entry = self.objects.get(key)
        if entry is None:
            return NOT_FOUND, b""
        data, crc = entry
        return (OK, data) if zlib.crc32(data) == crc else (CORRUPT, b"")

    def _scatter(self, data: bytes, regions: Sequence[Region]) -> None:
        scatter(data, regions)

    def remove(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        if (early := self._gate(len(keys), timeout_s)) is not None:
            return early
        out = []
        with self.lock:
            for key in keys:
                entry = self.objects.pop(key, None)
                self.used -= len(entry[0]) if entry else 0
                out.append(OK if entry else NOT_FOUND)
        return out

    def _matches(self, key: str, prefix: str) -> bool:
        return key.startswith(prefix)

    def remove_prefix(self, prefix: str, timeout_s: float) -> tuple[Status, int]:
        if (early := self._gate(1, timeout_s)) is not None:
            return early[0], 0
        if not self._prefix_ok(prefix):
            return INVALID, 0
        with self.lock:
            doomed = [k for k in self.objects if self._matches(k, prefix)]
            for k in doomed:
                self.used -= len(self.objects.pop(k)[0])
        return OK, len(doomed)

    def _prefix_ok(self, prefix: str) -> bool:
        return prefix != ""

    def _lists(self, key: str, prefix: str) -> bool:
        return key.startswith(prefix)

    def list_keys(self, prefix: str = "", limit: int = 1000) -> Iterator[str]:
        if self.closed:
            return iter(())
        with self.lock:
            keys = sorted(self.objects)
        return itertools.islice((k for k in keys if self._lists(k, prefix)), limit)

    def stats(self) -> dict[str, Any]:
        return {"capacity_bytes": self.capacity, "used_bytes": self.used, "objects": len(self.objects)}

    def health(self, timeout_s: float) -> Health:
        if self.closed or self.broken:
            return Health(UNAVAILABLE)
        if (early := self._slow(1, timeout_s)) is not None:
            return Health(early[0])
        return Health(OK)

    def close(self) -> None:
        self.closed = True

    def test_hooks(self) -> MemHooks:
        return MemHooks(self)


# ---------------------------------------------------------------------------
# Planted bugs: each is the reference with one thing wrong.


class ExistsLies(MemStore):
    def exists(self, keys, timeout_s):
        return [OK] * len(keys)


class StaleReadCache(MemStore):
    """Serves a per-client read cache that nothing invalidates."""

    def __init__(self, options):
        super().__init__(options)
        self.cache: dict[str, bytes] = {}

    def _read(self, key):
        if key in self.cache:
            return OK, self.cache[key]
        status, data = super()._read(key)
        if status is OK:
            self.cache[key] = data
        return status, data


class TruncatedGet(MemStore):
    def _scatter(self, data, regions):
        scatter(data[:-1], [*regions[:-1], Region(regions[-1].addr, regions[-1].length - 1)])


class DropsLastKeyOfBatch(MemStore):
    def put(self, keys, regions, timeout_s):
        if len(keys) < 2:
            return super().put(keys, regions, timeout_s)
        return super().put(keys[:-1], regions[:-1], timeout_s) + [OK]


class WrongStatusForMissing(MemStore):
    def _read(self, key):
        status, data = super()._read(key)
        return (INVALID, data) if status is NOT_FOUND else (status, data)


class IgnoresTimeout(MemStore):
    """Waits for the slow store however long it takes."""

    def _gate(self, n, timeout_s):
        if self.closed:
            return [UNAVAILABLE] * n
        time.sleep(self.slow_s)
        return None


class TornWrites(MemStore):
    """Overwrites objects in place piece by piece, and reads them the same way, without a lock."""

    CAPS = dataclasses.replace(MemStore.CAPS, detects_corruption=False)

    def _write(self, key, data):
        with self.lock:
            entry = self.objects.get(key)
        if entry is None or len(entry[0]) != len(data):
            return super()._write(key, bytearray(data))
        target = entry[0]
        step = -(-len(data) // 4)
        for pos in range(0, len(data), step):
            target[pos : pos + step] = data[pos : pos + step]
            time.sleep(0.0005)
        return OK

    def _read(self, key):
        with self.lock:
            entry = self.objects.get(key)
        if entry is None:
            return NOT_FOUND, b""
        source, parts = entry[0], []
        step = -(-len(source) // 4)
        for pos in range(0, len(source), step):
            parts.append(bytes(source[pos : pos + step]))
            time.sleep(0.0005)
        return OK, b"".join(parts)


class RemovedStillReadable(MemStore):
    """remove() only hides keys from exists()."""

    def __init__(self, options):
        super().__init__(options)
        self.hidden: set[str] = set()

    def remove(self, keys, timeout_s):
        out = [OK if k in self.objects and k not in self.hidden else NOT_FOUND for k in keys]
        self.hidden.update(keys)
        return out

    def exists(self, keys, timeout_s):
        return [
            NOT_FOUND if k in self.hidden else s
            for k, s in zip(keys, super().exists(keys, timeout_s), strict=True)
        ]

    def _write(self, key, data):
        self.hidden.discard(key)
        return super()._write(key, data)


class PrefixAsRegex(MemStore):
    """Hands the prefix to a regex engine unescaped (as with a store's remove_by_regex)."""

    def _matches(self, key, prefix):
        return re.match(prefix, key) is not None


class RaisesWhenFull(MemStore):
    def _write(self, key, data):
        if super()._write(key, data) is NO_SPACE:
            raise MemoryError("pool exhausted")
        return OK


class FullDropsSilently(MemStore):
    def _write(self, key, data):
        super()._write(key, data)
        return OK


class ReversedRegions(MemStore):
    """Fills the regions of a multi-region get back to front."""

    def _scatter(self, data, regions):
        pos = 0
        for r in reversed(regions):
            ctypes.memmove(r.addr, data[pos : pos + r.length], r.length)
            pos += r.length


class WritesPastRegion(MemStore):
    """Copies whole 8-byte words, past the end of an odd-sized region."""

    def _scatter(self, data, regions):
        pos = 0
        for r in regions:
            n = -(-r.length // 8) * 8
            ctypes.memmove(r.addr, data[pos : pos + n].ljust(n, b"\0"), n)
            pos += r.length


class ClaimsPersistence(MemStore):
    CAPS = dataclasses.replace(MemStore.CAPS, persistent=True)


class ClaimsSharing(MemStore):
    CAPS = dataclasses.replace(MemStore.CAPS, shared_across_processes=True)


class CorruptionUndetected(MemStore):
    def _read(self, key):
        with self.lock:
            entry = self.objects.get(key)
        return (OK, entry[0]) if entry else (NOT_FOUND, b"")


class CrashesAfterClose(MemStore):
    def _gate(self, n, timeout_s):
        if self.closed:
            raise RuntimeError("client is closed")
        return super()._gate(n, timeout_s)


class OverwriteIgnored(MemStore):
    """Declares overwrite_on_put (the default) but keeps the first value."""

    def _write(self, key, data):
        with self.lock:
            if key in self.objects:
                return OK
        return super()._write(key, data)


class DedupClaimedButOverwrites(MemStore):
    """Declares dedups_puts (the engine then asks no exists before a save) but a
    second put replaces the value (its overwrite_on_put=True is consistent with that)."""

    CAPS = dataclasses.replace(MemStore.CAPS, dedups_puts=True)


class KeyLimitLie(MemStore):
    """Declares 128-byte keys but refuses anything over 100."""

    def _key_ok(self, key):
        return super()._key_ok(key) and len(key) <= 100


class PrefixAnywhere(MemStore):
    """remove_prefix matches keys that contain the prefix anywhere (``LIKE '%p%'``)."""

    def _matches(self, key, prefix):
        return prefix in key


class ListsAnywhere(MemStore):
    """list_keys matches keys that contain the prefix anywhere."""

    def _lists(self, key, prefix):
        return prefix in key


def _like(prefix: str) -> str:
    return "".join(".*" if c == "%" else "." if c == "_" else re.escape(c) for c in prefix)


class PrefixAsSqlLike(MemStore):
    """``DELETE ... WHERE key LIKE prefix || '%'`` with the prefix unescaped."""

    def _matches(self, key, prefix):
        return re.match(_like(prefix), key) is not None


class PrefixAsGlob(MemStore):
    """``fnmatch(key, prefix + '*')``, as with a store's glob-style key scan."""

    def _matches(self, key, prefix):
        return fnmatch.fnmatchcase(key, prefix + "*")


class PrefixCaseFolded(MemStore):
    """Compares keys case-insensitively (SQLite's LIKE does, for ASCII)."""

    def _matches(self, key, prefix):
        return key.lower().startswith(prefix.lower())


class EmptyPrefixWipesStore(MemStore):
    def _prefix_ok(self, prefix):
        return True


class ExistsInKeyOrder(MemStore):
    """Answers a batched exists in sorted-key order (as a sorted IN (...) query returns rows)."""

    def exists(self, keys, timeout_s):
        return super().exists(sorted(keys), timeout_s)


class RemoveInKeyOrder(MemStore):
    def remove(self, keys, timeout_s):
        return super().remove(sorted(keys), timeout_s)


class HealthIgnoresBrokenStore(MemStore):
    """health() only knows about close()."""

    def health(self, timeout_s):
        return Health(UNAVAILABLE if self.closed else OK)


class AcksWritesToBrokenStore(MemStore):
    """A put into a broken store reports OK (a write-behind queue that never drains)."""

    def put(self, keys, regions, timeout_s):
        if self.broken and not self.closed:
            return [OK] * len(keys)
        return super().put(keys, regions, timeout_s)


class BacksOffPastDeadline(MemStore):
    """After the deadline, sleeps one more retry backoff before reporting TIMEOUT."""

    def _slow(self, n, timeout_s):
        early = super()._slow(n, timeout_s)
        if early is not None:
            time.sleep(1.0)
        return early


class HealthIgnoresDelay(MemStore):
    """health() waits for the slow store however long it takes."""

    def health(self, timeout_s):
        time.sleep(self.slow_s)
        return Health(UNAVAILABLE if self.closed else OK)


class RemovePrefixIgnoresDelay(MemStore):
    def remove_prefix(self, prefix, timeout_s):
        slow, self.slow_s = self.slow_s, 0.0
        try:
            return super().remove_prefix(prefix, timeout_s)
        finally:
            self.slow_s = slow


class TimedOutPutLeavesKeyStuck(MemStore):
    """A put that timed out leaves its keys reserved: later reads of them answer
    UNAVAILABLE instead of NOT_FOUND (an allocation never finished nor freed)."""

    def __init__(self, options):
        super().__init__(options)
        self.stuck: set[str] = set()

    def put(self, keys, regions, timeout_s):
        out = super().put(keys, regions, timeout_s)
        self.stuck.update(k for k, s in zip(keys, out, strict=True) if s is TIMEOUT)
        return out

    def get(self, keys, regions, timeout_s):
        out = super().get(keys, regions, timeout_s)
        return [UNAVAILABLE if k in self.stuck and s is not TIMEOUT else s for k, s in zip(keys, out, strict=True)]


class WritesBeforeSizeCheck(MemStore):
    """Copies what fits into the regions, then finds the sizes differ (INVALID)."""

    def get(self, keys, regions, timeout_s):
        for key, regs in zip(keys, regions, strict=True):
            status, data = self._read(key)
            if status is OK and sum(r.length for r in regs) != len(data):
                scatter(data.ljust(sum(r.length for r in regs), b"\0"), regs)
        return super().get(keys, regions, timeout_s)


class ZeroCapacityWhenUnlimited(MemStore):
    """Reports capacity_bytes 0, meaning "no limit"."""

    def stats(self):
        return {**super().stats(), "capacity_bytes": 0}


class ListsAfterClose(MemStore):
    def list_keys(self, prefix="", limit=1000):
        closed, self.closed = self.closed, False
        try:
            return iter(list(super().list_keys(prefix, limit)))
        finally:
            self.closed = closed


class StatsRaiseAfterClose(MemStore):
    def stats(self):
        if self.closed:
            raise RuntimeError("client is closed")
        return super().stats()


class FinishesInBackground(MemStore):
    """Declares bounded_calls but, on a timeout, lets the work finish on a thread:
    the get scatters and the put gathers after the call returned."""

    def _late(self, fn):
        threading.Timer(self.slow_s, fn).start()

    def get(self, keys, regions, timeout_s):
        if self.slow_s > timeout_s:
            self._late(lambda: [scatter(self._read(k)[1], r) for k, r in zip(keys, regions, strict=True)
                                if self._read(k)[0] is OK])
        return super().get(keys, regions, timeout_s)

    def put(self, keys, regions, timeout_s):
        if self.slow_s > timeout_s:
            self._late(lambda: [self._write(k, gather(r)) for k, r in zip(keys, regions, strict=True)])
        return super().put(keys, regions, timeout_s)


class UndoesLatePuts(MemStore):
    """Detaches a put that overran its deadline (``detaches_calls``: quiescent()
    False until it ends) and, once it has ended, removes every key it answered
    for, keys it found stored too. Mooncake's backend did so until 2026-12-05: its
    master turns a duplicate put away and the client answers that like a stored one."""

    CAPS = dataclasses.replace(MemStore.CAPS, detaches_calls=True)

    def __init__(self, options):
        super().__init__(options)
        self.late_running = 0

    def quiescent(self):
        with self.lock:
            return self.late_running == 0

    def put(self, keys, regions, timeout_s):
        if self.slow_s > timeout_s:
            with self.lock:
                self.late_running += 1

            def late() -> None:
                with self.lock:
                    for k in keys:
                        entry = self.objects.pop(k, None)
                        self.used -= len(entry[0]) if entry else 0
                    self.late_running -= 1

            threading.Timer(self.slow_s, late).start()
        return super().put(keys, regions, timeout_s)


#: bug -> the suite's tests that must catch it
class EvictingMemStore(MemStore):
    """The reference with LRU eviction and pins (evicts, pins): correct."""

    CONFIG = {"evict": True}


class PinIgnored(EvictingMemStore):
    """pin() answers like exists and protects nothing: a chunk a lookup counted
    is evicted before its load."""

    def _pinned(self, key, now):
        return False


PLANTED: dict[type[MemStore], set[str]] = {
    ExistsLies: {"test_absent_keys_are_not_found", "test_batch_mixing_present_and_absent_keys"},
    StaleReadCache: {"test_duplicate_put_semantics_as_declared", "test_removed_key_is_gone"},
    TruncatedGet: {"test_put_exists_get_byte_exact"},
    DropsLastKeyOfBatch: {"test_every_key_of_a_batch_put_is_stored"},
    WrongStatusForMissing: {"test_absent_keys_are_not_found", "test_batch_mixing_present_and_absent_keys"},
    IgnoresTimeout: {"test_timeout_surfaces_as_timeout_status"},
    TornWrites: {"test_concurrent_writers_and_readers"},
    RemovedStillReadable: {"test_removed_key_is_gone"},
    PrefixAsRegex: {"test_remove_by_prefix"},
    RaisesWhenFull: {"test_capacity_full"},
    FullDropsSilently: {"test_capacity_full"},
    ReversedRegions: {"test_several_regions_per_key"},
    WritesPastRegion: {"test_odd_sizes_and_alignments"},
    ClaimsPersistence: {"test_persistence_across_reopen"},
    ClaimsSharing: {"test_visible_from_another_process"},
    CorruptionUndetected: {"test_corruption_is_detected"},
    CrashesAfterClose: {"test_calls_after_close_are_unavailable"},
    OverwriteIgnored: {"test_duplicate_put_semantics_as_declared"},
    DedupClaimedButOverwrites: {"test_duplicate_put_semantics_as_declared"},
    KeyLimitLie: {"test_key_length_limit"},
    # Prefix removal and listing: plain text, at the start, case-sensitive; "" is INVALID.
    PrefixAnywhere: {"test_remove_prefix_matches_only_at_the_start"},
    ListsAnywhere: {"test_remove_prefix_matches_only_at_the_start"},
    PrefixAsSqlLike: {"test_remove_prefix_is_plain_text"},
    PrefixAsGlob: {"test_remove_prefix_is_plain_text"},
    PrefixCaseFolded: {"test_remove_prefix_is_case_sensitive"},
    EmptyPrefixWipesStore: {"test_remove_prefix_of_empty_string_is_invalid"},
    # Batches answer in request order.
    ExistsInKeyOrder: {"test_batches_answer_in_request_order"},
    RemoveInKeyOrder: {"test_batches_answer_in_request_order"},
    # Health and writes of a broken store (break_store hook).
    HealthIgnoresBrokenStore: {"test_health_reports_a_broken_store"},
    AcksWritesToBrokenStore: {"test_health_reports_a_broken_store"},
    # Every call returns within its timeout_s (a small margin, checked per call).
    BacksOffPastDeadline: {"test_timeout_surfaces_as_timeout_status"},
    HealthIgnoresDelay: {"test_timeout_covers_remove_prefix_and_health"},
    RemovePrefixIgnoresDelay: {"test_timeout_covers_remove_prefix_and_health"},
    TimedOutPutLeavesKeyStuck: {"test_timeout_surfaces_as_timeout_status"},
    # A failed get leaves its regions untouched (INVALID, NOT_FOUND of an absent key).
    WritesBeforeSizeCheck: {"test_get_into_wrong_total_length_is_invalid"},
    # bounded_calls: done with the regions on return (no late write, no late read).
    FinishesInBackground: {"test_bounded_calls_are_done_with_their_regions_on_return"},
    # A put given up at its deadline never removes what it found.
    UndoesLatePuts: {"test_a_put_that_times_out_never_removes_what_was_stored"},
    # stats() conventions, and calls after close().
    ZeroCapacityWhenUnlimited: {"test_stats_follow_the_conventions"},
    ListsAfterClose: {"test_calls_after_close_are_unavailable"},
    StatsRaiseAfterClose: {"test_calls_after_close_are_unavailable"},
    # pins (evicts + pins): what a lookup pinned survives eviction pressure.
    PinIgnored: {"test_evicted_after_lookup"},
}

#: bug -> words its failure must show (the message points at the real fault)
MESSAGES: dict[type[MemStore], tuple[str, ...]] = {
    PrefixAnywhere: ("removed keys that do not start with it",),
    ListsAnywhere: ("list_keys(",),
    PrefixAsSqlLike: ("removed keys that do not start with it", "never a pattern"),
    PrefixAsGlob: ("removed keys that do not start with it",),
    PrefixCaseFolded: ("only in case",),
    EmptyPrefixWipesStore: ("an empty prefix is INVALID",),
    ExistsInKeyOrder: ("must follow the order of the request",),
    RemoveInKeyOrder: ("remove() of keys in the order",),
    HealthIgnoresBrokenStore: ("health must not say OK",),
    AcksWritesToBrokenStore: ("a put into a broken store reported OK",),
    BacksOffPastDeadline: ("over its timeout by",),
    HealthIgnoresDelay: ("over its timeout by",),
    RemovePrefixIgnoresDelay: ("the delay hook covers remove_prefix",),
    TimedOutPutLeavesKeyStuck: ("get of the key of a timed-out put returned",),
    WritesBeforeSizeCheck: ("returned INVALID but wrote into the region",),
    FinishesInBackground: ("wrote into its regions afterwards",),
    UndoesLatePuts: ("a late put must not remove what it found",),
    ZeroCapacityWhenUnlimited: ("leaves the key out",),
    ListsAfterClose: ("a closed client lists nothing",),
    StatsRaiseAfterClose: ("client is closed",),
    IgnoresTimeout: ("over its timeout by",),
    PinIgnored: ("pinned objects were evicted within their",),
    DedupClaimedButOverwrites: ("dedups_puts=True but a second put",),
}
#: words no failure of a bug may show (a message that would send the author the wrong way)
MISLEADING: dict[type[MemStore], tuple[str, ...]] = {
    TimedOutPutLeavesKeyStuck: ("torn object",),
}


def memstore_factory(cls: type[MemStore]) -> BackendFactory:
    config = dict(getattr(cls, "CONFIG", {}))
    return BackendFactory(cls, config=config, small_config={**SMALL, **config})


class TestReferencePassesEverything(BackendConformance):
    """The reference, subclassing form, whole suite: what the bugs are measured against."""

    @pytest.fixture
    def backend_factory(self) -> BackendFactory:
        return memstore_factory(MemStore)


class TestEvictingReferencePassesEverything(BackendConformance):
    """The reference that evicts and pins, whole suite (the capacity tests take its other branch)."""

    @pytest.fixture
    def backend_factory(self) -> BackendFactory:
        return memstore_factory(EvictingMemStore)


HEADER = """
import sys
sys.path.insert(0, {tests_dir!r})
import pytest
from ascendstore_conformance import BackendConformance
import test_conformance_planted as planted
"""

CLASS = """

class {name}(BackendConformance):
    @pytest.fixture
    def backend_factory(self):
        return planted.memstore_factory(planted.{backend})
"""

@dataclasses.dataclass
class Outcome:
    outcome: str  # passed | failed | error | skipped
    text: str  # the failure message and traceback


def read_junit(path: Path) -> dict[str, dict[str, Outcome]]:
    """class -> test -> outcome, from pytest's JUnit XML report."""
    out: dict[str, dict[str, Outcome]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = case.get("classname", "").rpartition(".")[2]
        outcome, text = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, text = tag if tag != "failure" else "failed", f"{node.get('message', '')}\n{node.text or ''}"
                break
        out.setdefault(cls, {})[case.get("name", "")] = Outcome(outcome, text)
    return out


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict[str, Outcome]], str]:
    """One pytest run (a separate process) of the suite's tests that should catch
    each bug, against the buggy backend and against the reference."""
    where = tmp_path_factory.mktemp("planted")
    source = HEADER.format(tests_dir=str(Path(__file__).parent)) + CLASS.format(
        name="TestGood", backend="MemStore"
    ) + CLASS.format(name="TestGoodEvicting", backend="EvictingMemStore")
    node_ids = []
    for bug, must_fail in PLANTED.items():
        source += CLASS.format(name=f"TestBug{bug.__name__}", backend=bug.__name__)
        node_ids += [f"test_planted.py::TestBug{bug.__name__}::{t}" for t in sorted(must_fail)]
    node_ids += sorted({f"test_planted.py::TestGood::{t}" for tests in PLANTED.values() for t in tests})
    node_ids += sorted({f"test_planted.py::TestGoodEvicting::{t}" for b, tests in PLANTED.items()
                        if issubclass(b, EvictingMemStore) for t in tests})
    (where / "test_planted.py").write_text(source)
    report = where / "report.xml"
    done = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "addopts=",
            f"--junitxml={report}", *node_ids,
        ],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = done.stdout + done.stderr
    assert report.exists(), log[-5000:]
    return read_junit(report), log


def test_reference_passes_the_tests_that_catch_the_bugs(planted_run) -> None:
    outcomes, log = planted_run
    want = {t for tests in PLANTED.values() for t in tests}
    good = outcomes.get("TestGood", {})
    ran = {t: o.outcome for t, o in good.items() if o.outcome != "skipped"}
    # Tests of eviction with pins run against the reference that evicts and pins.
    ran |= {t: o.outcome for t, o in outcomes.get("TestGoodEvicting", {}).items() if o.outcome != "skipped"}
    # Skipped ones are those for capabilities the reference does not claim.
    assert set(ran.values()) == {"passed"}, log[-5000:]
    assert want - set(ran) <= {"test_persistence_across_reopen", "test_visible_from_another_process"}, good


@pytest.mark.parametrize("bug", list(PLANTED), ids=lambda c: c.__name__)
def test_planted_bug_fails_the_suite(planted_run, bug: type[MemStore]) -> None:
    outcomes, log = planted_run
    got = outcomes.get(f"TestBug{bug.__name__}", {})
    must_fail = PLANTED[bug]
    assert set(got) == must_fail, f"{bug.__name__}: tests did not run: {must_fail - set(got)}\n{log[-3000:]}"
    # FAILED, not ERROR: the bug is caught by the test's checks, not by a broken set-up.
    slipped = {t: got[t].outcome for t in must_fail if got[t].outcome != "failed"}
    assert not slipped, f"{bug.__name__} slipped through {slipped}"
    for t in must_fail:
        text = got[t].text
        for words in MESSAGES.get(bug, ()):
            assert words in text, f"{bug.__name__}: the failure of {t} does not say {words!r}:\n{text[-2000:]}"
        for words in MISLEADING.get(bug, ()):
            assert words not in text, f"{bug.__name__}: the failure of {t} misleads with {words!r}:\n{text[-2000:]}"


def test_enough_distinct_bugs_are_planted() -> None:
    assert len(PLANTED) >= 25
    assert len({frozenset(v) for v in PLANTED.values()}) >= 20, "bugs must be caught by different tests"
