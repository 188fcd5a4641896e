"""bench/bench_lookup.py runs in several processes and reports every figure it
promises (speed itself is never asserted in tests)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from ascendstore.contract import BackendContext, Region, Status
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions

ROOT = Path(__file__).resolve().parents[2]


def test_bench_lookup_in_two_processes_reports_every_figure(tmp_path):
    out = tmp_path / "lookup.json"
    # An engine's pool of the default name, open with options of its own: the bench
    # must leave it alone (opening it under the bench's options would be refused).
    engines_pool = LocalBackend.create(LocalOptions(capacity=8 << 20, page_size=64 << 10), BackendContext())
    kv = np.arange(256, dtype=np.uint8)
    try:
        assert engines_pool.put(["engine-kv"], [[Region(kv.ctypes.data, kv.nbytes)]], 5.0) == [Status.OK]
        subprocess.run(
            [sys.executable, str(ROOT / "bench" / "bench_lookup.py"), "--quick", "--procs", "2", "--max-tokens",
             "16384", "--holes", "0.01", "--crowd", "3000", "--evict-mib", "8", "--json", str(out)],
            capture_output=True, text=True, timeout=300, check=True,
        )
        back = np.zeros_like(kv)  # its object is still there, byte for byte
        assert engines_pool.get(["engine-kv"], [[Region(back.ctypes.data, back.nbytes)]], 5.0) == [Status.OK]
        assert (back == kv).all()
    finally:
        engines_pool.close()
    res = json.loads(out.read_text())
    assert [(r["tokens"], r["scenario"]) for r in res["rows"]] == [
        (t, s) for t in (4096, 16384) for s in ("hit", "half", "miss")]
    for r in res["rows"]:
        for name in ("scan", "scan/bytes", "exists"):
            q = r["ratio"][name]
            assert q["n"] == 2 == len(q["per_process"]) and 0 < q["min"] <= q["median"] <= q["max"], (r, name)
            assert q["within_spread"] >= 0
    s = res["scheduler"]
    assert s["tokens"] == 16384 and s["keys"] == 128 and s["pins"] is True
    for name in ("ratio", "ratio_first", "ratio_first_native"):
        assert s[name]["n"] == 2 and s[name]["median"] > 0
    lv = s["ratio_by_level"]
    assert lv["rounds"]["fast"] == 0 or "ratio_first_native" in lv["fast"]  # (a level without rounds is left out)
    assert len(res["holes"]) == 1
    c = res["crowded"]
    assert (c["tokens"], c["keys"], c["crowd"], c["evict_mib"]) == (16384, 128, 3000, 8)
    for name in ("raw", "scan", "raw cold", "scan cold", "native", "native cold"):
        assert 0 < c["us"][name]["min"] <= c["us"][name]["median"] <= c["us"][name]["max"], name
    for name in ("ratio", "ratio_cold", "ratio_native", "ratio_native_cold"):
        # (like parts 1 and 2, one figure per process: the median of its three rounds)
        assert c[name]["n"] == 2 == len(c[name]["per_process"]) and c[name]["median"] > 0, name
    # its rounds split by host level too, so that agree compares like with like
    clv = c["ratio_by_level"]
    assert sum(clv["rounds"].values()) == 2 * res["rounds"] and "per_round" not in c
    for level in ("fast", "slow"):
        assert clv["rounds"][level] == 0 or set(clv[level]) == {"ratio", "ratio_cold", "ratio_native",
                                                                 "ratio_native_cold"}
