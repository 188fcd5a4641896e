"""PD composition: the config helper's output, and the known mistakes refused
both by ``ascendstore config pd --check`` and when vLLM 0.33 creates the connector.

The end-to-end hand-off (separate prefill/decode engines, real MooncakeConnector)
is tests/mooncake/test_pd_split.py; it needs a private network namespace.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import uuid

import pytest
import torch
import zmq
from typer.testing import CliRunner

from ascendstore.config import load_config
from ascendstore.errors import ConfigError
from ascendstore.pd import (
    build_pd_config,
    ensure_lookup_path_free,
    lookup_path_in_use,
    pool_access,
    validate_host,
    validate_pd_config,
)

MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 4,
    "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "float16",
}


def local_pool() -> dict:
    return {"name": f"pdcfg-{uuid.uuid4().hex[:8]}", "capacity": "4MiB", "page_size": "4KiB"}


def children(cfg: dict) -> list[dict]:
    return cfg["kv_connector_extra_config"]["connectors"]


def swapped(cfg: dict) -> dict:
    out = copy.deepcopy(cfg)
    children(out).reverse()
    return out


def pool_of(cfg: dict) -> dict:
    return children(cfg)[1]["kv_connector_extra_config"]


# -- known mistakes -----------------------------------------------------------------
def _mistakes() -> dict[str, tuple[dict, str]]:
    p = build_pd_config("prefill")
    d = build_pd_config("decode")
    pool_missing = copy.deepcopy(p)
    del children(pool_missing)[1]
    no_p2p = copy.deepcopy(d)
    del children(no_p2p)[0]
    hang = copy.deepcopy(p)
    pool_of(hang)["load_async"] = True
    child_policy = copy.deepcopy(d)
    child_policy["kv_load_failure_policy"] = "fail"
    children(child_policy)[1]["kv_load_failure_policy"] = "recompute"
    role_mismatch = copy.deepcopy(d)
    children(role_mismatch)[1]["kv_role"] = "kv_producer"
    two_pools = copy.deepcopy(p)
    children(two_pools).append(copy.deepcopy(children(p)[1]))
    flags_on_prefill = copy.deepcopy(p)
    pool_of(flags_on_prefill)["consumer_is_to_load"] = True
    decode_cache_without_put = copy.deepcopy(d)
    pool_of(decode_cache_without_put)["save_decode_cache"] = True
    partition = copy.deepcopy(p)
    pool_of(partition).update(prefill_pp_size=2, prefill_pp_layer_partition="3")
    bad_key = copy.deepcopy(p)
    pool_of(bad_key)["consumer_is_to_lod"] = True
    lone_consumer = build_pd_config("mixed")
    lone_consumer["kv_role"] = "kv_consumer"
    return {
        "wrong order": (swapped(d), "wrong order"),
        "pool missing": (pool_missing, "pool connector is missing"),
        "no P2P on a split role": (no_p2p, "without a P2P connector"),
        "failure policy that hangs": (hang, "loop forever"),
        "policy set on a child": (child_policy, "vLLM ignores"),
        "child role differs": (role_mismatch, "give every child the node's role"),
        "two pool connectors": (two_pools, "keep one"),
        "consumer flag on prefill": (flags_on_prefill, "only applies to decode"),
        "save_decode_cache without put": (decode_cache_without_put, "saves nothing"),
        "partition vs pp size": (partition, "prefill_pp_layer_partition"),
        "misspelt key": (bad_key, "Did you mean 'consumer_is_to_load'"),
        "lone consumer pool": (lone_consumer, "never loads"),
    }


MISTAKES = _mistakes()


@pytest.mark.parametrize("name", list(MISTAKES))
def test_validation_names_each_known_mistake(name: str) -> None:
    cfg, phrase = MISTAKES[name]
    # The hang needs a pool connector that offers a failed chunk again; AscendStore's does not.
    problems = validate_pd_config(cfg, bounded_load_retry=name != "failure policy that hangs")
    assert any(phrase in p for p in problems), problems


def test_the_hanging_policy_is_refused_only_without_a_bounded_retry() -> None:
    from ascendstore_vllm.connector import AscendStoreConnector

    cfg, _ = MISTAKES["failure policy that hangs"]
    assert AscendStoreConnector.bounded_load_retry is True
    assert validate_pd_config(cfg) == []
    fail_policy = copy.deepcopy(cfg)
    fail_policy["kv_load_failure_policy"] = "fail"
    assert validate_pd_config(fail_policy, bounded_load_retry=False) == []


def test_recompute_with_async_loads_does_not_loop_when_every_get_fails(tmp_path) -> None:
    """The failure policy that hangs an unbounded pool connector: recompute +
    load_async, and a pool whose lookups say "present" while every get fails.
    vLLM rewinds the request to token 0 and asks again; AscendStore must not
    offer the failed chunks a second time. Bounded: 20 s, 400 steps."""
    from ascendstore_vllm.testing import EngineHarness, EngineSpec
    from conftest import pool_config

    prompt = [(7 * i + 3) % 983 for i in range(6 * 16)]
    a = EngineHarness(EngineSpec(extra_config=pool_config(str(tmp_path), load_async=True)))
    try:
        a.add_request("a", prompt)
        a.run(timeout_s=20)
    finally:
        a.close()
    b = EngineHarness(EngineSpec(extra_config=pool_config(str(tmp_path), load_async=True,
                                                          backend_config={"fail_get_every": 1})))
    try:
        b.add_request("b", prompt)
        b.run(max_steps=400, timeout_s=20)  # raises TimeoutError if the request loops
        st = b.stats_total()
        assert st["load_failures"] > 0 and st["lookups"] <= 3, st
        assert all(torch.equal(x, y) for x, y in zip(b.prompt_kv("b"), b.expected_prompt_kv(prompt), strict=True))
    finally:
        b.close()


@pytest.mark.parametrize("role", ["prefill", "decode", "mixed"])
def test_helper_output_is_sound_and_accepted_by_vllm(role: str) -> None:
    from ascendstore_vllm.connector import AscendStoreConnector
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import MooncakeConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    cfg = build_pd_config(role, protocol="tcp", instance=1)
    assert validate_pd_config(cfg) == []
    ktc = KVTransferConfig(**json.loads(json.dumps(cfg)))  # what vLLM makes of --kv-transfer-config
    assert ktc.kv_role == {"prefill": "kv_producer", "decode": "kv_consumer", "mixed": "kv_both"}[role]
    if role == "mixed":
        assert KVConnectorFactory.get_connector_class(ktc) is AscendStoreConnector
        return
    assert KVConnectorFactory.get_connector_class(ktc) is MultiConnector
    kinds = [KVConnectorFactory.get_connector_class(KVTransferConfig(**c)) for c in children(cfg)]
    assert kinds == [MooncakeConnector, AscendStoreConnector]  # P2P first, pool second
    assert {c["kv_role"] for c in children(cfg)} == {ktc.kv_role}
    assert ktc.kv_load_failure_policy == "recompute"
    assert pool_of(cfg)["lookup_rpc_port"] == 1
    MultiConnector.requires_piecewise_for_cudagraph(ktc.kv_connector_extra_config)  # vLLM parses every child


def test_pd_split_through_the_pool_alone_is_accepted() -> None:
    """No P2P connector: prefill saves the prompt, decode loads it (consumer_is_to_load).
    Served end to end by tests/real/test_openai_e2e.py."""
    from ascendstore_vllm.connector import AscendStoreConnector
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    p, d = build_pd_config("prefill", p2p="none"), build_pd_config("decode", p2p="none")
    for cfg in (p, d):
        assert validate_pd_config(cfg) == []
        assert [KVConnectorFactory.get_connector_class(KVTransferConfig(**c)) for c in children(cfg)] == [
            AscendStoreConnector]
    assert children(d)[0]["kv_connector_extra_config"]["consumer_is_to_load"] is True
    lone = {**children(d)[0], "kv_load_failure_policy": "recompute"}  # the pool connector alone, kv_consumer
    assert validate_pd_config(lone) == []
    no_load = copy.deepcopy(lone)
    del no_load["kv_connector_extra_config"]["consumer_is_to_load"]
    assert any("never loads" in x for x in validate_pd_config(no_load))
    with pytest.raises(ConfigError, match="none"):
        build_pd_config("decode", p2p="pigeon")


def test_pool_access_follows_roles() -> None:
    plain = load_config({})
    assert pool_access("kv_producer", plain) == (True, True, False)
    assert pool_access("kv_both", plain) == (True, True, False)
    assert pool_access("kv_consumer", plain) == (False, False, False)
    assert pool_access("kv_consumer", load_config({"consumer_is_to_load": True})) == (True, False, False)
    assert pool_access("kv_consumer", load_config({"consumer_is_to_put": True})) == (False, True, False)
    both = load_config({"consumer_is_to_put": True, "save_decode_cache": True})
    assert pool_access("kv_consumer", both) == (False, True, True)
    assert pool_access("kv_producer", load_config({"save_decode_cache": True})) == (True, True, True)
    with pytest.raises(ConfigError, match="kv_both"):
        pool_access("producer", plain)


def test_build_refuses_what_validation_refuses() -> None:
    with pytest.raises(ConfigError, match="only applies to decode"):
        build_pd_config("prefill", consumer_is_to_load=True)
    with pytest.raises(ConfigError, match="Valid choices: prefill, decode, mixed"):
        build_pd_config("prefil")
    assert validate_pd_config(build_pd_config("prefill", load_async=True)) == []


# -- two instances on one host ----------------------------------------------------------
def test_host_check_finds_a_shared_lookup_ipc_path() -> None:
    a = build_pd_config("prefill", instance=0, extra={"instance_id": "node7"})
    b = build_pd_config("prefill", instance=0, extra={"instance_id": "node7"})
    c = build_pd_config("prefill", instance=1, extra={"instance_id": "node7"})
    assert any("share the lookup IPC path" in p for p in validate_host({"a": a, "b": b}))
    assert validate_host({"a": a, "c": c}) == []
    # No pinned identity: vLLM gives each instance its own engine_id, part of the path.
    assert validate_host({"x": build_pd_config("prefill"), "y": build_pd_config("prefill")}) == []


def test_live_lookup_path_is_refused_and_stale_one_is_not(tmp_path) -> None:
    path = f"ipc://{tmp_path}/lookup-0.ipc"
    assert not lookup_path_in_use(path)
    ctx = zmq.Context()
    rep = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    rep.bind(path)
    try:
        assert lookup_path_in_use(path)
        with pytest.raises(ConfigError, match=r"lookup_rpc_port \(this one has 3\)"):
            ensure_lookup_path_free(path, 3)
    finally:
        rep.close()
        ctx.term()
    # A socket file whose owner is gone (crashed instance) is not "in use".
    stale = tmp_path / "stale.ipc"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()
    assert stale.exists() and not lookup_path_in_use(f"ipc://{stale}")


def test_lookup_path_too_long_for_a_unix_socket_says_so(tmp_path) -> None:
    """Not "already served": connect() fails for a too-long path with no errno."""
    path = f"ipc://{tmp_path}/{'d' * 120}/lookup-0.ipc"
    with pytest.raises(ConfigError, match=r"bytes long; a Unix socket path holds at most 107: set VLLM_RPC_BASE_PATH"):
        ensure_lookup_path_free(path)


def test_a_second_lookup_server_on_a_live_path_is_refused(tmp_path) -> None:
    from ascendstore_vllm.lookup_rpc import LookupServer

    path = f"ipc://{tmp_path}/ascendstore-lookup-x-p0-dp0.ipc"
    first = LookupServer(path, None)  # lookups are only needed once requests arrive
    try:
        with pytest.raises(ConfigError, match="already served by another vLLM instance"):
            LookupServer(path, None)
    finally:
        first.close()
    LookupServer(path, None).close()  # once its owner is gone the path is free again


# -- the command line ---------------------------------------------------------------------
def test_cli_prints_a_config_vllm_accepts() -> None:
    from vllm.config import KVTransferConfig

    from ascendstore.cli import get_app

    r = CliRunner().invoke(get_app(), ["config", "pd", "--role", "decode", "--protocol", "tcp", "--instance", "2",
                                       "--consumer-load", "--set", "timeout_ms=2000"])
    assert r.exit_code == 0, r.output
    cfg = json.loads(r.stdout)
    assert KVTransferConfig(**cfg).kv_role == "kv_consumer"
    assert pool_of(cfg) == {"backend": "local", "lookup_rpc_port": 2, "consumer_is_to_load": True,
                            "timeout_ms": 2000}
    assert children(cfg)[0]["kv_connector_extra_config"] == {"mooncake_protocol": "tcp"}


def test_other_commands_read_the_pool_config_inside_a_pd_split_config() -> None:
    from ascendstore.cli import get_app

    runner = CliRunner()
    cfg = json.dumps(build_pd_config("decode", consumer_is_to_put=True, extra={"timeout_ms": 1234}))
    r = runner.invoke(get_app(), ["config", "show", "--json", "--kv-transfer-config", cfg])
    assert r.exit_code == 0, r.output
    shown = json.loads(r.stdout)
    assert shown["consumer_is_to_put"] is True and shown["timeout_ms"] == 1234


def test_cli_check_reports_mistakes(tmp_path) -> None:
    from ascendstore.cli import get_app

    good = tmp_path / "good.json"
    good.write_text(json.dumps(build_pd_config("prefill")))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(MISTAKES["wrong order"][0]))
    runner = CliRunner()
    ok = runner.invoke(get_app(), ["config", "pd", "--check", f"@{good}"])
    assert ok.exit_code == 0, ok.output
    r = runner.invoke(get_app(), ["config", "pd", "--check", f"@{good}", "--check", f"@{bad}"])
    assert r.exit_code == 2
    assert "wrong order" in r.output.replace("\n", " ")
    tp = runner.invoke(get_app(), ["config", "pd", "--check", json.dumps(build_pd_config("prefill", prefill_tp_size=4)),
                                   "--tp", "2"])
    assert tp.exit_code == 2 and "prefill_tp_size" in tp.output


# -- when vLLM creates the connector --------------------------------------------------------
@pytest.fixture
def model_dir(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(MODEL))
    return str(tmp_path)


def make_vllm_config(model_dir: str, ktc: dict, tp: int = 1, pp: int = 1):
    from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype="float16", skip_tokenizer_init=True),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        kv_transfer_config=KVTransferConfig(**ktc),
        device_config=DeviceConfig("cpu"),
    )


def create_scheduler_connector(vc):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(MODEL["num_hidden_layers"])]
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16)
    kcc = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    return KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.SCHEDULER, kv_cache_config=kcc)


@pytest.fixture
def validating_factory():
    """What every vLLM process does before creating connectors: load the general
    plugins, ours among them, which puts the PD check in front of the factory."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert getattr(KVConnectorFactory.create_connector.__func__, "_ascendstore_pd_checked", False)


@pytest.mark.parametrize("name", ["wrong order", "pool missing", "policy set on a child", "child role differs"])
def test_vllm_refuses_a_broken_composition_at_creation(model_dir, validating_factory, name: str) -> None:
    cfg, phrase = MISTAKES[name]
    vc = make_vllm_config(model_dir, cfg)
    with pytest.raises(ConfigError, match="invalid kv-transfer-config for AscendStore") as exc:
        create_scheduler_connector(vc)
    assert phrase in str(exc.value)


def test_vllm_creates_the_sound_composition(model_dir, validating_factory) -> None:
    from ascendstore_vllm.connector import AscendStoreConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import MooncakeConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    cfg = build_pd_config("prefill", protocol="tcp", backend_config=local_pool())
    conn = create_scheduler_connector(make_vllm_config(model_dir, cfg))
    try:
        assert isinstance(conn, MultiConnector)
        assert [type(c) for c in conn.sub_connectors] == [MooncakeConnector, AscendStoreConnector]
    finally:
        conn.shutdown()


def test_unsupported_layouts_are_refused_at_start_up(model_dir, validating_factory) -> None:
    # A decode node sharing the pool with prefill nodes of another TP size: refused.
    shared = build_pd_config("decode", consumer_is_to_load=True, prefill_tp_size=4)
    with pytest.raises(ConfigError, match="decode tensor_parallel_size 2 differs from prefill_tp_size 4"):
        create_scheduler_connector(make_vllm_config(model_dir, shared, tp=2))
    # Declared sizes that contradict the instance itself: refused.
    p = build_pd_config("prefill", prefill_tp_size=4, prefill_pp_size=2)
    with pytest.raises(ConfigError) as exc:
        create_scheduler_connector(make_vllm_config(model_dir, p, tp=2, pp=1))
    assert "prefill_tp_size' is 4" in str(exc.value) and "prefill_pp_size' is 2" in str(exc.value)
    part = build_pd_config("prefill", prefill_pp_size=2, extra={"prefill_pp_layer_partition": "1,2"})
    assert any("covers 3 layers but the model has 4" in x
               for x in validate_pd_config(part, tp_size=1, pp_size=2, num_layers=4))


def test_honoured_layouts_pass(model_dir) -> None:
    from ascendstore_vllm.pd import check_vllm_config

    # The P2P connector handles different TP sizes; a decode node that leaves the
    # pool alone is therefore fine with any prefill layout.
    check_vllm_config(make_vllm_config(model_dir, build_pd_config("decode", prefill_tp_size=4, decode_tp_size=2),
                                       tp=2))
    same = build_pd_config("decode", consumer_is_to_load=True, consumer_is_to_put=True, prefill_tp_size=2,
                           prefill_pp_size=2, decode_tp_size=2)
    check_vllm_config(make_vllm_config(model_dir, same, tp=2, pp=2))
    check_vllm_config(make_vllm_config(model_dir, build_pd_config("prefill", prefill_tp_size=2, prefill_pp_size=2,
                                                                  extra={"prefill_pp_layer_partition": "2,2"}),
                                       tp=2, pp=2))


def test_someone_elses_multiconnector_is_left_alone(model_dir) -> None:
    from ascendstore_vllm.pd import check_vllm_config

    other = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"shared_storage_path": os.devnull}},
        {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"},
    ]}}
    check_vllm_config(make_vllm_config(model_dir, other))  # no AscendStore involved: not ours to judge
