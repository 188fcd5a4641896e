"""bench/bench_local.py runs, stays bounded and reports every figure it promises
(speed itself is never asserted in tests: the numbers are for people to read)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ascendstore.handoff import halt_polling
from ascendstore.local.pages import tmpfs_huge

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
    assert res["user_offset"] == 0  # the caller's buffers 64-byte aligned, as vLLM's KV
    for size in ("64KiB", "2048KiB"):
        r = res[f"dram_{size}"]
        for op in ("put", "get"):
            for case in (
                f"{op} checksum off",
                f"{op} checksum on",
                f"{op}: memcpy",
                f"{op}: memcpy/obj",
                f"{op}: memcpy shm",
            ):
                g = r["gbps"][case]
                assert 0 < g["min"] <= g["median"] <= g["max"], (size, case)
                assert g["n"] == res["procs"] == len(g["per_process"]), (size, case)
                assert g["within_spread"] >= 0
            for ck in ("off", "on"):
                for base in ("memcpy", "memcpy/obj", "memcpy shm"):
                    q = r["ratio"][f"{op} checksum {ck} / {base}"]
                    assert q["median"] > 0 and q["spread"] >= 0, (size, op, ck, base)
    assert res["exists_512_us"]["median"] > 0
    d = res["disk_64KiB"]
    assert d["put_gbps"]["median"] > 0 and d["get_gbps"]["median"] > 0
    assert d["spills"] > 0 and d["disk_hits"] > 0
    assert len(res["env_before"]["loadavg"]) == 3
    # the host's idle polling, with which every hand-off figure moves (ascendstore.handoff)
    assert {k: res["env_before"][k] for k in ("cpuidle_driver", "guest_halt_poll_ns")} == halt_polling().as_dict()
    assert list(tmp_path.iterdir()) == []  # the bench's disk tier cleaned up after itself
    host = tmpfs_huge("/dev/shm")
    assert res["shm_huge"] == host
    if host == "never":  # the usual default: the pools' segments in 4 KiB pages, and said so
        assert res["dram_2048KiB"]["pages"] == {"off": ["small"], "on": ["small"]}


def test_buffers_start_where_the_bench_says():
    """The caller's buffers at --user-offset past a page, the mirrors on one (as the
    pool's objects): glibc's memcpy speed depends on the two addresses mod 64."""
    sys.path.insert(0, str(ROOT / "bench"))
    import harness

    for off in (0, 16, 64, 4095):
        a = harness.placed(5000, off, 7)
        assert a.ctypes.data % 4096 == off and len(a) == 5000 and (a == 7).all()
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_local.py"), "--user-offset", "4096"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--user-offset" in out.stderr and "4096" in out.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None
                    or not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="needs root, unshare(1) and transparent huge pages")
def test_bench_local_over_a_private_dev_shm_that_grants_huge_pages(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_local.py"), "--quick", "--procs", "1", "--json",
         "--shm-huge", "advise"],
        capture_output=True, text=True, timeout=120,
        env={"BENCH_DISK_DIR": str(tmp_path), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}, check=True,
    )
    res = json.loads(out.stdout)
    assert res["shm_huge"] == "advise"
    for size in ("64KiB", "2048KiB"):  # the pools asked for huge pages and got them
        assert res[f"dram_{size}"]["pages"] == {"off": ["thp"], "on": ["thp"]}, size
        assert res[f"dram_{size}"]["gbps"]["get checksum off"]["median"] > 0
