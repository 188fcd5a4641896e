"""Engine A fills the pool; engine B (another process) serves a prompt sharing
its prefix: B loads the pooled chunks, computes only the rest, and its KV
blocks equal A's byte for byte. Sync, async-load and layerwise modes."""

from __future__ import annotations

import pytest
import torch
from ascendstore_vllm.testing import EngineHarness, EngineSpec, prompt_bytes, run_in_subprocess
from conftest import pool_config
from scenarios import serve

BS = 16
PREFIX = [(7 * i + 3) % 997 for i in range(5 * BS + 5)]  # 85 tokens: 5 full blocks + 5
PROMPT_A = PREFIX + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]  # 96 tokens
PROMPT_B = PREFIX[: 5 * BS] + [(13 * i + 1) % 991 for i in range(40)]  # shares 5 blocks


MODES = {
    "sync": {},
    "async": {"load_async": True},
    "layerwise": {"use_layerwise": True},
    # saves on the save thread, not the forward thread (local: the step's saves as one task)
    "save-thread": {"inline_save_bytes": 0},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_then_b_across_processes_byte_exact(pool, mode):
    extra = pool(**MODES[mode])
    # No failures expected here: any failed load fails the request loudly.
    spec = {"extra_config": extra, "kv_load_failure_policy": "fail"}
    a = EngineHarness(EngineSpec(**spec))
    try:  # A stays up while B runs: two engines on one node sharing the pool
        a.add_request("a", PROMPT_A)
        a.run()
        assert a.first_schedule("a") == (0, len(PROMPT_A))  # empty pool: A computes everything
        kv_a = a.prompt_kv("a")
        assert all(torch.equal(x, y) for x, y in zip(kv_a, a.expected_prompt_kv(PROMPT_A), strict=True))
        assert a.read_errors() == []
        # 6 full blocks (chunk_size = block_size) -> 6 chunks; layerwise: one object per layer.
        assert a.stats_total()["save_ops"] == 6 * (2 if mode == "layerwise" else 1)
        b = run_in_subprocess(serve, spec, [("b", PROMPT_B)], timeout_s=180)
    finally:
        a.close()
    rb = b["reqs"]["b"]
    # B computes only what lies beyond the 5 pooled blocks.
    assert rb["first"] == (5 * BS, len(PROMPT_B) - 5 * BS)
    assert rb["exact"], "B's KV differs from the deterministic model"
    assert b["read_errors"] == [], "a layer read KV before its load landed"
    # B's pooled prefix bytes equal A's, layer by layer.
    n = 5 * BS
    for layer, (raw_b, t_a) in enumerate(zip(rb["kv"][0], kv_a, strict=True)):
        row = t_a[0].numel() * t_a.element_size()
        assert raw_b[: n * row] == prompt_bytes([t_a[:n]]), f"layer {layer} prefix differs from engine A"
    assert b["stats"]["load_ops"] == 5 * (2 if mode == "layerwise" else 1)
    assert b["stats"].get("load_failures", 0) == 0
    assert b["stats"]["lookup_hit_tokens"] == n


def test_device_prefix_hit_is_not_reloaded(pool_root):
    """Tokens the device prefix cache already holds are not fetched from the pool."""
    eng = EngineHarness(EngineSpec(extra_config=pool_config(pool_root)))
    try:
        eng.add_request("x", PROMPT_A)
        eng.run()
        eng.add_request("y", PROMPT_A[:80] + [5, 6, 7, 8] * 8)
        eng.run()
        before, scheduled = eng.first_schedule("y")
        assert before == 80  # from vLLM's own prefix cache
        assert eng.stats_total().get("load_ops", 0) == 0
        assert all(torch.equal(x, y) for x, y in zip(eng.prompt_kv("y"), eng.expected_prompt_kv(
            PROMPT_A[:80] + [5, 6, 7, 8] * 8), strict=True))
    finally:
        eng.close()
