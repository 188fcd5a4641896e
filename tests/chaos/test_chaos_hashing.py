"""Isolation and hashing: keys are deterministic across processes without
PYTHONHASHSEED, a setting that makes them differ between nodes fails at
start-up, and tenants (cache_salt) never share KV."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

ROOT = Path(__file__).parents[2]

# One engine process's view: vLLM's own request block hasher (as the engine core
# builds it) -> our chunk hashes -> pool key text, for both crypto algorithms.
HASHES = textwrap.dedent(
    """
    import json, os, sys
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    from ascendstore.keys import PoolKey, RankPart, chunk_hashes, tenant_id

    def keys():
        out = {}
        for algo in ("sha256", "sha256_cbor"):
            fn = get_hash_fn_by_name(algo)
            init_none_hash(fn)
            for salt in (None, "alice"):
                req = Request("r", list(range(100, 164)), SamplingParams(max_tokens=1), None,
                              cache_salt=salt, block_hasher=get_request_block_hasher(16, fn))
                hs = chunk_hashes(list(req.block_hashes), 2)
                out[f"{algo}/{salt}"] = [PoolKey(tenant_id(salt), "f" * 16, RankPart(), h).text() for h in hs]
        return out

    unseeded = keys()
    os.environ["PYTHONHASHSEED"] = "1"  # vLLM reads it when NONE_HASH is initialised
    print(json.dumps({"unseeded": unseeded, "seeded": keys()}))
    """
)


def _keys_in_fresh_process(**env_over: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.update(env_over)
    return subprocess.Popen(
        [sys.executable, "-c", HASHES], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )


def test_pool_keys_are_identical_across_processes_without_pythonhashseed():
    procs = [_keys_in_fresh_process(), _keys_in_fresh_process()]
    outs = []
    for p in procs:
        stdout, _ = p.communicate(timeout=180)
        assert p.returncode == 0
        outs.append(json.loads(stdout))
    a, b = outs[0]["unseeded"], outs[1]["unseeded"]
    seeded = outs[0]["seeded"]
    assert a == b, "two engines without PYTHONHASHSEED must compute the same pool keys"
    assert all(len(v) == 2 for v in a.values())
    # tenants and algorithms never share a key
    flat = [k for v in a.values() for k in v]
    assert len(set(flat)) == len(flat)
    # PYTHONHASHSEED feeds vLLM's NONE_HASH: a node with a different value never
    # hits what the others stored (a deployment must set it everywhere or nowhere).
    assert seeded["sha256/None"] != a["sha256/None"]


_CFG: list = []


def _context(algo: str):
    """The connector's start-up derivation (both roles run it) for a hash algorithm."""
    from ascendstore_vllm.context import ConnectorContext
    from ascendstore_vllm.testing import EngineSpec, build_vllm_config

    if not _CFG:  # one VllmConfig for the module: building one takes seconds here
        _CFG.append(build_vllm_config(EngineSpec(extra_config={"backend": "local"})))
    cfg = _CFG[0]
    cfg.cache_config.prefix_caching_hash_algo = algo
    return ConnectorContext.from_vllm(cfg, None)


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_random_per_process_hashes_fail_at_start_up(algo, monkeypatch):
    """vLLM seeds NONE_HASH randomly per process for non-cryptographic algorithms
    unless PYTHONHASHSEED is set: every pool lookup would miss, silently."""
    from ascendstore.errors import ConfigError

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ConfigError) as exc:
        _context(algo)
    msg = str(exc.value)
    assert "prefix_caching_hash_algo" in msg and algo in msg and "PYTHONHASHSEED" in msg
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert _context(algo).fingerprint  # with a shared seed it is a valid deployment


def test_hash_algorithm_is_part_of_the_key_fingerprint(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    digests = {algo: _context(algo).fingerprint.digest() for algo in ("sha256", "sha256_cbor")}
    assert digests["sha256"] != digests["sha256_cbor"], (
        "engines hashing blocks differently must not share a key space"
    )
