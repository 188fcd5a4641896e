"""Config: vllm-ascend keys keep their meaning; bad input names key, value, choices, nearest key."""

import json

import pytest
from pydantic import ValidationError

from ascendstore.config import AscendStoreConfig, config_reference, load_config, parse_bytes
from ascendstore.errors import ConfigError


def test_defaults_match_vllm_ascend_except_backend():
    c = load_config({})
    assert c.backend == "local"
    assert (c.load_async, c.use_layerwise, c.discard_partial_chunks) == (False, False, True)
    assert (c.consumer_is_to_put, c.consumer_is_to_load, c.save_decode_cache) == (False, False, False)
    assert (c.lookup_rpc_port, c.prefill_pp_size, c.h2d_stagger_us, c.layerwise_prefetch_layers) == (0, 1, 0, 1)


def test_legacy_mooncake_rpc_port_alias():
    assert load_config({"mooncake_rpc_port": 7}).lookup_rpc_port == 7


def test_string_booleans_as_vllm_ascend_docs_write_them():
    c = load_config({"load_async": "True", "use_layerwise": "false"})
    assert c.load_async is True and c.use_layerwise is False


def test_unknown_key_names_key_value_and_nearest():
    with pytest.raises(ConfigError) as e:
        load_config({"use_layerwize": True})
    msg = str(e.value)
    assert "'use_layerwize'" in msg and "True" in msg and "Did you mean 'use_layerwise'" in msg
    assert "backend_config" in msg  # lists the valid keys


def test_bad_choice_lists_choices():
    with pytest.raises(ConfigError) as e:
        load_config({"lookup_mode": "udp"})
    assert "'udp'" in str(e.value) and "'scheduler'" in str(e.value) and "'rpc'" in str(e.value)


@pytest.mark.parametrize(
    "extra,key",
    [
        ({"qos_priority": 9}, "qos_priority"),
        ({"prefill_pp_size": 0}, "prefill_pp_size"),
        ({"timeout_ms": "soon"}, "timeout_ms"),
        ({"max_inflight_bytes": "12 apples"}, "max_inflight_bytes"),
        ({"gr": {"ttl_s": -1}}, "gr.ttl_s"),
    ],
)
def test_bad_values_name_the_key(extra, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(extra)


def test_nested_unknown_key_is_named_with_its_path():
    with pytest.raises(ConfigError, match=r"'gr\.user_lr'.*Did you mean 'user_lru'"):
        load_config({"gr": {"user_lr": True}})


def test_sizes_with_units():
    assert parse_bytes("4GiB") == 4 << 30
    assert parse_bytes("1.5 MB") == 1_500_000
    assert parse_bytes(17) == 17
    for bad in ("-1", "ten", True, -3):
        with pytest.raises(ValueError):
            parse_bytes(bad)


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".toml"])
def test_config_file_supplies_defaults_extra_config_wins(tmp_path, suffix):
    f = tmp_path / f"as{suffix}"
    if suffix == ".json":
        f.write_text(json.dumps({"load_async": True, "timeout_ms": 123}))
    elif suffix == ".yaml":
        f.write_text("load_async: true\ntimeout_ms: 123\n")
    else:
        f.write_text("load_async = true\ntimeout_ms = 123\n")
    c = load_config({"config_file": str(f), "timeout_ms": 9})
    assert c.load_async is True and c.timeout_ms == 9


def test_config_file_from_env(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"use_layerwise": True}))
    assert load_config({}, env={"ASCENDSTORE_CONFIG_FILE": str(f)}).use_layerwise is True


def test_config_file_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config({"config_file": str(tmp_path / "nope.json")})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be parsed"):
        load_config({"config_file": str(bad)})
    lst = tmp_path / "list.json"
    lst.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="mapping"):
        load_config({"config_file": str(lst)})
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"lod_async": True}))
    with pytest.raises(ConfigError, match="Did you mean 'load_async'"):
        load_config({"config_file": str(typo)})


def test_extra_config_must_be_a_mapping():
    with pytest.raises(ConfigError, match="mapping"):
        load_config(["backend", "local"])  # type: ignore[arg-type]


def test_config_is_frozen():
    c = load_config({})
    with pytest.raises(ValidationError):
        c.backend = "x"  # type: ignore[misc]


def test_reference_rows_cover_every_key():
    keys = {row[0] for row in config_reference()}
    assert set(AscendStoreConfig.model_fields) - {"gr"} <= keys
    assert "gr.user_lru" in keys
