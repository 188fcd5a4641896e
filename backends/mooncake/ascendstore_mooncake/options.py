"""Options of the Mooncake backend and where they come from.

vllm-ascend users already configure Mooncake through a ``mooncake.json`` file
(``MOONCAKE_CONFIG_PATH``) and ``MOONCAKE_*`` environment variables; both keep
working. Merge order, later wins::

    defaults < mooncake.json (config_path or MOONCAKE_CONFIG_PATH) < MOONCAKE_* env < backend_config

Sizes follow Mooncake's own convention (``4GB`` means 4 GiB, as in the
mooncake.json files users already have); ``GiB``-style units are accepted too.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from ascendstore.config import Bool
from ascendstore.contract import BackendOptions
from ascendstore.errors import ConfigError, format_validation_error
from ascendstore_mooncake.errors import MooncakeConfigError

_BINARY = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_mooncake_size(value: Any) -> int:
    """``30GB``, ``512mb``, ``1.5GiB`` or an integer -> bytes (K/M/G/T are binary, as in Mooncake)."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 4GB or a number of bytes")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("size must be >= 0")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtKMGT]?)(?:i?[bB])?\s*", str(value))
    if not m:
        raise ValueError(
            f"cannot read {value!r} as a size; use bytes or a unit among B, KB, MB, GB, TB "
            "(binary, as in Mooncake) or KiB, MiB, GiB, TiB"
        )
    return int(float(m.group(1)) * _BINARY[m.group(2).lower()])


#: Mooncake's smallest mountable segment (client_buffer_allocation: "at least 16777216").
MIN_SEGMENT = 16 << 20

MooncakeSize = Annotated[int, BeforeValidator(parse_mooncake_size)]


def _lower(v: Any) -> Any:
    # Mooncake matches protocol names in lowercase; "RDMA" is a typo we can forgive.
    return v.strip().lower() if isinstance(v, str) else v


class MooncakeOptions(BackendOptions):
    """``backend_config`` of ``backend: mooncake`` (also read from mooncake.json and env)."""

    model_config = ConfigDict(populate_by_name=True)

    # -- where the store is ---------------------------------------------------
    config_path: str | None = Field(
        None, description="mooncake.json to read (default: env MOONCAKE_CONFIG_PATH)"
    )
    master_server_address: str | None = Field(
        None,
        validation_alias=AliasChoices("master_server_address", "master_server_addr", "master"),
        description="host:port of mooncake_master (required; env MOONCAKE_MASTER)",
    )
    metadata_server: str = Field(
        "P2PHANDSHAKE",
        description="transfer-engine metadata: P2PHANDSHAKE (no server), http://host:port/metadata, etcd://...",
    )
    local_hostname: str | None = Field(
        None, description="address peers reach this client at (default: the interface that routes to the master)"
    )
    protocol: Annotated[Literal["tcp", "rdma", "ascend"], BeforeValidator(_lower)] = Field(
        "tcp", description="transport, passed to Mooncake: tcp | rdma | ascend (needs the NPU wheel)"
    )
    device_name: str = Field(
        "",
        validation_alias=AliasChoices("device_name", "rdma_devices"),
        description="RDMA/NPU device list, e.g. mlx5_0 (empty: Mooncake's auto-discovery)",
    )
    # -- memory -----------------------------------------------------------------
    global_segment_size: MooncakeSize = Field(
        1 << 30, description="memory this worker contributes to the pool (the scheduler contributes 0)"
    )
    local_buffer_size: MooncakeSize = Field(
        1 << 30, description="Mooncake's staging buffer for non-registered transfers"
    )
    # -- placement ---------------------------------------------------------------
    replica_num: int = Field(1, ge=1, le=16, description="copies of each object")
    preferred_segment: str = Field("", description="segment (host:port) to place new objects in first")
    prefer_alloc_in_same_node: Bool = Field(
        False,
        validation_alias=AliasChoices("prefer_alloc_in_same_node", "alloc_in_same_node"),
        description="place objects on this node's segments when possible (also prefer local replicas on reads)",
    )
    # -- SSD offload, tenant -----------------------------------------------------
    enable_ssd_offload: Bool = Field(False, description="let Mooncake offload objects to SSD")
    ssd_offload_path: str = Field("", description="directory for SSD offload (required when enabled)")
    tenant_id: str = Field(
        "default",
        validation_alias=AliasChoices("tenant_id", "tenant"),
        description="Mooncake tenant (accounting); AscendStore keys carry their own tenant salt",
    )
    enable_client_http_server: Bool = Field(False, description="Mooncake client's HTTP metrics endpoint")
    client_http_port: int = Field(9300, ge=1, le=65535, description="port of that endpoint")
    use_ascend_direct: Bool | None = Field(
        None, description="accepted from older vllm-ascend mooncake.json; protocol 'ascend' is the direct path"
    )
    # -- AscendStore's bounds around the native client ------------------------------
    setup_timeout_s: float = Field(30.0, gt=0, description="bound on client set-up")
    setup_retries: int = Field(
        1, ge=1, le=20, description="Mooncake connect attempts at set-up (~4.4 s each without a master)"
    )
    max_inflight_calls: int = Field(4, ge=1, le=64, description="threads running native calls")
    inline_puts: Bool = Field(
        True,
        description="run puts of the engine's save thread on that thread while the store is healthy, "
        "saving a thread hand-off per call; such a put then returns when Mooncake does (up to 60 s in a "
        "stall) instead of at its deadline; puts from anywhere else (GR's saves on vLLM's forward thread, "
        "its records in the scheduler), exists and removes always keep the deadline",
    )
    inline_gets: Bool = Field(
        True,
        description="run gets of the engine's load thread (async and layerwise loads) on that thread while the "
        "store is healthy, saving a thread hand-off per call; the engine's watchdog gives up on one that "
        "overruns its deadline (the load is recomputed); gets from vLLM's forward thread (sync loads) keep "
        "the hand-off",
    )
    close_timeout_s: float = Field(10.0, gt=0, description="bound on close()")
    force_remove: Bool = Field(
        True, description="remove objects even while a reader's lease is held (else: UNAVAILABLE)"
    )
    lease_pins: Bool = Field(
        True,
        description="declare pins: a lookup's counted keys get the master's read lease "
        "(--default_kv_lease_ttl) renewed; leased objects are never evicted",
    )
    exists_cache_ttl_s: float = Field(
        1.0,
        ge=0,
        description="reuse a positive exists() answer this long instead of renewing Mooncake's read lease",
    )

    @field_validator("global_segment_size")
    @classmethod
    def _segment_floor(cls, v: int) -> int:
        # Mooncake refuses smaller segments at set-up with a bare -600.
        if 0 < v < MIN_SEGMENT:
            raise ValueError("must be 0 (lend no memory) or at least 16 MiB (Mooncake's minimum segment)")
        return v

    @field_validator("master_server_address")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        if v is None:
            return v
        host, sep, port = v.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("expected host:port, e.g. 10.0.0.5:50051")
        return v.strip()


#: env var -> option, the names vllm-ascend and Mooncake's own MooncakeConfig read.
ENV_VARS: dict[str, str] = {
    "MOONCAKE_MASTER": "master_server_address",
    "MOONCAKE_TE_META_DATA_SERVER": "metadata_server",
    "MOONCAKE_LOCAL_HOSTNAME": "local_hostname",
    "MOONCAKE_PROTOCOL": "protocol",
    "MOONCAKE_DEVICE": "device_name",
    "MOONCAKE_GLOBAL_SEGMENT_SIZE": "global_segment_size",
    "MOONCAKE_LOCAL_BUFFER_SIZE": "local_buffer_size",
    "MOONCAKE_OFFLOAD_ENABLED": "enable_ssd_offload",
    "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": "ssd_offload_path",
    "MOONCAKE_TENANT_ID": "tenant_id",
    "MOONCAKE_ENABLE_CLIENT_HTTP_SERVER": "enable_client_http_server",
    "MOONCAKE_CLIENT_HTTP_PORT": "client_http_port",
}
CONFIG_PATH_ENV = "MOONCAKE_CONFIG_PATH"
#: mooncake.json keys that are Mooncake's own business and carry no meaning here.
_IGNORED_FILE_KEYS = frozenset({"ipc_socket_path"})


def _canonical_names() -> dict[str, str]:
    """Every accepted spelling -> field name."""
    names: dict[str, str] = {}
    for name, info in MooncakeOptions.model_fields.items():
        names[name] = name
        alias = info.validation_alias
        for choice in getattr(alias, "choices", []):
            if isinstance(choice, str):
                names[choice] = name
    return names


def _canonicalise(data: Mapping[str, Any]) -> dict[str, Any]:
    names = _canonical_names()
    # unknown keys are kept as they are so that validation names them
    return {names.get(k, k): v for k, v in data.items()}


def _read_mooncake_json(path: str, source: str) -> dict[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise MooncakeConfigError(f"mooncake config file {path!r} ({source}) does not exist")
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise MooncakeConfigError(f"mooncake config file {path!r} ({source}) cannot be parsed: {exc}") from None
    if not isinstance(data, dict):
        raise MooncakeConfigError(f"mooncake config file {path!r} ({source}) must hold a JSON object")
    return {k: v for k, v in data.items() if k not in _IGNORED_FILE_KEYS}


def resolve_options(
    explicit: MooncakeOptions | Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> MooncakeOptions:
    """Merge defaults < mooncake.json < env < explicit, validate, check required keys.

    Raises MooncakeConfigError naming the key, the bad value and where it came from.
    """
    env = os.environ if env is None else env
    if explicit is None:
        explicit = {}
    if isinstance(explicit, MooncakeOptions):
        given = explicit.model_dump(include=explicit.model_fields_set)
    else:
        given = _canonicalise(explicit)
    sources: dict[str, str] = {}
    merged: dict[str, Any] = {}

    path = given.get("config_path") or env.get(CONFIG_PATH_ENV)
    if path:
        where = "config_path" if given.get("config_path") else f"env {CONFIG_PATH_ENV}"
        for key, value in _canonicalise(_read_mooncake_json(path, where)).items():
            merged[key] = value
            sources[key] = f"mooncake.json {path}"
    for var, key in ENV_VARS.items():
        if env.get(var) not in (None, ""):
            merged[key] = env[var]
            sources[key] = f"env {var}"
    for key, value in given.items():
        merged[key] = value
        sources[key] = "backend_config"
    if path:
        merged["config_path"] = path

    try:
        opts = MooncakeOptions.model_validate(merged)
    except ValidationError as exc:
        msg = format_validation_error(exc, MooncakeOptions, prefix="backend_config")
        origins = {
            str(err["loc"][0]): sources.get(str(err["loc"][0]), "backend_config")
            for err in exc.errors()
            if err["loc"]
        }
        msg += "".join(f"\n  ({key!r} was set by {src})" for key, src in origins.items())
        raise MooncakeConfigError(msg) from None

    if not opts.master_server_address:
        raise MooncakeConfigError(
            "config key 'backend_config.master_server_address' is not set: give the mooncake_master "
            "host:port in backend_config, in mooncake.json (MOONCAKE_CONFIG_PATH) or as env MOONCAKE_MASTER"
        )
    if opts.enable_ssd_offload and not opts.ssd_offload_path:
        raise MooncakeConfigError(
            "config key 'backend_config.ssd_offload_path' must name a directory when enable_ssd_offload "
            "is true (env MOONCAKE_OFFLOAD_FILE_STORAGE_PATH)"
        )
    return opts


def option_reference() -> list[tuple[str, str, str, str]]:
    """(key, default, env var, description) rows for the docs."""
    env_of = {v: k for k, v in ENV_VARS.items()}
    env_of["config_path"] = CONFIG_PATH_ENV
    rows = []
    for name, info in MooncakeOptions.model_fields.items():
        default = info.get_default(call_default_factory=True)
        rows.append((name, json.dumps(default), env_of.get(name, ""), info.description or ""))
    return rows


__all__ = [
    "CONFIG_PATH_ENV",
    "ENV_VARS",
    "ConfigError",
    "MooncakeOptions",
    "MooncakeSize",
    "option_reference",
    "parse_mooncake_size",
    "resolve_options",
]
