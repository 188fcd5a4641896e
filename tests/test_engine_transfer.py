"""Core engine without vLLM: guard, lookup, transfers, dedup, stagger, limits."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

import pytest
import torch
from engine_helpers import MemBackend

from ascendstore.contract import Capabilities, Region, Status, caller_may_block
from ascendstore.engine import (
    BackendGuard,
    ChunkOp,
    KeyBuilder,
    PoolLookup,
    ReplicaGroup,
    TransferEngine,
    stagger,
)
from ascendstore.engine.transfer import batches
from ascendstore.keys import RankPart

_KEEP: list[torch.Tensor] = []  # buffers a late backend call may still touch after a test returns


def ops_for(buf: torch.Tensor, n: int, size: int, prefix: str = "k") -> list[ChunkOp]:
    base = buf.data_ptr()
    return [ChunkOp(f"{prefix}{i}", [Region(base + i * size, size)], [i], i) for i in range(n)]


def test_guard_turns_overrun_and_exception_into_statuses():
    be = MemBackend()
    g = BackendGuard(be, timeout_s=0.1, max_stuck=1)
    be.delay_s = 2.0
    t0 = time.monotonic()
    assert g.exists(["a", "b"]) == [Status.TIMEOUT] * 2
    assert time.monotonic() - t0 < 1.5  # bounded by the guard, not by the backend
    # The stuck call holds its thread: further calls answer UNAVAILABLE at once.
    assert g.exists(["c"]) == [Status.UNAVAILABLE]
    time.sleep(2.2)
    be.delay_s = 0
    assert g.exists(["c"]) == [Status.NOT_FOUND]
    be.raise_on.add("get")
    assert g.get(["c"], [[Region(0, 0)]]) == [Status.UNAVAILABLE]
    m = g.metrics.totals()
    assert m["timeouts"] == 2 and m["unavailable"] == 2
    g.close()


class _BoundedMem(MemBackend):
    """MemBackend that returns by itself in time: the guard calls it inline."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[threading.Thread] = []

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(bounded_calls=True)

    def _enter(self, op, keys):
        self.threads.append(threading.current_thread())
        super()._enter(op, keys)


class _Monitor:
    """Stands in for HealthMonitor: a degraded flag, and the calls it was shown."""

    def __init__(self) -> None:
        self.degraded = False
        self.seen: list[tuple[str, list[Status]]] = []

    def record(self, op, statuses):
        self.seen.append((op, list(statuses)))

    def close(self):
        pass


def _guard_outcomes(be: MemBackend) -> list:
    """Each case's statuses, the counters it added, and what the monitor and an
    observer were shown, for one guard over ``be``."""
    g = BackendGuard(be, timeout_s=5.0)
    g.monitor = mon = _Monitor()
    seen: list = []
    g.observers.append(lambda op, st: seen.append((op, list(st))))
    be.data["a"] = b"x"
    out = []

    def case(name, fn):
        out.append((name, fn(), g.metrics.take(), mon.seen[:], seen[:]))
        mon.seen.clear()
        seen.clear()

    case("some present", lambda: g.exists(["a", "b"]))
    case("none", lambda: g.exists([]))
    be.raise_on.add("exists")
    case("raises", lambda: g.exists(["a", "b", "c"]))
    be.raise_on.clear()
    real = be.exists
    be.exists = lambda keys, t: [0]  # one status for two keys
    case("wrong length", lambda: g.exists(["a", "b"]))
    be.exists = lambda keys, t: [0, 1]  # plain ints: normalized to Status
    case("ints", lambda: g.exists(["a", "b"]))
    be.exists = real
    mon.degraded = True
    case("degraded", lambda: g.exists(["a", "b"]))
    case("degraded, ungated", lambda: g.exists(["a", "b"], gated=False))
    mon.degraded = False
    g.close()
    case("closed", lambda: g.exists(["a"]))
    return out


def test_a_bounded_backend_called_inline_answers_as_the_general_path():
    """The guard calls a backend declaring bounded_calls on the caller's thread,
    by a shorter path (no PendingCall): every outcome the same as the general
    path's, counters, health monitor and observers included."""
    general, bounded = MemBackend(), _BoundedMem()
    want, got = _guard_outcomes(general), _guard_outcomes(bounded)
    assert [c[0] for c in got] == [c[0] for c in want]
    for w, g in zip(want, got, strict=True):
        assert g == w, w[0]
    assert dict((c[0], c[1]) for c in got)["some present"] == [Status.OK, Status.NOT_FOUND]
    assert dict((c[0], c[1]) for c in got)["ints"] == [Status.OK, Status.NOT_FOUND]
    assert all(type(s) is Status for c in got for s in c[1])
    assert bounded.threads and all(t is threading.current_thread() for t in bounded.threads)
    # No spare thread for stuck calls (max_stuck 0): unavailable at once, and observed.
    for be in (MemBackend(), _BoundedMem()):
        g = BackendGuard(be, timeout_s=5.0, max_stuck=0)
        g.monitor = mon = _Monitor()
        assert g.exists(["a"]) == [Status.UNAVAILABLE] and not be.calls
        assert mon.seen == [("exists", [Status.UNAVAILABLE])] and g.metrics.take() == {"unavailable": 1}
        g.close()


def test_lookup_is_one_batched_query_and_counts_a_prefix():
    be = MemBackend()
    kb = KeyBuilder("fp", RankPart(0), all_ranks=(RankPart(0), RankPart(1)))
    for h in ("h0", "h1", "h3"):
        for r in (0, 1):
            be.data[KeyBuilder("fp", RankPart(r)).key("-", h)] = b"x"
    be.data.pop(KeyBuilder("fp", RankPart(1)).key("-", "h1"))  # rank 1 misses chunk 1
    lk = PoolLookup(BackendGuard(be, 1.0), kb, 1.0)
    assert lk.prefix_hits("-", ["h0", "h1", "h2", "h3"]) == 1
    assert [c[0] for c in be.calls] == ["exists"] and len(be.calls[0][1]) == 8
    assert lk.prefix_hits("-", ["h0", "h1", "h2", "h3"], start=3) == 4  # from the device hit on


def test_save_skips_existing_and_load_reports_failed_blocks():
    be = MemBackend()
    eng = TransferEngine(BackendGuard(be, 1.0))
    src = torch.arange(64, dtype=torch.uint8)
    be.data["k1"] = bytes(range(100, 116))
    eng.submit_save("r", ops_for(src, 4, 16))
    assert eng.wait("save", ["r"], 5)
    assert be.data["k1"] == bytes(range(100, 116)), "an existing object is not rewritten"
    assert be.data["k2"] == bytes(range(32, 48))
    assert [c[0] for c in be.calls] == ["exists", "put"] and be.calls[1][1] == ["k0", "k2", "k3"]
    dst = torch.zeros(64, dtype=torch.uint8)
    be.fail_keys.add("k2")
    failed = eng.load_now("r", ops_for(dst, 4, 16))
    assert failed == {2}
    assert dst[:16].tolist() == list(range(16)) and dst[48:].tolist() == list(range(48, 64))
    eng.shutdown()


class DedupBackend(MemBackend):
    """A store that turns the put of a key it holds away (``dedups_puts``)."""

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(overwrite_on_put=False, dedups_puts=True)

    def put(self, keys, regions, timeout_s):
        self._enter("put", keys)
        for k, regs in zip(keys, regions, strict=True):
            self.data.setdefault(k, b"".join(ctypes.string_at(r.addr, r.length) for r in regs))
        return [Status.OK] * len(keys)


def test_a_store_that_dedups_its_puts_is_asked_no_exists_before_computed_chunks():
    be = DedupBackend()
    eng = TransferEngine(BackendGuard(be, 1.0))
    assert eng.dedups_puts
    src = torch.arange(64, dtype=torch.uint8)
    be.data["k1"] = bytes(range(100, 116))
    eng.submit_save("r", ops_for(src, 4, 16), computed=True)
    assert eng.wait("save", ["r"], 5)
    assert be.calls == [("put", ["k0", "k1", "k2", "k3"])], "one round trip: the put is the dedup"
    assert be.data["k1"] == bytes(range(100, 116)) and be.data["k2"] == bytes(range(32, 48))
    assert eng.metrics.totals()["save_skipped_existing"] == 0
    # A device prefix hit's re-save (the pool usually holds it): asked first, and counted.
    be.calls.clear()
    be.data["d2"] = bytes(16)
    eng.submit_save("d", ops_for(src, 4, 16, prefix="d"))
    assert eng.wait("save", ["d"], 5)
    assert be.calls == [("exists", ["d0", "d1", "d2", "d3"]), ("put", ["d0", "d1", "d3"])]
    assert eng.metrics.totals()["save_skipped_existing"] == 1
    # Layerwise saves still share one exists per step: a chunk stored with a layer
    # missing is removed whole, so a task must know which layers it wrote itself.
    from ascendstore.engine import SharedExists

    be.calls.clear()
    ops = ops_for(src, 4, 16, prefix="L")
    shared = SharedExists([op.key for op in ops])
    eng.submit_save("w", ops[:2], layer=0, shared_exists=shared)
    eng.submit_save("w", ops[2:], layer=1, shared_exists=shared)
    assert eng.wait("save", ["w"], 5)
    assert [c[0] for c in be.calls] == ["exists", "put", "put"]
    eng.shutdown()


class DetachingBackend(MemBackend):
    """A client without per-call timeouts behind a hand-off of its own (as
    Mooncake's): records, per put, whether the calling thread may block."""

    def __init__(self) -> None:
        super().__init__()
        self.may_block: list[tuple[str, bool]] = []

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(bounded_calls=True, detaches_calls=True)

    def put(self, keys, regions, timeout_s):
        self.may_block.append((threading.current_thread().name, caller_may_block()))
        return super().put(keys, regions, timeout_s)


def test_only_the_save_thread_is_a_caller_that_may_block():
    """A backend may run a put past its deadline only where nothing waits on the
    thread call by call: the engine's save thread. GR's saves on vLLM's forward
    thread and its record writes in the scheduler call the guard directly."""
    be = DetachingBackend()
    guard = BackendGuard(be, 1.0)
    eng = TransferEngine(guard)
    src = torch.arange(64, dtype=torch.uint8)
    eng.submit_save("r", ops_for(src, 4, 16), computed=True)
    assert eng.wait("save", ["r"], 5)
    guard.put(["gr/0"], [[Region(src.data_ptr(), 16)]])  # as GR puts, on the caller's thread
    assert not caller_may_block()
    (saver, on_save_thread), (caller, on_caller) = be.may_block
    assert saver != threading.current_thread().name and caller == threading.current_thread().name
    assert on_save_thread and not on_caller, be.may_block
    eng.shutdown()


def test_caller_marks_belong_to_one_thread_nest_and_restore():
    from ascendstore.contract import blocking_caller, caller_is_watched, watched_caller

    seen: list[tuple[bool, bool]] = []

    def look() -> None:
        seen.append((caller_may_block(), caller_is_watched()))

    with blocking_caller():
        t = threading.Thread(target=look)
        t.start()
        t.join()  # another thread: not marked
        look()
        with blocking_caller():
            look()
        look()  # the inner block left the outer mark on
        with watched_caller():
            look()
    look()
    with watched_caller():
        look()  # watched: it may block too
    with pytest.raises(KeyError), blocking_caller():
        raise KeyError("a failing call")
    look()  # left by an exception: restored all the same
    assert seen == [(False, False), (True, False), (True, False), (True, False), (True, True), (False, False),
                    (True, True), (False, False)]


def test_inflight_bytes_limit_splits_batches():
    buf = torch.zeros(64, dtype=torch.uint8)
    assert [len(b) for b in batches(ops_for(buf, 4, 16), 40)] == [2, 2]
    be = MemBackend()
    eng = TransferEngine(BackendGuard(be, 1.0), max_inflight_bytes=32)
    dst = torch.zeros(64, dtype=torch.uint8)
    eng.load_now("r", ops_for(dst, 4, 16))
    assert [len(c[1]) for c in be.calls] == [2, 2]
    eng.shutdown()


def test_dedup_writer_selection_spreads_evenly_and_once():
    for size in (1, 2, 4):
        groups = [ReplicaGroup.for_tp(r, size, size) for r in range(size)]
        writers = [[g.writes(c) for g in groups] for c in range(40)]
        assert all(sum(w) == 1 for w in writers)
        assert [sum(w[r] for w in writers) for r in range(size)] == [40 // size] * size
    with pytest.raises(ValueError):
        ReplicaGroup(2, 2)


def test_stagger_rotates_reads_per_rank():
    items = list(range(8))
    assert stagger(items, 0, 2) == items
    assert stagger(items, 1, 2) == [4, 5, 6, 7, 0, 1, 2, 3]
    assert stagger(items, 3, 4)[0] == 6
    be = MemBackend()
    for i in range(8):
        be.data[f"k{i}"] = bytes(16)
    eng = TransferEngine(BackendGuard(be, 1.0), stagger_index=1, stagger_size=2)
    dst = torch.zeros(128, dtype=torch.uint8)
    failed = eng.load_now("r", ops_for(dst, 8, 16))
    assert failed == set() and be.calls[0][1][0] == "k4"
    eng.shutdown()


def test_async_load_results_and_layer_waits():
    be = MemBackend()
    for i in range(4):
        be.data[f"k{i}"] = bytes([i]) * 16
    eng = TransferEngine(BackendGuard(be, 1.0))
    dst = torch.zeros(64, dtype=torch.uint8)
    ops = ops_for(dst, 4, 16)
    eng.submit_load("r", ops[:2], layer=0)
    eng.submit_load("r", ops[2:], layer=1)
    assert eng.wait_layer(0) == set() and eng.wait_layer(1) == set()
    deadline = time.monotonic() + 2
    res = eng.take_results()
    while "r" not in res.loaded and time.monotonic() < deadline:
        time.sleep(0.01)
        res = eng.take_results()
    assert res.loaded == {"r": set()} and dst[48] == 3
    eng.shutdown()


def test_cancel_drops_queued_loads_and_waits_for_running_ones():
    be = MemBackend()
    be.delay_s = 0.2
    for i in range(4):
        be.data[f"k{i}"] = bytes(16)
    eng = TransferEngine(BackendGuard(be, 2.0))
    dst = torch.zeros(64, dtype=torch.uint8)
    ops = ops_for(dst, 4, 16)
    eng.submit_load("busy", ops[:1])
    eng.submit_load("victim", ops[1:])
    time.sleep(0.05)  # "busy" is running, "victim" queued behind it
    t0 = time.monotonic()
    failed = eng.cancel(["victim"])
    assert failed == {1, 2, 3}, "queued loads of a preempted request never run"
    assert not eng.pending("load", "victim")
    del t0
    assert all("k1" not in keys for _, keys in be.calls)
    assert eng.wait("load", ["busy"], 2)  # it writes into dst: let it land before dst goes
    eng.shutdown()


def test_full_queue_drops_saves_and_never_blocks():
    be = MemBackend()
    be.delay_s = 0.3
    eng = TransferEngine(BackendGuard(be, 2.0), queue_size=1)
    src = torch.zeros(64, dtype=torch.uint8)
    _KEEP.append(src)
    results = [eng.submit_save(f"r{i}", ops_for(src, 1, 16, prefix=f"s{i}-")) for i in range(4)]
    assert results[0] and not all(results)
    assert eng.metrics.totals()["save_dropped_queue_full"] >= 1
    eng.shutdown(timeout_s=3)


def test_hung_backend_never_blocks_a_load_and_late_writes_are_bounced():
    class RegBackend(MemBackend):
        """Needs registered memory (as Mooncake over RDMA): the landing buffers too."""

        def __init__(self) -> None:
            super().__init__()
            self.registered: list[Region] = []
            self.unregistered: list[Region] = []

        @property
        def capabilities(self):
            from ascendstore.contract import Capabilities

            return Capabilities(needs_registration=True)

        def register(self, regions):
            self.registered.extend(regions)
            return Status.OK

        def unregister(self, regions):
            self.unregistered.extend(regions)
            return Status.OK

    be = RegBackend()
    be.delay_s = 2.0
    be.data["k0"] = bytes([7]) * 16
    eng = TransferEngine(BackendGuard(be, 0.1, max_stuck=3))
    first = torch.zeros(16, dtype=torch.uint8)
    second = torch.zeros(16, dtype=torch.uint8)
    _KEEP.extend([first, second])
    t0 = time.monotonic()
    assert eng.load_now("r", ops_for(first, 1, 16)) == {0}
    assert time.monotonic() - t0 < 1.5
    # Every get lands in a connector-owned buffer: the stuck calls' late writes
    # land there (each in its own retired buffer), never in the destination blocks
    # -- the first overrun included.
    assert eng.load_now("r", ops_for(second, 1, 16)) == {0}
    assert len(eng._retired) == 2 and len(be.registered) == 2, "each landing buffer is registered"
    time.sleep(2.3)
    assert first.sum() == 0 and second.sum() == 0
    be.delay_s = 0
    assert eng.load_now("r", ops_for(second, 1, 16)) == set() and second[0] == 7
    # Recovery: once the late calls ended their buffers are freed (and unregistered).
    assert eng._retired == [] and len(be.unregistered) == 2
    eng.shutdown(timeout_s=1)
    assert threading.active_count() < 50


def test_a_landing_buffer_that_cannot_be_allocated_fails_the_load_not_the_caller():
    """After an overrun the next load allocates a fresh landing buffer; if that fails
    (no device memory left), the load is recomputed: nothing raises into vLLM's thread."""
    class NoRoom:
        capacity = 1 << 20

        def stage_in(self, ops):
            raise RuntimeError("no room on npu:0")

    be = MemBackend()
    be.data["k0"] = bytes([7]) * 16
    eng = TransferEngine(BackendGuard(be, 1.0))
    assert eng.landing is not None  # MemBackend is not bounded: loads land
    eng.use_landing(lambda register: NoRoom())
    dst = torch.zeros(16, dtype=torch.uint8)
    assert eng.load_now("r", ops_for(dst, 1, 16)) == {0} and dst.sum() == 0
    eng.shutdown(timeout_s=1)


def test_the_landing_buffer_starts_on_a_page_and_grows_on_one():
    """Backends copy into it with ``memcpy``, slow on some CPUs into a destination
    16 bytes past a page (where a malloc'd buffer this large starts)."""
    from ascendstore.engine.transfer import HostBounce

    registered: list[Region] = []
    bounce = HostBounce(1 << 20, registered.append)
    for nbytes in (4096, 3 << 20):  # within the capacity, then an object larger than it
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        (region,), = bounce.stage_in([ChunkOp("k", [Region(dst.data_ptr(), nbytes)], [0], 0)])
        assert region.addr % mmap.PAGESIZE == 0 and region.length == nbytes
        assert registered[-1].addr == region.addr and registered[-1].length >= nbytes
        assert bytes((ctypes.c_char * 64).from_address(region.addr)) == bytes(64)  # zeroed, as before
    assert len(registered) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_bounce_commit_copies_what_arrived_into_each_objects_regions(stream):
    """The landing buffer holds the batch's objects back to back; each object that
    arrived goes out to its own regions (several per object, in any order in
    memory), one that did not is skipped and so are its bytes in the buffer."""
    from ascendstore.engine.transfer import HostBounce
    from ascendstore.local import _shmpool

    size = 3 << 20 if stream else 4096  # past the size a get streams from, or not
    dst = torch.zeros(8 * size, dtype=torch.uint8)
    base = dst.data_ptr()
    # object 0: two regions, the second below the first; 1: one; 2: three (one empty)
    layout = [[(4, 1), (0, 1)], [(2, 2)], [(6, 1), (5, 0), (7, 1)]]
    ops = [ChunkOp(f"k{i}", [Region(base + o * size, n * size) for o, n in regs], [i], i)
           for i, regs in enumerate(layout)]
    bounce = HostBounce(1 << 20)
    landing = bounce.stage_in(ops)
    total = sum(op.nbytes for op in ops)
    assert [r[0].length for r in landing] == [op.nbytes for op in ops] and total == 6 * size
    src = torch.randint(0, 256, (total,), dtype=torch.uint8)
    ctypes_buf = (ctypes.c_uint8 * total).from_address(landing[0][0].addr)
    ctypes.memmove(ctypes_buf, src.data_ptr(), total)
    saved = _shmpool.stream_min()
    try:
        if stream:
            _shmpool.stream_min(-1, 1 << 20)
        bounce.commit_in(ops, [True, False, True])
    finally:
        _shmpool.stream_min(*saved)
    want = torch.zeros_like(dst)
    pos = 0
    for i, regs in enumerate(layout):
        for o, n in regs:
            if i != 1:
                want[o * size : (o + n) * size] = src[pos : pos + n * size]
            pos += n * size
    assert torch.equal(dst, want) and dst[2 * size : 4 * size].sum() == 0
    bounce.commit_in(ops, [True, True, True])
    assert torch.equal(dst[2 * size : 4 * size], src[2 * size : 4 * size])
    with pytest.raises(ValueError, match="one ok flag per object"):
        bounce.commit_in(ops, [True])


def test_layer_saves_share_one_exists_per_step():
    from ascendstore.engine import SharedExists

    be = MemBackend()
    be.data["k1"] = bytes(16)
    eng = TransferEngine(BackendGuard(be, 1.0))
    src = torch.arange(64, dtype=torch.uint8)
    ops = ops_for(src, 4, 16)
    shared = SharedExists([op.key for op in ops])
    eng.submit_save("r", ops[:2], layer=0, shared_exists=shared)
    eng.submit_save("r", ops[2:], layer=1, shared_exists=shared)
    assert eng.wait("save", ["r"], 5)
    assert [c[0] for c in be.calls] == ["exists", "put", "put"]
    assert be.calls[1][1] == ["k0"] and be.calls[2][1] == ["k2", "k3"]
    eng.shutdown()


def _two_chunks_by_layer(src: torch.Tensor) -> list[list[ChunkOp]]:
    """Layerwise ops of two 16-byte chunks of ``src``, two layers each: [layer][chunk]."""
    return [
        [ChunkOp(f"L{layer}-c{i}", [Region(src.data_ptr() + i * 16, 16)], [i], i, layer) for i in range(2)]
        for layer in range(2)
    ]


def test_layerwise_chunk_with_a_failed_layer_is_removed_whole():
    """A chunk whose layer 1 failed to save is never a hit (lookups need every
    layer): the layers this step did store are removed, not left as dead weight."""
    from ascendstore.engine import SharedExists

    be = MemBackend()
    eng = TransferEngine(BackendGuard(be, 1.0))
    src = torch.arange(64, dtype=torch.uint8)
    layer_ops = _two_chunks_by_layer(src)
    be.fail_puts.add("L1-c1")  # chunk 1 loses its second layer
    shared = SharedExists([op.key for ops in layer_ops for op in ops], num_layers=2)
    for layer, ops in enumerate(layer_ops):
        eng.submit_save("r", ops, layer=layer, shared_exists=shared)
    assert eng.wait("save", ["r"], 5)
    deadline = time.monotonic() + 5
    while "L0-c1" in be.data and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "L0-c0" in be.data and "L1-c0" in be.data, "the whole chunk 0 stays"
    assert "L0-c1" not in be.data and "L1-c1" not in be.data, "chunk 1 is gone whole"
    assert eng.metrics.totals()["save_partial_removed"] == 1
    eng.shutdown()


class DedupFailingBackend(DedupBackend):
    """Turns duplicate puts away (answering OK) and fails the keys in ``fail_puts``;
    ``racing`` lands right after an exists (another engine's save of the same chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.racing: dict[str, bytes] = {}

    def exists(self, keys, timeout_s):
        out = super().exists(keys, timeout_s)
        self.data.update(self.racing)
        return out

    def remove(self, keys, timeout_s):
        self._enter("remove", keys)
        return super().remove(keys, timeout_s)

    def put(self, keys, regions, timeout_s):
        ok = [i for i, k in enumerate(keys) if k not in self.fail_puts]
        super().put([keys[i] for i in ok], [regions[i] for i in ok], timeout_s)
        return [Status.OK if k not in self.fail_puts else Status.UNAVAILABLE for k in keys]


def test_a_partial_chunk_is_left_where_puts_are_turned_away():
    """With a store that dedups puts, "stored" may mean "another engine had it":
    the layer answered OK may belong to that engine's whole chunk, which a reader
    may be loading. The partial chunk is left to eviction, counted."""
    from ascendstore.engine import SharedExists

    be = DedupFailingBackend()
    eng = TransferEngine(BackendGuard(be, 1.0))
    src = torch.arange(64, dtype=torch.uint8)
    layer_ops = _two_chunks_by_layer(src)
    be.fail_puts.add("L1-c1")
    shared = SharedExists([op.key for ops in layer_ops for op in ops], num_layers=2)
    be.racing["L0-c1"] = b"theirs".ljust(16)  # another engine's, landing after our exists
    for layer, ops in enumerate(layer_ops):
        eng.submit_save("r", ops, layer=layer, shared_exists=shared)
    assert eng.wait("save", ["r"], 5)
    time.sleep(0.1)
    assert [c for c in be.calls if c[0] == "remove"] == [], "a dedup store's turned-away keys were removed"
    assert be.data["L0-c1"] == b"theirs".ljust(16)
    assert eng.metrics.totals()["save_partial_left"] == 1
    assert eng.metrics.totals().get("save_partial_removed", 0) == 0
    eng.shutdown()


def test_layerwise_batches_capped_in_bytes_and_blocks():
    ops = [ChunkOp(f"k{i}", [Region(0, 100)], [i, i + 10], i) for i in range(5)]
    assert [len(b) for b in batches(ops, 250)] == [2, 2, 1]
    assert [len(b) for b in batches(ops, 0, 4)] == [2, 2, 1]  # two blocks per op
    assert [len(b) for b in batches(ops, 1000, 2)] == [1, 1, 1, 1, 1]


def test_layerwise_loader_runs_at_most_prefetch_layers_ahead():
    """layerwise_prefetch_layers: layer i is fetched only once the forward pass
    waited for layer i - prefetch (bounded by the step's deadline)."""
    be = MemBackend()
    dst = torch.zeros(64, dtype=torch.uint8)
    _KEEP.append(dst)
    for layer in range(4):
        be.data[f"L{layer}"] = bytes([layer + 1]) * 16
    eng = TransferEngine(BackendGuard(be, 2.0), prefetch_layers=1)
    eng.new_step()
    deadline = time.monotonic() + 5
    for layer in range(4):
        op = ChunkOp(f"L{layer}", [Region(dst.data_ptr() + 16 * layer, 16)], [layer], 0, layer)
        eng.submit_load("r", [op], layer=layer, deadline=deadline)
    time.sleep(0.5)
    fetched = [k for op, keys in be.calls if op == "get" for k in keys]
    # Before the forward pass reaches layer 0 only layer 0 is fetched.
    assert fetched == ["L0"], f"the loader ran ahead of the forward pass: {fetched}"
    for layer in range(4):
        assert eng.wait_layer(layer) == set()
    assert dst.view(4, 16)[:, 0].tolist() == [1, 2, 3, 4]
    eng.shutdown()


# -- a whole step in one backend call (load_step / save_step) ----------------------------
class DirectMem(MemBackend):
    """Bounded and in-process like the local pool (the engine may fuse a step), with
    planted per-key statuses: a get or put of a key in ``status_of`` answers that
    status and moves nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.status_of: dict[str, Status] = {}

    @property
    def capabilities(self):
        from ascendstore.contract import Capabilities

        return Capabilities(bounded_calls=True)

    def get(self, keys, regions, timeout_s):
        out = super().get(keys, [[] if k in self.status_of else r for k, r in zip(keys, regions, strict=True)],
                          timeout_s)
        return [self.status_of.get(k, s) for k, s in zip(keys, out, strict=True)]

    def put(self, keys, regions, timeout_s):
        out = super().put(keys, regions, timeout_s)
        for k in keys:
            if k in self.status_of:
                self.data.pop(k, None)
        return [self.status_of.get(k, s) for k, s in zip(keys, out, strict=True)]


class AbsentMem(DirectMem):
    """DirectMem with the local pool's ``put_absent``: a key it holds keeps its
    value, answers OK and is reported; the rest are put (planted statuses apply)."""

    def put_absent(self, keys, regions, present, timeout_s):
        self._enter("put_absent", keys)
        out = []
        for i, (k, regs) in enumerate(zip(keys, regions, strict=True)):
            if k in self.data:
                present.append(i)
                out.append(Status.OK)
            elif k in self.status_of:
                out.append(self.status_of[k])
            else:
                self.data[k] = b"".join(ctypes.string_at(r.addr, r.length) for r in regs)
                out.append(Status.OK)
        return out


def _random_step(rng, buf: torch.Tensor, size: int):
    """Requests of 0-6 objects (some blocks already on the device: negative ids)."""
    from ascendstore.engine import StepObjects

    base, reqs, pos = buf.data_ptr(), [], 0
    for r in range(rng.randint(1, 4)):
        objs = []
        for i in range(rng.randint(0, 6)):
            ids = [pos * 2, pos * 2 + 1] if rng.random() < 0.8 else [-1, pos * 2 + 1]
            objs.append((f"r{r}-k{i}", [Region(base + pos * size, size // 2), Region(base + pos * size + size // 2,
                                                                                    size // 2)], ids))
            pos += 1
        reqs.append((f"r{r}", objs))
    keys, regions, blocks, spans = [], [], [], []
    for req, objs in reqs:
        keys += [k for k, _, _ in objs]
        regions += [r for _, r, _ in objs]
        blocks += [b for _, _, b in objs]
        if objs:
            spans.append((req, len(keys), len(objs) * size))
    ops = {req: [ChunkOp(k, r, [b for b in ids if b >= 0], i, None, size) for i, (k, r, ids) in enumerate(objs)]
           for req, objs in reqs}
    return StepObjects(keys, regions, blocks, spans), ops


_COUNTED = ("load_ops", "load_bytes", "load_failures", "load_corrupt", "save_ops", "save_bytes", "save_failures",
            "save_no_space", "save_skipped_existing", "save_dropped_queue_full")


@pytest.mark.parametrize("seed", range(40))
def test_load_step_matches_one_load_per_request(seed):
    """One backend call for the step, same outcome as the per-request path: failed
    blocks, counters, per-request staggered read order, bytes landed, corrupt
    objects removed."""
    import random

    rng = random.Random(seed)
    size = 32
    index, nranks = rng.choice([(0, 1), (1, 2), (2, 3)])
    src = torch.randint(0, 255, (64 * size,), dtype=torch.uint8)
    outs, results = [], []
    step = None
    statuses = [Status.NOT_FOUND, Status.CORRUPT, Status.UNAVAILABLE, Status.TIMEOUT]
    plan = {}
    for fused in (True, False):
        be = DirectMem()
        dst = torch.zeros(64 * size, dtype=torch.uint8)
        _KEEP.append(dst)
        step, ops = _random_step(random.Random(seed), dst, size)
        for i, k in enumerate(step.keys):
            if fused:
                plan[k] = rng.choice(statuses) if rng.random() < 0.3 else Status.OK
            if plan[k] is not Status.NOT_FOUND:
                be.data[k] = bytes(src[i * size:(i + 1) * size].tolist())
            if plan[k] not in (Status.OK, Status.NOT_FOUND):
                be.status_of[k] = plan[k]
        eng = TransferEngine(BackendGuard(be, 1.0), stagger_index=index, stagger_size=nranks)
        assert eng.fused
        deadline = time.monotonic() + 5
        if fused:
            failed = eng.load_step(step, deadline)
            assert [op for op, _ in be.calls].count("get") == (1 if step.keys else 0)
        else:
            failed = set()
            for req, req_ops in ops.items():
                failed |= eng.load_now(req, req_ops, deadline=deadline)
        m = eng.metrics.totals()
        results.append((failed, {k: m.get(k, 0) for k in _COUNTED}, list(eng.load_order), sorted(be.data)))
        outs.append(dst.clone())
        eng.shutdown()
    assert results[0] == results[1]
    assert torch.equal(outs[0], outs[1])
    bad = {b for i, k in enumerate(step.keys) if plan[k] is not Status.OK for b in step.blocks[i] if b >= 0}
    assert results[0][0] == bad


def test_load_step_past_its_deadline_fails_fast():
    be = DirectMem()
    dst = torch.zeros(128, dtype=torch.uint8)
    from ascendstore.engine import StepObjects

    be.data["a"] = bytes(16)
    eng = TransferEngine(BackendGuard(be, 1.0))
    failed = eng.load_step(StepObjects(["a"], [[Region(dst.data_ptr(), 16)]], [[3, -1]], [("r", 1, 16)]),
                           time.monotonic() - 1)
    assert failed == {3} and not be.calls and eng.metrics.totals()["load_failures"] == 1
    eng.shutdown()


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("inline", [True, False], ids=["inline", "save-thread"])
def test_save_step_matches_one_save_per_request(seed, inline):
    """One exists and one put for the step, or one ``put_absent`` where the
    backend has it, same outcome as one save per request (inline, or queued on
    the save thread): objects already pooled skipped, failures and NO_SPACE
    counted, requests the save queue has no room for dropped, landed keys
    reported, the queue's room given back."""
    import random

    rng = random.Random(seed)
    size = 32
    plan, pooled, results = {}, set(), []
    reserve = rng.choice([0, 64, 200])  # bytes of an async save in flight (makes the queue busy)
    for path in ("put_absent", "fused", "per-request"):
        fused = path != "per-request"
        be = AbsentMem() if path == "put_absent" else DirectMem()
        src = torch.randint(0, 255, (64 * size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        _KEEP.append(src)
        step, ops = _random_step(random.Random(seed), src, size)
        for k in step.keys:
            if path == "put_absent":
                plan[k] = rng.choice([Status.UNAVAILABLE, Status.NO_SPACE]) if rng.random() < 0.2 else Status.OK
                if rng.random() < 0.3:
                    pooled.add(k)
            if k in pooled:
                be.data[k] = b"old"
            if plan[k] is not Status.OK:
                be.status_of[k] = plan[k]
        eng = TransferEngine(BackendGuard(be, 1.0), save_queue_bytes=256)
        assert eng.puts_absent == (path == "put_absent")
        if reserve:
            assert eng.admit_save(1, reserve)
        if fused:
            assert eng.save_step(step) if inline else eng.submit_save_step(step)
        else:
            for req, req_ops in ops.items():
                if req_ops:
                    eng.submit_save(req, req_ops, inline=inline)
        assert eng.wait("save", list(ops), 5)
        ops_called = [op for op, _ in be.calls]
        if path == "put_absent":
            assert ops_called.count("put_absent") <= 1 and "exists" not in ops_called and "put" not in ops_called
        elif fused:
            assert ops_called.count("put") <= 1
        if reserve:
            eng._save_slots -= 1
            eng._save_bytes -= reserve
        m = eng.metrics.totals()
        results.append(({k: m.get(k, 0) for k in _COUNTED}, sorted(eng.take_landed()), dict(be.data),
                        eng._save_slots, eng._save_bytes))
        eng.shutdown()
    assert results[0] == results[2]
    assert results[1] == results[2]


def test_save_step_leaves_a_step_saving_one_object_twice_to_the_per_request_path():
    from ascendstore.engine import StepObjects

    be = DirectMem()
    src = torch.zeros(64, dtype=torch.uint8)
    r = [Region(src.data_ptr(), 16)]
    eng = TransferEngine(BackendGuard(be, 1.0))
    assert not eng.save_step(StepObjects(["x", "x"], [r, r], [[1], [2]], [("a", 1, 16), ("b", 2, 16)]))
    assert not be.calls and eng._save_slots == 0
    eng.shutdown()


def test_a_queued_step_save_is_pending_under_each_request():
    from ascendstore.engine import StepObjects

    be = DirectMem()
    be.delay_s = 0.3
    src = torch.arange(64, dtype=torch.uint8)
    _KEEP.append(src)
    r = [Region(src.data_ptr(), 16)]
    eng = TransferEngine(BackendGuard(be, 2.0))
    assert eng.submit_save_step(StepObjects(["x", "y", "z"], [r, r, r], [[1], [2], [3]],
                                            [("a", 1, 16), ("b", 3, 32)]))
    assert eng.pending("save", "a") and eng.pending("save", "b") and eng._save_slots == 2
    assert eng.wait("save", ["a", "b"], 5)
    assert not eng.pending("save", "a") and not eng.pending("save", "b")
    assert eng._save_slots == 0 and eng._save_bytes == 0
    assert sorted(eng.take_landed()) == ["x", "y", "z"] and be.data["y"] == bytes(range(16))
    assert eng.take_results().saved == {"a", "b"}
    eng.shutdown()
