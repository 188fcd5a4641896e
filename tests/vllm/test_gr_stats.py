"""GR counters through vLLM's connector-stats and Prometheus hooks."""

from __future__ import annotations

from ascendstore_vllm.gr.stats import gr_part, prefixed
from ascendstore_vllm.testing.harness import EngineSpec


def test_stats_reduce_and_prometheus():
    from ascendstore_vllm.gr.connector import AscendStoreGRConnector
    from ascendstore_vllm.testing.harness import build_vllm_config
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    stats = AscendStoreGRConnector.build_kv_connector_stats({"dram_hits": 2, "dram_misses": 1})
    stats.aggregate(AscendStoreGRConnector.build_kv_connector_stats({"dram_hits": 1, "device_hits": 1}))
    red = stats.reduce()
    assert list(red)[:5] == ["lru_evictions", "dram_hits", "dram_misses", "swapin_attempts", "swapin_successes"]
    assert red["dram_hits"] == 3 and red["gr_hit_rate"] == 0.8
    reg = CollectorRegistry()

    def bind(cls):
        class Bound(cls):
            def __init__(self, *a, **kw):
                super().__init__(*a, registry=reg, **kw)
        return Bound

    cfg = build_vllm_config(EngineSpec(kv_connector="AscendStoreGRConnector", kv_transfer_kwargs={"kv_connector_module_path": "ascendstore_vllm.gr.connector"}))
    prom = AscendStoreGRConnector.build_prom_metrics(
        cfg, {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}, ["engine"], {0: ["0"]})
    prom.observe(stats.data, 0)
    assert reg.get_sample_value("vllm:ascendstore_gr_dram_hits_total", {"engine": "0"}) == 3
    assert reg.get_sample_value("vllm:ascendstore_gr_lru_evictions_total", {"engine": "0"}) == 0


def test_prefixed_counters_inside_a_shared_stats_dict():
    shared = {"save_failures": 4, **prefixed({"save_failures": 1, "dram_hits": 2})}
    assert gr_part(shared) == {"save_failures": 1, "dram_hits": 2}


def test_main_connector_reports_gr_counters_when_enabled():
    from ascendstore_vllm.connector import AscendStoreConnector
    from ascendstore_vllm.gr.stats import prefixed
    from ascendstore_vllm.stats import AscendStoreStats
    from ascendstore_vllm.testing.harness import build_vllm_config
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    reg = CollectorRegistry()

    def bind(cls):
        class Bound(cls):
            def __init__(self, *a, **kw):
                super().__init__(*a, registry=reg, **kw)
        return Bound

    types = {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}
    data = {"save_failures": 4, **prefixed({"save_failures": 1, "dram_hits": 2, "dram_misses": 2})}
    on = build_vllm_config(EngineSpec(extra_config={"gr": {"enabled": True}}))
    prom = AscendStoreConnector.build_prom_metrics(on, types, ["engine"], {0: ["0"]})
    prom.observe(data, 0)
    assert reg.get_sample_value("vllm:ascendstore_gr_dram_hits_total", {"engine": "0"}) == 2
    assert reg.get_sample_value("vllm:ascendstore_gr_save_failures_total", {"engine": "0"}) == 1
    assert reg.get_sample_value("vllm:ascendstore_save_failures_total", {"engine": "0"}) == 4
    reduced = AscendStoreStats(data=data).reduce()
    assert reduced["gr_dram_hits"] == 2 and reduced["gr_hit_rate"] == 0.5
    reg2 = CollectorRegistry()
    reg = reg2
    off = build_vllm_config(EngineSpec())
    AscendStoreConnector.build_prom_metrics(off, types, ["engine"], {0: ["0"]})
    assert not [m for m in reg2.collect() if "gr_" in m.name]
