"""bench/bench_connector.py runs and reports every figure it promises (speed itself
is never asserted in tests: the numbers are for people to read)."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import run_bench

ROOT = Path(__file__).resolve().parents[2]


def test_bench_connector_quick_reports_every_figure():
    res = run_bench("bench_connector.py", "--quick")
    assert len(res["transfer"]) == 4
    # the local rows on one CPU, the process's first: the engine's save and load threads too
    first = min(os.sched_getaffinity(0))
    assert res["pin_cpu"] == first
    for t in res["transfer"]:
        assert t["pin_cpu"] == first and t["engine_thread_cpus"] == [first], t
        for op in ("put", "get"):
            for case in (f"conn {op}", f"raw {op}"):
                g = t["gbps"][case]
                assert 0 < g["min"] <= g["median"] <= g["max"], (t["objects"], case)
            assert t["ratio"][op]["median"] > 0
        # the step's save as an exists and a put, beside the local pool's put_absent
        assert set(t["ratio"]) == {"put", "get", "put exists first"}
        assert t["gbps"]["conn put exists first"]["median"] > 0
    s = res["scheduler"]
    assert s["running"] == 256 and s["engines"] == 3 and s["clock"] == "thread cpu"
    # One ratio per engine instance; each is connector time over schedule() time.
    assert s["ratio"]["n"] == 3 and 0 < s["ratio"]["min"] <= s["ratio"]["median"] <= s["ratio"]["max"] < 1
    assert 0 < s["connector_ms"] < s["schedule_ms"]


def test_bench_connector_pin_cpu_leaves_rows_unpinned_or_refuses_a_cpu_it_may_not_use():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_connector.py"), "--pin-cpu", "4096",
                          "--quick"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--pin-cpu" in out.stderr, out.stderr
    res = run_bench("bench_connector.py", "--quick", "--pin-cpu", "-1")
    assert res["pin_cpu"] is None
    mask = sorted(os.sched_getaffinity(0))
    assert all(t["pin_cpu"] is None and t["engine_thread_cpus"] == mask for t in res["transfer"])


def test_bench_connector_remote_segment_needs_mooncake_and_the_wall_clock():
    for args, clock in ((["--backend", "mooncake", "--segment", "remote"], "cpu"),
                        (["--segment", "remote"], "wall"), (["--backend", "mooncake", "--segment", "far"], "wall")):
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_connector.py"), *args, "--quick"],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "BENCH_CLOCK": clock})
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert "--segment" in out.stderr, out.stderr


def test_scheduler_share_counts_the_connector_calls_after_schedule(monkeypatch):
    """A step's connector time takes in its calls in update_from_output() too
    (update_connector_output and the rest run after schedule() returns): one that
    burns 2 ms of CPU there shows in every steady step's figure."""
    from ascendstore_vllm.connector import AscendStoreConnector

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_connector
        from harness import thread_clock
    finally:
        sys.path.remove(str(ROOT / "bench"))
    real = AscendStoreConnector.update_connector_output

    def slow(self, connector_output):
        t0 = thread_clock()
        while thread_clock() - t0 < 0.002:
            pass
        return real(self, connector_output)

    monkeypatch.setattr(AscendStoreConnector, "update_connector_output", slow)
    running, steps = bench_connector._scheduler_run("local", 8, 8)
    assert running == 8 and len(steps) == 5
    for sched_s, conn_s in steps:
        assert conn_s >= 0.002 and sched_s > 0, (sched_s, conn_s)
