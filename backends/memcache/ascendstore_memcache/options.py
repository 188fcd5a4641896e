"""``backend_config`` of the ``memcache`` backend."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ascendstore.config import ByteSize
from ascendstore.contract import BackendOptions

Protocol = Literal[
    "device_rdma",
    "device_urma",
    "device_uboe",
    "device_sdma",
    "host_shm",
    "host_urma",
    "host_rdma",
    "host_tcp",
]
LogLevel = Literal["debug", "info", "warn", "error"]


class MemcacheOptions(BackendOptions):
    """Options of the MemCache backend.

    The local-service and meta-service settings come from, in this order of
    precedence: the keys below that the user set explicitly, then the files
    ``local_config_path`` / ``meta_config_path`` (default: the environment
    variables ``MMC_LOCAL_CONFIG_PATH`` / ``MMC_META_CONFIG_PATH`` that
    vllm-ascend deployments already set), then the defaults below. When no file
    is given, both ``.conf`` files are generated under ``conf_dir``.
    """

    driver: Literal["memcache_hybrid", "standin"] = Field(
        "memcache_hybrid",
        description="memcache_hybrid: the real client; standin: the pure-Python stand-in "
        "(tests and machines without Ascend; stores in a local SQLite file)",
    )
    standin_path: str | None = Field(
        None, description="stand-in store file or directory (default: per meta_service_url in the temp dir)"
    )

    # -- config files (vllm-ascend compatible) ---------------------------------
    local_config_path: str | None = Field(None, description="mmc-local.conf (default: $MMC_LOCAL_CONFIG_PATH)")
    meta_config_path: str | None = Field(None, description="mmc-meta.conf (default: $MMC_META_CONFIG_PATH)")
    conf_dir: str | None = Field(None, description="where generated .conf files go (default: temp dir)")

    # -- what the generated files / the LocalConfig carry -----------------------
    meta_service_url: str = Field("tcp://127.0.0.1:5000", pattern=r"^tcp://[^:/]+:\d+$")
    config_store_url: str = Field("tcp://127.0.0.1:6000", pattern=r"^tcp://[^:/]+:\d+$")
    metrics_url: str = Field("http://127.0.0.1:8000", pattern=r"^https?://[^:/]+:\d+$")
    protocol: Protocol = Field("host_rdma", description="data transfer protocol of the local service")
    dram_size: ByteSize = Field(1 << 30, description="DRAM this process contributes to the pool")
    hbm_size: ByteSize = Field(0, description="HBM this process contributes to the pool")
    world_size: int = Field(256, ge=1, description="most ranks that may join the pool")
    log_level: LogLevel = "info"
    log_path: str | None = Field(None, description="meta service log directory (default: conf_dir/logs)")
    client_timeout_seconds: int | None = Field(None, ge=1, description="native RPC timeout")
    client_retry_milliseconds: int | None = Field(None, ge=0)
    lease_ttl_ms: int | None = Field(None, ge=1, description="read lease TTL (meta service default: 10000)")
    replica_num: int = Field(0, ge=0, le=8, description="0: library default")

    # -- how this process joins ---------------------------------------------------
    device_id: int | None = Field(None, ge=0, description="NPU id (default: local rank)")
    init_bm: bool | None = Field(
        None,
        description="contribute memory and move data (default: all roles but the scheduler, "
        "which opens a pure client for lookups)",
    )
    memory: Literal["auto", "device", "host"] = Field(
        "auto",
        description="where regions live: device -> L2G/G2L copies, host -> H2G/G2H; "
        "auto: from the context's device type",
    )
    register_buffers: bool | None = Field(
        None, description="register regions with the store (default: only for device_rdma)"
    )
    check_sizes: bool = Field(
        True, description="before a get, compare object sizes with the regions (one batch query)"
    )
    preflight: bool = Field(True, description="check driver/CANN before native init")
    setup_timeout_s: float = Field(30.0, gt=0, description="bound on setup+init of the native client")
    workers: int = Field(4, ge=1, le=64, description="threads running native calls")
