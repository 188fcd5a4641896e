"""bench/bench_connector.py --backend mooncake runs against a real master and
reports every row it promises (speed is never asserted: the figures are for
people to read, docs/benchmarking.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_connector_mooncake_reports_put_and_every_get_per_row():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_connector.py"), "--backend", "mooncake", "--quick",
         "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=300, check=True, env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
    )
    res = json.loads(out.stdout)
    assert res["scheduler"] is None  # the scheduler share is the local pool's
    assert len(res["transfer"]) == 4
    for row in res["transfer"]:
        assert set(row["gbps"]) == {"raw put", "conn put", "raw get", "conn get", "conn get async",
                                    "conn get async direct", "conn put exists first"}
        assert set(row["ratio"]) == {"put", "get", "get async", "get async direct", "put exists first"}
        for g in row["gbps"].values():
            assert 0 < g["min"] <= g["median"] <= g["max"]


def test_bench_connector_mooncake_reads_another_client_s_segment():
    # The worker's client lends nothing: every object sits in the lender process's
    # segment and each transfer crosses a socket; timed by the wall clock.
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_connector.py"), "--backend", "mooncake", "--segment", "remote",
         "--quick", "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=300, check=True,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR", "BENCH_CLOCK": "wall"},
    )
    res = json.loads(out.stdout)
    assert res["segment"] == "remote" and res["clock"] == "wall"
    assert len(res["transfer"]) == 4
    for row in res["transfer"]:
        assert set(row["ratio"]) == {"put", "get", "get async", "get async direct", "put exists first"}
        for g in row["gbps"].values():
            assert 0 < g["min"] <= g["median"] <= g["max"]
