"""The embedded local pool in one process: round trips, statuses, LRU, space,
checksums, timeouts, close/unlink and option errors. Real shared memory throughout."""

from __future__ import annotations

import os
import threading
import time
import uuid

import numpy as np
import pytest

from ascendstore import registry
from ascendstore.contract import BackendContext, BackendSetupError, Region, Status, StoreNotFound
from ascendstore.errors import ConfigError
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions

KiB, MiB = 1 << 10, 1 << 20
OK, NOT_FOUND, NO_SPACE, TIMEOUT, UNAVAILABLE, CORRUPT, INVALID = (
    Status.OK,
    Status.NOT_FOUND,
    Status.NO_SPACE,
    Status.TIMEOUT,
    Status.UNAVAILABLE,
    Status.CORRUPT,
    Status.INVALID,
)
T = 5.0


@pytest.fixture
def make_pool():
    opened: list[LocalBackend] = []

    def make(**kw) -> LocalBackend:
        kw.setdefault("name", f"t-{uuid.uuid4().hex[:10]}")
        kw.setdefault("capacity", 4 * MiB)
        be = LocalBackend.create(LocalOptions(**kw), BackendContext())
        opened.append(be)
        return be

    yield make
    for be in opened:
        be.destroy()


def data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def split(buf: np.ndarray, cuts: list[int]) -> list[Region]:
    """Regions over buf cut at the given offsets (a repeated cut gives a zero-length region)."""
    edges = [0, *cuts, len(buf)]
    base = buf.ctypes.data
    return [Region(base + a, b - a) for a, b in zip(edges, edges[1:], strict=False)]


def shm_path(be: LocalBackend) -> str:
    return "/dev/shm/" + be.shm_name


SIZES = [1, 7, 4095, 4096, 4097, 65535, 65536, 65537, 200_001, 1 << 20]


def test_round_trip_several_regions_odd_sizes(make_pool):
    be = make_pool(page_size=4 * KiB)
    rng = np.random.default_rng(7)
    keys = [f"rt/{n}" for n in SIZES]
    src = [data(n, i) for i, n in enumerate(SIZES)]
    put_regions = [split(s, sorted(rng.integers(0, len(s) + 1, 3).tolist())) for s in src]
    assert be.put(keys, put_regions, T) == [OK] * len(SIZES)
    dst = [np.zeros(n, dtype=np.uint8) for n in SIZES]
    get_regions = [split(d, sorted(rng.integers(0, len(d) + 1, 2).tolist())) for d in dst]
    assert be.get(keys, get_regions, T) == [OK] * len(SIZES)
    for s, d in zip(src, dst, strict=True):
        assert np.array_equal(s, d)
    # tuples (addr, length) are accepted as regions too
    d2 = np.zeros(SIZES[-1], dtype=np.uint8)
    assert be.get([keys[-1]], [[(d2.ctypes.data, len(d2))]], T) == [OK]
    assert np.array_equal(d2, src[-1])


@pytest.mark.parametrize("checksum", [False, True])
def test_streaming_copies_round_trip_byte_for_byte(make_pool, checksum):
    """Large batches are copied with streaming stores (_shmpool.stream_min); forced
    here on every piece of 4 KiB or more: odd sizes, odd alignments, many regions."""
    from ascendstore.local import _shmpool

    saved = _shmpool.stream_min()
    try:
        be = make_pool(page_size=4 * KiB, capacity=16 * MiB, checksum=checksum)
        for put_min, get_min in ((0, 0), (1 << 20, 1 << 20), (1 << 62, 1 << 62)):
            _shmpool.stream_min(put_min, get_min)
            rng = np.random.default_rng(put_min % 1000)
            sizes = [*SIZES, 3 * MiB + 13]
            keys = [f"st/{put_min}/{n}" for n in sizes]
            src = [data(n + 3, i)[3:] for i, n in enumerate(sizes)]  # unaligned sources
            put_regions = [split(s, sorted(rng.integers(0, len(s) + 1, 5).tolist())) for s in src]
            assert be.put(keys, put_regions, T) == [OK] * len(sizes)
            dst = [np.zeros(n + 5, dtype=np.uint8)[5:] for n in sizes]  # unaligned destinations
            get_regions = [split(d, sorted(rng.integers(0, len(d) + 1, 4).tolist())) for d in dst]
            assert be.get(keys, get_regions, T) == [OK] * len(sizes)
            for s, d in zip(src, dst, strict=True):
                assert np.array_equal(s, d)
    finally:
        _shmpool.stream_min(*saved)
    assert _shmpool.stream_min() == saved


def test_copies_between_addresses_aligned_differently_are_exact():
    """The pool's copy (copy_regions stream=2: a get below the streaming size) takes a
    vector loop of its own where source and destination differ mod 64 (glibc's memcpy
    ran 2.5-6x slower there on AMD Zen 4); every pair of offsets, sizes around the
    loop's 128-byte step and its 2 KiB threshold, bytes around each copy untouched."""
    from ascendstore.local import _shmpool

    rng = np.random.default_rng(11)
    base_src = data(70_000 + 4096, 5)
    for size in (2047, 2048, 2049, 2048 + 127, 4096 + 13, 65_536 + 7):
        for so, do in ((0, 16), (16, 0), (1, 0), (0, 1), (3, 5), (63, 0), (8, 40), (0, 64), (32, 0)):
            src = base_src[4096 - (base_src.ctypes.data % 4096) + so:][:size]
            dst_buf = np.full(size + 8192, 0xA5, dtype=np.uint8)
            start = 4096 - (dst_buf.ctypes.data % 4096) + do
            for stream in (0, 2):  # glibc's memcpy (the baseline), the pool's copy
                dst_buf[:] = 0xA5
                _shmpool.copy_regions([dst_buf.ctypes.data + start], [src.ctypes.data], size, stream)
                assert np.array_equal(dst_buf[start:start + size], src), (size, so, do, stream)
                assert (dst_buf[:start] == 0xA5).all() and (dst_buf[start + size:] == 0xA5).all(), (size, so, do)
    # many objects in one call, each at an odd place
    n, size = 16, 9000
    srcs = [data(size + 64, i)[int(rng.integers(0, 64)):][:size] for i in range(n)]
    dsts = [np.zeros(size + 64, dtype=np.uint8)[int(rng.integers(0, 64)):][:size] for _ in range(n)]
    _shmpool.copy_regions([d.ctypes.data for d in dsts], [s.ctypes.data for s in srcs], size, 2)
    for s, d in zip(srcs, dsts, strict=True):
        assert np.array_equal(s, d)


def test_gets_stream_from_at_most_16_mib():
    """A get streams from half the last-level cache, at most 16 MiB: sysfs reports
    a whole Intel socket's L3 (480 MiB on a Xeon 6 VM), where gets of 2 MiB objects
    in 64 MiB batches then never streamed (0.92 of memcpy, 1.32-1.35 streaming)."""
    from ascendstore.local import _shmpool

    put_min, get_min = _shmpool.stream_min()
    assert put_min <= get_min <= 16 * MiB


def test_zero_length_objects(make_pool):
    be = make_pool()
    buf = data(16, 1)
    assert be.put(["z0", "z1"], [[], [Region(buf.ctypes.data, 0)]], T) == [OK, OK]
    assert be.exists(["z0", "z1"], T) == [OK, OK]
    assert be.get(["z0", "z1"], [[], [Region(buf.ctypes.data, 0), Region(buf.ctypes.data, 0)]], T) == [OK, OK]
    assert be.get(["z0"], [[Region(buf.ctypes.data, 1)]], T) == [INVALID]


def test_status_per_key_in_mixed_batches(make_pool):
    be = make_pool()
    a, b = data(1000, 1), np.zeros(1000, dtype=np.uint8)
    long_key = "k" * 257
    statuses = be.put(["good", "", long_key, 42, "good2"], [[Region(a.ctypes.data, 1000)]] * 5, T)  # type: ignore[list-item]
    assert statuses == [OK, INVALID, INVALID, INVALID, OK]
    assert be.put(["max" + "k" * 253], [[Region(a.ctypes.data, 10)]], T) == [OK]  # 256 bytes is allowed
    got = be.get(
        ["good", "absent", "good2", "good"],
        [
            [Region(b.ctypes.data, 1000)],
            [Region(b.ctypes.data, 1000)],
            [Region(b.ctypes.data, 999)],
            [Region(b.ctypes.data, 1000)],
        ],
        T,
    )
    assert got == [OK, NOT_FOUND, INVALID, OK]
    assert np.array_equal(a, b)
    assert be.exists(["good", "absent", "", "good2"], T) == [OK, NOT_FOUND, INVALID, OK]
    assert be.remove(["good", "absent", "good"], T) == [OK, NOT_FOUND, NOT_FOUND]
    with pytest.raises(ValueError, match="2 keys but 1 region lists"):
        be.put(["x", "y"], [[]], T)


def test_put_replaces_existing_value(make_pool):
    be = make_pool()
    a, c = data(5000, 1), data(5000, 2)
    out = np.zeros(5000, dtype=np.uint8)
    assert be.put(["k"], [[Region(a.ctypes.data, 5000)]], T) == [OK]
    assert be.put(["k"], [[Region(c.ctypes.data, 5000)]], T) == [OK]
    assert be.get(["k"], [[Region(out.ctypes.data, 5000)]], T) == [OK]
    assert np.array_equal(out, c)
    assert be.stats()["objects"] == 1
    assert be.capabilities.overwrite_on_put


# -- put_absent: a save's dedup inside the put (the same outcome as an exists, then a
# put of the keys not found, in one native call), held keys reported ----------------
def _read(be: LocalBackend, key: str, n: int) -> np.ndarray | None:
    out = np.zeros(n, np.uint8)
    (st,) = be.get([key], [split(out, [])], T)
    return out if st is Status.OK else None


def test_put_absent_keeps_held_values_and_reports_them(make_pool):
    be = make_pool(capacity=8 * MiB, page_size=4 * KiB)
    n = 48 * KiB + 100
    old = [data(n, i) for i in range(3)]
    assert be.put(["k0", "k2", "k4"], [split(v, []) for v in old], T) == [Status.OK] * 3
    new = [data(n, 100 + i) for i in range(6)]
    present: list[int] = []
    keys = [f"k{i}" for i in range(6)]
    assert be.put_absent(keys, [split(v, [n // 3, 2 * (n // 3)]) for v in new], present, T) == [Status.OK] * 6
    assert present == [0, 2, 4]
    for i, k in enumerate(keys):
        want = old[i // 2] if i % 2 == 0 else new[i]
        got = _read(be, k, n)
        assert got is not None and np.array_equal(got, want), f"{k}: wrong bytes"
    # a plain put of the same keys replaces (the test can tell the two apart)
    assert be.put(["k0"], [split(new[0], [])], T) == [Status.OK]
    assert np.array_equal(_read(be, "k0", n), new[0])


def test_put_absent_evicts_nothing_when_every_key_is_held(make_pool):
    be = make_pool(capacity=1 * MiB, page_size=4 * KiB)
    n = 62 * KiB  # 16 pages each: 16 objects fill the pool
    vals = [data(n, i) for i in range(16)]
    keys = [f"k{i}" for i in range(16)]
    assert be.put(keys, [split(v, []) for v in vals], T) == [Status.OK] * 16
    before = be.stats()
    assert before["pages_free"] < 16, "the pool should be full"
    present: list[int] = []
    assert be.put_absent(keys, [split(data(n, 99), [])] * 16, present, T) == [Status.OK] * 16
    after = be.stats()
    assert present == list(range(16))
    assert after["evictions"] == before["evictions"] and after["puts"] == before["puts"]
    for k, v in zip(keys, vals, strict=True):
        assert np.array_equal(_read(be, k, n), v)


@pytest.mark.parametrize("absent_only", [True, False], ids=["put_absent", "put"])
def test_put_absent_keeps_the_first_value_of_a_key_stored_meanwhile(make_pool, absent_only):
    """put_absent reserves, then copies with the pool unlocked (stalled here);
    another client stores the key meanwhile: its value stays, and the stalled
    call reports the key as held. A plain put in the same race replaces it."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    a = make_pool(name=name, capacity=8 * MiB, page_size=4 * KiB)
    b = make_pool(name=name, capacity=8 * MiB, page_size=4 * KiB)
    n = 20 * KiB
    mine, theirs = data(n, 1), data(n, 2)
    a.test_hooks().stall_puts(0.5)
    present: list[int] = []
    out: list = []

    def write() -> None:
        if absent_only:
            out.append(a.put_absent(["k"], [split(mine, [])], present, T))
        else:
            out.append(a.put(["k"], [split(mine, [])], T))

    t = threading.Thread(target=write)
    t.start()
    end = time.monotonic() + 5
    while b.stats()["pages_reserved"] == 0 and time.monotonic() < end:
        time.sleep(0.005)  # until the stalled call holds its reservation
    assert b.stats()["pages_reserved"] > 0, "the stalled put never reserved"
    assert b.put(["k"], [split(theirs, [])], T) == [Status.OK]
    t.join(10)
    a.test_hooks().stall_puts(0)
    assert out == [[Status.OK]]
    assert present == ([0] if absent_only else [])
    assert np.array_equal(_read(b, "k", n), theirs if absent_only else mine)
    assert a.stats()["pages_reserved"] == 0, "the dropped reservation's pages were not given back"


def test_put_absent_counts_a_key_on_the_disk_tier_as_held(make_pool, tmp_path):
    be = make_pool(capacity=1 * MiB, page_size=4 * KiB, disk_path=str(tmp_path), disk_capacity=8 * MiB)
    n = 200 * KiB
    first = data(n, 7)
    assert be.put(["spilled"], [split(first, [])], T) == [Status.OK]
    for i in range(8):  # push it out of DRAM
        assert be.put([f"f{i}"], [split(data(n, i), [])], T) == [Status.OK]
    assert be.stats()["disk_objects"] >= 1
    present: list[int] = []
    assert be.put_absent(["spilled"], [split(data(n, 8), [])], present, T) == [Status.OK]
    assert present == [0]
    assert np.array_equal(_read(be, "spilled", n), first)


def test_put_absent_statuses_of_keys_it_cannot_store_beside_held_ones(make_pool):
    be = make_pool(capacity=1 * MiB, page_size=4 * KiB)
    small = data(4 * KiB, 1)
    assert be.put(["held"], [split(small, [])], T) == [Status.OK]
    huge = np.zeros(2 * MiB, np.uint8)  # larger than the pool: never storable
    present: list[int] = []
    out = be.put_absent(["new", "held", "huge"], [split(small, []), split(small, []), split(huge, [])], present, T)
    assert out == [Status.OK, Status.OK, Status.INVALID] and present == [1]


def test_put_absent_on_a_destroyed_pool_answers_unavailable_and_reports_nothing_held(make_pool):
    be = make_pool(capacity=1 * MiB, page_size=4 * KiB)
    small = data(4 * KiB, 1)
    assert be.put(["held"], [split(small, [])], T) == [Status.OK]
    be.test_hooks().break_store()
    present: list[int] = []
    assert be.put_absent(["held", "new"], [split(small, [])] * 2, present, T) == [Status.UNAVAILABLE] * 2
    assert present == []


def test_remove_prefix_and_listing(make_pool):
    be = make_pool()
    a = data(100, 1)
    keys = [f"user{u}/chunk{i}" for u in range(3) for i in range(5)]
    assert be.put(keys, [[Region(a.ctypes.data, 100)]] * len(keys), T) == [OK] * len(keys)
    assert sorted(be.list_keys("user1/")) == sorted(k for k in keys if k.startswith("user1/"))
    assert len(list(be.list_keys("", limit=4))) == 4
    assert be.remove_prefix("user1/", T) == (OK, 5)
    assert be.exists(keys, T) == [NOT_FOUND if k.startswith("user1/") else OK for k in keys]
    assert be.remove_prefix("nothing", T) == (OK, 0)
    assert list(be.list_keys("user1/")) == []


def test_a_batch_gets_its_pages_in_ascending_order_through_overwrites_and_evictions(make_pool):
    """A put hands a batch's objects their pages in ascending order, object after
    object, so a get of the batch in the same order reads the arena forward. The
    free list is LIFO: without the ordering, each overwrite or eviction of a batch
    gives the next batch its pages in reverse. Objects of 1-3 pages; the pool is
    too small for all batches, so later batches take evicted pages. Bytes exact
    and the pool's invariants hold after each put."""
    page = 64 * KiB
    be = make_pool(capacity=96 * page, page_size=page)
    hooks = be.test_hooks()
    rng = np.random.default_rng(5)
    sizes = [int(rng.integers(1, 3 * page)) for _ in range(16)]  # 1-3 pages each, 32 pages a batch at most
    src = data(sum(sizes), 6)
    offs = np.cumsum([0, *sizes[:-1]])
    regions = [[Region(src.ctypes.data + int(o), n)] for o, n in zip(offs, sizes, strict=True)]
    for rnd in range(6):
        for b in range(4):  # 4 batches (~128 pages) in a 96-page pool: evictions from the second round on
            keys = [f"b{b}/k{i}" for i in range(16)]
            assert be.put(keys, regions, T) == [OK] * 16
            flat = [pg for pages in hooks.pages(keys) for pg in pages]
            assert len(flat) == sum((n + page - 1) // page for n in sizes)
            assert flat == sorted(flat), f"round {rnd} batch {b}: pages not ascending: {flat}"
            out = np.zeros_like(src)
            oregions = [[Region(out.ctypes.data + int(o), n)] for o, n in zip(offs, sizes, strict=True)]
            assert be.get(keys, oregions, T) == [OK] * 16 and np.array_equal(out, src)
            assert hooks.check() == ""
    assert be.stats()["evictions"] > 0


def test_lru_eviction_order(make_pool):
    be = make_pool(capacity=8 * 64 * KiB, page_size=64 * KiB)
    a = data(64 * KiB, 3)
    r = [[Region(a.ctypes.data, 64 * KiB)]]
    for i in range(8):
        assert be.put([f"k{i}"], r, T) == [OK]
    out = np.zeros_like(a)
    assert be.get(["k0"], [[Region(out.ctypes.data, len(out))]], T) == [OK]  # k0 becomes most recent
    assert be.put(["k8"], r, T) == [OK]  # evicts k1, the least recently used
    assert be.exists(["k1"], T) == [NOT_FOUND]
    assert be.put(["k9"], r, T) == [OK]  # then k2 (k0 was used after k2..k7)
    assert be.exists(["k2"], T) == [NOT_FOUND]
    assert be.exists(["k3"], T) == [OK]  # exists counts as a use too: k4 goes next
    assert be.put(["k10"], r, T) == [OK]
    assert be.exists(["k4"], T) == [NOT_FOUND]
    assert sorted(be.list_keys()) == sorted(
        ["k0", "k3", "k5", "k6", "k7", "k8", "k9", "k10"]
    )  # listing is no use
    assert be.stats()["evictions"] == 3
    assert be.test_hooks().check() == ""


def test_too_big_is_invalid_and_no_space_when_all_reserved(make_pool):
    be = make_pool(capacity=1 * MiB, page_size=64 * KiB)
    big = data(1 * MiB + 1, 1)
    assert be.put(["big"], [[Region(big.ctypes.data, len(big))]], T) == [INVALID]  # can never fit
    assert be.put(["full"], [[Region(big.ctypes.data, 1 * MiB)]], T) == [OK]  # exactly the capacity fits
    # a writer mid-put holds every page: nothing can be evicted, so the next put is NO_SPACE
    hooks = be.test_hooks()
    t = threading.Thread(target=hooks.stall_put, args=("stalled", 1 * MiB, 1.0))
    t.start()
    deadline = time.monotonic() + 5
    while hooks.holder() == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert hooks.holder() == -os.getpid()
    assert be.put(["small"], [[Region(big.ctypes.data, 100)]], T) == [NO_SPACE]
    assert be.exists(["full"], T) == [NOT_FOUND]  # evicted to make room for the stalled put
    assert be.stats()["pages_reserved"] == 16
    t.join()
    assert be.put(["small"], [[Region(big.ctypes.data, 100)]], T) == [OK]
    # in one batch, objects that do not fit together: the later one is NO_SPACE, never a crash
    half = 512 * KiB + 1
    st = be.put(["h1", "h2"], [[Region(big.ctypes.data, half)], [Region(big.ctypes.data, half)]], T)
    assert st == [OK, NO_SPACE]
    assert be.test_hooks().check() == ""


def test_checksum_detects_corruption(make_pool):
    be = make_pool(checksum=True)
    assert be.capabilities.detects_corruption
    a, g = data(70_000, 1), data(8192, 2)
    assert be.put(["bad", "good"], [[Region(a.ctypes.data, len(a))], [Region(g.ctypes.data, len(g))]], T) == [
        OK,
        OK,
    ]
    hooks = be.test_hooks()
    assert hooks.corrupt("bad", 66_000) is True
    assert hooks.corrupt("absent") is False
    out, og = np.zeros_like(a), np.zeros_like(g)
    st = be.get(["bad", "good"], [[Region(out.ctypes.data, len(a))], [Region(og.ctypes.data, len(g))]], T)
    assert st == [CORRUPT, OK]
    assert np.array_equal(og, g)
    assert be.stats()["corrupt"] == 1
    assert be.put(["bad"], [[Region(a.ctypes.data, len(a))]], T) == [OK]  # rewriting heals it
    assert be.get(["bad"], [[Region(out.ctypes.data, len(a))]], T) == [OK]
    assert np.array_equal(out, a)


def test_without_checksum_corruption_is_not_claimed(make_pool):
    be = make_pool(checksum=False)
    assert not be.capabilities.detects_corruption


def test_lock_held_elsewhere_gives_timeout_not_a_hang(make_pool):
    be = make_pool()
    a = data(4096, 1)
    r = [[Region(a.ctypes.data, 4096)]]
    assert be.put(["k"], r, T) == [OK]
    hooks = be.test_hooks()
    t = threading.Thread(target=hooks.hold_lock, args=(2.5,))
    t.start()
    while hooks.holder() == 0:
        time.sleep(0.002)
    for call in (
        lambda: be.exists(["k"], 0.1),
        lambda: be.get(["k"], r, 0.1),
        lambda: be.put(["k2"], r, 0.1),
        lambda: be.remove(["k"], 0.1),
        lambda: [be.remove_prefix("k", 0.1)[0]],
        lambda: [be.health(0.1).status],
    ):
        t0 = time.monotonic()
        assert call() == [TIMEOUT]
        assert time.monotonic() - t0 < 1.2  # generous: the point is not waiting 1.5-2 s
    t.join()
    assert be.exists(["k", "k2"], T) == [OK, NOT_FOUND]
    assert be.test_hooks().check() == ""


def test_delay_hook_makes_calls_time_out(make_pool):
    be = make_pool()
    a = data(4096, 1)
    hooks = be.test_hooks()
    hooks.delay(2.0)
    t0 = time.monotonic()
    assert be.put(["k"], [[Region(a.ctypes.data, 4096)]], 0.1) == [TIMEOUT]
    assert time.monotonic() - t0 < 1.2  # generous: the point is not waiting 1.5-2 s
    hooks.delay(0.05)
    assert be.put(["k"], [[Region(a.ctypes.data, 4096)]], 1.0) == [OK]
    hooks.delay(0)
    assert be.exists(["k"], 0.0) in ([OK], [TIMEOUT])


def test_close_then_every_call_is_unavailable(make_pool):
    be = make_pool()
    a = data(10, 1)
    r = [[Region(a.ctypes.data, 10)]]
    assert be.put(["k"], r, T) == [OK]
    be.close()
    assert be.exists(["k"], T) == [UNAVAILABLE]
    assert be.put(["k"], r, T) == [UNAVAILABLE]
    assert be.get(["k"], r, T) == [UNAVAILABLE]
    assert be.remove(["k"], T) == [UNAVAILABLE]
    assert be.remove_prefix("", T) == (UNAVAILABLE, 0)
    assert list(be.list_keys()) == []
    assert be.health(T).status is UNAVAILABLE
    assert be.stats() == {"status": "UNAVAILABLE"}
    assert be.test_hooks().corrupt("k") is False
    be.close()  # twice is fine


def test_last_close_unlinks_and_destroy_unlinks_now(make_pool):
    name = f"t-{uuid.uuid4().hex[:10]}"
    a = LocalBackend.create(LocalOptions(name=name, capacity=MiB), BackendContext())
    b = LocalBackend.create(LocalOptions(name=name, capacity=MiB), BackendContext())
    path = shm_path(a)
    assert os.path.exists(path) and b.stats()["processes"] == 2
    a.close()
    assert os.path.exists(path)
    b.close()
    assert not os.path.exists(path)
    c = make_pool(name=name, capacity=MiB)
    d = make_pool(name=name, capacity=MiB)
    c.destroy()
    assert not os.path.exists(path)
    assert d.exists(["x"], T) == [UNAVAILABLE]
    # a new pool of the same name is a fresh one
    e = make_pool(name=name, capacity=MiB)
    assert e.exists(["x"], T) == [NOT_FOUND] and os.path.exists(path)


def test_keep_pool_after_last_close_when_asked(make_pool):
    name = f"t-{uuid.uuid4().hex[:10]}"
    a = LocalBackend.create(
        LocalOptions(name=name, capacity=MiB, unlink_on_last_close=False), BackendContext()
    )
    buf = data(100, 1)
    assert a.put(["k"], [[Region(buf.ctypes.data, 100)]], T) == [OK]
    a.close()
    b = make_pool(name=name, capacity=MiB, unlink_on_last_close=False)
    assert b.exists(["k"], T) == [OK]


def test_different_names_are_different_pools(make_pool):
    a, b = make_pool(), make_pool()
    buf = data(100, 1)
    assert a.put(["k"], [[Region(buf.ctypes.data, 100)]], T) == [OK]
    assert b.exists(["k"], T) == [NOT_FOUND]


def test_open_with_other_options_while_in_use_is_refused(make_pool):
    a = make_pool(capacity=2 * MiB)
    with pytest.raises(BackendSetupError, match="different options"):
        LocalBackend.create(LocalOptions(name=a.options.name, capacity=4 * MiB), BackendContext())
    # a stale pool nobody uses is replaced by one with the new options
    name = f"t-{uuid.uuid4().hex[:10]}"
    old = LocalBackend.create(
        LocalOptions(name=name, capacity=MiB, unlink_on_last_close=False), BackendContext()
    )
    old.close()
    new = make_pool(name=name, capacity=2 * MiB)
    assert new.stats()["capacity_bytes"] == 2 * MiB


def test_existing_only_opens_a_pool_as_it_was_made_and_makes_none(make_pool, tmp_path):
    """What ``ascendstore pool`` opens: no pool is an error naming the file, and one made
    with other options than the tool was given is read as it is, not refused."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    tool = BackendContext(existing_only=True)
    with pytest.raises(StoreNotFound, match=f"ascendstore-pool.{name} does not exist"):
        LocalBackend.create(LocalOptions(name=name), tool)
    assert not os.path.exists(f"/dev/shm/ascendstore-pool.{name}")
    assert not os.path.exists(f"/dev/shm/ascendstore-lock.{name}")

    a = make_pool(name=name, capacity=2 * MiB, page_size=16 * KiB, checksum=True,
                  disk_path=str(tmp_path / "d"), disk_capacity=8 * MiB)
    buf = data(100, 1)
    assert a.put(["k"], [[Region(buf.ctypes.data, 100)]], T) == [OK]
    b = LocalBackend.create(LocalOptions(name=name), tool)  # the defaults: 1 GiB, 64 KiB pages
    try:
        made = {k: getattr(b.options, k) for k in ("capacity", "page_size", "checksum", "disk_path", "disk_capacity")}
        assert made == {"capacity": 2 * MiB, "page_size": 16 * KiB, "checksum": True,
                        "disk_path": str(tmp_path / "d"), "disk_capacity": 8 * MiB}
        assert b.options.max_keys == a.options.effective_max_keys
        assert b.capabilities.detects_corruption and b.capabilities.max_object_bytes == 2 * MiB
        assert b.huge_page_filler is None
        assert b.exists(["k"], T) == [OK] and b.stats()["processes"] == 2
    finally:
        b.close()


def test_existing_only_leaves_a_pool_whose_processes_died_in_place(make_pool):
    """A tool that looks at a pool last, its engines gone, does not remove it."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    old = LocalBackend.create(LocalOptions(name=name, capacity=MiB, unlink_on_last_close=False), BackendContext())
    buf = data(100, 1)
    assert old.put(["k"], [[Region(buf.ctypes.data, 100)]], T) == [OK]
    old.close()
    path = f"/dev/shm/ascendstore-pool.{name}"
    for _ in range(2):
        tool = LocalBackend.create(LocalOptions(name=name), BackendContext(existing_only=True))
        assert tool.exists(["k"], T) == [OK] and tool.options.capacity == MiB
        tool.close()
        assert os.path.exists(path)
    make_pool(name=name, capacity=MiB).destroy()
    assert not os.path.exists(path)


def test_registry_creates_local_with_validated_options():
    be = registry.create_backend(
        "local",
        {"name": f"t-{uuid.uuid4().hex[:10]}", "capacity": "2MiB", "page_size": "16KiB", "checksum": "true"},
    )
    try:
        assert isinstance(be, LocalBackend)
        caps = be.capabilities
        assert caps.shared_across_processes and not caps.shared_across_nodes and caps.evicts
        assert caps.listing and caps.remove_by_prefix and caps.scheduler_client and caps.detects_corruption
        assert not caps.persistent and caps.max_object_bytes == 2 * MiB
        s = be.stats()
        assert s["capacity_bytes"] == 2 * MiB and s["page_size"] == 16 * KiB
        assert be.health(T).ok
    finally:
        be.destroy()


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"capcity": "1GiB"}, "Did you mean 'capacity'"),
        ({"page_size": "3000"}, "power of two"),
        ({"page_size": "1KiB"}, "power of two"),
        ({"capacity": "1KiB"}, "at least one page"),
        ({"capacity": "lots"}, "cannot read 'lots' as a size"),
        ({"name": "../etc"}, "backend_config.name"),
        ({"disk_path": "/tmp/x"}, "set disk_capacity"),
        ({"max_keys": -1}, "backend_config.max_keys"),
        ({"checksum": "maybe"}, "backend_config.checksum"),
    ],
)
def test_option_errors_name_the_key(config, needle):
    with pytest.raises(ConfigError) as e:
        registry.create_backend("local", config)
    assert needle in str(e.value)


def test_many_threads_share_one_handle(make_pool):
    be = make_pool(capacity=2 * MiB, page_size=4 * KiB)
    errors: list[str] = []

    def worker(t: int) -> None:
        rng = np.random.default_rng(t)
        for i in range(300):
            k = f"th{t}/{i % 10}"
            n = 1000 + (i % 10) * 997
            src = np.full(n, (t * 31 + i) % 251, dtype=np.uint8)
            if be.put([k], [[Region(src.ctypes.data, n)]], T) != [OK]:
                errors.append("put")
            out = np.zeros(n, dtype=np.uint8)
            st = be.get([k], [[Region(out.ctypes.data, n)]], T)
            if st == [OK] and not (out == out[0]).all():
                errors.append(f"torn read {k}")
            if rng.random() < 0.1:
                be.remove([k], T)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert be.test_hooks().check() == ""


def test_checksum_is_streaming_and_the_same_in_avx2_and_scalar_form():
    from ascendstore.local import _shmpool

    rng = np.random.default_rng(3)
    for n in (0, 1, 63, 64, 65, 1023, 1024, 1025, 70_001):
        buf = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        whole = _shmpool.checksum(buf)
        assert _shmpool.checksum(buf, (), True) == whole
        cuts = sorted(rng.integers(0, n + 1, 4).tolist())
        pieces = [b - a for a, b in zip([0, *cuts], cuts, strict=False)]
        assert _shmpool.checksum(buf, pieces) == whole
        assert _shmpool.checksum(buf, pieces, True) == whole
        if n:
            i = int(rng.integers(0, n))
            flipped = bytearray(buf)
            flipped[i] ^= 1
            assert _shmpool.checksum(bytes(flipped)) != whole
    a, b = (
        rng.integers(0, 256, 1024, dtype=np.uint8).tobytes(),
        rng.integers(0, 256, 1024, dtype=np.uint8).tobytes(),
    )
    assert _shmpool.checksum(a + b) != _shmpool.checksum(b + a)  # order matters
    assert _shmpool.checksum(b"") != _shmpool.checksum(b"\0")  # so does length


def test_a_process_exiting_without_close_still_removes_its_pool():
    import subprocess
    import sys

    name = f"t-{uuid.uuid4().hex[:10]}"
    code = (
        "from ascendstore.contract import BackendContext; from ascendstore.local.backend import LocalBackend;"
        "from ascendstore.local.options import LocalOptions;"
        f"b = LocalBackend.create(LocalOptions(name={name!r}, capacity='1MiB'), BackendContext());"
        f"import os; assert os.path.exists('/dev/shm/ascendstore-pool.{name}')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert not os.path.exists(f"/dev/shm/ascendstore-pool.{name}")
