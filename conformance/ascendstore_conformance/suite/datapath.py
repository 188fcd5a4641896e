"""put / exists / get: absent keys, byte-exact reads, batches, regions, sizes."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from ascendstore.contract import BackendOptions, Capabilities, Health, Status
from ascendstore.errors import ConfigError
from ascendstore.registry import parse_options
from ascendstore_conformance.factory import BackendFactory
from ascendstore_conformance.harness import UNTOUCHED, Harness, assert_same, pattern
from ascendstore_conformance.suite.base import object_size

OK, NOT_FOUND, INVALID = Status.OK, Status.NOT_FOUND, Status.INVALID


class DeclarationTests:
    def test_capabilities_and_health_are_declared(self, harness: Harness) -> None:
        caps = harness.backend.capabilities
        assert isinstance(caps, Capabilities), f"capabilities is {caps!r}, not a Capabilities"
        assert caps.max_key_bytes >= 16, f"max_key_bytes={caps.max_key_bytes} is too small for pool keys"
        assert caps.max_object_bytes >= 4096, f"max_object_bytes={caps.max_object_bytes} is below one page"
        health = harness.call("health", harness.timeout_s)
        assert isinstance(health, Health) and health.status is OK, f"health() of a fresh client: {health!r}"
        assert hasattr(harness.call("stats"), "keys"), "stats() must return a mapping"

    def test_stats_follow_the_conventions(self, harness: Harness) -> None:
        harness.put_ok({harness.key("st"): b"stats"})
        stats = harness.call("stats")
        assert isinstance(stats, Mapping), f"stats() returned {stats!r}, not a mapping"
        cap = stats.get("capacity_bytes")
        assert cap is None or (isinstance(cap, int) and cap > 0), (
            f"stats()['capacity_bytes'] is {cap!r}: a store with a limit reports it in bytes (> 0); a store "
            "without one leaves the key out (0 would read as a store that holds nothing)"
        )
        for name in ("disk_capacity_bytes", "used_bytes", "objects"):
            value = stats.get(name)
            assert value is None or (isinstance(value, int) and value >= 0), (
                f"stats()[{name!r}] is {value!r}: expected an int >= 0 (or the key left out)"
            )

    def test_unknown_option_is_rejected_by_name(self, bound_factory: BackendFactory) -> None:
        cls = bound_factory.backend_class()
        assert issubclass(cls.Options, BackendOptions), "Options must subclass BackendOptions"
        bad = {**bound_factory.config, "no_such_option_zq": 1}
        with pytest.raises(ConfigError) as info:
            parse_options(cls, bad)
        assert "no_such_option_zq" in str(info.value), f"error does not name the bad key: {info.value}"


class AbsentKeyTests:
    def test_absent_keys_are_not_found(self, harness: Harness) -> None:
        keys = harness.keys("never-a", "never-b", "never-c")
        assert harness.exists(keys) == [NOT_FOUND] * 3
        statuses, bufs = harness.get(keys, [4096, 1, 100])
        assert statuses == [NOT_FOUND] * 3, f"get of absent keys returned {statuses!r}"
        for k, b in zip(keys, bufs, strict=True):
            assert b.read() == bytes([UNTOUCHED]) * b.size, (
                f"get({k!r}) of an absent key wrote into the region"
            )
        assert harness.remove(keys) == [NOT_FOUND] * 3

    def test_batches_answer_in_request_order(self, harness: Harness) -> None:
        # Present and absent keys interleaved, in an order that is not sorted (nor
        # reverse sorted): a backend answering in key order gets the statuses wrong.
        names = ["m-in", "c-out", "z-in", "a-out", "q-in", "b-out", "k-in"]
        keys = harness.keys(*names)
        assert keys not in (sorted(keys), sorted(keys, reverse=True))
        present = {k: pattern(k, 200 + 10 * i) for i, k in enumerate(keys) if k.endswith("in")}
        harness.put_ok(present)
        want = [OK if k in present else NOT_FOUND for k in keys]
        assert harness.exists(keys) == want, (
            f"exists() of keys in the order {names} returned {harness.exists(keys)!r}, expected {want!r}: "
            "statuses must follow the order of the request"
        )
        statuses, bufs = harness.get(keys, [len(present.get(k, b"-" * 50)) for k in keys])
        assert statuses == want, f"get() of keys in the order {names} returned {statuses!r}, expected {want!r}"
        for k, b in zip(keys, bufs, strict=True):
            if k in present:
                assert_same(b.read(), present[k], k)
        got = harness.remove(keys)
        assert got == want, f"remove() of keys in the order {names} returned {got!r}, expected {want!r}"

    def test_empty_batches(self, harness: Harness) -> None:
        assert harness.exists([]) == []
        assert harness.statuses("put", [], []) == []
        assert harness.statuses("get", [], []) == []
        assert harness.remove([]) == []


class PutGetTests:
    def test_put_exists_get_byte_exact(self, harness: Harness) -> None:
        items = {
            harness.key(f"obj{i}"): pattern(f"obj{i}", object_size(harness, 4096 * (i + 1))) for i in range(3)
        }
        harness.put_ok(items)
        assert harness.exists(list(items)) == [OK] * 3
        harness.assert_reads(items)
        harness.assert_reads(items)  # a read does not consume or change the object

    def test_batch_mixing_present_and_absent_keys(self, harness: Harness) -> None:
        names = [f"mix{i}" for i in range(8)]
        present = {harness.key(n): pattern(n, 1000 + 37 * i) for i, n in enumerate(names) if i % 3 != 1}
        harness.put_ok(present)
        keys = harness.keys(*names)
        want = [OK if k in present else NOT_FOUND for k in keys]
        assert harness.exists(keys) == want, "exists() statuses do not match which keys were put"
        sizes = [len(present.get(k, b"x" * 64)) for k in keys]
        statuses, bufs = harness.get(keys, sizes)
        assert statuses == want, "get() statuses do not match which keys were put"
        for k, b in zip(keys, bufs, strict=True):
            if k in present:
                assert_same(b.read(), present[k], k)
            else:
                assert b.read() == bytes([UNTOUCHED]) * b.size, (
                    f"get({k!r}) of an absent key wrote into the region"
                )

    def test_every_key_of_a_batch_put_is_stored(self, harness: Harness) -> None:
        items = {harness.key(f"batch{i:02d}"): pattern(f"batch{i}", 512 + i) for i in range(16)}
        harness.put_ok(items)
        assert harness.exists(list(items)) == [OK] * 16
        harness.assert_reads(items)

    def test_several_regions_per_key(self, harness: Harness) -> None:
        lengths = [100, 1, 4099, 64]
        data = pattern("multi", sum(lengths))
        key = harness.key("multi")
        parts, pos = [], 0
        for i, n in enumerate(lengths):  # each region in its own buffer, at its own offset
            parts.append(harness.source(data[pos : pos + n], offset=i).region)
            pos += n
        assert harness.statuses("put", [key], [parts]) == [OK]
        # Read back split differently: the object is the concatenation of its regions.
        for split in ([len(data)], [7, len(data) - 7], [2000, 2000, len(data) - 4000]):
            bufs = [harness.buffer(n, offset=3) for n in split]
            for b in bufs:
                b.fill(UNTOUCHED)
            assert harness.statuses("get", [key], [[b.region for b in bufs]]) == [OK], f"get into {split}"
            assert all(b.guards_intact() for b in bufs), f"get into regions {split} wrote outside them"
            assert_same(b"".join(b.read() for b in bufs), data, key)

    def test_zero_length_region_among_regions(self, harness: Harness) -> None:
        key = harness.key("zreg")
        data = pattern("zreg", 3000)
        a, b = harness.source(data[:1000]), harness.source(data[1000:])
        empty = harness.buffer(1)
        assert harness.statuses("put", [key], [[a.region, empty.sub(0, 0), b.region]]) == [OK]
        dst = harness.buffer(3000)
        assert harness.statuses("get", [key], [[empty.sub(0, 0), dst.region]]) == [OK]
        assert_same(dst.read(), data, key)

    def test_get_into_wrong_total_length_is_invalid(self, harness: Harness) -> None:
        key = harness.key("len")
        data = pattern("len", 5000)
        harness.put_ok({key: data})
        for size in (4999, 5001, 1):
            statuses, (buf,) = harness.get([key], [size])
            assert statuses == [INVALID], f"get of a 5000-byte object into {size} bytes returned {statuses!r}"
            assert buf.read() == bytes([UNTOUCHED]) * size, (
                f"get of a 5000-byte object into {size} bytes returned INVALID but wrote into the region: a "
                "get that is INVALID (or NOT_FOUND for an absent key) leaves its regions untouched"
            )
        harness.assert_reads({key: data})  # the object is unharmed

    def test_odd_sizes_and_alignments(self, harness: Harness) -> None:
        sizes = [1, 3, 7, 8, 4095, 4097, 65537, (1 << 20) + 13]
        sizes = [s for s in sizes if s <= harness.caps.max_object_bytes]
        for put_off, get_off in ((0, 1), (1, 0), (3, 5), (7, 7)):
            items = {harness.key(f"odd{s}.{put_off}"): pattern(f"odd{s}.{put_off}", s) for s in sizes}
            assert harness.put(items, offset=put_off) == [OK] * len(items)
            keys = list(items)
            statuses, bufs = harness.get(keys, [len(items[k]) for k in keys], offset=get_off)
            assert statuses == [OK] * len(keys)
            for k, b in zip(keys, bufs, strict=True):
                assert_same(b.read(), items[k], f"{k} (put at +{put_off}, get at +{get_off})")

    def test_zero_length_object(self, harness: Harness) -> None:
        key = harness.key("empty")
        buf = harness.buffer(1)
        statuses = harness.statuses("put", [key], [[buf.sub(0, 0)]])
        if not harness.caps.empty_objects:
            assert statuses == [INVALID], f"empty_objects=False but a zero-length put returned {statuses!r}"
            return
        assert statuses == [OK], f"zero-length put returned {statuses!r}"
        assert harness.exists([key]) == [OK]
        assert harness.statuses("get", [key], [[buf.sub(0, 0)]]) == [OK]

    def test_maximum_size_object(self, harness: Harness, bound_factory: BackendFactory) -> None:
        size = min(harness.caps.max_object_bytes, bound_factory.max_test_bytes)
        key = harness.key("max")
        data = pattern("max", size)
        harness.put_ok({key: data})
        harness.assert_reads({key: data})

    def test_over_maximum_size_is_invalid(self, harness: Harness, bound_factory: BackendFactory) -> None:
        limit = harness.caps.max_object_bytes
        if limit + 1 > bound_factory.max_test_bytes:
            pytest.skip(
                f"this test writes max_object_bytes+1={limit + 1} bytes, over "
                f"--backend-max-test-bytes={bound_factory.max_test_bytes}"
            )
        key, ok_key = harness.keys("over", "beside")
        big = harness.source(pattern("over", limit + 1))
        small = harness.source(b"ok")
        got = harness.statuses("put", [key, ok_key], [[big.region], [small.region]])
        assert got == [INVALID, OK], (
            f"put of max_object_bytes+1 beside a normal put returned {got!r}; an object that can never be "
            "stored is INVALID (NO_SPACE means full for now)"
        )
        assert harness.exists([key]) == [NOT_FOUND]


class KeyTests:
    def test_allowed_key_characters(self, harness: Harness) -> None:
        letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
        budget = harness.caps.max_key_bytes - len(harness.prefix)
        names = [letters[i : i + budget] for i in range(0, len(letters), budget)]
        names += [f"x{c}y" for c in harness.caps.key_extra_chars]
        items = {harness.key(n): pattern(n, 64) for n in names}
        got = harness.put(items)
        bad = [n for n, s in zip(names, got, strict=True) if s is not OK]
        assert not bad, f"keys with declared characters were refused: {bad} ({got})"
        harness.assert_reads(items)

    def test_key_length_limit(self, harness: Harness) -> None:
        limit = harness.caps.max_key_bytes
        longest = harness.key("k" * (limit - len(harness.prefix)))
        too_long = longest + "k"
        assert len(longest.encode()) == limit
        got = harness.put({longest: b"longest", too_long: b"too long"})
        assert got == [OK, INVALID], f"put of a {limit}-byte key and a {limit + 1}-byte key returned {got!r}"
        harness.assert_reads({longest: b"longest"})
        assert harness.exists([too_long]) != [OK]

    def test_keys_differing_in_last_character_are_distinct(self, harness: Harness) -> None:
        items = {harness.key(f"twin{c}"): pattern(c, 128) for c in "aAb0"}
        harness.put_ok(items)
        harness.assert_reads(items)


class DuplicatePutTests:
    def test_duplicate_put_semantics_as_declared(self, harness: Harness) -> None:
        key = harness.key("dup")
        first, second = pattern("first", 2048), pattern("second", 2048)
        harness.put_ok({key: first})
        harness.assert_reads({key: first})  # a cached first read must not hide the overwrite
        got = harness.put({key: second})
        assert got == [OK], f"a second put of an existing key returned {got!r}"
        caps = harness.caps
        status, data = harness.get_bytes(key, 2048)
        assert status is OK
        # The engine trusts dedups_puts to keep what the pool holds: it asks no exists before a save.
        assert not (caps.dedups_puts and data == second), (
            "dedups_puts=True but a second put of an existing key replaced the value: a store that turns "
            "duplicate puts away keeps the first one (and declares overwrite_on_put=False)"
        )
        want = second if caps.overwrite_on_put else first
        assert data == want, (
            f"overwrite_on_put={caps.overwrite_on_put} but a read after the second put returned the "
            f"{'first' if data == first else 'second' if data == second else 'neither'} value"
        )


__all__ = ["AbsentKeyTests", "DeclarationTests", "DuplicatePutTests", "KeyTests", "PutGetTests"]
