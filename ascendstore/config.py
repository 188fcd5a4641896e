"""Typed configuration, built from vLLM's ``kv_connector_extra_config``.

Keys vllm-ascend users already set keep their meaning and defaults (except
``backend``, whose default is our embedded ``local`` pool). An optional config
file (JSON, YAML or TOML; ``config_file`` key or ``ASCENDSTORE_CONFIG_FILE``)
supplies values the extra config does not set.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import tomllib
from pydantic import AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from ascendstore.errors import ConfigError, format_validation_error

CONFIG_FILE_ENV = "ASCENDSTORE_CONFIG_FILE"

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}


def parse_bytes(value: Any) -> int:
    """``4GiB``, ``512MB``, ``1.5g`` or a plain integer -> bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 4GiB or a number of bytes")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("size must be >= 0")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read {value!r} as a size; use bytes or a unit among "
            "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


ByteSize = Annotated[int, BeforeValidator(parse_bytes)]


def _lenient_bool(v: Any) -> Any:
    # vllm-ascend docs show "True"/"false" strings inside JSON; accept them.
    if isinstance(v, str) and v.strip().lower() in {"true", "false", "1", "0", "yes", "no"}:
        return v.strip().lower() in {"true", "1", "yes"}
    return v


Bool = Annotated[bool, BeforeValidator(_lenient_bool)]


class GRConfig(BaseModel):
    """Generative-recommendation mode (user-granular pool)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: Bool = Field(False, description="requests carrying a uid use the user-granular pool (docs/gr-mode.md)")
    #: device-side user-level LRU (extension of vLLM's KV cache manager); on by default
    #: as in the GR design (VLLM_ENABLE_USER_KV_LRU, VLLM_USER_KV_LRU_MAX_USERS=100).
    user_lru: Bool = Field(True, description="evict whole least-recently-used idle users from the device")
    max_resident_users: int = Field(
        100, ge=0, description="users whose history may stay on the device (user LRU); 0: unlimited"
    )
    min_free_blocks: int = Field(
        16, ge=0, description="device blocks the user LRU keeps free beyond each allocation"
    )
    #: pool lifecycle per user
    ttl_s: float = Field(0.0, ge=0, description="a user unused this long leaves the pool; 0: no expiry")
    user_quota_bytes: ByteSize = Field(0, description="pool bytes per user (all ranks); 0: no quota")
    tenant_quota_bytes: ByteSize = Field(0, description="pool bytes per tenant; LRU users leave first; 0: no quota")


class AscendStoreConfig(BaseModel):
    """Everything under ``kv_connector_extra_config``."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    # -- where KV goes --------------------------------------------------------
    backend: str = Field("local", description="storage plugin name (entry point in ascendstore.backends)")
    backend_config: dict[str, Any] = Field(
        default_factory=dict, description="options of the chosen backend (validated by it)"
    )
    config_file: str | None = Field(None, description="JSON/YAML/TOML file merged under these keys")

    # -- vllm-ascend compatible keys ------------------------------------------
    lookup_rpc_port: int = Field(
        0,
        ge=0,
        validation_alias=AliasChoices("lookup_rpc_port", "mooncake_rpc_port"),
        description="distinguishes lookup IPC paths of instances on one host",
    )
    load_async: Bool = Field(False, description="load on a transfer thread; the request waits in the scheduler until its KV arrives")
    direct_async_loads: Bool = Field(
        False,
        description="load_async over a backend that may write after a deadline (mooncake, memcache): get into vLLM's blocks instead of a landing buffer and a copy; a get that overruns then holds its request until the client lets go (30-60 s for Mooncake) before it recomputes",
    )
    use_layerwise: Bool = Field(False, description="store and load per layer, overlapping transfers with the forward pass")
    consumer_is_to_put: Bool = Field(False, description="PD split: decode (kv_consumer) nodes also write the pool")
    consumer_is_to_load: Bool = Field(False, description="PD split: decode (kv_consumer) nodes also read the pool")
    save_decode_cache: Bool = Field(False, description="also save chunks completed during decode (generated tokens)")
    discard_partial_chunks: Bool = Field(True, description="only whole chunks are saved and counted as hits")
    prefill_pp_size: int = Field(1, ge=1, description="PD split: pipeline size of the prefill instances")
    prefill_pp_layer_partition: str | None = Field(None, description="PD split: layers per prefill PP stage, e.g. \"18,18\"")
    prefill_tp_size: int | None = Field(None, ge=1, description="PD split: TP size of the prefill instances (checked against the instance)")
    decode_tp_size: int | None = Field(None, ge=1, description="PD split: TP size of the decode instances (checked against the instance)")
    h2d_stagger_us: int = Field(0, ge=0, description="extra per-rank delay before a load starts (rank x this), on top of staggered order")
    layerwise_prefetch_layers: int = Field(1, ge=0, description="layerwise: layers the loader may run ahead of the forward pass; 0: no limit")
    layerwise_max_transfer_blocks: int = Field(0, ge=0, description="layerwise: blocks per transfer batch; 0: unlimited")
    layerwise_max_transfer_bytes: ByteSize = Field(0, description="layerwise: bytes per transfer batch; 0: unlimited")
    layerwise_num_shared_buffers: int = Field(2, ge=1, description="accepted for vllm-ascend compatibility; ignored (one staging buffer per direction, bounded by staging_buffer_bytes); a warning names it when set")
    layerwise_independent_layers: Bool = Field(False, description="accepted for vllm-ascend compatibility; layers are always independent objects here")
    qos_priority: int = Field(0, ge=0, le=4, description="accepted for vllm-ascend compatibility (0-4); no backend here uses it yet")
    memcache_dp_init_barrier: Bool = Field(False, description="accepted for vllm-ascend compatibility; no effect here (memcache clients start independently)")

    # -- AscendStore keys -------------------------------------------------------
    chunk_size: int | None = Field(
        None, ge=1, description="tokens per pool object; a multiple of vLLM's block_size (default: block_size)"
    )
    timeout_ms: int = Field(5000, ge=1, description="bound on every backend call")
    lookup_timeout_ms: int = Field(1000, ge=1, description="bound on a scheduler-side lookup")
    pin_lease_ms: int = Field(
        10_000, ge=0, le=3_600_000,
        description="backends declaring pins: what a lookup counted is pinned until its load ends, at most this long (renewed while the request waits); 0: no pins",
    )
    lookup_mode: Literal["auto", "scheduler", "rpc"] = Field(
        "auto", description="scheduler: query the backend from the scheduler; rpc: ask worker rank 0"
    )
    max_inflight_bytes: ByteSize = Field(0, description="per rank; 0: unlimited")
    transfer_queue_size: int = Field(64, ge=1, description="save tasks queued per rank (layerwise: one per layer); a step's saves that do not fit are skipped whole")
    inline_save_bytes: ByteSize = Field(
        64 << 20,
        description="host KV and an in-process pool (local): a step's saves up to this size run on the forward thread instead of the save thread; 0: always on the save thread",
    )
    save_queue_bytes: ByteSize = Field(1 << 30, description="bytes of saves queued per rank; a step's saves that do not fit are skipped whole; 0: unlimited")
    staging_buffer_bytes: ByteSize = Field(
        256 << 20,
        description="pinned host buffer per direction for KV on a device the backend cannot read (cuda/npu)",
    )
    min_lookup_tokens: int = Field(0, ge=0, description="skip pool lookups for shorter prompts")
    tenant: str | None = Field(None, description="default tenant when a request has no cache_salt")
    instance_id: str | None = Field(None, description="names this vLLM instance in IPC paths")
    kv_events: Bool = Field(True, description="publish BlockStored/BlockRemoved KV events for routers")

    # -- admission: what is worth saving ---------------------------------------------
    admit_after_hits: int = Field(
        1, ge=1, description="save a chunk only once requests have used it this many times; 1: save every chunk"
    )
    admit_track_chunks: int = Field(
        65536, ge=1, description="chunk hashes whose uses are remembered for admit_after_hits (LRU; ~150 B each)"
    )
    save_budget_bytes_per_step: ByteSize = Field(
        0, description="KV bytes per rank a scheduler step may plan to save; the rest is skipped; 0: unlimited"
    )

    # -- health: stop using a sick backend, resume by itself --------------------------------
    health_failure_threshold: int = Field(
        5, ge=0, description="failed backend calls in a row that switch a process to degraded mode; 0: never"
    )
    health_probe_interval_ms: int = Field(1000, ge=1, description="degraded mode: time between background probes")
    health_recovery_probes: int = Field(
        2, ge=1, description="good probes in a row that end degraded mode (doubled for a flapping backend)"
    )

    # -- metrics -------------------------------------------------------------------------------
    metrics_max_tenants: int = Field(
        16, ge=0, description="tenants with their own label in hit metrics; later ones count as 'other'"
    )
    gr: GRConfig = Field(default_factory=GRConfig, description="GR mode; see the gr.* keys")


def _read_file(path: str) -> dict[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"config_file {path!r} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
        if p.suffix in {".toml"}:
            data = tomllib.loads(text)
        elif p.suffix in {".yaml", ".yml"}:
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:
        raise ConfigError(f"config_file {path!r} cannot be parsed: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config_file {path!r} must hold a mapping of keys, not {type(data).__name__}")
    return data


def load_config(extra: Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None) -> AscendStoreConfig:
    """Validate ``kv_connector_extra_config`` (merged over an optional file)."""
    env = os.environ if env is None else env
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigError(f"kv_connector_extra_config must be a mapping, not {type(extra).__name__}")
    merged: dict[str, Any] = {}
    file = (extra or {}).get("config_file") or env.get(CONFIG_FILE_ENV)
    if file:
        if not isinstance(file, str):
            raise ConfigError(f"bad value {file!r} for config key 'config_file': expected a path")
        merged.update(_read_file(file))
    merged.update(extra or {})
    if file:
        merged["config_file"] = file
    try:
        return AscendStoreConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, AscendStoreConfig)) from None


def config_reference() -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) rows for docs/configuration.md."""
    rows = []
    for model, prefix in ((AscendStoreConfig, ""), (GRConfig, "gr.")):
        for name, info in model.model_fields.items():
            if name == "gr" and model is AscendStoreConfig:
                continue
            default = info.get_default(call_default_factory=True)
            from ascendstore.docgen import type_name

            rows.append((prefix + name, type_name(info.annotation), json.dumps(default), info.description or ""))
    return rows
