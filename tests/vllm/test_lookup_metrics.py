"""Lookup over per-instance IPC when the backend has no scheduler client; stats
and Prometheus metrics through vLLM's hooks."""

from __future__ import annotations

import time

import torch
from ascendstore_vllm.lookup_rpc import LookupClient
from ascendstore_vllm.testing import EngineHarness, EngineSpec
from conftest import pool_config

PROMPT = [(3 * i + 1) % 911 for i in range(100)]


def test_lookup_rpc_to_worker_when_backend_has_no_scheduler_client(pool_root):
    cfg = pool_config(pool_root, backend_config={"scheduler_client": False})
    a = EngineHarness(EngineSpec(extra_config=cfg))
    b = EngineHarness(EngineSpec(extra_config=cfg))
    try:
        assert a.connector.scheduler._rpc is not None and a.connector.scheduler._lookup is None
        # Two instances on one host: distinct IPC paths (engine ids differ).
        assert a.connector.ctx.lookup_ipc_path() != b.connector.ctx.lookup_ipc_path()
        a.add_request("a", PROMPT)
        a.run()
        b.add_request("b", PROMPT[:64] + [9] * 10)
        b.run()
        assert b.first_schedule("b") == (64, 10)
        assert b.connector.scheduler.hit_tier() == "EXTERNAL_UNSPECIFIED"  # no scheduler client
        assert all(torch.equal(x, y) for x, y in zip(b.prompt_kv("b"), b.expected_prompt_kv(PROMPT[:64] + [9] * 10),
                                                     strict=True))
    finally:
        a.close()
        b.close()


def test_lookup_rpc_without_server_is_a_bounded_miss(tmp_path):
    client = LookupClient(f"ipc://{tmp_path}/nobody.ipc", timeout_s=0.2)
    t0 = time.monotonic()
    assert client.prefix_hits("-", ["ab", "cd"], 0) == 0
    assert client.prefix_hits("-", ["ab", "cd"], 1) == 1  # socket rebuilt after the lost reply
    assert time.monotonic() - t0 < 2
    client.close()


def test_stats_and_prometheus(pool_root):
    from ascendstore_vllm.connector import AscendStoreConnector
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    eng = EngineHarness(EngineSpec(extra_config=pool_config(pool_root)))
    try:
        eng.add_request("a", PROMPT)
        eng.run()
        eng.add_request("b", PROMPT[:80] + [1, 2, 3])
        eng.run()
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        assert eng.connector.get_external_cache_hit_sources(eng.scheduler.requests.get("b") or object(), 16) == {
            CacheHitSource.HOST: 16}  # a node-local pool is host memory
        # Scheduler-side counters (lookups) are reported by the scheduler's connector;
        # "b" is wholly in the device prefix cache, so it needs no pool lookup.
        assert eng.connector.scheduler.metrics.totals()["lookups"] == 1
        worker_stats = eng.stats_total()
        assert worker_stats["save_ops"] == 6 and worker_stats["save_bytes"] == 6 * 4096
        logging_ = KVConnectorLogging(eng.vllm_config.kv_transfer_config)
        logging_.observe(worker_stats)
        reduced = logging_.transfer_stats_accumulator.reduce()
        assert reduced["save_ops"] == 6 and reduced["save_MB"] > 0
        prom = AscendStoreConnector.build_prom_metrics(
            eng.vllm_config, {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
            ["model_name", "engine"], {0: ["m", "0"]},
        )
        prom.observe(worker_stats, 0)
        prom.observe({"lookups": 2, "lookup_hit_tokens": 16, "queue_depth_max": 3}, 0)
        val = REGISTRY.get_sample_value("vllm:ascendstore_save_bytes_total", {"model_name": "m", "engine": "0"})
        assert val == 6 * 4096
        assert REGISTRY.get_sample_value("vllm:ascendstore_lookup_hit_tokens_total",
                                         {"model_name": "m", "engine": "0"}) == 16
        assert REGISTRY.get_sample_value("vllm:ascendstore_queue_depth_max",
                                         {"model_name": "m", "engine": "0"}) == 3
    finally:
        eng.close()


def test_kv_events_for_saved_chunks(pool_root):
    from vllm.distributed.kv_events import BlockStored

    # Events are produced only while vLLM publishes them (its kv_events_config).
    eng = EngineHarness(EngineSpec(extra_config=pool_config(pool_root), kv_events=True))
    try:
        # vLLM's scheduler takes connector events every step (for its publisher): record them.
        events: list = []
        take = eng.connector.take_events
        eng.connector.take_events = lambda: (events.extend(e := list(take())) or e)
        eng.add_request("a", PROMPT)
        eng.run()
        assert events and all(isinstance(e, BlockStored) and e.medium == "CPU" for e in events)
        req_hashes = [h for e in events for h in e.block_hashes]
        assert len(req_hashes) == 6 and sum(len(e.token_ids) for e in events) == 6 * 16
        assert list(take()) == []
    finally:
        eng.close()
