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
from ascendstore.local.pages import frames_visible, tmpfs_huge

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
    # how physically contiguous each mapping was (docs/benchmarking.md), where frame numbers can be read
    assert res["compact_memory"] is False
    for size in ("64KiB", "2048KiB"):
        layout = res[f"dram_{size}"].get("layout", {})
        if frames_visible():
            assert set(layout) == {"pool off", "pool on", "memcpy shm", "memcpy"}, size
            for name, v in layout.items():
                assert 0.0 <= v["min"] <= v["median"] <= v["max"] <= 1.0, (size, name)
                assert len(v["per_process"]) == res["procs"]
        else:
            assert layout == {}
    host = tmpfs_huge("/dev/shm")
    assert res["shm_huge"] == host
    if host == "never":  # the usual default: 4 KiB pages, unless the kernel made 2 MiB ones of the
        # prefaulted pools (MADV_COLLAPSE: tests/test_local_thp.py), and said so
        assert res["dram_2048KiB"]["pages"] in ({"off": ["small"], "on": ["small"]}, {"off": ["thp"], "on": ["thp"]})


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


def test_compact_memory_is_asked_for_and_refused_where_it_cannot_run(monkeypatch, tmp_path):
    """--compact-memory compacts the host's free memory before each DRAM process (the
    layout a fresh mapping gets decides its copies' speed on 4 KiB pages); where the
    knob cannot be written it fails at once, naming it."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_local
    from typer.testing import CliRunner

    monkeypatch.setattr(bench_local, "COMPACT", str(tmp_path / "no-such-dir" / "compact_memory"))
    got = CliRunner().invoke(bench_local.app, ["--compact-memory", "--quick"])
    assert got.exit_code == 2
    assert "--compact-memory" in got.output and "compact_memory" in got.output
    knob = tmp_path / "compact_memory"
    knob.write_text("")
    compactions = []

    def one_process(*args: object) -> dict:  # each DRAM process finds memory compacted just before it
        compactions.append(knob.read_text())
        knob.write_text("")
        return {}

    monkeypatch.setattr(bench_local, "COMPACT", str(knob))
    monkeypatch.setattr(bench_local, "_one_process", one_process)
    monkeypatch.setattr(bench_local, "bench_exists", lambda *a: {"median": 1.0})
    monkeypatch.setattr(bench_local, "bench_disk", lambda *a: {})
    got = CliRunner().invoke(bench_local.app, ["--compact-memory", "--quick", "--procs", "3", "--json"])
    assert got.exit_code == 0, got.output
    assert compactions == ["1", "1", "1"] and json.loads(got.output)["compact_memory"] is True


@pytest.mark.skipif(tmpfs_huge("/dev/shm") != "never", reason="/dev/shm grants huge pages itself: nothing to compare")
def test_bench_hugefill_quick_reports_every_figure():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_hugefill.py"), "--quick", "--json", "--fill-mib", "32",
         "--rounds", "2"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    res = json.loads(out.stdout)
    fill = res["fill"]
    assert {k: len(v) for k, v in fill.items()} == {"lazy": 1, "off": 1, "prefault": 1}
    (lazy,), (off,), (pre,) = fill["lazy"], fill["off"], fill["prefault"]
    for r in (lazy, off, pre):
        assert r["fill_gbps"] > 0 and r["segment_bytes"] >= 32 << 20 and r["page_table_bytes"] >= 0, r
    assert lazy["caught_up"] and off["caught_up"] is None and off["huge_bytes"] == 0
    # the lazy pool takes memory as it fills; the prefaulted one all of its capacity at once
    assert lazy["segment_bytes"] < 256 << 20 <= 1 << 30 <= pre["segment_bytes"]
    for size in ("64KiB", "2048KiB"):
        for op in ("put", "get"):
            for kind in ("lazy", "off", "prefault"):
                assert res["speed"][size]["gbps"][f"{op} {kind}"]["median"] > 0
            for base in ("off", "prefault"):
                assert res["speed"][size]["ratio"][f"{op} lazy / {base}"]["median"] > 0
