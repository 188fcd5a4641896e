"""Other shapes of the data path: device KV through bounded host staging
(exercised with CPU tensors standing in for device memory), chunks of several
blocks that the device prefix cache partly holds, a block-outermost KV layout."""

from __future__ import annotations

import pytest
import torch
from ascendstore_vllm.metadata import ChunkRef, LoadSpec
from ascendstore_vllm.testing import EngineHarness, EngineSpec
from ascendstore_vllm.worker import AscendStoreWorker
from conftest import pool_config

PROMPT = [(17 * i + 3) % 929 for i in range(130)]


def exact(eng: EngineHarness, req_id: str, prompt: list[int], rank: int = 0) -> bool:
    return all(torch.equal(x, y) for x, y in zip(eng.prompt_kv(req_id, rank), eng.expected_prompt_kv(prompt, rank),
                                                 strict=True))


@pytest.mark.parametrize("mode", [{}, {"use_layerwise": True}], ids=["chunk", "layerwise"])
def test_staged_transfers_in_bounded_batches(pool_root, monkeypatch, mode):
    monkeypatch.setattr(AscendStoreWorker, "treat_kv_as_device", True)
    # 2 layers x 4 KiB per chunk object: a 10 KiB buffer holds 2 objects per batch.
    cfg = pool_config(pool_root, staging_buffer_bytes="10KiB", **mode)
    a = EngineHarness(EngineSpec(extra_config=cfg))
    b = EngineHarness(EngineSpec(extra_config=cfg))
    try:
        w = a.workers[0].connector.worker
        assert w.staging is not None and w.engine.stager is w.staging and w.staging.capacity == 10 * 1024
        a.add_request("a", PROMPT)
        a.run()
        assert exact(a, "a", PROMPT)
        b.add_request("b", PROMPT[:112] + [4, 5, 6])
        b.run()
        assert b.first_schedule("b") == (112, 3)
        assert exact(b, "b", PROMPT[:112] + [4, 5, 6])
        assert b.read_errors() == []
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kv", ["host", "device"])
def test_multi_block_chunks_partly_on_device(pool_root, kv, monkeypatch):
    """chunk_size = 2 blocks; the device already holds the first block of a pooled
    chunk: the chunk is read whole, that block into scratch, never into vLLM's cache.

    ``device``: KV taken for device KV, and a backend that reads device memory and
    registered memory only (``faulty``'s ``registered_only``, as RDMA) but may
    outlive its deadline: the chunk lands whole in the device landing buffer,
    which must be registered, and only its wanted block goes on into the cache."""
    cfg = pool_config(pool_root, chunk_size=32)
    if kv == "device":
        monkeypatch.setattr(AscendStoreWorker, "treat_kv_as_device", True)
        inner = {"backend": cfg.pop("backend"), "backend_config": cfg.pop("backend_config")}
        cfg.update(backend="faulty", backend_config={**inner, "device_memory": True, "registered_only": True})
    a = EngineHarness(EngineSpec(extra_config=cfg))
    b = EngineHarness(EngineSpec(extra_config=cfg))
    try:
        a.add_request("a", PROMPT)  # 8 full blocks -> 4 chunks saved
        a.run()
        assert a.stats_total()["save_ops"] == 4
        b.add_request("warm", PROMPT[:20])  # B's device cache: 1 full block of the prefix
        b.run()
        b.add_request("b", PROMPT[:128] + [7, 7, 7])
        b.run()
        assert b.first_schedule("b") == (128, 3)  # 16 from the device, 112 from the pool
        assert b.stats_total()["load_ops"] == 4
        assert exact(b, "b", PROMPT[:128] + [7, 7, 7]) and exact(b, "warm", PROMPT[:20])
        assert b.read_errors() == []
        if kv == "device":
            from ascendstore.chaos import live_backends

            assert sum(x.injected["unregistered"] for x in live_backends()) == 0
    finally:
        a.close()
        b.close()


def test_block_outermost_layout(pool_root):
    """BLNHC: every block holds all layers side by side; regions follow the strides."""
    cfg = pool_config(pool_root)
    a = EngineHarness(EngineSpec(extra_config=cfg, kv_cache_layout="BLNHC"))
    b = EngineHarness(EngineSpec(extra_config=cfg, kv_cache_layout="BLNHC"))
    try:
        t = next(iter(a.workers[0].kv_caches.values()))
        assert not t.is_contiguous()
        a.add_request("a", PROMPT)
        a.run()
        b.add_request("b", PROMPT[:96] + [1])
        b.run()
        assert b.first_schedule("b") == (96, 1)
        assert exact(b, "b", PROMPT[:96] + [1])
    finally:
        a.close()
        b.close()


def test_chunk_size_must_be_a_multiple_of_the_block_size(pool_root):
    from ascendstore.errors import ConfigError

    with pytest.raises(ConfigError, match="chunk_size.*multiple of vLLM's block_size"):
        EngineHarness(EngineSpec(extra_config=pool_config(pool_root, chunk_size=24)))


def test_step_objects_take_one_block_chunks_regions_by_block_id(pool_root):
    """A step's one-block chunks take their regions from a list indexed by block id
    (``_step_objects``): the same regions as built from the layout, on a miss and
    from the list; a block the device holds (-1) reads into scratch and is never
    cached; an id outside the KV cache is refused by name, every time."""
    eng = EngineHarness(EngineSpec(extra_config=pool_config(pool_root), num_blocks=32, max_model_len=256))
    try:
        w = eng.workers[0].connector.worker
        assert w.ctx.blocks_per_chunk == 1

        def regions(*block_lists: list[int]) -> list:
            chunks = [ChunkRef(i, f"{i:064x}", list(b)) for i, b in enumerate(block_lists)]
            return w._step_objects([LoadSpec("r", "-", chunks)]).regions

        blocks = [[3], [31], [0], [-1], [7]]
        want = [w._build_regions(b, None) for b in blocks]
        assert want[3] != want[0] and want[1] != want[0]
        assert regions(*blocks) == want  # misses
        assert regions(*blocks) == want  # from the list
        assert w._block_regions[3] is not None and w._block_regions[-1] is None
        # A two-block chunk (not this config's shape) takes the general path.
        assert regions([3], [4, 5]) == [want[0], w._build_regions([4, 5], None)]
        for _ in range(2):
            with pytest.raises(IndexError, match="block 32 outside the KV cache"):
                regions([3], [32])
    finally:
        eng.close()
