"""``ascendstore doctor`` shows the health monitors of running engines."""

from __future__ import annotations

import json
import multiprocessing
import os
import uuid

import pytest
from typer.testing import CliRunner

from ascendstore.cli import common as cli_common
from ascendstore.cli import get_app
from ascendstore.engine.health import HealthMonitor, state_path_for

runner = CliRunner()


@pytest.fixture(autouse=True)
def private_state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    old = cli_common.console.width
    cli_common.console.width = 250
    yield tmp_path
    cli_common.console.width = old


def doctor(instance: str):
    opts = json.dumps({"name": "doc-" + uuid.uuid4().hex[:8], "capacity": "4MiB", "page_size": "4KiB"})
    extra = json.dumps({"instance_id": instance})
    return runner.invoke(get_app(), ["doctor", "--backend", "local", "--backend-config", opts,
                                     "--kv-transfer-config", extra])


def test_doctor_reports_degraded_then_healthy_engine_processes(private_state_dir):
    inst = "inst-" + uuid.uuid4().hex[:6]
    good = [True]
    mons = [HealthMonitor(lambda: (good[0], "probe"), failure_threshold=1, probe_interval_s=60, recovery_probes=1,
                          process=p, backend="mooncake", state_path=state_path_for(inst, p))
            for p in ("scheduler", "worker-dp0-tp0-pp0")]
    try:
        res = doctor(inst)
        assert res.exit_code == 0, res.output
        assert "ok   engine health scheduler" in res.output and "ok   engine health worker-dp0-tp0-pp0" in res.output
        assert "ok   degraded mode: after 5 failed backend calls in a row" in res.output
        mons[1].degrade("get: TIMEOUT")
        res = doctor(inst)
        assert res.exit_code == 1, res.output
        assert "FAIL engine health worker-dp0-tp0-pp0" in res.output and "DEGRADED since" in res.output
        assert "get: TIMEOUT" in res.output
        assert mons[1].probe_now() and not mons[1].degraded
        res = doctor(inst)
        assert res.exit_code == 0 and "1 degraded / 1 recovered" in res.output, res.output
        # A file left by a dead process is named as stale, not as an engine's state.
        stale = state_path_for(inst, "worker-dp0-tp1-pp0")
        with open(stale, "w") as f:
            json.dump({"state": "degraded", "pid": 2**22 + 12345, "process": "worker-dp0-tp1-pp0"}, f)
        res = doctor(inst)
        assert res.exit_code == 0 and "stale health file" in res.output, res.output
        os.unlink(stale)
        # A reused pid: the pid runs (it is this test's), but the process that wrote
        # the file started earlier. CI's long-lived /tmp had degraded files of dead
        # engines whose pids a later job reused: doctor must not report them.
        reused = state_path_for(inst, "worker-dp0-tp2-pp0")
        me = json.loads(open(state_path_for(inst, "scheduler")).read())
        assert me["pid"] == os.getpid() and me["started"] > 0
        with open(reused, "w") as f:
            json.dump({"state": "degraded", "pid": os.getpid(), "started": me["started"] - 3600,
                       "process": "worker-dp0-tp2-pp0", "last_failure": "get: TIMEOUT"}, f)
        res = doctor(inst)
        assert res.exit_code == 0, res.output
        assert f"stale health file of a dead process: {reused}" in res.output
        assert "FAIL" not in res.output
        os.unlink(reused)
    finally:
        for m in mons:
            m.close()
    res = doctor(inst)
    assert "no running AscendStore process publishes its health" in res.output


def test_a_clock_step_never_makes_a_running_engine_stale(private_state_dir):
    """psutil's start time adds /proc/stat's boot time, whole seconds that NTP moves
    while a process runs: 12 minutes into a CI run a live monitor's file read as a
    dead process's. The kernel's clock-tick count decides where a file records it."""
    inst = "inst-" + uuid.uuid4().hex[:6]
    path = state_path_for(inst, "scheduler")
    mon = HealthMonitor(lambda: (True, "probe"), failure_threshold=1, probe_interval_s=60, recovery_probes=1,
                        process="scheduler", backend="mooncake", state_path=path)
    try:
        with open(path) as f:
            st = json.load(f)
        assert st["start_mark"], st
        st["started"] += 2.0  # as a later reading differs once the boot time stepped
        with open(path, "w") as f:
            json.dump(st, f)
        res = doctor(inst)
        assert "ok   engine health scheduler" in res.output and "stale" not in res.output, res.output
        # The same pid started at another tick: a reused pid, not this process.
        boot, ticks = st["start_mark"].rsplit(":", 1)
        st["start_mark"], st["started"] = f"{boot}:{int(ticks) - 100}", st["started"] - 2.0
        with open(path, "w") as f:
            json.dump(st, f)
        res = doctor(inst)
        assert f"stale health file of a dead process: {path}" in res.output and "engine health" not in res.output
    finally:
        mon.close()


def test_a_forked_process_publishes_a_start_of_its_own(private_state_dir):
    """vLLM may fork its workers after the engine's process published its health; a
    child that wrote its parent's start would read as a dead process to doctor."""
    inst = "inst-" + uuid.uuid4().hex[:6]
    parent = HealthMonitor(lambda: (True, "probe"), failure_threshold=1, probe_interval_s=60, recovery_probes=1,
                           process="scheduler", backend="local", state_path=state_path_for(inst, "scheduler"))
    ctx = multiprocessing.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()

    def worker() -> None:
        mon = HealthMonitor(lambda: (True, "probe"), failure_threshold=1, probe_interval_s=60, recovery_probes=1,
                            process="worker-dp0-tp0-pp0", backend="local",
                            state_path=state_path_for(inst, "worker-dp0-tp0-pp0"))
        ready.set()
        done.wait(60)
        mon.close()

    child = ctx.Process(target=worker)
    child.start()
    try:
        assert ready.wait(60), "the forked worker never published"
        res = doctor(inst)
        assert "ok   engine health worker-dp0-tp0-pp0" in res.output and "stale" not in res.output, res.output
        assert "ok   engine health scheduler" in res.output, res.output
    finally:
        done.set()
        child.join(60)
        parent.close()
