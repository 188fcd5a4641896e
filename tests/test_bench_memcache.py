"""bench/bench_memcache.py runs against the stand-in and reports what it promises
(speed is never asserted: the figures are for people to read, docs/benchmarking.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "bench_memcache.py"), "--rounds", "2", *args],
                          capture_output=True, text=True, timeout=120, check=True)


def test_bench_memcache_reports_both_cases_their_ratio_and_the_added_time():
    res = json.loads(_run("--keys", "1100", "--json").stdout)
    assert res["keys"] == 1100 and res["native_calls"] == 3  # batches of at most 512 keys
    assert set(res["us"]) == {"native", "exists"}
    for figure in [*res["us"].values(), res["ratio"]["exists"]]:
        assert 0 < figure["min"] <= figure["median"] <= figure["max"] and figure["n"] == 2
    assert res["added_us"]["n"] == 2


def test_bench_memcache_prints_a_line_by_default():
    out = _run("--keys", "8").stdout
    assert "exists of 8 keys (1 native call," in out and "exists ÷ native" in out
