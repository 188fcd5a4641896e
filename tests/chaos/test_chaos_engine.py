"""The pool engine (guard, lookup, transfer threads) under injected faults, over
the real shared-memory ``local`` pool wrapped by ``faulty``. No vLLM here: the
"device" is a byte buffer of blocks, and "recompute" rewrites a block's known
content, so every byte a load claims to have delivered is checked."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from chaos_helpers import KiB, MiB, faulty_config, local_config, pool_name, report

from ascendstore.chaos import FaultyBackend
from ascendstore.contract import BackendContext, Region
from ascendstore.engine import BackendGuard, ChunkOp, KeyBuilder, PoolLookup, TransferEngine
from ascendstore.engine.transfer import PIPELINE_BYTES, HostBounce
from ascendstore.keys import RankPart
from ascendstore.registry import create_backend

BLOCK = 4 * KiB
SLACK = 1.5  # seconds of thread hand-off allowed on a loaded 2-core machine


class Device:
    """A fake KV cache: ``n`` blocks; block content is a function of its chunk hash."""

    def __init__(self, n: int) -> None:
        self.buf = np.zeros(n * BLOCK, dtype=np.uint8)
        self.n = n

    @staticmethod
    def content(chunk: int, seed: int = 0) -> np.ndarray:
        return np.random.default_rng(chunk * 7919 + seed).integers(0, 256, BLOCK, dtype=np.uint8)

    def block(self, b: int) -> np.ndarray:
        return self.buf[b * BLOCK : (b + 1) * BLOCK]

    def region(self, b: int) -> Region:
        return Region(self.buf.ctypes.data + b * BLOCK, BLOCK)

    def compute(self, b: int, chunk: int) -> None:
        self.block(b)[:] = self.content(chunk)

    def wipe(self) -> None:
        self.buf[:] = 0xEE


def open_engine(timeout_s: float = 1.0, **faults):
    name = pool_name()
    inner = local_config(name, capacity=faults.pop("capacity", 8 * MiB), checksum=faults.pop("checksum", True))
    be = create_backend("faulty", faulty_config(inner, **faults), BackendContext(timeout_s=timeout_s))
    assert isinstance(be, FaultyBackend)
    guard = BackendGuard(be, timeout_s)
    return be, guard, TransferEngine(guard)


def ops(dev: Device, chunks: list[int], keys: KeyBuilder) -> list[ChunkOp]:
    # block i of the device holds chunk chunks[i]
    return [ChunkOp(keys.key("-", f"{c:032x}"), [dev.region(i)], [i], c) for i, c in enumerate(chunks)]


KEYS = KeyBuilder("f" * 16, RankPart())


def serve(eng: TransferEngine, dev: Device, chunks: list[int]) -> tuple[set[int], int, int]:
    """Load the chunks; recompute failed blocks; return (failed, wrong bytes served, calls)."""
    dev.wipe()
    failed = eng.load_now("r", ops(dev, chunks, KEYS))
    wrong = sum(
        int((dev.block(i) != dev.content(c)).sum()) for i, c in enumerate(chunks) if i not in failed
    )
    for i in failed:
        dev.compute(i, chunks[i])
    return failed, wrong, len(chunks)


def save_all(eng: TransferEngine, dev: Device, chunks: list[int], req: str = "w") -> None:
    for i, c in enumerate(chunks):
        dev.compute(i, c)
    assert eng.submit_save(req, ops(dev, chunks, KEYS))
    assert eng.wait("save", [req], 30)


def test_planted_corruption_is_never_served_and_is_repaired():
    be, guard, eng = open_engine(corrupt_rate=0.5, seed=3)
    dev = Device(32)
    chunks = list(range(32))
    try:
        save_all(eng, dev, chunks)
        planted = be.stats()["injected"]["corrupt"]
        assert 8 < planted < 24
        failed, wrong, _ = serve(eng, dev, chunks)
        assert wrong == 0, "a corrupt object was served as a hit"
        assert len(failed) == planted, "every damaged object must be refused (CORRUPT)"
        report("engine_corruption", planted=planted, refused=len(failed), corrupt_served=wrong)
        # vLLM recomputes the failed blocks and saves them again; the damaged
        # objects must be replaced, else the prefix misses forever.
        be.set_faults(corrupt_rate=0.0)
        save_all(eng, dev, chunks, req="w2")
        failed2, wrong2, _ = serve(eng, dev, chunks)
        report("engine_corruption_repair", still_failing=len(failed2))
        assert wrong2 == 0
        assert failed2 == set(), (
            f"{len(failed2)} corrupt objects were never replaced: the save path skips keys that "
            "exist() reports, so a damaged object is never rewritten (should be removed on CORRUPT)"
        )
    finally:
        eng.shutdown()
        guard.close()


@pytest.mark.parametrize("fault", ["delay", "hang"])
def test_slow_and_hanging_store_never_holds_a_step_past_the_timeout(fault):
    timeout = 0.2
    be, guard, eng = open_engine(timeout_s=timeout)
    dev = Device(8)
    chunks = list(range(8))
    lookup = PoolLookup(guard, KEYS, timeout)
    try:
        save_all(eng, dev, chunks)
        be.set_faults(**{f"{fault}_s": {"get": 1.0, "exists": 1.0}})
        worst = 0.0
        for _ in range(3):
            t0 = time.monotonic()
            hits = lookup.prefix_hits("-", [f"{c:032x}" for c in chunks])
            failed, wrong, _ = serve(eng, dev, chunks)
            took = time.monotonic() - t0
            worst = max(worst, took)
            assert hits == 0 and failed == set(range(8)) and wrong == 0
        m = guard.metrics.totals()
        report(f"engine_{fault}", timeout_s=timeout, worst_step_s=round(worst, 3), timeouts=m["timeouts"],
               unavailable=m["unavailable"])
        # two bounded calls per step (lookup + load), each within timeout + guard grace
        assert worst < 2 * timeout + SLACK
        be.set_faults(delay_s={}, hang_s={})
        time.sleep(1.1)  # stuck calls end
        failed, wrong, _ = serve(eng, dev, chunks)
        assert failed == set() and wrong == 0, "the pool serves again once the store recovers"
    finally:
        eng.shutdown(timeout_s=1)
        guard.close()


def test_full_pool_skips_writes_without_errors_and_stays_bounded():
    be, guard, eng = open_engine(quota_bytes=16 * BLOCK, capacity=4 * MiB)
    dev = Device(64)
    try:
        for r in range(4):  # 4 requests of 16 new chunks each; room for 16
            chunks = list(range(r * 16, r * 16 + 16))
            save_all(eng, dev, chunks, req=f"r{r}")
        m = guard.metrics.totals()
        st = be.stats()
        report("engine_pool_full", saved=m["save_ops"], no_space=m["save_no_space"],
               save_failures=m["save_failures"], used_bytes=st["inner"]["used_bytes"])
        assert m["save_ops"] == 16 and m["save_no_space"] == 48
        assert m["save_failures"] == 0, "a full pool is not a failure"
        assert st["quota_used_bytes"] <= 16 * BLOCK
        failed, wrong, _ = serve(eng, dev, list(range(16)))
        assert failed == set() and wrong == 0, "what fitted is served"
    finally:
        eng.shutdown()
        guard.close()


def test_real_full_local_pool_evicts_and_serves_only_exact_bytes():
    """The local pool itself at capacity (LRU eviction, no quota stand-in)."""
    be, guard, eng = open_engine(capacity=256 * KiB)  # room for ~64 blocks
    dev = Device(64)
    try:
        for r in range(6):
            save_all(eng, dev, list(range(r * 64, r * 64 + 64)), req=f"r{r}")
        st = be.stats()["inner"]
        failed, wrong, n = serve(eng, dev, list(range(5 * 64, 6 * 64)))
        m = guard.metrics.totals()
        report("engine_local_full", capacity=st["capacity_bytes"], used=st["used_bytes"],
               save_failures=m["save_failures"], no_space=m["save_no_space"], hits=n - len(failed))
        assert st["used_bytes"] <= st["capacity_bytes"]
        assert wrong == 0 and m["save_failures"] == 0
        assert n - len(failed) > 0, "the newest request is served from the pool"
    finally:
        eng.shutdown()
        guard.close()


def test_random_fault_mix_never_serves_wrong_bytes_and_always_finishes():
    """Every kind of fault at once, at random: loads are exact or reported failed."""
    be, guard, eng = open_engine(
        timeout_s=0.3, seed=11,
        fail_rate={"get": 0.15, "put": 0.15, "exists": 0.1},
        raise_rate={"get": 0.05, "put": 0.05},
        corrupt_rate=0.1, flip_rate=0.0,
    )
    dev = Device(16)
    rng = np.random.default_rng(5)
    totals = {"requests": 0, "loaded": 0, "failed": 0, "wrong": 0}
    # `make chaos` runs it for a minute; `make test` for a few seconds
    t_end = time.monotonic() + float(os.environ.get("ASCENDSTORE_CHAOS_SECONDS", "6"))
    try:
        while time.monotonic() < t_end:
            base = int(rng.integers(0, 24))
            chunks = [base + i for i in range(16)]
            failed, wrong, n = serve(eng, dev, chunks)
            totals["requests"] += 1
            totals["loaded"] += n - len(failed)
            totals["failed"] += len(failed)
            totals["wrong"] += wrong
            save_all(eng, dev, chunks, req=f"s{totals['requests']}")
        report("engine_fault_mix", injected=be.stats()["injected"], **totals)
        assert totals["wrong"] == 0
        assert totals["loaded"] > 0 and totals["failed"] > 0
    finally:
        eng.shutdown()
        guard.close()


# -- a client that blocks the load thread (``detaches``, as Mooncake's gets there) --------

def _wait_for(pred, timeout_s: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


def _load_async(eng: TransferEngine, req: str, dev: Device, chunks: list[int], timeout_s: float,
                holds_blocks: bool = False) -> set[int]:
    """An async load as the connector makes it (the load thread); its failed blocks.
    ``holds_blocks``: vLLM keeps the request's blocks until it is reported (what
    ``direct_async_loads`` relies on)."""
    eng.submit_load(req, ops(dev, chunks, KEYS), deadline=time.monotonic() + timeout_s, holds_blocks=holds_blocks)
    assert eng.wait("load", [req], 30.0), "an async load never finished"
    return eng.take_results().loaded[req]


def _given_up_load(eng: TransferEngine, be: FaultyBackend, dev: Device, chunks: list[int], timeout_s: float,
                   hang_s: float) -> None:
    """An async load whose get hangs ``hang_s`` and then scribbles: failed whole,
    and answered while the get still hangs (the watchdog gave up on it)."""
    be.set_faults(hang_s={"get": hang_s}, late_garbage=True)
    dev.wipe()
    assert _load_async(eng, "r", dev, chunks, timeout_s) == set(range(len(chunks)))
    assert be.hanging == 1, "the load was not answered while its get still hung: nothing was given up"


def _wrong(dev: Device, chunks: list[int], failed: set[int]) -> int:
    return sum(int((dev.block(i) != dev.content(c)).sum()) for i, c in enumerate(chunks) if i not in failed)


def test_a_load_threads_get_past_its_deadline_is_given_up_and_its_late_bytes_go_nowhere():
    """The load thread runs the get itself (no hand-off) and the client hangs there,
    then scribbles: the watchdog fails the load while the get still hangs, the late
    bytes land only in a retired buffer, and the next load runs on a new thread."""
    timeout = 0.2
    be, guard, eng = open_engine(timeout_s=timeout, detaches=True)
    assert guard.inline and not guard.direct and eng._watch is not None
    dev, dev2 = Device(8), Device(8)
    chunks = list(range(8))
    try:
        save_all(eng, dev, chunks)
        # (the hang is long against the deadline, so that "answered while it still
        # hung" holds on a loaded machine too)
        _given_up_load(eng, be, dev, chunks, timeout, 3.0)
        m = guard.metrics.totals()
        assert m["loads_abandoned"] == 1 and m["load_buffers_retired"] == 1 and m["timeouts"] == 8
        be.set_faults(hang_s={})
        dev2.wipe()
        assert _load_async(eng, "r2", dev2, chunks, timeout) == set(), "the new load thread serves"
        assert _wrong(dev2, chunks, set()) == 0
        _wait_for(lambda: be.hanging == 0 and be.injected["late_garbage"] == 1, what="the hung get to wake")
        assert (dev.buf == 0xEE).all(), "the late get wrote into the blocks it was given up for"
        _wait_for(lambda: (eng._reap(), not eng._retired)[1], what="the retired buffer to come back")
        # (its call returns, and so frees the buffer, a moment before the thread ends)
        _wait_for(lambda: len([t for t in eng._threads if t.is_alive() and t.name.endswith("-load")]) == 1,
                  what="the stuck load thread to end once its call returned")
        dev2.wipe()
        assert _load_async(eng, "r3", dev2, chunks, timeout) == set() and _wrong(dev2, chunks, set()) == 0
        report("engine_watched_get_abandoned", late_writes=be.injected["late_garbage"],
               abandoned=m["loads_abandoned"])
    finally:
        be.set_faults(hang_s={}, late_garbage=False)
        eng.shutdown(timeout_s=2)
        guard.close()


class SlowCommit(HostBounce):
    """The engine's landing buffer, copying into the blocks only after a pause: it
    holds open the window in which a late get could write a buffer in use."""

    pause_s = 0.0

    def commit_in(self, ops, ok) -> None:
        time.sleep(self.pause_s)
        super().commit_in(ops, ok)


def test_a_given_up_gets_late_write_never_reaches_the_next_load_through_the_buffer():
    """The next load lands in the buffer and copies out only after the given-up get
    wakes and scribbles: with the buffer retired it copies its own bytes; were the
    old buffer reused, it would copy the scribble into its blocks."""
    timeout = 0.2
    be, guard, saver = open_engine(timeout_s=timeout, detaches=True)
    stager = SlowCommit(PIPELINE_BYTES)
    eng = TransferEngine(guard, stager=stager)  # (a stager takes saves too: the other engine saves)
    dev, dev2 = Device(8), Device(8)
    chunks = list(range(8))
    try:
        save_all(saver, dev, chunks)
        _given_up_load(eng, be, dev, chunks, timeout, 1.0)
        be.set_faults(hang_s={})
        stager.pause_s = 1.5  # the next load copies out after the hung get has woken
        dev2.wipe()
        eng.submit_load("r2", ops(dev2, chunks, KEYS), deadline=time.monotonic() + 5.0)
        assert eng.wait("load", ["r2"], 30.0)
        assert be.injected["late_garbage"] == 1, "the hung get had not scribbled before the copy: no proof"
        failed = eng.take_results().loaded["r2"]
        assert failed == set() and _wrong(dev2, chunks, failed) == 0, "the next load copied the late get's bytes"
    finally:
        be.set_faults(hang_s={}, late_garbage=False)
        eng.shutdown(timeout_s=2)
        saver.shutdown(timeout_s=2)
        guard.close()


def test_a_get_returning_just_before_the_watchdog_is_used_and_just_after_is_not():
    """The race the watchdog settles under one lock: whichever comes first wins.
    Gets wake around the deadline; a load is either exact or failed, never half."""
    timeout = 0.1
    be, guard, eng = open_engine(timeout_s=timeout, detaches=True)
    dev = Device(8)
    chunks = list(range(8))
    rng = np.random.default_rng(17)
    outcomes = {"loaded": 0, "failed": 0}
    try:
        save_all(eng, dev, chunks)
        for k in range(24):
            # from well before the deadline to past the watchdog's grace and tick
            hang = float(rng.uniform(0.5, 2.0) * timeout)
            be.set_faults(hang_s={"get": hang}, late_garbage=bool(k % 2))
            dev.wipe()
            failed = _load_async(eng, f"r{k}", dev, chunks, timeout)
            assert failed in (set(), set(range(8))), failed
            assert _wrong(dev, chunks, failed) == 0, f"round {k}: hang {hang:.3f} s served wrong bytes"
            outcomes["failed" if failed else "loaded"] += 1
            _wait_for(lambda: be.hanging == 0)
            assert (dev.buf[[i * BLOCK for i in failed]] == 0xEE).all(), "a given-up get wrote into the blocks"
        be.set_faults(hang_s={}, late_garbage=False)
        _wait_for(lambda: (eng._reap(), not eng._retired)[1], what="retired buffers to come back")
        report("engine_watched_get_race", **outcomes, abandoned=guard.metrics.totals()["loads_abandoned"])
        assert outcomes["loaded"] and outcomes["failed"], f"both sides of the race must be seen: {outcomes}"
    finally:
        be.set_faults(hang_s={}, late_garbage=False)
        eng.shutdown(timeout_s=2)
        guard.close()


def test_watched_and_sync_loads_share_the_landing_buffer_safely_while_gets_hang():
    """Async loads (watched, on load threads that may be given up) and sync loads
    (vLLM's forward thread: the client's own hand-off) at once, gets hanging at
    random and scribbling late: every load is exact or failed, retired buffers
    are bounded and all come back, and stuck load threads all end."""
    timeout = 0.1
    be, guard, eng = open_engine(timeout_s=timeout, detaches=True, seed=23)
    chunks = list(range(8))
    seed_dev = Device(8)
    errors: list[str] = []
    counts = {"async": 0, "sync": 0, "failed": 0}
    t_end = time.monotonic() + float(os.environ.get("ASCENDSTORE_CHAOS_SECONDS", "6"))
    try:
        save_all(eng, seed_dev, chunks)
        be.set_faults(late_garbage=True)

        def sync_loads() -> None:
            dev = Device(8)
            r = np.random.default_rng(3)
            while time.monotonic() < t_end:
                dev.wipe()
                failed = eng.load_now("s", ops(dev, chunks, KEYS), deadline=time.monotonic() + timeout)
                if _wrong(dev, chunks, failed):
                    errors.append(f"sync load served wrong bytes (failed {sorted(failed)})")
                counts["sync"] += 1
                counts["failed"] += bool(failed)
                time.sleep(float(r.uniform(0, 0.002)))

        th = threading.Thread(target=sync_loads)
        th.start()
        rng = np.random.default_rng(29)
        dev = Device(8)
        k = 0
        while time.monotonic() < t_end:
            hang = float(rng.choice([0.0, 0.0, 0.5, 1.2, 3.0]) * timeout)
            be.set_faults(hang_s={"get": hang} if hang else {})
            dev.wipe()
            failed = _load_async(eng, f"a{k}", dev, chunks, timeout)
            if _wrong(dev, chunks, failed):
                errors.append(f"async load {k} (hang {hang:.2f} s) served wrong bytes")
            counts["async"] += 1
            counts["failed"] += bool(failed)
            k += 1
            assert len(eng._retired) <= 4, "retired landing buffers must stay bounded"
        th.join()
        be.set_faults(hang_s={})
        assert not errors, errors[:5]
        _wait_for(lambda: be.quiescent() and be.hanging == 0, what="hung calls to end")
        _wait_for(lambda: (eng._reap(), not eng._retired)[1], what="retired buffers to come back")
        _wait_for(lambda: len([t for t in eng._threads if t.is_alive() and t.name.endswith("-load")]) == 1,
                  what="stuck load threads to end")
        dev.wipe()
        assert _load_async(eng, "last", dev, chunks, timeout) == set() and _wrong(dev, chunks, set()) == 0
        m = guard.metrics.totals()
        report("engine_watched_and_sync_loads", **counts, abandoned=m["loads_abandoned"],
               retired=m["load_buffers_retired"], detached=be.injected["detached"])
        assert m["loads_abandoned"] > 0 and be.injected["detached"] > 0, "both paths must have been given up on"
    finally:
        be.set_faults(hang_s={}, late_garbage=False)
        eng.shutdown(timeout_s=2)
        guard.close()


def test_a_sync_load_queued_behind_a_given_up_get_moves_on_and_keeps_the_retired_bound():
    """Three landing buffers are retired (stuck gets); a fourth get hangs holding
    the stage lock while a sync load (vLLM's forward thread) waits for that lock.
    The watchdog gives the fourth up and retires its buffer, which reaches the
    bound of 4. The waiting sync load must go on at once, not wait out the stuck
    call, and fail without a call of its own (a fifth stuck buffer). It used to do
    both: check the bound only before it waited, and wait for the old lock."""
    # A backend timeout long enough that the sync load's wait for the lock (bounded
    # by it) outlasts the fourth get's hang; the async loads' own deadlines are short.
    timeout, short = 2.0, 0.1
    be, guard, eng = open_engine(timeout_s=timeout, detaches=True)
    dev, sdev = Device(8), Device(8)
    chunks = list(range(8))
    out: dict = {}

    def sync_load() -> None:
        out["failed"] = eng.load_now("s", ops(sdev, chunks, KEYS), deadline=time.monotonic() + 4.0)

    try:
        save_all(eng, dev, chunks)
        be.set_faults(hang_s={"get": 5.0})  # longer than the test's steps: none of these comes back meanwhile
        for k in range(3):
            assert _load_async(eng, f"r{k}", dev, chunks, short) == set(range(8))
        assert len(eng._retired) == 3 and be.hanging == 3
        # given up at ~0.35 s (deadline, grace, a tick), returns at 1.2 s
        be.set_faults(hang_s={"get": 1.2})
        eng.submit_load("r3", ops(dev, chunks, KEYS), deadline=time.monotonic() + 0.3)
        _wait_for(lambda: be.hanging == 4, what="the fourth get to hang holding the stage lock")
        be.set_faults(hang_s={"get": 5.0})  # what a call by the sync load would do
        handed_off = be.injected["detached"]  # the sync load's call would be the next
        th = threading.Thread(target=sync_load)
        th.start()  # passes the bound's first check (3 retired) and waits for the lock
        assert eng.wait("load", ["r3"], 30.0)
        assert eng.take_results().loaded["r3"] == set(range(8)), "the fourth get was not given up"
        th.join(30)
        assert out["failed"] == set(range(8)), "with every spare buffer held by a stuck call the sync load fails"
        # It went on when the fourth get was given up (at ~0.35 s), not when that get
        # returned (1.2 s; its buffer could then be freed and a call of its own be made).
        assert be.injected["detached"] == handed_off, "the sync load waited out the given-up get, then made a call"
        assert be.hanging == 4, "the sync load made a call into a fifth landing buffer"
        assert len(eng._retired) == 4, f"{len(eng._retired)} retired landing buffers: the bound is 4"
        be.set_faults(hang_s={})
        _wait_for(lambda: be.hanging == 0, what="the stuck gets to return")
        _wait_for(lambda: (eng._reap(), not eng._retired)[1], what="the retired buffers to come back")
        sdev.wipe()
        assert _load_async(eng, "last", sdev, chunks, short) == set() and _wrong(sdev, chunks, set()) == 0
    finally:
        be.set_faults(hang_s={})
        eng.shutdown(timeout_s=2)
        guard.close()


# -- async loads straight into vLLM's blocks (``direct_async_loads``) ------------------------

def _open_direct(timeout_s: float):
    be, guard, eng = open_engine(timeout_s=timeout_s, detaches=True)
    eng.direct_async_loads = True
    return be, guard, eng


def test_a_direct_async_load_is_reported_only_once_its_late_get_has_written():
    """The get writes vLLM's blocks (no landing buffer). Given up at its deadline,
    the load keeps its request unreported (so vLLM keeps the blocks) while the get
    still hangs, and reports it failed only after the get has scribbled; other
    loads go on meanwhile on a new load thread. Reported at the deadline instead,
    the scribble would land in blocks vLLM had taken back."""
    timeout = 0.2
    be, guard, eng = _open_direct(timeout)
    dev, dev2 = Device(8), Device(8)
    chunks = list(range(8))
    try:
        save_all(eng, dev, chunks)
        dev.wipe()
        be.set_faults(hang_s={"get": 2.0}, late_garbage=True)
        eng.submit_load("r", ops(dev, chunks, KEYS), deadline=time.monotonic() + timeout, holds_blocks=True)
        _wait_for(lambda: guard.metrics.totals()["loads_abandoned"] == 1, what="the watchdog to give up")
        be.set_faults(hang_s={}, late_garbage=False)
        # A new load thread serves while the given-up get still hangs on the old one.
        dev2.wipe()
        assert _load_async(eng, "r2", dev2, chunks, timeout, holds_blocks=True) == set() and _wrong(dev2, chunks, set()) == 0
        assert be.hanging == 1 and eng.pending("load", "r"), "r was reported while its get still hung"
        loaded: dict[str, set[int]] = {}
        _wait_for(lambda: loaded.update(eng.take_results().loaded) or "r" in loaded, what="r to be reported")
        assert be.injected["late_garbage"] == 1, "reported before the late get had written its blocks"
        assert loaded["r"] == set(range(8)), "the given-up load's blocks must all be recomputed"
        assert (dev.buf == 0xA5).any(), "the late get did not write the held blocks: no landing buffer in between"
        assert eng.landing is not None and eng.landing.region() is None, "the landing buffer was used"
        m = guard.metrics.totals()
        assert m["loads_abandoned"] == 1 and m["load_held_late"] == 1 and m["load_buffers_retired"] == 0
        _wait_for(lambda: len([t for t in eng._threads if t.is_alive() and t.name.endswith("-load")]) == 1,
                  what="the stuck load thread to end")
        report("engine_direct_async_held", late_writes=be.injected["late_garbage"], held=m["load_held_late"])
    finally:
        be.set_faults(hang_s={}, late_garbage=False)
        eng.shutdown(timeout_s=2)
        guard.close()


def test_direct_async_loads_racing_their_deadline_never_report_blocks_a_get_still_writes():
    """Gets wake around the deadline (and past the watchdog), half of them
    scribbling: every load is exact or failed whole, no call is running when it
    is reported, and blocks recomputed after the report stay as recomputed (no
    write after the report); sync loads keep the landing buffer meanwhile."""
    timeout = 0.1
    be, guard, eng = _open_direct(timeout)
    chunks = list(range(8))
    rng = np.random.default_rng(int(os.environ.get("ASCENDSTORE_CHAOS_SEED", "41")))
    outcomes = {"loaded": 0, "failed": 0}
    devs: list[Device] = []
    try:
        save_all(eng, Device(8), chunks)
        for k in range(24):
            hang = float(rng.uniform(0.5, 2.5) * timeout)
            be.set_faults(hang_s={"get": hang}, late_garbage=bool(k % 2))
            dev = Device(8)
            dev.wipe()
            failed = _load_async(eng, f"r{k}", dev, chunks, timeout, holds_blocks=True)
            assert be.hanging == 0 and be.quiescent(), f"round {k}: reported while its get ran (hang {hang:.3f} s)"
            assert failed in (set(), set(range(8))), failed
            assert _wrong(dev, chunks, failed) == 0, f"round {k}: hang {hang:.3f} s served wrong bytes"
            for i in failed:  # vLLM recomputes them
                dev.compute(i, chunks[i])
            devs.append(dev)
            outcomes["failed" if failed else "loaded"] += 1
            time.sleep(float(rng.uniform(0, 0.01)))
        be.set_faults(hang_s={}, late_garbage=False)
        sdev = Device(8)
        sdev.wipe()
        assert eng.load_now("s", ops(sdev, chunks, KEYS)) == set() and _wrong(sdev, chunks, set()) == 0
        assert eng.landing is not None and eng.landing.region() is not None, "sync loads keep the landing buffer"
        time.sleep(3 * timeout)
        assert all(_wrong(d, chunks, set()) == 0 for d in devs), "a block was written after its load was reported"
        m = guard.metrics.totals()
        report("engine_direct_async_race", **outcomes, abandoned=m["loads_abandoned"], held=m["load_held_late"])
        assert outcomes["loaded"] and outcomes["failed"] and m["load_held_late"], f"both sides of the race: {outcomes}"
    finally:
        be.set_faults(hang_s={}, late_garbage=False)
        eng.shutdown(timeout_s=2)
        guard.close()


def test_direct_async_loads_waiting_out_late_gets_are_bounded_then_fail_fast():
    """Four given-up gets hold their requests (and four stuck load threads); the
    next direct load fails at once (recompute) without a call of its own, and
    once the gets return, all four are reported and loads are direct again."""
    timeout = 0.1
    be, guard, eng = _open_direct(timeout)
    dev = Device(8)
    chunks = list(range(8))
    try:
        save_all(eng, dev, chunks)
        be.set_faults(hang_s={"get": 5.0})
        held = [Device(8) for _ in range(4)]  # vLLM's blocks: alive while the gets may write them
        for k in range(4):
            eng.submit_load(f"r{k}", ops(held[k], chunks, KEYS), deadline=time.monotonic() + timeout,
                            holds_blocks=True)
            _wait_for(lambda k=k: guard.metrics.totals()["load_held_late"] == k + 1, what=f"r{k} to be held")
        assert be.hanging == 4
        t0 = time.monotonic()
        assert _load_async(eng, "r4", dev, chunks, 5.0, holds_blocks=True) == set(range(8)), "a fifth stuck get was allowed"
        assert time.monotonic() - t0 < 2.5 and be.hanging == 4, "the fifth load made a call or waited"
        assert not eng.take_results().loaded, "a held load was reported while its get hung"
        be.set_faults(hang_s={})
        loaded: dict[str, set[int]] = {}
        _wait_for(lambda: loaded.update(eng.take_results().loaded) or len(loaded) == 4, timeout_s=15,
                  what="the held loads to be reported")
        assert all(f == set(range(8)) for f in loaded.values()) and be.hanging == 0
        dev.wipe()
        assert _load_async(eng, "last", dev, chunks, timeout, holds_blocks=True) == set() and _wrong(dev, chunks, set()) == 0
    finally:
        be.set_faults(hang_s={})
        eng.shutdown(timeout_s=2)
        guard.close()
