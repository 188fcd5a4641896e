"""GR statistics through vLLM's connector-stats hooks and Prometheus."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ascendstore.gr.stats import SEED_COUNTERS, GRStats

_HELP = {
    "lru_evictions": "users evicted from the device by the GR user-level LRU",
    "dram_hits": "GR requests whose history the pool served (swap-in)",
    "dram_misses": "GR requests whose history neither the device nor the pool held",
    "swapin_attempts": "GR swap-ins (pool to device) started",
    "swapin_successes": "GR swap-ins completed",
    "device_hits": "GR requests whose history was already on the device",
    "hit_tokens_device": "GR history tokens served by the device prefix cache",
    "hit_tokens_pool": "GR history tokens served by the pool",
    "saves": "GR user histories written to the pool",
    "invalidations": "GR stored histories cut back after a rewrite",
    "expired": "GR users dropped for TTL",
    "late_saves_reclaimed": "GR objects a timed-out save stored late, removed once its call ended",
    "invalid_inputs": "GR requests with unusable GR fields (served as ordinary requests)",
}
COUNTERS = tuple(GRStats().snapshot())
#: GR counters inside another connector's stats dict carry this prefix
PREFIX = "gr_"


def prefixed(data: dict[str, int]) -> dict[str, int]:
    """GR counters as keys of a shared stats dict (no clash with chunk-pool names)."""
    return {PREFIX + k: v for k, v in data.items()}


def gr_part(data: dict[str, Any]) -> dict[str, int]:
    """The GR counters of a shared stats dict, unprefixed."""
    return {k[len(PREFIX):]: v for k, v in data.items() if k.startswith(PREFIX) and k[len(PREFIX):] in COUNTERS}


def reduce_prefixed(data: dict[str, Any]) -> dict[str, int | float]:
    """``reduce_gr`` of the GR part of a shared stats dict, keys prefixed again."""
    gr = gr_part(data)
    if not any(gr.values()):
        return {}
    return {k if k.startswith(PREFIX) else PREFIX + k: v for k, v in reduce_gr(gr).items()}


def reduce_gr(data: dict[str, Any]) -> dict[str, int | float]:
    """Human view: the seed's five counters first, then what explains them."""
    out: dict[str, int | float] = {k: data.get(k, 0) for k in SEED_COUNTERS}
    out.update({k: v for k, v in data.items() if v and k not in out})
    lookups = out.get("device_hits", 0) + out["dram_hits"] + out["dram_misses"]
    if lookups:
        out["gr_hit_rate"] = round((out.get("device_hits", 0) + out["dram_hits"]) / lookups, 4)
    return out


@dataclass
class GRConnectorStats(KVConnectorStats):
    """``data``: GR counters, summed over the scheduler and the workers."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def is_empty(self) -> bool:
        return not any((self.data or {}).values())

    def reduce(self) -> dict[str, int | float]:
        return reduce_gr(self.data)


class GRPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name in COUNTERS:
            metric = self._counter_cls(
                name=f"vllm:ascendstore_gr_{name}",
                documentation=_HELP.get(name, "GR " + name.replace("_", " ")),
                labelnames=labelnames,
            )
            self._counters[name] = {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._observe(transfer_stats_data, engine_idx)

    def observe_prefixed(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """The GR counters inside another connector's stats dict (``gr_`` keys only)."""
        self._observe(gr_part(transfer_stats_data), engine_idx)

    def _observe(self, data: dict[str, Any], engine_idx: int) -> None:
        for name, value in data.items():
            counter = self._counters.get(name)
            if counter is not None and value:
                counter[engine_idx].inc(value)


def gr_prom_metrics_if_enabled(vllm_config: Any, metric_types: Any, labelnames: list[str],
                               per_engine_labelvalues: dict[int, list[object]]) -> GRPromMetrics | None:
    """GR's Prometheus counters for a connector whose config has ``gr.enabled`` (else None)."""
    from ascendstore.config import load_config

    ktc = getattr(vllm_config, "kv_transfer_config", None)
    try:
        enabled = load_config(dict(getattr(ktc, "kv_connector_extra_config", None) or {})).gr.enabled
    except Exception:  # the connector itself reports config errors
        enabled = False
    return GRPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues) if enabled else None
