"""Data path against a real mooncake_master: byte-exact, statuses, Mooncake's own semantics."""

from __future__ import annotations

import numpy as np
import pytest
from mooncake_helpers import payload, region

from ascendstore.contract import Region, Status

pytestmark = pytest.mark.mooncake

T = 5.0


def test_multi_region_put_get_byte_exact(open_backend) -> None:
    b = open_backend()
    src = payload(1, 3 * 65536)
    # key a spans two non-adjacent regions, key b one region
    keys = ["data/a", "data/b"]
    regions = [[region(src, 0, 65536), region(src, 2 * 65536, 4096)], [region(src, 65536, 65536)]]
    assert b.put(keys, regions, T) == [Status.OK, Status.OK]
    assert b.exists(["data/a", "data/b", "data/none"], T) == [Status.OK, Status.OK, Status.NOT_FOUND]

    dst = np.zeros(3 * 65536, dtype=np.uint8)
    # read key a back scattered differently than it was gathered
    got = b.get(
        ["data/a", "data/none", "data/b"],
        [[region(dst, 0, 1000), region(dst, 1000, 65536 + 4096 - 1000)], [region(dst, 140000, 10)],
         [region(dst, 70000, 65536)]],
        T,
    )
    assert got == [Status.OK, Status.NOT_FOUND, Status.OK]
    assert np.array_equal(dst[: 65536 + 4096], np.concatenate([src[:65536], src[2 * 65536: 2 * 65536 + 4096]]))
    assert np.array_equal(dst[70000: 70000 + 65536], src[65536: 2 * 65536])
    assert b.capabilities.zero_copy and b.capabilities.shared_across_nodes


def test_objects_of_one_region_each_round_trip_in_any_shape(open_backend) -> None:
    # One region per object is the engine's shape; sizes differ, and a read may scatter
    # differently than the write.
    b = open_backend()
    sizes = [65536, 4096, 65536, 100, 65536]
    src = payload(9, sum(sizes))
    offs = np.cumsum([0, *sizes[:-1]]).tolist()
    keys = [f"flat/{i}" for i in range(len(sizes))]
    assert b.put(keys, [[region(src, o, n)] for o, n in zip(offs, sizes, strict=True)], T) == [Status.OK] * 5
    dst = np.zeros_like(src)
    assert b.get(keys, [[region(dst, o, n)] for o, n in zip(offs, sizes, strict=True)], T) == [Status.OK] * 5
    assert np.array_equal(dst, src)
    dst2 = np.zeros_like(src)  # the first object read back in two regions
    assert b.get(keys[:1], [[region(dst2, 0, 1000), region(dst2, 1000, 65536 - 1000)]], T) == [Status.OK]
    assert np.array_equal(dst2[:65536], src[:65536])
    # one bad key among one-region objects: the rest are stored and read as ever
    more = ["flat/x", "", "flat/y"]
    assert b.put(more, [[region(src, 0, 4096)]] * 3, T) == [Status.OK, Status.INVALID, Status.OK]
    dst3 = np.zeros(3 * 4096, dtype=np.uint8)
    assert b.get(more, [[region(dst3, i * 4096, 4096)] for i in range(3)], T) == [
        Status.OK, Status.INVALID, Status.OK]
    assert np.array_equal(dst3[:4096], src[:4096]) and np.array_equal(dst3[8192:], src[:4096])
    assert not dst3[4096:8192].any()


def test_duplicate_put_keeps_first_value_as_declared(open_backend) -> None:
    b = open_backend()
    assert b.capabilities.overwrite_on_put is False
    first, second = payload(2, 4096), payload(3, 4096)
    assert b.put(["dup/k"], [[region(first)]], T) == [Status.OK]
    assert b.put(["dup/k"], [[region(second)]], T) == [Status.OK]
    dst = np.zeros(4096, dtype=np.uint8)
    assert b.get(["dup/k"], [[region(dst)]], T) == [Status.OK]
    assert np.array_equal(dst, first)


def test_engine_saves_leave_dedup_to_the_put_and_keep_the_pooled_bytes(open_backend) -> None:
    """dedups_puts: the master turns the put of a stored key away, so the engine's
    saves of computed chunks ask no exists first; a chunk saved again keeps its
    first bytes. A device prefix hit's re-save still asks (and counts the skips)."""
    from ascendstore.engine import BackendGuard, ChunkOp, TransferEngine

    b = open_backend()
    assert b.capabilities.dedups_puts and not b.capabilities.overwrite_on_put
    asked: list[list[str]] = []
    exists = b.exists

    def counted(keys, timeout_s):
        asked.append(list(keys))
        return exists(keys, timeout_s)

    b.exists = counted
    size = 65536
    first, second = payload(5, 4 * size), payload(6, 4 * size)
    eng = TransferEngine(BackendGuard(b, T))
    try:
        def save(req: str, src: np.ndarray, names: list[str], computed: bool = True) -> None:
            ops = [ChunkOp(f"dedup/{n}", [region(src, i * size, size)], [i], i) for i, n in enumerate(names)]
            assert eng.submit_save(req, ops, computed=computed) and eng.wait("save", [req], 30)

        save("a", first, ["c0", "c1", "c2", "c3"])
        save("b", second, ["c2", "c3", "c4", "c5"])  # two chunks the pool holds, two new ones
        assert asked == [], "a save of computed chunks asked exists: the put is the dedup"
        dst = np.zeros(6 * size, dtype=np.uint8)
        keys = [f"dedup/c{i}" for i in range(6)]
        assert b.get(keys, [[region(dst, i * size, size)] for i in range(6)], T) == [Status.OK] * 6
        assert np.array_equal(dst[: 4 * size], first), "a chunk saved again lost its first bytes"
        assert np.array_equal(dst[4 * size :], second[2 * size :])
        m = eng.metrics.totals()
        assert m["save_failures"] == 0 and m["save_skipped_existing"] == 0
        save("c", second, ["c4", "c5"], computed=False)  # a device prefix hit's re-save
        assert asked == [["dedup/c4", "dedup/c5"]]
        assert eng.metrics.totals()["save_skipped_existing"] == 2
    finally:
        eng.shutdown()


def test_no_data_call_runs_on_the_thread_that_set_the_client_up(open_backend) -> None:
    # That thread runs native calls measurably slower (guard.call_alone); a get from a
    # thread the engine does not watch (a synchronous load) goes to a worker.
    b = open_backend()
    guard = b._guard
    assert guard._threads == []
    src = payload(7, 65536)
    assert b.put(["setup-thread/a"], [[region(src, 0, 65536)]], T) == [Status.OK]
    dst = np.zeros(65536, dtype=np.uint8)
    assert b.get(["setup-thread/a"], [[region(dst, 0, 65536)]], T) == [Status.OK]
    assert np.array_equal(src, dst)
    assert [t.name for t in guard._threads] == ["mooncake_0"]


def test_wrong_sizes_and_bad_keys_are_invalid(open_backend) -> None:
    b = open_backend()
    src = payload(4, 4096)
    assert b.put(["size/k"], [[region(src)]], T) == [Status.OK]
    small, big = np.zeros(100, dtype=np.uint8), np.zeros(8192, dtype=np.uint8)
    assert b.get(["size/k", "size/k"], [[region(small)], [region(big)]], T) == [Status.INVALID, Status.INVALID]
    assert b.capabilities.empty_objects is False
    assert b.put(["", "size/empty", "size/zero", "size/ok"],
                 [[region(src)], [], [Region(src.ctypes.data, 0)], [region(src)]], T) == [
        Status.INVALID, Status.INVALID, Status.INVALID, Status.OK]
    assert b.exists(["", "x" * 5000], T) == [Status.INVALID, Status.INVALID]
    # the client is still fine after all of that
    assert b.health(T).ok


def test_remove_by_keys_and_by_prefix(open_backend) -> None:
    b = open_backend()
    src = payload(5, 1024)
    keys = ["rm/u1.a@0", "rm/u1.a@1", "rm/u1xa@2", "rm/u1.a@", "rm/u2.a@0", "rm/k"]
    assert b.put(keys, [[region(src)]] * len(keys), T) == [Status.OK] * len(keys)
    # exists() grants read leases; removal still works (force_remove default)
    assert b.exists(keys, T) == [Status.OK] * len(keys)
    assert b.remove(["rm/k", "rm/never"], T) == [Status.OK, Status.NOT_FOUND]
    # '.' and '@' are literal in prefixes, not regex syntax
    assert b.remove_prefix("rm/u1.a@", T) == (Status.OK, 3)
    assert b.exists(keys, T) == [Status.NOT_FOUND, Status.NOT_FOUND, Status.OK, Status.NOT_FOUND, Status.OK,
                                 Status.NOT_FOUND]
    assert b.remove_prefix("rm/nothing-here/", T) == (Status.OK, 0)


def test_read_lease_blocks_plain_removal(open_backend) -> None:
    """With force_remove off, an object a reader just checked is busy (Mooncake -706)."""
    b = open_backend(force_remove=False, exists_cache_ttl_s=0)
    src = payload(6, 1024)
    assert b.put(["lease/k"], [[region(src)]], T) == [Status.OK]
    assert b.exists(["lease/k"], T) == [Status.OK]
    assert b.remove(["lease/k"], T) == [Status.UNAVAILABLE]
    assert b.exists(["lease/k"], T) == [Status.OK]


def _race_removal_and_reads(writer, reader, force: bool, seconds: float, enough: int) -> dict[str, int]:
    """One client removes a 4 MiB object and puts it again with new bytes, over and
    over; another reads it. Counts reads that answered success with bytes of two
    versions (each version is one uint32 value repeated)."""
    import threading
    import time

    size = 4 << 20
    src, dst = np.zeros(size // 4, np.uint32), np.zeros(size // 4, np.uint32)
    key, cfg = "torn/k", writer._replicate
    w, r = writer._store, reader._store
    src[:] = 1
    assert list(w.batch_put_from_multi_buffers([key], [[src.ctypes.data]], [[size]], cfg)) == [0]
    out = {"reads": 0, "torn": 0, "removed": 0, "refused": 0}
    stop = time.monotonic() + seconds

    def write() -> None:
        v = 1
        while time.monotonic() < stop and out["torn"] < enough:
            out["removed" if list(w.batch_remove([key], force)) == [0] else "refused"] += 1
            v += 1
            src[:] = v
            w.batch_put_from_multi_buffers([key], [[src.ctypes.data]], [[size]], cfg)

    t = threading.Thread(target=write)
    t.start()
    while time.monotonic() < stop and out["torn"] < enough:
        if list(r.batch_get_into_multi_buffers([key], [[dst.ctypes.data]], [[size]], False)) == [size]:
            out["reads"] += 1
            out["torn"] += int(dst.min() != dst.max())
    t.join()
    w.batch_remove([key], True)
    return out


def test_a_forced_removal_under_a_read_hands_torn_bytes_and_a_leased_one_is_refused(open_backend) -> None:
    """Mooncake's facts behind force_remove (measured 2026-12-05, 40 s each: 440 of
    7,046 reads torn with forced removals, 864 of 19,330 with upserts, none of 86,207
    with removals that respect the read lease, all but 2 of 106,229 refused).
    A get takes a read lease; a forced removal ignores it, the freed space goes to
    the next put, and a get still copying out of it answers success with bytes of
    two objects. So nothing that may be read by another engine is safe to remove
    with force (docs/backends/mooncake.md, "Removal under a read")."""
    writer, reader = open_backend(exists_cache_ttl_s=0), open_backend(exists_cache_ttl_s=0)
    forced = _race_removal_and_reads(writer, reader, force=True, seconds=10.0, enough=3)
    assert forced["torn"] >= 1, f"no torn read with forced removals (Mooncake changed? re-measure): {forced}"
    leased = _race_removal_and_reads(writer, reader, force=False, seconds=3.0, enough=1)
    assert leased["torn"] == 0 and leased["refused"] > 0, leased


def test_positive_exists_is_reused_instead_of_renewing_the_lease(open_backend) -> None:
    b = open_backend(exists_cache_ttl_s=30)
    src = payload(7, 1024)
    assert b.put(["ttl/k"], [[region(src)]], T) == [Status.OK]
    assert b.exists(["ttl/k", "ttl/missing"], T) == [Status.OK, Status.NOT_FOUND]
    hits = b.stats()["exists_cache_hits"]
    assert b.exists(["ttl/k", "ttl/missing"], T) == [Status.OK, Status.NOT_FOUND]
    assert b.stats()["exists_cache_hits"] == hits + 1  # only the positive answer is reused
    assert b.remove(["ttl/k"], T) == [Status.OK]
    assert b.exists(["ttl/k"], T) == [Status.NOT_FOUND]  # our own removal invalidates


@pytest.mark.parametrize("ttl", [0, 30])
def test_exists_pin_and_unpin_answer_each_key_of_a_mixed_batch_in_order(open_backend, ttl) -> None:
    # exists, pin and unpin take C-level passes for the usual batch (every key valid, all
    # asked or all cached) and per-key ones otherwise: every kind of key at once,
    # in an order that would show an answer given to the wrong key.
    b = open_backend(exists_cache_ttl_s=ttl)
    src = payload(8, 512)
    present = [f"mix/p{i}" for i in range(6)]
    assert b.put(present, [[region(src)]] * 6, T) == [Status.OK] * 6
    assert b.exists(present[:3], T) == [Status.OK] * 3  # (with a ttl: these three are now cached)
    keys = ["mix/gone0", present[0], "", present[3], "x" * 5000, "mix/ключ", present[4], "mix/gone1", present[1]]
    want = [Status.NOT_FOUND, Status.OK, Status.INVALID, Status.OK, Status.INVALID, Status.INVALID, Status.OK,
            Status.NOT_FOUND, Status.OK]
    hits = b.stats()["exists_cache_hits"]
    assert b.exists(keys, T) == want
    assert b.stats()["exists_cache_hits"] == hits + (2 if ttl else 0)  # present[0] and [1]; never a miss
    assert b.pin(keys, 10.0, T) == want
    assert b.unpin(keys, T) == [Status.INVALID if s is Status.INVALID else Status.OK for s in want]
    assert b.stats()["exists_cache_hits"] == hits + (2 if ttl else 0)  # pins never read the cache
    # A batch all present: every answer from the master, then (with a ttl) all from the cache.
    assert b.exists(present, T) == [Status.OK] * 6
    hits = b.stats()["exists_cache_hits"]
    assert b.exists(present, T) == [Status.OK] * 6
    assert b.stats()["exists_cache_hits"] == hits + (6 if ttl else 0)
    assert b.pin(present, 10.0, T) == [Status.OK] * 6
    assert b.unpin(present, T) == [Status.OK] * 6  # (every key valid: one list, no pass per key)
    assert b.unpin(["", *present[:2]], T) == [Status.INVALID, Status.OK, Status.OK]
    # One of them removed: the cache no longer answers for it.
    assert b.remove([present[5]], T) == [Status.OK]
    assert b.exists(present, T) == [Status.OK] * 5 + [Status.NOT_FOUND]
    assert b.exists([], T) == [] and b.pin([], 10.0, T) == []
    # Batches whose keys all have a fine length, one of them not ASCII; one too long.
    for odd in ("mix/ключ", "y" * 4097):
        assert b.exists([present[0], odd, "mix/gone0"], T) == [Status.OK, Status.INVALID, Status.NOT_FOUND]
        assert b.pin([odd, present[1]], 10.0, T) == [Status.INVALID, Status.OK]
        assert b.unpin([present[1], odd], T) == [Status.OK, Status.INVALID]


@pytest.mark.parametrize("ttl", [0, 30])
def test_a_pin_neither_reads_nor_fills_the_exists_cache_and_drops_what_it_finds_gone(open_backend, ttl) -> None:
    # The engine asks nothing again about a run it holds pinned (PoolLookup): a pin's
    # answers are not cached. One that finds a cached key gone drops it from the cache.
    b = open_backend(exists_cache_ttl_s=ttl)
    other = open_backend(exists_cache_ttl_s=0)
    src = payload(4, 256)
    keys = [f"pinc/{i}" for i in range(3)]
    assert b.put(keys, [[region(src)]] * 3, T) == [Status.OK] * 3
    asked = [*keys, "pinc/absent"]
    hits = b.stats()["exists_cache_hits"]
    assert b.pin(asked, 10.0, T) == [Status.OK] * 3 + [Status.NOT_FOUND]
    assert b.pin(keys, 10.0, T) == [Status.OK] * 3  # (every key present: the other branch)
    assert b.exists(asked, T) == [Status.OK] * 3 + [Status.NOT_FOUND]
    assert b.stats()["exists_cache_hits"] == hits  # the pins neither read nor filled it
    assert b.exists(keys, T) == [Status.OK] * 3
    assert b.stats()["exists_cache_hits"] == hits + (3 if ttl else 0)  # the exists' own answers
    # Another client removes one (forced, through its lease): our cache cannot know, until a pin asks.
    assert other.remove([keys[0]], T) == [Status.OK]
    assert b.pin(keys, 10.0, T) == [Status.NOT_FOUND, Status.OK, Status.OK]
    hits = b.stats()["exists_cache_hits"]
    assert b.exists(keys, T) == [Status.NOT_FOUND, Status.OK, Status.OK]
    assert b.stats()["exists_cache_hits"] == hits + (2 if ttl else 0)


def test_scheduler_client_lends_no_memory_but_sees_keys(open_backend) -> None:
    w = open_backend()
    s = open_backend(role="scheduler")
    src = payload(8, 2048)
    assert w.put(["sched/k"], [[region(src)]], T) == [Status.OK]
    assert s.exists(["sched/k", "sched/none"], T) == [Status.OK, Status.NOT_FOUND]
    assert s.health(T).detail["segment_bytes"] == 0


def test_pool_full_reports_no_space_and_keeps_working(master_factory, open_backend) -> None:
    m = master_factory()
    b = open_backend(m, global_segment_size=16 << 20)
    obj = payload(9, 2 << 20)
    # One batch: the master evicts in the background above its watermark, and
    # one-at-a-time puts sometimes find room again before the pool is full.
    statuses = b.put([f"full/{i}" for i in range(12)], [[region(obj)]] * 12, T)
    assert statuses[0] is Status.OK
    assert Status.NO_SPACE in statuses, statuses
    assert set(statuses) <= {Status.OK, Status.NO_SPACE}
    stored = [i for i, s in enumerate(statuses) if s is Status.OK]
    dst = np.zeros_like(obj)
    # some stored objects may already be evicted (watermark); whatever is there is intact
    for i in stored:
        got = b.get([f"full/{i}"], [[region(dst)]], T)[0]
        assert got in (Status.OK, Status.NOT_FOUND)
        if got is Status.OK:
            assert np.array_equal(dst, obj)
    assert b.health(T).ok


def test_closed_backend_refuses_calls_without_crashing(open_backend) -> None:
    b = open_backend(exists_cache_ttl_s=60)
    src = payload(10, 64)
    assert b.put(["closed/k"], [[region(src)]], T) == [Status.OK]
    assert b.exists(["closed/k"], T) == [Status.OK]  # now cached
    b.close()
    b.close()
    assert b.put(["closed/k"], [[region(src)]], T) == [Status.UNAVAILABLE]
    assert b.get(["closed/k"], [[region(src)]], T) == [Status.UNAVAILABLE]
    assert b.exists(["closed/k"], T) == [Status.UNAVAILABLE]
    assert b.remove(["closed/k"], T) == [Status.UNAVAILABLE]
    assert b.remove_prefix("closed/", T) == (Status.UNAVAILABLE, 0)
    assert b.health(T).status is Status.UNAVAILABLE


def test_ssd_offload_and_tenant_settings_reach_mooncake(master_factory, open_backend, tmp_path) -> None:
    """Offload on (master and client) with a directory, a tenant: set-up accepts them and data flows.
    (Whether Mooncake writes to the SSD is its business; in 0.3.13 nothing reached disk in our tries.)"""
    m = master_factory(["--enable_offload=true"])
    b = open_backend(m, enable_ssd_offload=True, ssd_offload_path=str(tmp_path), tenant_id="tenant-a")
    src = payload(11, 1 << 20)
    dst = np.zeros_like(src)
    assert b.put(["ssd/k"], [[region(src)]], T) == [Status.OK]
    assert b.get(["ssd/k"], [[region(dst)]], T) == [Status.OK]
    assert np.array_equal(src, dst)
