"""MemCache ``.conf`` files: read, merge with our options, write.

MemCache reads ``key = value`` files: the client (``init`` without ``setup``)
reads ``$MMC_LOCAL_CONFIG_PATH``, the meta service (``MetaService.main`` without
``setup``) reads ``$MMC_META_CONFIG_PATH``. We always hand the native side a
whole file rather than a ``LocalConfig`` object, so keys that object does not
expose (SSD tier, UBS IO, batch options...) in a user's file keep working.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ascendstore.errors import ConfigError
from ascendstore_memcache.options import MemcacheOptions

LOCAL_ENV = "MMC_LOCAL_CONFIG_PATH"
META_ENV = "MMC_META_CONFIG_PATH"

#: option name -> key in mmc-local.conf (names from the shipped template and
#: the keys libmf_memcache.so parses).
LOCAL_KEYS = {
    "meta_service_url": "ock.mmc.meta_service_url",
    "config_store_url": "ock.mmc.local_service.config_store_url",
    "log_level": "ock.mmc.log_level",
    "world_size": "ock.mmc.local_service.world_size",
    "protocol": "ock.mmc.local_service.protocol",
    "dram_size": "ock.mmc.local_service.dram.size",
    "hbm_size": "ock.mmc.local_service.hbm.size",
    "client_timeout_seconds": "ock.mmc.client.timeout.seconds",
    "client_retry_milliseconds": "ock.mmc.client.retry_milliseconds",
}
#: option name -> key in mmc-meta.conf
META_KEYS = {
    "meta_service_url": "ock.mmc.meta_service_url",
    "config_store_url": "ock.mmc.meta_service.config_store_url",
    "metrics_url": "ock.mmc.meta_service.metrics_url",
    "log_level": "ock.mmc.log_level",
    "log_path": "ock.mmc.log_path",
    "lease_ttl_ms": "ock.mmc.meta.lease_ttl_ms",
}


#: mmc-local.conf key -> attribute of memcache_hybrid.LocalConfig, for the
#: fallback where the client must be configured through setup() (see backend).
LOCAL_CONFIG_ATTRS = {
    "ock.mmc.meta_service_url": "meta_service_url",
    "ock.mmc.local_service.config_store_url": "config_store_url",
    "ock.mmc.local_service.backend_id": "backend_id",
    "ock.mmc.log_level": "log_level",
    "ock.mmc.local_service.world_size": "world_size",
    "ock.mmc.local_service.protocol": "protocol",
    "ock.mmc.local_service.tag": "tag",
    "ock.mmc.local_service.tag_op_info": "tag_op_info",
    "ock.mmc.local_service.hcom_url": "hcom_url",
    "ock.mmc.local_service.dram.size": "dram_size",
    "ock.mmc.local_service.hbm.size": "hbm_size",
    "ock.mmc.local_service.max.dram.size": "max_dram_size",
    "ock.mmc.local_service.max.hbm.size": "max_hbm_size",
    "ock.mmc.client.retry_milliseconds": "client_retry_milliseconds",
    "ock.mmc.client.timeout.seconds": "client_timeout_seconds",
    "ock.mmc.client.read_thread_pool.size": "read_thread_pool_size",
    "ock.mmc.client.write_thread_pool.size": "write_thread_pool_size",
    "ock.mmc.client.aggregate.io": "aggregate_io",
    "ock.mmc.client.aggregate.num": "aggregate_num",
    **{
        f"ock.mmc.{prefix}tls.{part}": f"{attr}tls_{part.replace('.', '_')}"
        for prefix, attr in (("", ""), ("config_store.", "config_store_"), ("local_service.hcom.", "hcom_"))
        for part in ("enable", "ca.path", "ca.crl.path", "cert.path", "key.path", "key.pass.path",
                     "package.path", "decrypter.path")
    },
}


def local_config_object(module: object, values: Mapping[str, str]) -> tuple[object, list[str]]:
    """A ``LocalConfig`` of ``module`` carrying ``values``; also the keys it
    cannot carry (they only work when MemCache reads the file itself)."""
    cfg = module.LocalConfig()  # type: ignore[attr-defined]
    dropped = []
    for key, text in values.items():
        attr = LOCAL_CONFIG_ATTRS.get(key)
        if attr is None or not hasattr(cfg, attr):
            dropped.append(key)
            continue
        current = getattr(cfg, attr)
        if isinstance(current, bool):
            value: object = text.strip().lower() in {"true", "1", "yes", "on"}
        elif isinstance(current, int):
            value = int(text)
        else:
            value = text
        setattr(cfg, attr, value)
    return cfg, dropped


def parse_conf(text: str, source: str = "<conf>") -> dict[str, str]:
    """``key = value`` lines; ``#`` starts a comment line."""
    values: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{source}:{n}: expected 'key = value', got {raw!r}")
        values[key.strip()] = value.strip()
    return values


def read_conf(path: str | os.PathLike[str], what: str) -> dict[str, str]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{what} {str(p)!r} does not exist (set the path or unset it to generate one)")
    return parse_conf(p.read_text(), str(p))


def render_conf(values: Mapping[str, str], header: str) -> str:
    lines = [f"## {line}" for line in header.splitlines()]
    lines += [f"{k} = {v}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def default_conf_dir(instance_id: str) -> Path:
    return Path(tempfile.gettempdir()) / f"ascendstore-memcache-{os.getuid()}" / instance_id


@dataclass(frozen=True)
class ResolvedConf:
    """The files the native side will read and the values in them."""

    local_path: Path
    meta_path: Path
    local: dict[str, str]
    meta: dict[str, str]
    #: True when local_path was written by us (not the user's own file).
    generated: bool

    @property
    def meta_service_url(self) -> str:
        return self.local.get(LOCAL_KEYS["meta_service_url"], "tcp://127.0.0.1:5000")

    @property
    def protocol(self) -> str:
        return self.local.get(LOCAL_KEYS["protocol"], "host_rdma")


#: keys the client refuses to start without ("Config item <...> is not set!" [measured])
REQUIRED_LOCAL = {"protocol", "dram_size"}


def _merge(
    base: dict[str, str] | None, options: MemcacheOptions, keys: Mapping[str, str], explicit: set[str]
) -> dict[str, str]:
    # With a user's file only what the user set explicitly overrides it (the
    # library keeps its own defaults for the rest, and required keys the file
    # lacks come from the options); without a file, every option.
    merged = dict(base or {})
    for field, key in keys.items():
        required = keys is LOCAL_KEYS and field in REQUIRED_LOCAL and key not in merged
        if base is None or field in explicit or required:
            value = getattr(options, field)
            if value is not None:
                merged[key] = _text(value)
    return merged


def resolve(
    options: MemcacheOptions, instance_id: str, env: Mapping[str, str] | None = None
) -> ResolvedConf:
    """Merge the user's files (if any) with the options and write the result.

    A user's file is used as is when no option overrides one of its keys;
    otherwise (and when there is no file) the merged file is written to
    ``conf_dir``. Options the user set explicitly win over the file; keys the
    file lacks keep the library's defaults.
    """
    env = os.environ if env is None else env
    explicit = set(options.model_fields_set)
    conf_dir = Path(options.conf_dir).expanduser() if options.conf_dir else default_conf_dir(instance_id)
    if options.log_path is None:
        options = options.model_copy(update={"log_path": str(conf_dir / "logs")})

    out: dict[str, tuple[Path, dict[str, str], bool]] = {}
    for name, given, env_key, keys in (
        ("local", options.local_config_path, LOCAL_ENV, LOCAL_KEYS),
        ("meta", options.meta_config_path, META_ENV, META_KEYS),
    ):
        path = given or env.get(env_key) or None
        base = read_conf(path, f"mmc-{name}.conf ({'backend_config' if given else env_key})") if path else None
        merged = _merge(base, options, keys, explicit)
        if path and merged == base:
            out[name] = (Path(path).expanduser(), merged, False)
            continue
        conf_dir.mkdir(parents=True, exist_ok=True)
        target = conf_dir / f"mmc-{name}.conf"
        header = (
            f"Written by ascendstore-memcache from {'the file ' + str(path) + ' and ' if path else ''}"
            "backend_config; edit the source, not this file."
        )
        tmp = target.with_suffix(f".conf.{os.getpid()}.tmp")
        tmp.write_text(render_conf(merged, header))
        tmp.replace(target)
        out[name] = (target, merged, True)
    return ResolvedConf(
        local_path=out["local"][0],
        meta_path=out["meta"][0],
        local=out["local"][1],
        meta=out["meta"][1],
        generated=out["local"][2],
    )


def tcp_endpoint(url: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port)."""
    rest = url.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ConfigError(f"bad MemCache url {url!r}: expected tcp://host:port") from None
