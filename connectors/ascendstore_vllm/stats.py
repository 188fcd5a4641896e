"""Connector stats and Prometheus metrics through vLLM's hooks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ascendstore.engine import EngineMetrics
from ascendstore.engine.metrics import COUNTERS, GAUGES
from ascendstore_vllm.gr.stats import gr_prom_metrics_if_enabled, reduce_prefixed


@dataclass
class AscendStoreStats(KVConnectorStats):
    """``data`` holds engine counters (summed across workers and the scheduler)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = EngineMetrics.merge(self.data, dict(other.data or {}))
        return self

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {}
        for k in ("lookups", "lookup_hit_tokens", "load_ops", "save_ops", "load_failures", "save_failures",
                  "timeouts", "queue_depth_max"):
            if d.get(k):
                out[k] = d[k]
        for kind in ("load", "save"):
            nbytes, secs = d.get(f"{kind}_bytes", 0), d.get(f"{kind}_time_s", 0)
            if nbytes:
                out[f"{kind}_MB"] = round(nbytes / 1e6, 3)
                if secs:
                    out[f"{kind}_GBps"] = round(nbytes / secs / 1e9, 3)
        out.update(reduce_prefixed(d))  # GR counters (gr_*), when GR mode is on
        return out


_HELP = {
    "lookups": "pool lookups (one batched existence query each)",
    "lookup_hit_tokens": "tokens found in the pool beyond the device prefix cache",
    "lookup_miss_tokens": "tokens looked up but not found",
    "load_bytes": "bytes loaded from the pool",
    "load_time_s": "seconds spent in pool gets",
    "save_bytes": "bytes saved to the pool",
    "save_time_s": "seconds spent in pool puts",
    "load_failures": "chunk objects that failed to load (recomputed)",
    "load_corrupt": "chunk objects that failed their checksum (removed, recomputed)",
    "save_failures": "chunk objects that failed to save",
    "timeouts": "backend calls that overran timeout_ms",
}


class AscendStorePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name in COUNTERS:
            metric = self._counter_cls(
                name=f"vllm:ascendstore_{name}",
                documentation=_HELP.get(name, name.replace("_", " ")),
                labelnames=labelnames,
            )
            self._counters[name] = {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}
        self._gauges: dict[str, dict[int, Any]] = {}
        for name in GAUGES:
            metric = self._gauge_cls(
                name=f"vllm:ascendstore_{name}",
                documentation=name.replace("_", " ") + " in the last interval",
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
            self._gauges[name] = {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}
        self._gr = gr_prom_metrics_if_enabled(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self._counters and value:
                self._counters[name][engine_idx].inc(value)
            elif name in self._gauges:
                self._gauges[name][engine_idx].set(value)
        if self._gr is not None:
            self._gr.observe_prefixed(transfer_stats_data, engine_idx)
