"""TP=2: with identical KV across ranks each chunk is written once, by ranks in
turn; both ranks load correctly and start reading at different chunks."""

from __future__ import annotations

import os

import torch
from ascendstore_vllm.testing import EngineHarness, EngineSpec, run_in_subprocess
from conftest import pool_config
from scenarios import serve

BS = 16
PROMPT = [(9 * i + 4) % 953 for i in range(8 * BS + 3)]  # 8 full blocks
PROMPT_B = PROMPT[: 8 * BS] + [1, 2, 3, 4, 5, 6, 7]


def objects(root: str) -> list[str]:
    return sorted(f for f in os.listdir(root) if not f.startswith("."))


def test_replicated_kv_written_once_and_staggered_loads(pool_root):
    spec = {"extra_config": pool_config(pool_root), "tp_size": 2, "replicated_kv": True}
    a = EngineHarness(EngineSpec(**spec))
    try:
        assert a.kv_cache_config.kv_tp_replicas == 2  # vLLM itself says ranks hold identical KV
        a.add_request("a", PROMPT)
        a.run()
        for r in (0, 1):
            assert all(torch.equal(x, y) for x, y in zip(a.prompt_kv("a", r), a.expected_prompt_kv(PROMPT, r),
                                                         strict=True))
        per_rank = [w.connector.worker.metrics.totals() for w in a.workers]
    finally:
        a.close()
    names = objects(pool_root)
    assert len(names) == 8, "one object per chunk, shared by both ranks"
    assert all("@h0p0c0d0@" in n for n in names)
    # Exactly one writer per chunk, spread evenly.
    assert [m["save_ops"] for m in per_rank] == [4, 4]
    assert [m["save_skipped_not_writer"] for m in per_rank] == [4, 4]

    b = run_in_subprocess(serve, spec, [("b", PROMPT_B)], timeout_s=180)
    rb = b["reqs"]["b"]
    assert rb["first"] == (8 * BS, len(PROMPT_B) - 8 * BS)
    assert rb["exact"] and b["read_errors"] == []
    assert b["stats"]["load_ops"] == 16  # both ranks load all 8 chunks
    order0, order1 = (orders[0] for orders in b["load_order"])
    assert sorted(order0) == sorted(order1)
    assert order0[0] != order1[0] and order1[0] == order0[4], "rank 1 starts half-way along"


def test_sharded_kv_each_rank_writes_its_own(pool_root):
    spec = EngineSpec(extra_config=pool_config(pool_root), tp_size=2, replicated_kv=False)
    a = EngineHarness(spec)
    try:
        assert a.kv_cache_config.kv_tp_replicas == 1
        a.add_request("a", PROMPT)
        a.run()
    finally:
        a.close()
    names = objects(pool_root)
    assert len(names) == 16
    assert sum("@h1p0c0d0@" in n for n in names) == 8
    b = EngineHarness(spec)
    try:
        b.add_request("b", PROMPT_B)
        b.run()
        assert b.first_schedule("b") == (8 * BS, len(PROMPT_B) - 8 * BS)
        for r in (0, 1):
            assert all(torch.equal(x, y) for x, y in zip(b.prompt_kv("b", r), b.expected_prompt_kv(PROMPT_B, r),
                                                         strict=True))
        # The two ranks' KV differ (sharded heads): each loaded its own objects.
        assert not torch.equal(b.prompt_kv("b", 0)[0], b.prompt_kv("b", 1)[0])
    finally:
        b.close()
