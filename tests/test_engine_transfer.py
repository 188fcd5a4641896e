"""Core engine without vLLM: guard, lookup, transfers, dedup, stagger, limits."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from engine_helpers import MemBackend

from ascendstore.contract import Region, Status
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


def test_layerwise_chunk_with_a_failed_layer_is_removed_whole():
    """A chunk whose layer 1 failed to save is never a hit (lookups need every
    layer): the layers this step did store are removed, not left as dead weight."""
    from ascendstore.engine import SharedExists

    be = MemBackend()
    eng = TransferEngine(BackendGuard(be, 1.0))
    src = torch.arange(64, dtype=torch.uint8)
    layer_ops = [
        [ChunkOp(f"L{layer}-c{i}", [Region(src.data_ptr() + i * 16, 16)], [i], i, layer) for i in range(2)]
        for layer in range(2)
    ]
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
