"""Save admission through the real vLLM scheduler and worker lifecycle."""

from __future__ import annotations

import uuid

import torch
from ascendstore_vllm.scheduler import chunk_kv_bytes
from ascendstore_vllm.testing import EngineHarness, EngineSpec
from conftest import local_pool_config

PROMPT = [(7 * i + 3) % 911 for i in range(100)]  # 6 full blocks of 16


def engine(**extra) -> EngineHarness:
    # KV events on (vLLM publishes them), so BlockStored can be checked.
    return EngineHarness(EngineSpec(extra_config=local_pool_config("adm-" + uuid.uuid4().hex[:10], **extra),
                                    kv_events=True))


def exact(eng: EngineHarness, req: str, prompt: list[int]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(eng.prompt_kv(req), eng.expected_prompt_kv(prompt), strict=True))


def test_admit_after_two_hits_saves_on_second_use_only():
    eng = engine(admit_after_hits=2)
    events: list = []
    take = eng.connector.take_events
    eng.connector.take_events = lambda: (events.extend(e := list(take())) or e)
    try:
        eng.add_request("once", PROMPT)
        eng.run()
        s = eng.stats_total()
        assert s.get("save_ops", 0) == 0 and s["save_skipped_admission"] == 6
        assert events == [], "no BlockStored for chunks that were not saved"
        eng.add_request("twice", PROMPT)  # device prefix hit; second sighting: saved now
        eng.run()
        assert eng.stats_total()["save_ops"] == 6 and len(events) >= 1
        assert eng.scheduler.reset_prefix_cache()
        eng.add_request("pool", PROMPT)
        eng.run()
        assert eng.first_schedule("pool")[0] == 96 and exact(eng, "pool", PROMPT)
    finally:
        eng.close()


def test_save_budget_per_step_caps_bytes_planned():
    probe = engine()
    chunk = chunk_kv_bytes(probe.connector.scheduler.ctx)
    probe.close()
    assert chunk == 2 * 2 * 2 * 16 * 2 * 16  # layers * (K,V) * heads * head size * fp16 * tokens
    eng = engine(save_budget_bytes_per_step=2 * chunk)
    try:
        eng.add_request("a", PROMPT)
        eng.add_request("b", PROMPT[::-1])
        eng.run()
        s = eng.stats_total()
        # One prefill step for both: 2 chunks fit the budget, the other 10 are skipped.
        assert s["save_ops"] == 2 and s["save_skipped_budget"] == 10, s
        assert s["save_bytes"] == 2 * chunk
    finally:
        eng.close()
