"""``discard_partial_chunks: false`` under chunked prefill: every full chunk is
saved, and the prompt's trailing run of full blocks too, so a second engine (in
another process) loads the whole prefix byte for byte.

Before the fix, a partial tail saved mid-prefill moved the save cursor past the
start of the full chunk that later covered it: that chunk was never saved and
every later lookup stopped there.
"""

from __future__ import annotations

import pytest
import torch
from ascendstore_vllm.testing import EngineHarness, EngineSpec, prompt_bytes, run_in_subprocess
from conftest import pool_config
from scenarios import serve

BS = 16
BPC = 4  # blocks per chunk: chunk_size 64 tokens
CHUNK = BS * BPC
# 14 full blocks (3 full chunks + a 2-block tail) + 8 tokens.
PROMPT = [(11 * i + 5) % 983 for i in range(14 * BS + 8)]
# Shares the 3 full chunks only, then differs.
OTHER = PROMPT[: 3 * CHUNK] + [(17 * i + 2) % 977 for i in range(40)]


def _spec(root: str, **extra) -> dict:
    cfg = pool_config(root, chunk_size=CHUNK, discard_partial_chunks=False, **extra)
    # 40 tokens per step: block and chunk ends fall mid-step, a partial tail is
    # there to be saved at almost every step of the prefill.
    return {"extra_config": cfg, "kv_load_failure_policy": "fail", "max_num_batched_tokens": 40}


MODES = {"sync": {}, "async": {"load_async": True}, "layerwise": {"use_layerwise": True}}


@pytest.mark.parametrize("mode", list(MODES))
def test_chunked_prefill_saves_every_full_chunk_and_the_tail(pool_root, mode):
    spec = _spec(pool_root, **MODES[mode])
    a = EngineHarness(EngineSpec(**spec))
    try:
        a.add_request("a", PROMPT)
        a.run()
        # Chunked prefill really happened: the first step computed 40 tokens.
        assert a.first_schedule("a") == (0, 40)
        assert sum(1 for rec in a.records if rec.scheduled.get("a")) >= 6
        kv_a = a.prompt_kv("a")
        assert all(torch.equal(x, y) for x, y in zip(kv_a, a.expected_prompt_kv(PROMPT), strict=True))
        # 3 full chunks + 1 tail object (x layers when layerwise), nothing else.
        objects = 4 * (2 if mode == "layerwise" else 1)
        assert a.stats_total()["save_ops"] == objects
        b = run_in_subprocess(serve, spec, [("b", PROMPT), ("c", OTHER)], timeout_s=180)
    finally:
        a.close()
    rb, rc = b["reqs"]["b"], b["reqs"]["c"]
    # B loads all 14 full blocks (3 chunks + the tail) and computes only the last 8 tokens.
    assert rb["first"] == (14 * BS, 8)
    # C shares only the 3 full chunks (the tail's key names a different prefix
    # end): 192 tokens come from the pool or, once B holds them, the device cache.
    # (what it computes in that step depends on the token budget B shares)
    assert rc["first"][0] == 3 * CHUNK
    for r in (rb, rc):
        assert r["exact"], "KV differs from the deterministic model"
        assert r["invalid_blocks"] == []
    assert b["read_errors"] == []
    n = 14 * BS
    for layer, (raw_b, t_a) in enumerate(zip(rb["kv"][0], kv_a, strict=True)):
        row = t_a[0].numel() * t_a.element_size()
        assert raw_b[: n * row] == prompt_bytes([t_a[:n]]), f"layer {layer}: pooled prefix differs from engine A"


def test_full_chunk_over_a_saved_tail_is_saved_during_decode(pool_root):
    """With save_decode_cache the tail saved at the end of the prefill does not
    hide the full chunk that decode completes over it."""
    spec = _spec(pool_root, save_decode_cache=True)
    prompt = PROMPT[: 13 * BS + 4]  # 13 full blocks: 3 chunks + 1-block tail
    a = EngineHarness(EngineSpec(**spec))
    try:
        # 60 generated tokens: the sequence reaches 16 full blocks = 4 full chunks.
        a.add_request("a", prompt, max_tokens=60)
        a.run()
        tokens = a.tokens["a"]
        assert len(tokens) >= 16 * BS
        # 3 prefill chunks + the tail + the 4th full chunk completed in decode.
        assert a.stats_total()["save_ops"] == 5
        b = run_in_subprocess(serve, spec, [("b", tokens[: 16 * BS] + [1, 2, 3])], timeout_s=180)
    finally:
        a.close()
    rb = b["reqs"]["b"]
    assert rb["first"] == (16 * BS, 3)
    assert rb["exact"] and rb["invalid_blocks"] == []
