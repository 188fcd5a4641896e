"""``ascendstore bench`` end to end: the real vLLM 0.33 scheduler, AscendStoreConnector,
the worker lifecycle and the embedded local pool, with small workloads."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
from ascendstore_vllm.bench.driver import BenchDriver, run_bench
from typer.testing import CliRunner

from ascendstore.bench.report import BenchReport
from ascendstore.bench.spec import BenchSpec
from ascendstore.bench.workloads import make_workload
from ascendstore.cli import common as cli_common
from ascendstore.cli import get_app
from ascendstore.contract import Region, Status
from ascendstore.registry import create_backend

pytestmark = pytest.mark.vllm

SMALL_GR = dict(users=8, requests=48, history_tokens=256, candidates=4, item_tokens=8)


def _check_invariants(rep) -> None:
    assert rep.requests > 0 and rep.prompt_tokens > 0
    for r in rep.per_request:
        # vLLM never serves more than an infinite cache could (same block granularity).
        assert r.device_hit + r.pool_hit <= r.bound_hit, r
        assert r.device_hit % rep.block_size == 0
    assert rep.prefill_tokens_saved <= rep.infinite_cache_bound_tokens
    assert rep.lookup_latency_us.count >= rep.requests
    assert rep.kv_mismatches == 0
    # Every loaded byte was checked against what the fake model wrote for those tokens.
    assert rep.kv_bytes_verified == rep.bytes_loaded


def test_cli_gr_run_writes_report_and_plots(tmp_path):
    cli_common.console.width = 200
    args = [
        "bench",
        "-w",
        "gr",
        "-q",
        "--json",
        str(tmp_path / "r.json"),
        "--plot",
        str(tmp_path / "plots"),
        "--device-blocks",
        "96",
    ]
    for k, v in SMALL_GR.items():
        args += ["-p", f"{k}={v}"]
    res = CliRunner().invoke(get_app(), args)
    assert res.exit_code == 0, res.output
    assert "hit tokens: pool" in res.output and "KV bytes verified" in res.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["workload"] == "gr" and data["backend"] == "local" and data["requests"] == 48
    assert data["hit_tokens"]["pool"] > 0 and data["hit_tokens"]["device"] > 0
    assert data["bytes_loaded"] > 0 and data["kv_bytes_verified"] == data["bytes_loaded"]
    assert data["bytes_saved"] > 0
    assert 0 < data["prefill_tokens_saved_ratio"] <= data["infinite_cache_bound_ratio"] <= 1
    assert (
        data["lookup_latency_us"]["p50"] > 0
        and data["lookup_latency_us"]["p99"] >= data["lookup_latency_us"]["p50"]
    )
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "hit_rate.png",
        "lookup_cdf.png",
        "tiers.png",
    ]


@pytest.mark.parametrize(
    "name,params",
    [
        ("trace", dict(limit=40, block_tokens=32)),
        ("chat", dict(conversations=6, rounds=4, system_tokens=64, user_tokens=32, reply_tokens=16)),
        ("docqa", dict(documents=3, questions=30, doc_tokens=384, question_tokens=16, output_len=2)),
    ],
)
def test_workloads_run_and_respect_the_bound(name, params):
    rep = run_bench(BenchSpec(workload=name, workload_params=params, device_blocks=64))
    _check_invariants(rep)
    assert rep.prefill_tokens_saved > 0


def test_bigger_pool_saves_more_and_both_granularities_run():
    wl = make_workload("gr", **SMALL_GR)
    reps = {
        (g, c): BenchDriver(
            BenchSpec(workload="gr", granularity=g, capacity_fraction=c, device_blocks=48), wl
        ).run()
        for g in ("block", "user")
        for c in (0.1, 1.0)
    }
    for rep in reps.values():
        _check_invariants(rep)
    small, big = reps[("block", 0.1)], reps[("block", 1.0)]
    assert small.pool_capacity_bytes < big.pool_capacity_bytes
    assert big.hit_tokens.pool > small.hit_tokens.pool
    user, block = reps[("user", 1.0)], reps[("block", 1.0)]
    assert user.config["gr"]["enabled"] is True and block.config["gr"]["enabled"] is False
    # The user-granular path really ran (the GR store's counters), found histories in
    # the pool, and never pooled the one-off candidates: fewer bytes saved than block mode.
    assert user.connector_stats.get("gr_saves", 0) > 0 and user.connector_stats.get("gr_dram_hits", 0) > 0
    assert not any("no GR activity" in n for n in user.notes)
    assert user.hit_tokens.pool > 0 and user.bytes_saved < block.bytes_saved
    # every GR report carries the design's five counters, with the user LRU on by default
    from ascendstore.gr.stats import SEED_COUNTERS

    assert block.gr is None and user.gr is not None and list(user.gr)[:5] == list(SEED_COUNTERS)
    assert user.gr["dram_hits"] == user.connector_stats["gr_dram_hits"] > 0
    assert user.gr["swapin_successes"] == user.gr["swapin_attempts"] >= user.gr["dram_hits"]
    assert user.gr["device_hits"] + user.gr["dram_hits"] + user.gr["dram_misses"] == user.requests
    assert user.config["gr"].get("user_lru", True) is True
    assert BenchReport.model_validate_json(user.to_json()).gr == user.gr


def test_verifier_catches_wrong_kv_from_the_pool():
    """Plant wrong bytes in every pool object between two runs: the second run
    loads them and the byte-for-byte check must report mismatches."""
    opts = {
        "name": f"bench-plant-{uuid.uuid4().hex[:8]}",
        "checksum": False,
        "capacity": "64MiB",
        "page_size": "4KiB",
    }
    holder = create_backend("local", opts)  # keeps the pool alive between the runs
    try:
        spec = BenchSpec(workload="gr", workload_params=SMALL_GR, backend_config=opts, device_blocks=96)
        first = run_bench(spec)
        _check_invariants(first)
        keys = list(holder.list_keys("as1@", 100000))
        assert keys
        obj = first.block_size * spec.kv_bytes_per_token()
        junk = np.full(obj, 0x5A, dtype=np.uint8)
        st = holder.put(keys, [[Region(junk.ctypes.data, obj)]] * len(keys), 5.0)
        assert all(s is Status.OK for s in st)
        second = run_bench(spec)
        assert second.hit_tokens.pool > 0 and second.kv_bytes_verified > 0
        assert second.kv_mismatches > 0
    finally:
        holder.close()
