"""Prefill/decode split, proven with real parts on CPU.

Separate OS processes, each one vLLM 0.33 engine (real Scheduler, real worker
connector lifecycle, KV caches from vLLM's allocator, see pd_node.py) whose
connector is vLLM's real ``MultiConnector`` holding

  1. vLLM's real ``MooncakeConnector`` (P2P hand-off over Mooncake's transfer
     engine, TCP, inside this private network namespace), and
  2. ``AscendStoreConnector`` on the embedded shared-memory ``local`` pool,

configured exactly as ``ascendstore config pd`` prints them. The only stand-in
is the model (deterministic per-token K/V) and one line for CPU-only torch
(see pd_node.py): every KV byte a decode engine holds is checked against what
the prefill engine computed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pd_node import BLOCK_SIZE, MODEL_CONFIG, Node, Result, token_kv

from ascendstore.loopback import free_port
from ascendstore.pd import build_pd_config

pytestmark = [pytest.mark.mooncake, pytest.mark.vllm, pytest.mark.timeout(600)]

CHUNKS = 3  # full pool chunks in PROMPT (chunk = one vLLM block of 32 tokens)
PROMPT = [int(x) for x in np.random.default_rng(7).integers(3, 990, CHUNKS * BLOCK_SIZE + 4)]
ENV = {
    "VLLM_TARGET_DEVICE": "cpu",  # vLLM's CpuPlatform (the lean wheel does not detect it)
    "VLLM_HOST_IP": "127.0.0.1",  # where Mooncake's side channel listens; the netns has only lo
    "PYTHONHASHSEED": "0",
}


class Cluster:
    """Two prefill instances and a decode instance on one host, as the helper configures them."""

    def __init__(self, tmp: Path) -> None:
        self.model = tmp / "model"
        self.model.mkdir()
        (self.model / "config.json").write_text(json.dumps(MODEL_CONFIG))
        pool = {"name": f"pd-{uuid.uuid4().hex[:8]}", "capacity": "16MiB", "page_size": "4KiB"}
        self.nodes: dict[str, Node] = {}
        self.bootstrap: dict[str, int] = {}
        common = {"protocol": "tcp", "backend": "local", "backend_config": pool}
        # P1 pins its identity (instance_id): its lookup IPC path is then predictable.
        # Unique per run: another test run on this host must not find it served.
        self.p1_identity = f"host-a-{uuid.uuid4().hex[:8]}"
        self.configs = {
            "P1": build_pd_config("prefill", instance=0, extra={"instance_id": self.p1_identity}, **common),
            "P2": build_pd_config("prefill", instance=1, **common),
            "D": build_pd_config("decode", instance=2, **common),
            "Dflags": build_pd_config("decode", instance=3, consumer_is_to_load=True, consumer_is_to_put=True,
                                      **common),
            "Ddecode": build_pd_config("decode", instance=4, consumer_is_to_put=True, save_decode_cache=True,
                                       **common),
        }

    def node(self, name: str) -> Node:
        if name not in self.nodes:
            env = dict(ENV)
            if self.configs[name]["kv_role"] == "kv_producer":
                # Each prefill instance's rank 0 runs MooncakeConnector's bootstrap server.
                self.bootstrap[name] = free_port()
                env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(self.bootstrap[name])
            self.nodes[name] = Node(name, self.configs[name], str(self.model), env=env)
        return self.nodes[name]

    def prefill(self, name: str, req_id: str, prompt: list[int]) -> tuple[Result, dict]:
        """What a PD proxy does: prefill with max_tokens 1, then hand the decode side its params."""
        p = self.node(name)
        transfer_id = f"xfer-{req_id}"
        p.submit(req_id, prompt, 1, {"do_remote_decode": True, "do_remote_prefill": False,
                                     "transfer_id": transfer_id})
        res = p.result(req_id, timeout=120)
        decode_params = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_engine_id": p.info["engine_id"],
            "remote_bootstrap_addr": f"http://127.0.0.1:{self.bootstrap[name]}",
        }
        return res, decode_params

    def run(self, name: str, req_id: str, prompt: list[int], max_tokens: int, params: dict | None = None) -> Result:
        n = self.node(name)
        n.submit(req_id, prompt, max_tokens, params)
        return n.result(req_id, timeout=120)

    def close(self) -> None:
        for n in self.nodes.values():
            n.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("pd"))
    try:
        yield c
    finally:
        c.close()


def expected_kv(prompt: list[int]) -> bytes:
    return token_kv(prompt, 0, len(prompt)).tobytes()


def assert_drained(node: Node) -> None:
    """Nothing held: the P2P sender released the prompt's blocks once decode pulled
    them, and the pool connector's delayed frees completed."""
    st = node.wait_idle(timeout=60)
    assert st["requests"] == [], f"{node.name} still holds {st['requests']}"
    assert st["free_blocks"] == st["num_blocks"] - 1, st  # vLLM keeps block 0 as the null block


def test_prefill_hands_kv_to_decode_byte_exact(cluster: Cluster) -> None:
    p, params = cluster.prefill("P1", "r1", PROMPT)
    assert p.finish_reason == "length" and len(p.tokens) == 1
    assert p.computed_positions == list(range(len(PROMPT))), "P1 has an empty pool: it computes the whole prompt"
    assert p.prompt_kv == expected_kv(PROMPT)

    d = cluster.run("D", "r1-dec", PROMPT, 4, params)
    assert d.finish_reason == "length", d
    # Decode computed only the last prompt token (vLLM recomputes it to sample);
    # every other token's KV arrived from P1 through MooncakeConnector.
    assert d.computed_positions == [len(PROMPT) - 1]
    assert d.prompt_kv == p.prompt_kv, "decode KV differs from prefill KV"
    assert d.tokens[0] == p.tokens[0]
    assert_drained(cluster.node("P1"))
    assert_drained(cluster.node("D"))


def test_second_prefill_engine_hits_the_pool(cluster: Cluster) -> None:
    # P1 stored the prompt's full chunks in the pool during r1's prefill.
    p2, params = cluster.prefill("P2", "r2", PROMPT)
    # A fresh engine (empty device prefix cache) skipped exactly the pooled chunks.
    assert p2.computed_positions == list(range(CHUNKS * BLOCK_SIZE, len(PROMPT)))
    assert p2.prompt_kv == expected_kv(PROMPT)

    d = cluster.node("D")
    assert d.call("reset_prefix_cache") is True  # so D's own device cache cannot serve the prompt
    dec = cluster.run("D", "r2-dec", PROMPT, 4, params)
    assert dec.computed_positions == [len(PROMPT) - 1]
    assert dec.prompt_kv == expected_kv(PROMPT)
    assert_drained(cluster.node("P2"))


def test_decode_neither_loads_nor_saves_by_default(cluster: Cluster) -> None:
    d = cluster.node("D")
    assert d.call("reset_prefix_cache") is True
    # PROMPT is in the pool, but a decode node does not look it up ...
    local = cluster.run("D", "r3", PROMPT, 2)
    assert local.computed_positions == list(range(len(PROMPT)))
    # ... and what it computes is not written to the pool: a prefill engine misses it.
    fresh = [int(x) for x in np.random.default_rng(11).integers(3, 990, 2 * BLOCK_SIZE + 3)]
    cluster.run("D", "r4", fresh, 2)
    probe = cluster.run("P2", "r4-p", fresh, 1)  # a plain request: the pool alone decides what P2 skips
    assert probe.computed_positions == list(range(len(fresh)))


def test_consumer_flags_open_the_pool_to_decode(cluster: Cluster) -> None:
    # consumer_is_to_load: the decode node loads the prefix the prefill nodes stored.
    hit = cluster.run("Dflags", "r5", PROMPT, 2)
    assert hit.computed_positions == list(range(CHUNKS * BLOCK_SIZE, len(PROMPT)))
    assert hit.prompt_kv == expected_kv(PROMPT)
    # consumer_is_to_put: what it computes becomes a pool hit for prefill nodes.
    fresh = [int(x) for x in np.random.default_rng(13).integers(3, 990, 2 * BLOCK_SIZE + 5)]
    cluster.run("Dflags", "r6", fresh, 2)
    assert_drained(cluster.node("Dflags"))  # its saves are done
    p2 = cluster.run("P2", "r6-p", fresh, 1)
    assert p2.computed_positions == list(range(2 * BLOCK_SIZE, len(fresh)))
    assert p2.prompt_kv == expected_kv(fresh)


@pytest.mark.parametrize("node,saved_chunks", [("Dflags", 2), ("Ddecode", 3)])
def test_save_decode_cache_adds_the_chunks_filled_while_decoding(cluster: Cluster, node: str,
                                                                 saved_chunks: int) -> None:
    # 2 full chunks of prompt + 20 tokens; 16 generated tokens complete the 3rd chunk while decoding.
    prompt = [int(x) for x in np.random.default_rng(100 + len(node)).integers(3, 990, 2 * BLOCK_SIZE + 20)]
    out = cluster.run(node, f"r8-{node}", prompt, 16)
    assert len(out.tokens) == 16
    assert_drained(cluster.node(node))
    seq = prompt + out.tokens  # what a next turn would send
    p2 = cluster.run("P2", f"r8-p-{node}", seq, 1)
    assert p2.computed_positions == list(range(saved_chunks * BLOCK_SIZE, len(seq)))
    assert p2.prompt_kv == expected_kv(seq)


def test_broken_setups_stop_the_engine_at_start_up(cluster: Cluster) -> None:
    cluster.node("P1")  # running, serving lookups on its IPC path
    # A second instance on this host with P1's identity and lookup_rpc_port.
    clash = build_pd_config("prefill", instance=0, extra={"instance_id": cluster.p1_identity}, protocol="tcp",
                            backend="local",
                            backend_config=cluster.configs["P1"]["kv_connector_extra_config"]["connectors"][1]
                            ["kv_connector_extra_config"]["backend_config"])
    with pytest.raises(RuntimeError, match="already served by another vLLM instance"):
        Node("clash", clash, str(cluster.model), env={**ENV, "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(free_port())})
    # Children in the wrong order: refused when vLLM creates the connector (the plugin's check).
    wrong = build_pd_config("decode", protocol="tcp")
    wrong["kv_connector_extra_config"]["connectors"].reverse()
    with pytest.raises(RuntimeError, match="connectors are in the wrong order"):
        Node("wrong", wrong, str(cluster.model), env=ENV)
    # P1 kept serving: the refused instance took nothing from it.
    fresh = [int(x) for x in np.random.default_rng(17).integers(3, 990, BLOCK_SIZE + 7)]
    p = cluster.run("P1", "r7", fresh, 1)
    assert p.computed_positions == list(range(len(fresh))) and p.prompt_kv == expected_kv(fresh)
