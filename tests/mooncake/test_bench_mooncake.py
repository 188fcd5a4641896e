"""bench/bench_mooncake.py runs against a real master and reports what it promises
(speed is never asserted: the figures are for people to read, docs/benchmarking.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.mooncake


def _run(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_mooncake.py"), "--rounds", "1", "--json", *args],
        capture_output=True, text=True, timeout=300, check=True, env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )
    return json.loads(out.stdout)


def test_bench_mooncake_reports_every_case_per_size_and_its_batch():
    res = _run("--batch", "4")
    assert res["batch"] == 4 and set(res["sizes"]) == {str(64 << 10), str(2 << 20)}
    for r in res["sizes"].values():
        assert set(r["gbps"]) == {"put_raw", "put_ours", "put_thread", "get_raw", "get_ours", "get_thread"}
        for g in r["gbps"].values():
            assert 0 < g["min"] <= g["median"] <= g["max"]
        assert set(r["ratio"]) == set(r["ratio_thread"]) == {"put", "get"}
        assert r["inline_calls"] > 0  # "ours" ran on the calling thread, "thread" did not
    lk = res["lookup"]
    assert lk["chunks"] == lk["keys"] == 1024
    cases = {"exists", "exists/cached", "lookup", "lookup/pinned", "lookup/pinned/cache", "lookup/waiting"}
    assert set(lk["us"]) == {"raw", *cases} and set(lk["ratio"]) == cases
    assert all(0 < u["min"] <= u["median"] <= u["max"] for u in lk["us"].values())


def test_bench_mooncake_lookup_part_can_be_left_out_or_sized():
    assert _run("--batch", "2", "--lookup-chunks", "0")["lookup"] is None
    lk = _run("--batch", "2", "--lookup-chunks", "16")["lookup"]
    assert lk["chunks"] == lk["keys"] == 16


def test_bench_mooncake_keeps_2mib_objects_to_64mib_calls():
    # 64 x 2 MiB would be 128 MiB per call: more than the engine ever sends at once.
    res = _run("--batch", "64")
    assert res["batch"] == 64 and set(res["sizes"]) == {str(64 << 10)}


def test_bench_mooncake_pins_the_caller_and_the_workers_it_starts():
    cpu = max(os.sched_getaffinity(0))
    res = _run("--batch", "4", "--pin-cpu", str(cpu))
    assert res["pin_cpu"] == cpu
    for r in res["sizes"].values():
        # every guard worker the handed-off calls used was started pinned, and only there
        assert r["worker_cpus"] and all(m == [cpu] for m in r["worker_cpus"]), r["worker_cpus"]
    unpinned = _run("--batch", "4")["sizes"][str(64 << 10)]["worker_cpus"]
    assert unpinned and all(m == sorted(os.sched_getaffinity(0)) for m in unpinned), unpinned


def test_bench_mooncake_places_its_buffers_as_vllms_kv_or_where_told():
    # on a page by default (vLLM's KV is 64-byte aligned); numpy's own place was 16 past one
    for args, want in (((), 0), (("--user-offset", "16"), 16)):
        res = _run("--batch", "2", *args)
        assert res["user_offset"] == want
        assert all(r["buffer_page_offsets"] == [want, want] for r in res["sizes"].values())
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_mooncake.py"), "--user-offset", "4096"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--user-offset" in out.stderr and "4096" in out.stderr


def test_bench_mooncake_refuses_a_cpu_it_may_not_run_on():
    bad = max(os.sched_getaffinity(0)) + 1
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_mooncake.py"), "--pin-cpu", str(bad)],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2 and f"CPU {bad} is not among" in out.stderr and "--pin-cpu" in out.stderr
