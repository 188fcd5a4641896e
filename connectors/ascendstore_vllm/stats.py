"""Connector stats and Prometheus metrics through vLLM's hooks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ascendstore.engine import EngineMetrics
from ascendstore.engine.metrics import COUNTERS, GAUGES, LABELLED, STATES, split_labelled
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
        # A state gauge back at 0 is news (the degraded gauge must return to 0).
        return not any(self.data.values()) and not any(k in self.data for k in STATES)

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {}
        for k in ("lookups", "lookup_hit_tokens", "load_ops", "save_ops", "load_failures", "save_failures",
                  "timeouts", "queue_depth_max", "degraded", "lookup_load_misses", "save_skipped_admission",
                  "save_skipped_budget", "save_skipped_degraded"):
            if d.get(k):
                out[k] = d[k]
        if d.get("lookup_load_misses"):
            # The lookup-to-load miss rate: of the objects loads looked for, the share gone
            # since the lookup counted them (0 with pins, but for expired leases).
            out["lookup_load_miss_rate"] = round(d["lookup_load_misses"] / (d.get("load_ops", 0) + d["lookup_load_misses"]), 4)
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
    "loads_abandoned": "load-thread gets the engine's watchdog gave up on at their deadline (recomputed)",
    "load_held_late": "async loads into vLLM's blocks (direct_async_loads) held unreported until a late get ended",
    "prompt_tokens": "prompt tokens of requests the scheduler admitted (denominator of hit ratios)",
    "hit_tokens": "prompt tokens served from a cache tier: device (vLLM prefix cache) or pool_<tier>",
    "tenant_hit_tokens": "prompt tokens served from the pool, by tenant (hashed cache_salt; capped, rest 'other')",
    "tenant_prompt_tokens": "prompt tokens of admitted requests, by tenant (hashed cache_salt; capped, rest 'other')",
    "lookup_load_misses": "chunk objects a lookup counted present and the load then did not find (recomputed)",
    "degraded": "1 while a process of this engine has stopped using a sick backend (degraded mode)",
    "health_degraded": "transitions to degraded mode (repeated backend failures or timeouts)",
    "health_recovered": "transitions back to normal after good background probes",
    "health_probes": "background health probes while degraded",
    "degraded_skipped_keys": "keys of backend calls answered UNAVAILABLE without a call (degraded mode)",
    "lookups_skipped_degraded": "lookups answered 0 in degraded mode",
    "save_skipped_degraded": "chunk objects not saved in degraded mode",
    "save_skipped_admission": "chunks not saved: seen fewer than admit_after_hits times",
    "save_skipped_budget": "chunks not saved: over save_budget_bytes_per_step",
    "backend_read_bytes": "bytes read from the backend (chunk pool and GR user store)",
    "backend_written_bytes": "bytes written to the backend (chunk pool and GR user store)",
}
#: per-backend traffic: exported name -> stats keys summed into it
BACKEND_BYTES = {
    "backend_read_bytes": ("load_bytes", "gr_bytes_loaded"),
    "backend_written_bytes": ("save_bytes", "gr_bytes_saved"),
}


def _backend_name(vllm_config: Any) -> str:
    """The storage backend this engine's connector uses (label of the traffic metrics)."""
    from ascendstore.config import load_config

    try:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        return load_config(extra).backend
    except Exception:
        return "unknown"


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
        for name in STATES:
            metric = self._gauge_cls(
                name=f"vllm:ascendstore_{name}", documentation=_HELP.get(name, name),
                labelnames=labelnames, multiprocess_mode="max",
            )
            self._gauges[name] = {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}
        # Labelled counters: one child per (engine, label value); values are bounded at the source.
        self._labelled: dict[str, Any] = {
            name: self._counter_cls(name=f"vllm:ascendstore_{name}", documentation=_HELP.get(name, name),
                                    labelnames=[*labelnames, label])
            for name, label in LABELLED.items()
        }
        self._engine_labels = {i: list(v) for i, v in per_engine_labelvalues.items()}
        backend = _backend_name(vllm_config)
        self._backend_bytes: dict[str, dict[int, Any]] = {}
        for name in BACKEND_BYTES:
            metric = self._counter_cls(name=f"vllm:ascendstore_{name}", documentation=_HELP[name],
                                       labelnames=[*labelnames, "backend"])
            self._backend_bytes[name] = {i: metric.labels(*v, backend) for i, v in per_engine_labelvalues.items()}
        self._gr = gr_prom_metrics_if_enabled(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self._counters and value:
                self._counters[name][engine_idx].inc(value)
            elif name in self._gauges:
                self._gauges[name][engine_idx].set(value)
            elif value and (lab := split_labelled(name)) is not None:
                self._labelled[lab[0]].labels(*self._engine_labels[engine_idx], lab[1]).inc(value)
        for name, keys in BACKEND_BYTES.items():
            n = sum(transfer_stats_data.get(k, 0) for k in keys)
            if n:
                self._backend_bytes[name][engine_idx].inc(n)
        if self._gr is not None:
            self._gr.observe_prefixed(transfer_stats_data, engine_idx)
