"""The metrics an operator reads first, from a real engine run to vLLM's own
Prometheus logger, and the Grafana dashboard in docs/ against what is exported."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest
import torch
from ascendstore_vllm.testing import EngineHarness, EngineSpec

from ascendstore.chaos import live_backends
from ascendstore.keys import tenant_id

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "ascendstore.json"
PROMPT = [(5 * i + 2) % 911 for i in range(100)]  # 6 full blocks of 16 + a tail
METRIC = re.compile(r"vllm:[A-Za-z0-9_:]+")


def extra(**over) -> dict:
    local = {"name": "om-" + uuid.uuid4().hex[:10], "capacity": "16MiB", "page_size": "4KiB"}
    return {"backend": "faulty", "backend_config": {"backend": "local", "backend_config": local}, **over}


def exposed(vllm_config, stats: dict) -> tuple[set[str], object]:
    """Feed stats through vLLM's PrometheusStatLogger; sample names on /metrics."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    logger = PrometheusStatLogger(vllm_config)
    logger.record(scheduler_stats=SchedulerStats(kv_connector_stats=stats), iteration_stats=None)
    names = {s.name for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode())
             for s in fam.samples}
    return names, REGISTRY


@pytest.fixture
def engine():
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    eng = EngineHarness(EngineSpec(extra_config=extra(metrics_max_tenants=2)))
    yield eng
    eng.close()
    unregister_vllm_metrics()  # leave the global registry as other tests expect it


def test_hits_by_tier_and_tenant_misses_degraded_and_bytes_on_prometheus(engine):
    eng = engine
    eng.add_request("a", PROMPT)
    eng.run()
    assert eng.scheduler.reset_prefix_cache()
    eng.add_request("pool", PROMPT)          # served from the pool
    eng.run()
    eng.add_request("device", PROMPT)        # served by vLLM's own prefix cache
    eng.run()
    for salt in ("alice", "bob", "carol"):   # other tenants: misses, and a capped label set
        eng.add_request(salt, PROMPT, cache_salt=salt)
        eng.run()
    # A chunk present at lookup and gone at load (eviction stand-in: gets answer NOT_FOUND).
    assert eng.scheduler.reset_prefix_cache()
    for b in live_backends():
        b.set_faults(fail_rate={"get": 1.0}, fail_status="NOT_FOUND")
    eng.add_request("evicted", PROMPT)
    eng.run()
    for b in live_backends():
        b.clear_faults()
    got = eng.prompt_kv("evicted")
    assert all(torch.equal(x, y) for x, y in zip(got, eng.expected_prompt_kv(PROMPT), strict=True))
    s = eng.stats_total()
    alice = tenant_id("alice")
    assert s["hit_tokens/pool_host"] == 2 * 96  # "pool" and "evicted" (planned; the latter then failed)
    assert s["hit_tokens/device"] >= 96
    assert s["prompt_tokens"] == 7 * len(PROMPT)
    assert s["lookup_load_misses"] == 6 and s["load_failures"] == 6
    assert {k for k in s if k.startswith("tenant_prompt_tokens/")} == {
        "tenant_prompt_tokens/default", f"tenant_prompt_tokens/{alice}", "tenant_prompt_tokens/other"}
    assert s["tenant_prompt_tokens/other"] == 2 * len(PROMPT)  # bob and carol share the capped label
    assert s["tenant_hit_tokens/default"] == 2 * 96 and f"tenant_hit_tokens/{alice}" not in s
    assert s["degraded"] == 0 and s["save_bytes"] > 0 and s["load_bytes"] > 0

    names, reg = exposed(eng.vllm_config, s)
    labels = {"model_name": eng.vllm_config.model_config.served_model_name, "engine": "0"}
    val = reg.get_sample_value
    assert val("vllm:ascendstore_hit_tokens_total", labels | {"tier": "pool_host"}) == 2 * 96
    assert val("vllm:ascendstore_tenant_hit_tokens_total", labels | {"tenant": "default"}) == 2 * 96
    assert val("vllm:ascendstore_tenant_prompt_tokens_total", labels | {"tenant": "other"}) == 2 * len(PROMPT)
    assert val("vllm:ascendstore_lookup_load_misses_total", labels) == 6
    assert val("vllm:ascendstore_degraded", labels) == 0
    assert val("vllm:ascendstore_backend_written_bytes_total", labels | {"backend": "faulty"}) == s["save_bytes"]
    assert val("vllm:ascendstore_backend_read_bytes_total", labels | {"backend": "faulty"}) == s["load_bytes"]
    # Every metric the dashboard queries is on the endpoint.
    dash = json.loads(DASHBOARD.read_text())
    queried = {n for p in dash["panels"] for t in p["targets"] for n in METRIC.findall(t["expr"])}
    queried |= set(METRIC.findall(json.dumps(dash["templating"])))
    assert len(queried) >= 20
    missing = sorted(queried - names)
    assert not missing, f"the dashboard queries metrics that are not exported: {missing}"


def test_degraded_gauge_reaches_prometheus_and_returns_to_zero(engine):
    eng = engine
    mon = eng.workers[0].connector.worker.guard.monitor
    mon.degrade("test")  # as after health_failure_threshold failures (tested in tests/chaos)
    s1 = eng.workers[0].connector.get_kv_connector_stats().data
    _, reg = exposed(eng.vllm_config, s1)
    labels = {"model_name": eng.vllm_config.model_config.served_model_name, "engine": "0"}
    assert reg.get_sample_value("vllm:ascendstore_degraded", labels) == 1
    assert mon.probe_now() and mon.probe_now()  # the backend is fine: two good probes resume
    assert not mon.degraded
    s2 = eng.workers[0].connector.get_kv_connector_stats().data
    assert s2["degraded"] == 0 and s2["health_recovered"] == 1
