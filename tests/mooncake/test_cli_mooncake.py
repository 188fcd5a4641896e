"""`ascendstore doctor` / `pool` against a real mooncake_master (private network namespace)."""

from __future__ import annotations

import json
import tempfile
import uuid

import numpy as np
import pytest
from mooncake_helpers import BUFFER, SEGMENT
from typer.testing import CliRunner

from ascendstore.cli import common as cli_common
from ascendstore.cli import get_app
from ascendstore.contract import Region, Status

runner = CliRunner()


@pytest.fixture(autouse=True)
def private_health_dir(monkeypatch):
    """doctor reads every engine's health file in $VLLM_RPC_BASE_PATH (else the temp
    dir), host-wide: on a long-lived CI host files other jobs left there must not
    decide this test. Short (not tmp_path): lookup sockets live there too."""
    with tempfile.TemporaryDirectory(prefix="as-rpc-") as d:
        monkeypatch.setenv("VLLM_RPC_BASE_PATH", d)
        yield d


def _opts(address: str) -> str:
    return json.dumps(
        {
            "master_server_address": address,
            "local_hostname": "127.0.0.1",
            "global_segment_size": SEGMENT,
            "local_buffer_size": BUFFER,
            "setup_timeout_s": 15,
            "close_timeout_s": 10,
        }
    )


def run(*args: str):
    cli_common.console.width = 250
    return runner.invoke(get_app(), list(args))


def test_doctor_round_trip_then_master_gone(master_factory):
    m = master_factory()
    res = run("doctor", "--backend", "mooncake", "--backend-config", _opts(m.address))
    assert res.exit_code == 0, res.output
    assert "bytes read back equal bytes written" in res.output and "all checks passed" in res.output
    m.kill()
    res = run("doctor", "--backend", "mooncake", "--backend-config", _opts(m.address))
    assert res.exit_code == 1
    assert "FAIL connect to 'mooncake'" in res.output and m.address in res.output


def test_pool_rm_by_prefix_and_ls_refusal(master, open_backend):
    holder = open_backend()  # holds a segment, so the objects live on while the CLI connects
    tag = f"clitest{uuid.uuid4().hex[:8]}"
    keys = [f"{tag}@a.{i}" for i in range(3)] + [f"{tag}x@b.0"]
    buf = np.arange(4096, dtype=np.uint8)
    assert holder.put(keys, [[Region(buf.ctypes.data, buf.nbytes)]] * 4, 5.0) == [Status.OK] * 4
    opts = _opts(master.address)
    res = run("pool", "ls", "--prefix", tag, "--backend", "mooncake", "--backend-config", opts)
    assert res.exit_code == 1 and "cannot list keys" in res.output
    res = run("pool", "rm", "--user", tag, "--yes", "--backend", "mooncake", "--backend-config", opts)
    assert res.exit_code == 0, res.output
    assert "removed 3 key(s)" in res.output
    assert holder.exists(keys, 5.0) == [Status.NOT_FOUND] * 3 + [Status.OK]
    res = run("pool", "stats", "--backend", "mooncake", "--backend-config", opts)
    assert res.exit_code == 0 and "health" in res.output and "OK" in res.output


def test_bench_through_real_mooncake_verifies_loaded_kv(master):
    """The vLLM benchmark against a real Mooncake store: pool hits, and every loaded
    byte equal to what the fake model wrote."""
    from ascendstore_vllm.bench.driver import run_bench

    from ascendstore.bench.spec import BenchSpec

    spec = BenchSpec(
        workload="gr",
        workload_params=dict(users=8, requests=48, history_tokens=256, candidates=4, item_tokens=8),
        backend="mooncake",
        backend_config=json.loads(_opts(master.address)),
        device_blocks=96,
    )
    rep = run_bench(spec)
    assert rep.hit_tokens.pool > 0 and rep.bytes_loaded > 0
    assert rep.kv_bytes_verified == rep.bytes_loaded and rep.kv_mismatches == 0
    assert rep.load_errors == 0
    assert rep.prefill_tokens_saved <= rep.infinite_cache_bound_tokens
