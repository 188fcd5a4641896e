"""Configuration of the Mooncake backend: mooncake.json, env vars, backend_config, errors."""

from __future__ import annotations

import json

import pytest
from ascendstore_mooncake.backend import MooncakeBackend
from ascendstore_mooncake.options import MooncakeOptions, parse_mooncake_size, resolve_options

from ascendstore.contract import BackendSetupError
from ascendstore.errors import ConfigError
from ascendstore.registry import create_backend, installed_backends, load_backend_class

pytestmark = pytest.mark.mooncake


def test_entry_point_registers_the_backend() -> None:
    assert installed_backends()["mooncake"] == "ascendstore_mooncake.backend:MooncakeBackend"
    assert load_backend_class("mooncake") is MooncakeBackend


@pytest.mark.parametrize(
    ("text", "value"),
    [(1024, 1024), ("30GB", 30 << 30), ("512mb", 512 << 20), ("1.5GiB", 3 << 29), ("4g", 4 << 30), ("7", 7)],
)
def test_sizes_follow_mooncake_units(text: object, value: int) -> None:
    assert parse_mooncake_size(text) == value


def test_merge_order_file_then_env_then_backend_config(tmp_path) -> None:
    cfg = tmp_path / "mooncake.json"
    cfg.write_text(
        json.dumps(
            {
                "local_hostname": "10.0.0.7",
                "metadata_server": "P2PHANDSHAKE",
                "protocol": "ASCEND",
                "device_name": "",
                "master_server_address": "10.0.0.1:50088",
                "global_segment_size": "30GB",
                "local_buffer_size": 1073741824,
                "alloc_in_same_node": "True",
                "preferred_segment": "10.0.0.7:12345",
                "tenant_id": "t1",
                "use_ascend_direct": True,
            }
        )
    )
    env = {
        "MOONCAKE_CONFIG_PATH": str(cfg),
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "8GB",
        "MOONCAKE_MASTER": "10.0.0.2:50088",
    }
    opts = resolve_options({"master": "10.0.0.3:1", "replica_num": 2}, env=env)
    assert opts.master_server_address == "10.0.0.3:1"  # backend_config beats env beats file
    assert opts.global_segment_size == 8 << 30  # env beats file
    assert opts.local_hostname == "10.0.0.7"  # file beats default
    assert opts.protocol == "ascend"
    assert opts.prefer_alloc_in_same_node is True
    assert opts.tenant_id == "t1"
    assert opts.replica_num == 2
    assert opts.metadata_server == "P2PHANDSHAKE"
    assert opts.config_path == str(cfg)


def test_env_alone_is_enough() -> None:
    opts = resolve_options(None, env={"MOONCAKE_MASTER": "m:5", "MOONCAKE_PROTOCOL": "rdma", "MOONCAKE_DEVICE": "mlx5_0"})
    assert (opts.master_server_address, opts.protocol, opts.device_name) == ("m:5", "rdma", "mlx5_0")
    assert opts.metadata_server == "P2PHANDSHAKE"


def test_unknown_key_in_mooncake_json_names_key_file_and_valid_keys(tmp_path) -> None:
    cfg = tmp_path / "mooncake.json"
    cfg.write_text(json.dumps({"master_server_address": "m:1", "global_segmnet_size": "1GB"}))
    with pytest.raises(ConfigError) as exc:
        resolve_options({"config_path": str(cfg)}, env={})
    msg = str(exc.value)
    assert "global_segmnet_size" in msg and "Did you mean 'global_segment_size'" in msg
    assert "Valid keys:" in msg and str(cfg) in msg


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ConfigError) as exc:
        resolve_options(None, env={"MOONCAKE_MASTER": "m:1", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "lots"})
    assert "global_segment_size" in str(exc.value) and "MOONCAKE_GLOBAL_SEGMENT_SIZE" in str(exc.value)


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        ({}, "master_server_address"),
        ({"master": "no-port"}, "master_server_address"),
        ({"master": "m:1", "protocol": "udp"}, "'tcp', 'rdma', 'ascend'"),
        ({"master": "m:1", "replica_num": 0}, "replica_num"),
        ({"master": "m:1", "global_segment_size": "8MB"}, "at least 16 MiB"),
        ({"master": "m:1", "enable_ssd_offload": True}, "ssd_offload_path"),
        ({"master": "m:1", "config_path": "/nonexistent/mooncake.json"}, "/nonexistent/mooncake.json"),
    ],
)
def test_bad_values_fail_naming_the_key(cfg: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        resolve_options(cfg, env={})
    assert needle in str(exc.value)


def test_registry_rejects_unknown_backend_config_key() -> None:
    with pytest.raises(ConfigError) as exc:
        create_backend("mooncake", {"master_server_address": "m:1", "protocl": "tcp"})
    assert "backend_config.protocl" in str(exc.value) and "protocol" in str(exc.value)


def test_config_errors_are_also_setup_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    with pytest.raises(BackendSetupError):
        MooncakeBackend.create(MooncakeOptions(), None)  # type: ignore[arg-type]
