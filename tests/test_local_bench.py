"""bench/bench_local.py runs, stays bounded and reports every figure it promises
(speed itself is never asserted in tests: the numbers are for people to read)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_local_quick_reports_every_figure(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_local.py"), "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"BENCH_DISK_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
        check=True,
    )
    res = json.loads(out.stdout)
    for size in ("64KiB", "2048KiB"):
        for ck in ("off", "on"):
            r = res[f"dram_{size}_checksum_{ck}"]
            for k in ("memcpy_in", "put", "put_ratio", "memcpy_out", "get", "get_ratio"):
                assert r[k] > 0, (size, ck, k)
    assert res["exists_512_median_us"] > 0
    assert res["disk_64KiB"]["put"] > 0 and res["disk_64KiB"]["get"] > 0
    assert res["disk_64KiB"]["spills"] > 0 and res["disk_64KiB"]["disk_hits"] > 0
    assert list(tmp_path.iterdir()) == []  # the bench's disk tier cleaned up after itself
