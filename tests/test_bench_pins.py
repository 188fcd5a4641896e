"""bench/bench_pins.py times the lookup-pin ledger and reports what it promises
(speed is never asserted: the figures are for people to read, docs/benchmarking.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {"keys", "record", "release", "record counted", "release counted", "record run", "release run"}


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "bench_pins.py"), "--rounds", "2", *args],
                          capture_output=True, text=True, timeout=120, check=check)


def test_bench_pins_reports_every_case_and_its_ratio_to_building_the_keys():
    res = json.loads(_run("--keys", "64", "--others", "8", "--shared", "16", "--spread", "--json").stdout)
    assert (res["keys"], res["others"], res["shared"], res["spread"]) == (64, 8, 16, True)
    assert set(res["us"]) == CASES | {f"{c} shared" for c in CASES - {"keys"}}
    assert set(res["ratio"]) == set(res["us"]) - {"keys"}
    for figure in [*res["us"].values(), *res["ratio"].values()]:
        assert 0 < figure["min"] <= figure["median"] <= figure["max"] and figure["n"] == 2


def test_bench_pins_leaves_the_shared_cases_out_and_prints_a_table():
    out = _run("--keys", "8", "--others", "0", "--shared", "0").stdout
    assert "one request of 8 keys beside 0 other holdings from chunk 0" in out
    rows = [line.split()[0:2] for line in out.splitlines() if line.startswith("  ")]
    assert ["release", "counted"] in rows and not any("shared" in line for line in out.splitlines()
                                                      if line.startswith("  "))


def test_bench_pins_refuses_more_shared_chunks_than_keys():
    res = _run("--keys", "8", "--shared", "9", check=False)
    assert res.returncode != 0 and "--shared 9 is more than --keys 8" in res.stderr
