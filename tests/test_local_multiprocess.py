"""The local pool across real processes (multiprocessing spawn): visibility, a
4-process stress test with self-describing values (0 torn reads), racing writers,
and processes SIGKILLed while holding the lock, mid-put or mid-anything."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import signal
import struct
import time
import uuid

import numpy as np
import pytest

from ascendstore.contract import BackendContext, Region, Status
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions

KiB, MiB = 1 << 10, 1 << 20
OK, NOT_FOUND, NO_SPACE, TIMEOUT = Status.OK, Status.NOT_FOUND, Status.NO_SPACE, Status.TIMEOUT
T = 5.0
CTX = mp.get_context("spawn")
HEADER = struct.Struct("<QIIQ")  # key hash, writer, seq, payload digest


def open_pool(opts: dict) -> LocalBackend:
    return LocalBackend.create(LocalOptions(**opts), BackendContext())


def open_disk_pool(opts: dict, tmp_path, **kw) -> LocalBackend:
    """Four 64 KiB objects of DRAM over a disk tier (``kw``: its size, segments, checksum)."""
    opts.update(capacity=256 * KiB, page_size=64 * KiB, disk_path=str(tmp_path / "d"), **kw)
    return open_pool(opts)


def put_one(be: LocalBackend, key: str, v: np.ndarray) -> list[Status]:
    return be.put([key], [[Region(v.ctypes.data, len(v))]], T)


@pytest.fixture
def pool_opts():
    opts = {"name": f"t-{uuid.uuid4().hex[:10]}", "capacity": 4 * MiB}
    yield opts
    from ascendstore.local import _shmpool

    _shmpool.unlink(opts["name"])


def key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def value_size(key_index: int) -> int:
    return HEADER.size + 500 + (key_index * 7919) % 40_000  # odd sizes, fixed per key


def make_value(key: str, size: int, writer: int, seq: int) -> np.ndarray:
    payload = np.random.default_rng([writer, seq]).integers(0, 256, size - HEADER.size, dtype=np.uint8)
    digest = int.from_bytes(hashlib.blake2b(payload.tobytes(), digest_size=8).digest(), "little")
    return np.concatenate([np.frombuffer(HEADER.pack(key_hash(key), writer, seq, digest), np.uint8), payload])


def value_ok(key: str, buf: np.ndarray) -> bool:
    kh, _writer, _seq, digest = HEADER.unpack(buf[: HEADER.size].tobytes())
    payload = buf[HEADER.size :].tobytes()
    return kh == key_hash(key) and digest == int.from_bytes(
        hashlib.blake2b(payload, digest_size=8).digest(), "little"
    )


def thirds(buf: np.ndarray) -> list[Region]:
    n = len(buf)
    cuts = [0, n // 3, n // 3, 2 * n // 3 + 1, n]  # includes a zero-length region
    return [Region(buf.ctypes.data + a, b - a) for a, b in zip(cuts, cuts[1:], strict=False)]


# ---------------------------------------------------------------- children (top level: spawn imports them)


def child_put(opts: dict, keys: list[str], q) -> None:
    be = open_pool(opts)
    vals = [make_value(k, value_size(i), 99, i) for i, k in enumerate(keys)]
    q.put([s.name for s in be.put(keys, [thirds(v) for v in vals], T)])
    be.close()


def child_get(opts: dict, keys: list[str], q) -> None:
    be = open_pool(opts)
    bufs = [np.zeros(value_size(i), np.uint8) for i in range(len(keys))]
    st = be.get(keys, [thirds(b) for b in bufs], T)
    q.put([(s.name, bool(s is OK and value_ok(k, b))) for s, k, b in zip(st, keys, bufs, strict=True)])
    be.close()


def stream_all(stream: bool) -> None:
    """Copy every piece of 4 KiB or more with streaming stores (the path of large batches)."""
    if stream:
        from ascendstore.local import _shmpool

        _shmpool.stream_min(0, 0)


def child_stress(opts: dict, writer: int, n_ops: int, n_keys: int, q, stream: bool = False) -> None:
    stream_all(stream)
    be = open_pool(opts)
    rng = random.Random(writer)
    keys = [f"stress/{i}" for i in range(n_keys)]
    counts = {
        "calls": 0,
        "put_ok": 0,
        "get_ok": 0,
        "miss": 0,
        "torn": 0,
        "other": 0,
        "no_space": 0,
        "exists": 0,
        "remove": 0,
    }
    seq = 0
    for _ in range(n_ops):
        counts["calls"] += 1
        batch = rng.sample(range(n_keys), rng.choice((1, 1, 2, 4)))
        op = rng.random()
        if op < 0.45:
            vals = []
            for i in batch:
                seq += 1
                vals.append(make_value(keys[i], value_size(i), writer, seq))
            for s in be.put([keys[i] for i in batch], [thirds(v) for v in vals], T):
                # NO_SPACE is a put's honest answer when the other writers' puts in flight
                # hold more pages than the pool has (4 x 4 values of up to 3 pages each
                # against 32 pages in the disk-tier test): full for now, not a fault
                counts["put_ok" if s is OK else "no_space" if s is NO_SPACE else "other"] += 1
        elif op < 0.85:
            bufs = [np.zeros(value_size(i), np.uint8) for i in batch]
            for i, s, b in zip(
                batch, be.get([keys[i] for i in batch], [thirds(b) for b in bufs], T), bufs, strict=True
            ):
                if s is OK:
                    counts["get_ok"] += 1
                    counts["torn"] += not value_ok(keys[i], b)
                elif s is NOT_FOUND:
                    counts["miss"] += 1
                else:
                    counts["other"] += 1
        elif op < 0.95:
            counts["exists"] += sum(s in (OK, NOT_FOUND) for s in be.exists([keys[i] for i in batch], T))
        else:
            counts["remove"] += sum(s in (OK, NOT_FOUND) for s in be.remove([keys[i] for i in batch], T))
    q.put(counts)
    be.close()


def child_race(opts: dict, writer: int, rounds: int, q, stream: bool = False) -> None:
    stream_all(stream)
    be = open_pool(opts)
    torn = 0
    out = np.zeros(200_000, np.uint8)
    for seq in range(rounds):
        v = make_value("race", 200_000, writer, seq)
        assert be.put(["race"], [thirds(v)], T) == [OK]
        if be.get(["race"], [thirds(out)], T) == [OK]:
            torn += not value_ok("race", out)
    q.put(torn)
    be.close()


def child_hold_lock(opts: dict) -> None:
    be = open_pool(opts)
    be.test_hooks().hold_lock(60)


def child_stall_put(opts: dict, size: int) -> None:
    be = open_pool(opts)
    be.test_hooks().stall_put("stalled", size, 60)


def child_stalled_spill(opts: dict) -> None:
    be = open_pool(opts)
    be.test_hooks().stall_spills(60)
    v = np.zeros(64 * KiB, np.uint8)
    be.put(["newcomer"], [[Region(v.ctypes.data, len(v))]], 90)  # spills the LRU object, then stalls


def child_spill_then_stall(opts: dict, secs: float) -> None:
    be = open_pool(opts)
    be.test_hooks().stall_spills(secs)
    v = np.zeros(64 * KiB, np.uint8)
    be.put(["newcomer"], [[Region(v.ctypes.data, len(v))]], secs + 30)  # spills the LRU object, stalls, finishes
    be.close()


def child_hammer(opts: dict, seed: int) -> None:
    """Puts and gets 256 KiB objects until killed."""
    be = open_pool(opts)
    rng = random.Random(seed)
    bufs = [np.full(256 * KiB, i, np.uint8) for i in range(8)]
    while True:
        ks = [f"hammer/{rng.randrange(32)}" for _ in range(4)]
        if rng.random() < 0.5:
            be.put(ks, [[Region(b.ctypes.data, len(b))] for b in bufs[:4]], T)
        else:
            be.get(ks, [[Region(b.ctypes.data, len(b))] for b in bufs[4:]], T)


def run(target, *args) -> mp.Process:
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def wait_for(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# ---------------------------------------------------------------- tests


def test_objects_are_visible_across_processes(pool_opts):
    be = open_pool(pool_opts)  # keeps the pool alive between the children
    try:
        keys = [f"xproc/{i}" for i in range(6)]
        q = CTX.Queue()
        p = run(child_put, pool_opts, keys, q)
        assert q.get(timeout=60) == ["OK"] * 6
        p.join(30)
        # this process reads what the child wrote
        bufs = [np.zeros(value_size(i), np.uint8) for i in range(6)]
        assert be.get(keys, [thirds(b) for b in bufs], T) == [OK] * 6
        assert all(value_ok(k, b) for k, b in zip(keys, bufs, strict=True))
        # and another process reads what this one wrote
        mine = [make_value("mine", value_size(0), 1, 1)]
        assert be.put(["mine"], [thirds(mine[0])], T) == [OK]
        p = run(child_get, pool_opts, ["mine", "absent"], q)
        assert q.get(timeout=60) == [("OK", True), ("NOT_FOUND", False)]
        p.join(30)
        assert be.stats()["processes"] == 1  # the children detached
    finally:
        be.destroy()


@pytest.mark.parametrize("stream", [False, True], ids=["memcpy", "streaming"])
def test_four_process_stress_has_no_torn_reads(pool_opts, stream):
    # checksum off: versions alone must prevent torn reads; small: constant eviction and page reuse
    pool_opts.update(capacity=1 * MiB, page_size=16 * KiB, checksum=False)
    be = open_pool(pool_opts)
    try:
        q = CTX.Queue()
        procs = [run(child_stress, pool_opts, w, 2600, 40, q, stream) for w in range(4)]
        results = [q.get(timeout=240) for _ in procs]
        for p in procs:
            p.join(30)
        total = {k: sum(r[k] for r in results) for k in results[0]}
        assert total["calls"] >= 10_000, total
        assert total["torn"] == 0, total
        assert total["other"] == 0, total
        assert total["get_ok"] > 1000 and total["put_ok"] > 1000, total
        s = be.stats()
        assert s["evictions"] > 0
        assert be.test_hooks().check() == ""
        assert s["pages_reserved"] == 0
    finally:
        be.destroy()


def test_stress_through_the_disk_tier_has_no_torn_reads(pool_opts, tmp_path):
    # DRAM holds ~1/4 of the keys: constant spills, disk reads, promotions and segment drops
    pool_opts.update(
        capacity=512 * KiB,
        page_size=16 * KiB,
        checksum=False,
        disk_path=str(tmp_path / "disk"),
        disk_capacity=1 * MiB,
        disk_segment_size=256 * KiB,
    )
    be = open_pool(pool_opts)
    try:
        q = CTX.Queue()
        procs = [run(child_stress, pool_opts, w, 800, 40, q) for w in range(4)]
        results = [q.get(timeout=240) for _ in procs]
        for p in procs:
            p.join(30)
        total = {k: sum(r[k] for r in results) for k in results[0]}
        assert total["torn"] == 0 and total["other"] == 0, total
        s = be.stats()
        assert s["spills"] > 100 and s["disk_hits"] > 10 and s["disk_drops"] > 0, s
        assert s["disk_file_bytes"] <= 1 * MiB
        assert be.test_hooks().check() == ""
    finally:
        be.destroy()


@pytest.mark.parametrize("stream", [False, True], ids=["memcpy", "streaming"])
def test_racing_writers_of_one_key_leave_one_complete_value(pool_opts, stream):
    pool_opts.update(capacity=1 * MiB, checksum=False)
    be = open_pool(pool_opts)
    try:
        q = CTX.Queue()
        procs = [run(child_race, pool_opts, w, 150, q, stream) for w in range(4)]
        torn = [q.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        assert torn == [0, 0, 0, 0]
        out = np.zeros(200_000, np.uint8)
        assert be.get(["race"], [thirds(out)], T) == [OK]
        assert value_ok("race", out)
        _kh, writer, seq, _d = HEADER.unpack(out[: HEADER.size].tobytes())
        assert writer in range(4) and seq == 149  # the last value of one of the writers
        assert be.stats()["objects"] == 1
        assert be.test_hooks().check() == ""
    finally:
        be.destroy()


def test_sigkill_while_holding_the_lock_leaves_the_pool_usable(pool_opts):
    be = open_pool(pool_opts)
    try:
        a = np.arange(5000, dtype=np.uint8)
        assert be.put(["before"], [[Region(a.ctypes.data, 5000)]], T) == [OK]
        hooks = be.test_hooks()
        p = run(child_hold_lock, pool_opts)
        wait_for(lambda: hooks.holder() == p.pid)
        t0 = time.monotonic()
        assert be.exists(["before"], 0.2) == [TIMEOUT]  # held by a live process: a timeout, not a hang
        assert time.monotonic() - t0 < 2
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert be.exists(["before"], T) == [OK]  # the next locker recovers the lock
        out = np.zeros_like(a)
        assert be.get(["before"], [[Region(out.ctypes.data, 5000)]], T) == [OK]
        assert np.array_equal(out, a)
        assert be.put(["after"], [[Region(a.ctypes.data, 5000)]], T) == [OK]
        s = be.stats()
        assert s["lock_recoveries"] == 1 and s["processes"] == 1
        assert hooks.check() == ""
    finally:
        be.destroy()


def test_sigkill_mid_put_releases_its_reserved_pages(pool_opts):
    pool_opts.update(capacity=1 * MiB, page_size=64 * KiB)
    be = open_pool(pool_opts)
    try:
        hooks = be.test_hooks()
        p = run(child_stall_put, pool_opts, 1 * MiB)  # reserves the whole pool, then stalls
        wait_for(lambda: hooks.holder() == -p.pid)
        a = np.arange(1000, dtype=np.uint8)
        assert be.put(["k"], [[Region(a.ctypes.data, 1000)]], T) == [NO_SPACE]
        assert be.stats()["pages_reserved"] == 16
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert be.put(["k"], [[Region(a.ctypes.data, 1000)]], T) == [OK]  # the dead writer's pages came back
        s = be.stats()
        assert s["pages_reserved"] == 0 and s["dead_reservations_reclaimed"] == 1
        assert hooks.check() == ""
    finally:
        be.destroy()


def test_sigkill_mid_spill_keeps_the_object_in_dram(pool_opts, tmp_path):
    be = open_disk_pool(pool_opts, tmp_path, disk_capacity=MiB)
    try:
        vals = [np.full(64 * KiB, i + 1, np.uint8) for i in range(4)]
        assert (
            be.put([f"v/{i}" for i in range(4)], [[Region(v.ctypes.data, len(v))] for v in vals], T)
            == [OK] * 4
        )
        hooks = be.test_hooks()
        p = run(child_stalled_spill, pool_opts)
        wait_for(lambda: hooks.holder() == -p.pid)  # v/0's bytes are on disk, not yet finalized
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert hooks.check() == ""  # the sweep turns the orphaned victim back into a DRAM object
        s = be.stats()
        assert s["objects"] == 4 and s["disk_objects"] == 0 and s["dead_reservations_reclaimed"] == 1
        out = np.zeros(64 * KiB, np.uint8)
        assert be.get(["v/0"], [[Region(out.ctypes.data, len(out))]], T) == [OK]
        assert (out == 1).all()
        assert be.exists(["newcomer"], T) == [NOT_FOUND]
        assert be.put(["after"], [[Region(out.ctypes.data, len(out))]], T) == [OK]  # spills again, normally
        assert be.stats()["disk_objects"] == 1 and hooks.check() == ""
    finally:
        be.destroy()


@pytest.mark.parametrize("grown", [False, True], ids=["scanned", "scanned-then-grown"])
def test_a_rebuild_after_a_death_in_the_lock_keeps_a_scanned_prompt_in_prompt_order(pool_opts, grown):
    """A rebuild orders the LRU list by each entry's tick. A prefix scan leaves a
    prompt's chunks opening the list, chunk 0 first, with ticks that read in that
    order too: after a death in the lock, eviction must still take every other
    object first and the prompt from its tail. ``grown``: the prompt scanned
    again with more chunks, its first 30 already in place at the head."""
    pool_opts.update(capacity=512 * 4 * KiB, page_size=4 * KiB, max_keys=4096)
    be = open_pool(pool_opts)
    try:
        one = np.arange(64, dtype=np.uint8)
        region = [Region(one.ctypes.data, 64)]
        hooks = be.test_hooks()

        def store(keys):
            assert be.put(keys, [region] * len(keys), T) == [OK] * len(keys)

        hexes = [f"{i:04x}" for i in range(40)]
        mine = ["p@" + h for h in hexes]
        others = [f"other-{i}" for i in range(512 - len(mine))]
        store(mine)  # chunk 0 the oldest, then the others: all newer than the prompt
        store(others)
        if grown:
            assert be.prefix_run(["p@"], hexes[:30], T)[:2] == (OK, 30)
        assert be.prefix_run(["p@"], hexes, T)[:2] == (OK, 40)  # the prompt to the head, chunk 0 first
        p = run(child_hold_lock, pool_opts)
        wait_for(lambda: hooks.holder() == p.pid)
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert hooks.check() == ""  # the first locker rebuilt the lists, by tick
        assert be.stats()["lock_recoveries"] == 1
        assert be.put([f"n-{i}" for i in range(len(others))], [region] * len(others), T) == [OK] * len(others)
        assert all(hooks.pages(mine)), "the rebuild put a chunk of the prompt behind the others"
        went = []
        for i in range(3):
            store([f"m-{i}"])
            went += [k for k, pg in zip(mine, hooks.pages(mine), strict=True) if not pg and k not in went]
        assert went == mine[::-1][:3]  # the prompt's tail first
    finally:
        be.destroy()


def test_a_rebuild_after_a_death_in_the_lock_keeps_clean_disk_copies_right(pool_opts, tmp_path):
    # after the rebuild, a promoted object still goes back to its disk copy (nothing written),
    # one overwritten after its promotion does not, and both read back exact
    be = open_disk_pool(pool_opts, tmp_path, disk_capacity=4 * MiB, disk_segment_size=256 * KiB, checksum=True)
    try:
        vals = [np.full(64 * KiB, i + 1, np.uint8) for i in range(16)]
        out = np.zeros(64 * KiB, np.uint8)
        def get(k):
            return be.get([k], [[Region(out.ctypes.data, len(out))]], T)
        for i in range(8):  # c/0..c/3 on disk
            assert put_one(be, f"c/{i}", vals[i]) == [OK]
        assert get("c/0") == [OK] and get("c/1") == [OK]  # promoted: both keep their copies
        assert put_one(be, "c/1", vals[15]) == [OK]  # a new value: its copy is gone
        hooks = be.test_hooks()
        p = run(child_hold_lock, pool_opts)
        wait_for(lambda: hooks.holder() == p.pid)
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert hooks.check() == ""  # the first locker rebuilt every list, the disk list too
        assert be.stats()["lock_recoveries"] == 1
        before = be.stats()
        # DRAM: c/7, c/0, c/1 (LRU first) and one free page run; four puts evict all three
        for i in range(8, 12):
            assert put_one(be, f"m/{i}", vals[i]) == [OK]
        assert hooks.pages(["c/0", "c/1", "c/7"]) == [[], [], []]  # all on disk now
        after = be.stats()
        assert after["clean_spills"] - before["clean_spills"] == 1  # c/0
        assert after["disk_file_bytes"] - before["disk_file_bytes"] == 2 * 64 * KiB  # c/7 and c/1
        assert get("c/0") == [OK] and (out == 1).all()
        assert get("c/1") == [OK] and (out == 16).all()
        assert hooks.check() == ""
    finally:
        be.destroy()


def test_spills_that_finish_out_of_order_leave_no_object_in_a_dropped_segment(pool_opts, tmp_path):
    # a child's spill of v/0 (segment 0) finishes after this process's spills into later segments;
    # the disk list must stay in position order, or dropping segment 0 leaves v/0 behind, pointing
    # at a deleted file (found by exists, a miss on get, and wrong bytes once the path is re-created)
    be = open_disk_pool(pool_opts, tmp_path, disk_capacity=1 * MiB, disk_segment_size=128 * KiB, checksum=False)
    try:
        vals = [np.full(64 * KiB, i + 1, np.uint8) for i in range(24)]
        def put(k, i):
            return put_one(be, k, vals[i])
        for i in range(4):
            assert put(f"v/{i}", i) == [OK]
        hooks = be.test_hooks()
        p = run(child_spill_then_stall, pool_opts, 2.0)
        wait_for(lambda: hooks.holder() == -p.pid)  # v/0 written to segment 0, not yet on the disk list
        for i in range(4):
            assert put(f"m/{i}", 4 + i) == [OK]  # spills v/1.. into segments 0, 1, 2: finished first
        p.join(60)
        assert p.exitcode == 0
        assert be.stats()["disk_objects"] == 5 and hooks.check() == ""
        for i in range(4, 20):  # past the disk capacity: segment 0 (v/0 and v/1) is dropped
            assert put(f"m/{i}", 4 + i) == [OK]
        assert be.stats()["disk_drops"] >= 2
        assert be.exists(["v/0", "v/1"], T) == [NOT_FOUND, NOT_FOUND]
        assert hooks.check() == ""
    finally:
        be.destroy()


def test_random_sigkills_never_break_the_pool(pool_opts, tmp_path):
    # with the disk tier on, kills also land mid-spill and mid-promotion
    pool_opts.update(
        capacity=4 * MiB, page_size=64 * KiB, disk_path=str(tmp_path / "d"), disk_capacity=6 * MiB
    )
    be = open_pool(pool_opts)
    try:
        rng = random.Random(5)
        mine = np.arange(300_000, dtype=np.uint32).view(np.uint8)[:300_000].copy()
        for round_ in range(4):
            procs = [run(child_hammer, pool_opts, round_ * 10 + i) for i in range(2)]
            wait_for(lambda: be.stats()["processes"] == 3, timeout=60)
            time.sleep(rng.uniform(0.05, 0.3))
            for p in procs:
                os.kill(p.pid, signal.SIGKILL)
            for p in procs:
                p.join(30)
            # the pool is consistent and fully usable by the survivor
            assert be.test_hooks().check() == "", f"round {round_}"
            assert be.put(["mine"], [[Region(mine.ctypes.data, len(mine))]], T) == [OK]
            out = np.zeros_like(mine)
            assert be.get(["mine"], [[Region(out.ctypes.data, len(out))]], T) == [OK]
            assert np.array_equal(out, mine)
            s = be.stats()
            assert s["pages_reserved"] == 0 and s["processes"] == 1
            # every byte of capacity can still be used: nothing is pinned by the dead
            big = np.zeros(4 * MiB, np.uint8)
            assert be.put(["all"], [[Region(big.ctypes.data, len(big))]], T) == [OK]
            assert be.remove(["all"], T) == [OK]
    finally:
        be.destroy()


def test_last_process_to_close_unlinks_even_after_others_died(pool_opts):
    be = open_pool(pool_opts)
    p = run(child_hold_lock, pool_opts)
    wait_for(lambda: be.test_hooks().holder() == p.pid)
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    path = "/dev/shm/" + be.shm_name
    assert os.path.exists(path)
    be.close()  # the dead child's slot does not keep the pool alive
    assert not os.path.exists(path)


def test_a_forked_child_uses_the_inherited_handle(pool_opts):
    be = open_pool(pool_opts)
    try:
        a = np.arange(4000, dtype=np.uint16).view(np.uint8).copy()
        pid = os.fork()
        if pid == 0:  # child: the inherited handle takes its own process slot on first use
            code = 1
            try:
                code = 0 if be.put(["from-child"], [[Region(a.ctypes.data, len(a))]], T) == [OK] else 2
                be.close()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        out = np.zeros_like(a)
        assert be.get(["from-child"], [[Region(out.ctypes.data, len(out))]], T) == [OK]
        assert np.array_equal(out, a)
        assert be.stats()["processes"] == 1 and be.test_hooks().check() == ""
    finally:
        be.destroy()
