"""The benchmark report: one JSON document per run (schema: ``BenchReport``).

The driver collects per-request outcomes and raw counters; :func:`build_report`
derives every ratio and percentile from them, so the numbers in the table,
the JSON and the plots come from one place.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ascendstore.bench.cost import PrefillCostModel
from ascendstore.gr.stats import SEED_COUNTERS

SCHEMA_VERSION = 1


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HitTokens(_Model):
    """Prompt tokens not computed, by where their KV came from."""

    device: int = Field(0, description="vLLM's on-device prefix cache (HBM)")
    pool: int = Field(0, description="loaded from the AscendStore pool")


class Percentiles(_Model):
    count: int = 0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0


class RequestRecord(_Model):
    """What happened to one request."""

    req_id: str
    arrival_s: float
    #: modeled time (s) when its prefill was first scheduled.
    scheduled_s: float = 0.0
    prompt_tokens: int
    device_hit: int = 0
    pool_hit: int = 0
    #: what an infinite cache would have served for this request.
    bound_hit: int = 0
    #: pool tokens the connector promised but failed to load (vLLM recomputed them).
    load_errors: int = 0
    modeled_ttft_s: float = 0.0


class ModeledTime(_Model):
    cost_model: PrefillCostModel
    #: summed per-request modeled TTFT with no cache at all.
    ttft_no_cache_s: float
    ttft_s: float
    ttft_speedup: float


class BenchReport(_Model):
    schema_version: int = SCHEMA_VERSION
    workload: str
    backend: str
    granularity: str = "block"
    pool_capacity_bytes: int | None = None
    pool_capacity_fraction: float | None = None
    workload_params: dict[str, Any] = Field(default_factory=dict)
    config: dict[str, Any] = Field(default_factory=dict, description="kv_connector_extra_config used")
    block_size: int
    chunk_size: int
    requests: int
    prompt_tokens: int
    hit_tokens: HitTokens
    prefill_tokens_saved: int
    prefill_tokens_saved_ratio: float
    infinite_cache_bound_tokens: int
    infinite_cache_bound_ratio: float
    #: saved / bound: how much of the achievable saving was achieved.
    bound_efficiency: float
    #: bytes of the distinct chunks that more than one request uses (the base of --pool-capacity).
    working_set_bytes: int = 0
    load_errors: int = 0
    lookup_latency_us: Percentiles
    bytes_loaded: int
    bytes_saved: int
    load_gbps: float = Field(0.0, description="bytes_loaded / wall time spent loading")
    save_gbps: float = Field(0.0, description="bytes_saved / wall time spent saving")
    kv_bytes_verified: int = Field(
        0, description="loaded KV bytes compared byte-for-byte with what was written"
    )
    kv_mismatches: int = 0
    connector_s: float = Field(0.0, description="wall time inside connector hooks (scheduler + worker)")
    modeled: ModeledTime
    #: connector wall time per modeled second of no-cache prefill.
    connector_overhead_ratio: float
    wall_s: float
    #: the connector's own counters (vLLM connector stats), summed over the run.
    connector_stats: dict[str, float] = Field(default_factory=dict)
    #: GR counters of a user-granular run: the design's five (lru_evictions, dram_hits,
    #: dram_misses, swapin_attempts, swapin_successes) always, then the three-level hits.
    gr: dict[str, int] | None = None
    #: the backend's own counters at the end of the run (e.g. local: hits, disk_hits, evictions).
    backend_stats: dict[str, float] = Field(default_factory=dict)
    #: caveats about this run (printed under the table).
    notes: list[str] = Field(default_factory=list)
    per_request: list[RequestRecord] = Field(default_factory=list)
    lookup_latency_samples_us: list[float] = Field(default_factory=list)

    def to_json(self, path: str | Path | None = None) -> str:
        text = self.model_dump_json(indent=2)
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, path: str | Path) -> BenchReport:
        return cls.model_validate_json(Path(path).read_text())


def percentiles(samples: Sequence[float]) -> Percentiles:
    if not len(samples):
        return Percentiles()
    a = np.asarray(samples, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return Percentiles(count=len(a), p50=float(p50), p90=float(p90), p99=float(p99), max=float(a.max()))


def _ratio(a: float, b: float) -> float:
    return float(a) / float(b) if b else 0.0


def build_report(
    *,
    workload: str,
    backend: str,
    records: Sequence[RequestRecord],
    block_size: int,
    chunk_size: int,
    lookup_latency_us: Sequence[float],
    bytes_loaded: int,
    bytes_saved: int,
    load_wall_s: float,
    save_wall_s: float,
    kv_bytes_verified: int,
    kv_mismatches: int,
    connector_s: float,
    wall_s: float,
    cost_model: PrefillCostModel,
    granularity: str = "block",
    pool_capacity_bytes: int | None = None,
    pool_capacity_fraction: float | None = None,
    working_set_bytes: int = 0,
    workload_params: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    connector_stats: dict[str, float] | None = None,
    backend_stats: dict[str, float] | None = None,
    notes: list[str] | None = None,
    max_samples: int = 20000,
    load_rate_bytes: int | None = None,
    save_rate_bytes: int | None = None,
) -> BenchReport:
    """``load_rate_bytes``/``save_rate_bytes``: the bytes that ``load_wall_s``/``save_wall_s``
    timed, when only part of the traffic was timed (default: all of it)."""
    prompt = sum(r.prompt_tokens for r in records)
    device = sum(r.device_hit for r in records)
    pool = sum(r.pool_hit for r in records)
    bound = sum(r.bound_hit for r in records)
    saved = device + pool
    no_cache = sum(cost_model.request_ttft_s(r.prompt_tokens) for r in records)
    with_cache = sum(r.modeled_ttft_s for r in records)
    step = max(1, len(lookup_latency_us) // max_samples)
    return BenchReport(
        workload=workload,
        backend=backend,
        granularity=granularity,
        pool_capacity_bytes=pool_capacity_bytes,
        pool_capacity_fraction=pool_capacity_fraction,
        workload_params=workload_params or {},
        config=config or {},
        block_size=block_size,
        chunk_size=chunk_size,
        requests=len(records),
        prompt_tokens=prompt,
        hit_tokens=HitTokens(device=device, pool=pool),
        prefill_tokens_saved=saved,
        prefill_tokens_saved_ratio=_ratio(saved, prompt),
        infinite_cache_bound_tokens=bound,
        infinite_cache_bound_ratio=_ratio(bound, prompt),
        bound_efficiency=_ratio(saved, bound),
        working_set_bytes=working_set_bytes,
        load_errors=sum(r.load_errors for r in records),
        lookup_latency_us=percentiles(lookup_latency_us),
        bytes_loaded=bytes_loaded,
        bytes_saved=bytes_saved,
        load_gbps=_ratio(bytes_loaded if load_rate_bytes is None else load_rate_bytes, load_wall_s) / 1e9,
        save_gbps=_ratio(bytes_saved if save_rate_bytes is None else save_rate_bytes, save_wall_s) / 1e9,
        kv_bytes_verified=kv_bytes_verified,
        kv_mismatches=kv_mismatches,
        connector_s=connector_s,
        modeled=ModeledTime(
            cost_model=cost_model,
            ttft_no_cache_s=no_cache,
            ttft_s=with_cache,
            ttft_speedup=_ratio(no_cache, with_cache),
        ),
        connector_overhead_ratio=_ratio(connector_s, no_cache),
        wall_s=wall_s,
        connector_stats=dict(connector_stats or {}),
        gr=gr_counters(connector_stats or {}) if granularity == "user" else None,
        backend_stats=dict(backend_stats or {}),
        notes=list(notes or []),
        per_request=list(records),
        lookup_latency_samples_us=[float(x) for x in list(lookup_latency_us)[::step]],
    )


#: GR counters every user-granular report carries (zeros included), in this order.
GR_REPORTED = (*SEED_COUNTERS, "device_hits", "hit_tokens_device", "hit_tokens_pool", "saves", "invalid_inputs")


def gr_counters(connector_stats: dict[str, float]) -> dict[str, int]:
    """The GR counters of a run's connector stats (``gr_``-prefixed inside
    AscendStoreConnector's, bare from AscendStoreGRConnector)."""
    return {k: int(connector_stats.get("gr_" + k, connector_stats.get(k, 0))) for k in GR_REPORTED}


def report_schema() -> dict[str, Any]:
    """JSON schema of the report (published in docs/benchmarking.md)."""
    return BenchReport.model_json_schema()


def dumps_schema() -> str:
    return json.dumps(report_schema(), indent=2)
