"""Failures degrade to recompute and the final KV is still exact; nothing hangs."""

from __future__ import annotations

import os
import time

import pytest
import torch
from ascendstore_vllm.testing import EngineHarness, EngineSpec
from conftest import pool_config

BS = 16
PROMPT = [(5 * i + 2) % 983 for i in range(8 * BS)]  # 8 full blocks
PROMPT_B = PROMPT[: 7 * BS] + [(3 * i + 9) % 977 for i in range(30)]


def fill_pool(root: str, **extra) -> None:
    a = EngineHarness(EngineSpec(extra_config=pool_config(root, **extra)))
    try:
        a.add_request("a", PROMPT)
        a.run()
    finally:
        a.close()


def exact(eng: EngineHarness, req_id: str, prompt: list[int]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(eng.prompt_kv(req_id), eng.expected_prompt_kv(prompt), strict=True))


@pytest.mark.parametrize("mode", [{}, {"load_async": True}, {"use_layerwise": True}], ids=["sync", "async", "layerwise"])
def test_failed_gets_are_recomputed(pool_root, mode):
    fill_pool(pool_root, **mode)
    b = EngineHarness(EngineSpec(extra_config=pool_config(pool_root, backend_config={"fail_get_every": 2}, **mode)))
    try:
        b.add_request("b", PROMPT_B)
        b.run()
        stats = b.stats_total()
        invalid = set().union(*(r.invalid_block_ids for r in b.records))
        assert stats["load_failures"] > 0 and invalid, "the test backend should have failed some gets"
        assert exact(b, "b", PROMPT_B), "recomputed KV must equal the model's"
        # Every failed block belongs to the request and was reported to vLLM.
        assert invalid <= set(b.block_ids["b"])
        # The recompute covered the failed blocks: vLLM scheduled more than the 30 new tokens.
        assert sum(r.scheduled.get("b", 0) for r in b.records) > 30
    finally:
        b.close()


@pytest.mark.parametrize("mode", [{}, {"load_async": True}, {"use_layerwise": True}], ids=["sync", "async", "layerwise"])
def test_every_get_failing_does_not_loop(pool_root, mode):
    """Metadata says hit, data path broken: vLLM rewinds a failed async load to
    token 0 and asks again; the connector must not offer the broken chunks again."""
    fill_pool(pool_root, **mode)
    b = EngineHarness(EngineSpec(extra_config=pool_config(pool_root, backend_config={"fail_get_every": 1}, **mode)))
    try:
        b.add_request("b", PROMPT_B)
        b.run(timeout_s=60)
        assert b.stats_total().get("load_ops", 0) == 0
        assert exact(b, "b", PROMPT_B)
        lookups = b.connector.scheduler.metrics.totals()["lookups"]
        assert lookups <= 2, f"{lookups} lookups: the failed entry was offered again and again"
    finally:
        b.close()


def test_hanging_get_times_out_and_request_completes(pool_root):
    fill_pool(pool_root)
    cfg = pool_config(pool_root, timeout_ms=200, backend_config={"hang_ops": ["get"], "hang_s": 1.5})
    b = EngineHarness(EngineSpec(extra_config=cfg))
    try:
        b.add_request("b", PROMPT_B)
        t0 = time.monotonic()
        b.run(timeout_s=30)
        assert time.monotonic() - t0 < 10, "a hanging backend must not stall the engine"
        stats = b.stats_total()
        assert stats["timeouts"] >= 1
        assert exact(b, "b", PROMPT_B)
    finally:
        b.close()


def test_hanging_lookup_is_a_miss(pool_root):
    fill_pool(pool_root)
    cfg = pool_config(pool_root, timeout_ms=200, lookup_timeout_ms=100,
                      backend_config={"hang_ops": ["exists"], "hang_s": 1.0})
    b = EngineHarness(EngineSpec(extra_config=cfg))
    try:
        b.add_request("b", PROMPT_B)
        b.run(timeout_s=30)
        assert b.first_schedule("b") == (0, len(PROMPT_B))  # lookup timed out -> compute all
        assert exact(b, "b", PROMPT_B)
    finally:
        b.close()


def test_abort_during_save_keeps_blocks_until_saved(pool_root):
    cfg = pool_config(pool_root, backend_config={"put_delay_s": 0.5})
    a = EngineHarness(EngineSpec(extra_config=cfg, max_num_batched_tokens=32))
    try:
        a.add_request("a", PROMPT, max_tokens=4)
        a.step()  # chunked prefill: 32 tokens computed, 2 chunks being saved (slowly)
        assert a.records[-1].scheduled == {"a": 32}
        a.abort("a")
        req = a.scheduler.requests.get("a")
        assert req is not None and req.is_finished(), "blocks must stay allocated while the save runs"
        t0 = time.monotonic()
        a.run(timeout_s=30)
        sent_at = next(i for i, r in enumerate(a.records) if "a" in r.finished_sending)
        assert sent_at >= 1 and time.monotonic() - t0 > 0.2
        assert "a" not in a.scheduler.requests
    finally:
        a.close()
    # Both saved chunks are intact: a new engine loads them and its KV is exact.
    names = [f for f in os.listdir(pool_root) if not f.startswith(".")]
    assert len(names) == 2
    b = EngineHarness(EngineSpec(extra_config=pool_config(pool_root)))
    try:
        b.add_request("b", PROMPT[:32] + [1, 2, 3, 4, 5])
        b.run()
        assert b.first_schedule("b") == (32, 5)
        assert exact(b, "b", PROMPT[:32] + [1, 2, 3, 4, 5])
    finally:
        b.close()


@pytest.mark.parametrize("mode", [{}, {"use_layerwise": True}], ids=["sync", "layerwise"])
def test_preempted_loaded_request_resumes_exact(pool_root, mode):
    """Two requests that do not both fit: the later one is preempted after its
    pooled prefix was loaded, its transfers are stopped (handle_preemptions),
    and on resume it loads again; both end byte-exact."""
    fill_pool(pool_root, **mode)
    spec = EngineSpec(extra_config=pool_config(pool_root, **mode), num_blocks=20, max_model_len=288)
    eng = EngineHarness(spec)
    try:
        other = [(11 * i + 5) % 971 for i in range(96)]
        eng.add_request("long", other, max_tokens=150)
        eng.add_request("b", PROMPT_B, max_tokens=120)
        eng.run(timeout_s=60)
        preempted = set().union(*(r.preempted for r in eng.records))
        assert preempted, "the scenario must preempt a request"
        assert exact(eng, "b", PROMPT_B) and exact(eng, "long", other)
        assert eng.stats_total()["load_ops"] >= 7 * (2 if mode else 1)
    finally:
        eng.close()


def test_abort_during_async_load_frees_after_the_load(pool_root):
    fill_pool(pool_root, load_async=True)
    cfg = pool_config(pool_root, load_async=True, backend_config={"hang_ops": ["get"], "hang_s": 0.5})
    b = EngineHarness(EngineSpec(extra_config=cfg))
    try:
        b.add_request("b", PROMPT_B)
        b.step()
        from vllm.v1.request import RequestStatus

        assert b.scheduler.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        b.abort("b")
        assert "b" in b.scheduler.requests, "blocks stay while the load may still write them"
        b.run(timeout_s=30)
        assert any("b" in r.finished_recving for r in b.records)
        assert not b.scheduler.requests
        # The engine is healthy afterwards.
        b.add_request("c", PROMPT_B[:50])
        b.run(timeout_s=30)
        assert exact(b, "c", PROMPT_B[:50])
    finally:
        b.close()


@pytest.mark.parametrize(("mode", "warned"), [({}, True), ({"load_async": True, "use_layerwise": True}, True),
                                              ({"load_async": True}, False)], ids=["sync", "layerwise", "async"])
def test_direct_async_loads_where_it_does_nothing_is_named_at_start_up(pool_root, caplog, mode, warned):
    cfg = pool_config(pool_root, direct_async_loads=True, **mode)
    with caplog.at_level("WARNING", logger="ascendstore_vllm.worker"):
        eng = EngineHarness(EngineSpec(extra_config=cfg))
    try:
        hits = [r.getMessage() for r in caplog.records if "direct_async_loads" in r.getMessage()]
        assert len(hits) == (1 if warned else 0), hits
    finally:
        eng.close()
