"""A full store reports NO_SPACE per key (or evicts, if it says it does) and
keeps serving what it holds, byte-exact."""

from __future__ import annotations

import time

from ascendstore.contract import Status
from ascendstore_conformance.harness import Harness, assert_same, pattern
from ascendstore_conformance.suite.base import OpenClient, require

OK, NOT_FOUND, NO_SPACE = Status.OK, Status.NOT_FOUND, Status.NO_SPACE
#: bounds on filling the small store, so a store that never fills fails quickly.
MAX_FILL_BYTES = 256 << 20
FILL_DEADLINE_S = 60.0
#: lease of the pins in the eviction-after-lookup test: longer than its pressure lasts.
PIN_LEASE_S = 30.0
#: ... renewed this often while the pressure lasts (a waiting request's lookups do so).
PIN_RENEW_S = 3.0


def _fill_plan(h: Harness) -> tuple[int, int]:
    """(object size, most objects to write): about 1/32 of the first tier per
    object, and up to 4x the whole store, when stats() tells "capacity_bytes"
    (and "disk_capacity_bytes" for a second tier)."""
    stats = h.call("stats")
    capacity = stats.get("capacity_bytes") or 0
    total = capacity + (stats.get("disk_capacity_bytes") or 0)
    size = max(1024, min(capacity // 32 if capacity else 64 << 10, 1 << 20, h.caps.max_object_bytes))
    budget = min(4 * total, MAX_FILL_BYTES) if capacity else MAX_FILL_BYTES
    return size, budget // size


class CapacityTests:
    def test_capacity_full(self, open_client: OpenClient) -> None:
        """Fill the small store with up to four times what it holds.

        An evicting store is not looked at while it fills: some stores (Mooncake)
        grant a read lease on every exists and never evict a leased object, so
        probing the written keys would itself keep the store from evicting."""
        h = open_client(small=True)
        size, max_objects = _fill_plan(h)
        written: list[str] = []  # the bytes are pattern(key, size): not kept, so 4x a store fits in memory
        no_space = 0
        deadline = time.monotonic() + FILL_DEADLINE_S
        for i in range(max_objects):
            if time.monotonic() > deadline:
                break
            key = h.key(f"fill{i:05d}")
            (status,) = h.put({key: pattern(key, size)})
            assert status in (OK, NO_SPACE), f"put #{i} into a filling store returned {status!r}"
            if status is OK:
                written.append(key)
            else:
                no_space += 1
                if not h.caps.evicts:
                    break
                time.sleep(0.05)  # an evicting store may free space asynchronously
        if h.caps.evicts:
            self._check_evicting(h, written, size)
        else:
            assert no_space, (
                f"wrote {len(written)} objects ({len(written) * size} bytes) into the small store and it never "
                "reported NO_SPACE: small_config should describe a store of a few MiB"
            )
            self._check_full(h, {k: pattern(k, size) for k in written}, size)
        health = h.call("health", h.timeout_s)
        assert health.status is OK, f"health() of a full store: {health!r} (full is not unhealthy)"

    def _check_full(self, h: Harness, written: dict[str, bytes], size: int) -> None:
        keys = list(written)
        assert keys, "the small store refused the very first object"
        assert h.exists(keys) == [OK] * len(keys), "a store that does not evict lost objects when full"
        h.assert_reads(written)
        more = h.keys("over-a", "over-b")
        got = h.put({k: pattern(k, size) for k in more})
        assert got == [NO_SPACE, NO_SPACE], f"batch put into a full store returned {got!r}"
        assert h.exists(more) == [NOT_FOUND, NOT_FOUND], "a put that reported NO_SPACE left an object"
        # Removing frees space for new objects.
        assert h.remove(keys[:2]) == [OK, OK]
        fresh = {h.key("after-remove"): pattern("after-remove", size)}
        got = h.put(fresh)
        assert got == [OK], f"put after removing objects from a full store returned {got!r}"
        h.assert_reads(fresh)

    def _check_evicting(self, h: Harness, written: list[str], size: int) -> None:
        # Writing goes on once the store is full (allow for asynchronous eviction).
        # Before any exists(): its read leases could leave nothing evictable.
        key = h.key("after-evict")
        for _ in range(100):
            (status,) = h.put({key: pattern(key, size)})
            if status is OK:
                break
            assert status is NO_SPACE, f"put into an evicting store returned {status!r}"
            time.sleep(0.1)
        assert status is OK, "an evicting store kept reporting NO_SPACE for 10 s"
        written.append(key)
        states = h.exists(written)
        assert set(states) <= {OK, NOT_FOUND}, f"exists() of a full store returned {states!r}"
        kept = [k for k, s in zip(written, states, strict=True) if s is OK]
        assert len(kept) < len(written), (
            f"evicts=True but all {len(written)} objects ({len(written) * size} bytes) written into the small "
            "store are still there: small_config should describe a store of a few MiB"
        )
        assert kept, "an evicting store kept nothing, not even the object just written"
        # What is still there reads back exact: eviction never leaves stale or torn bytes.
        statuses, bufs = h.get(kept, [size] * len(kept))
        assert set(statuses) <= {OK, NOT_FOUND}, f"get() from an evicting store returned {statuses!r}"
        assert statuses.count(OK) > 0, "an evicting store kept nothing"
        for k, s, b in zip(kept, statuses, bufs, strict=True):
            if s is OK:
                assert_same(b.read(), pattern(k, size), k)


class PinTests:
    def test_evicted_after_lookup(self, open_client: OpenClient) -> None:
        """What a lookup pinned survives eviction pressure until unpinned or its
        lease ends (the connector loads it a step later); unpinned objects may go.

        Objects pinned and objects not pinned are written first, then the store is
        filled with up to four times its capacity. Nothing is looked at while the
        pressure lasts: some stores (Mooncake) grant a read lease on every exists,
        which would protect the unpinned ones too."""
        h = open_client(small=True)
        require(h, "evicts")
        require(h, "pins")
        size, max_objects = _fill_plan(h)
        pinned = {k: pattern(k, size) for k in h.keys(*(f"pinned{i}" for i in range(4)))}
        h.put_ok(pinned)
        absent = h.key("never-written")
        got = h.statuses("pin", [*pinned, absent], PIN_LEASE_S)
        assert got == [OK] * len(pinned) + [NOT_FOUND], (
            f"pin() of {len(pinned)} stored keys and an absent one returned {got!r}; a pin is an exists "
            "that also pins: OK for each stored key, NOT_FOUND for the absent one"
        )
        assert h.exists([absent]) == [NOT_FOUND], "pin() of an absent key created it"
        fill: list[str] = []
        deadline = time.monotonic() + FILL_DEADLINE_S
        renew = time.monotonic() + PIN_RENEW_S
        for i in range(max_objects):
            if time.monotonic() > deadline:
                break
            if time.monotonic() > renew:
                # As the connector does at every lookup of a waiting request (a store's
                # lease may be shorter than asked: Mooncake's is its master's TTL).
                got = h.statuses("pin", list(pinned), PIN_LEASE_S)
                assert got == [OK] * len(pinned), (
                    f"pinned objects were evicted within their {PIN_LEASE_S:.0f} s lease: renewing the pins "
                    f"returned {got!r}")
                renew = time.monotonic() + PIN_RENEW_S
            key = h.key(f"pressure{i:05d}")
            (status,) = h.put({key: pattern(key, size)})
            assert status in (OK, NO_SPACE), f"put #{i} under eviction pressure returned {status!r}"
            if status is OK:
                fill.append(key)
            else:
                time.sleep(0.05)  # only pinned victims left, or an asynchronous evictor behind
        # The oldest writes are the likeliest victims; asking about all of them would
        # lease them all on a store whose exists leases (Mooncake), filling it for a while.
        states = h.exists(fill[:64])
        assert set(states) <= {OK, NOT_FOUND}, f"exists() after the pressure returned {states!r}"
        assert NOT_FOUND in states, (
            f"wrote {len(fill)} objects of {size} bytes and the store evicted none: small_config should "
            "describe a store of a few MiB"
        )
        kept = h.exists(list(pinned))
        lost = [k for k, s in zip(pinned, kept, strict=True) if s is not OK]
        assert not lost, (
            f"{len(lost)} of {len(pinned)} pinned objects were evicted within their {PIN_LEASE_S:.0f} s lease "
            f"(a lookup counted them; their load would miss): {lost}"
        )
        h.assert_reads(pinned)
        got = h.statuses("unpin", list(pinned))
        assert set(got) <= {OK, NOT_FOUND}, f"unpin() returned {got!r}"
        # Unpinned, the store goes on serving and writing (unpinned objects may go now;
        # a store whose reads lease, like Mooncake, may need its lease TTL first).
        key = h.key("after-unpin")
        give_up = time.monotonic() + 30
        while True:
            (status,) = h.put({key: pattern(key, size)})
            if status is OK or time.monotonic() > give_up:
                break
            assert status is NO_SPACE, f"put after unpin() returned {status!r}"
            time.sleep(0.1)
        assert status is OK, "the store kept reporting NO_SPACE for 30 s after the pins ended"
