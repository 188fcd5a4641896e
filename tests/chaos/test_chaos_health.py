"""Health monitor and degraded mode at the engine level: the guard over the real
shared-memory ``local`` pool wrapped by ``faulty`` (outage, slow, hung,
flapping). No vLLM here (tests/chaos/test_chaos_health_vllm.py drives the same
through the real scheduler and worker lifecycle)."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
from chaos_helpers import KiB, MiB, faulty_config, local_config, pool_name, region, report

from ascendstore.chaos import FaultyBackend
from ascendstore.config import load_config
from ascendstore.contract import BackendContext, Status
from ascendstore.engine import BackendGuard, EngineMetrics, KeyBuilder, PoolLookup
from ascendstore.engine.health import HealthMonitor, attach_health, read_states
from ascendstore.keys import RankPart
from ascendstore.registry import create_backend


def open_guard(timeout_s: float = 0.3, **faults) -> tuple[FaultyBackend, BackendGuard]:
    inner = local_config(pool_name("health"), capacity=4 * MiB)
    be = create_backend("faulty", faulty_config(inner, **faults), BackendContext(timeout_s=timeout_s))
    assert isinstance(be, FaultyBackend)
    return be, BackendGuard(be, timeout_s)


def monitor(guard: BackendGuard, threshold: int = 3, interval_s: float = 0.05, probes: int = 2,
            **extra) -> HealthMonitor:
    cfg = load_config({"health_failure_threshold": threshold, "health_probe_interval_ms": int(interval_s * 1000),
                       "health_recovery_probes": probes, "backend": "faulty", **extra})
    m = attach_health(guard, cfg, process="test", instance_id=extra.get("instance_id"))
    assert m is not None
    return m


def backend_calls(be: FaultyBackend) -> int:
    return sum(be.injected.values())


def wait_for(pred, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


@pytest.fixture
def health_log(caplog):
    caplog.set_level(logging.WARNING, logger="ascendstore.engine.health")
    return lambda: [r for r in caplog.records if r.name == "ascendstore.engine.health"]


def test_outage_degrades_stops_traffic_probes_and_resumes(health_log):
    be, guard = open_guard()
    mon = monitor(guard)
    keys = [f"k{i}" for i in range(8)]
    assert guard.exists(keys) == [Status.NOT_FOUND] * 8
    be.set_faults(down=True)
    for _ in range(3):
        assert set(guard.exists(keys)) == {Status.UNAVAILABLE}
    assert mon.degraded, "3 failed calls in a row (threshold 3) must degrade"
    # While degraded: no keyed call reaches the backend; only the probe's one-key exists.
    before = be.injected["down"]
    data = np.zeros(4 * KiB, dtype=np.uint8)
    for _ in range(50):
        assert guard.put(["x"], [[region(data)]]) == [Status.UNAVAILABLE]
        assert guard.get(["x"], [[region(data)]]) == [Status.UNAVAILABLE]
    probes_meanwhile = mon.snapshot().probes
    assert be.injected["down"] - before <= probes_meanwhile + 1, "degraded calls went to the sick backend"
    assert guard.metrics.totals()["degraded_skipped_keys"] >= 100
    assert wait_for(lambda: mon.snapshot().probes >= 3), "the monitor probes in the background"
    assert mon.degraded
    be.set_faults(down=False)
    assert wait_for(lambda: not mon.degraded), "it resumes by itself once probes pass"
    assert guard.exists(keys) == [Status.NOT_FOUND] * 8
    t = guard.metrics.totals()
    lines = health_log()
    report("health_outage", probes=mon.snapshot().probes, log_lines=len(lines),
           degraded=t["health_degraded"], recovered=t["health_recovered"])
    assert t["health_degraded"] == 1 and t["health_recovered"] == 1 and t["degraded"] == 0
    assert len(lines) == 2, [r.getMessage() for r in lines]  # one line per transition, none per call
    assert "degraded" in lines[0].getMessage() and "healthy again" in lines[1].getMessage()
    guard.close()


@pytest.mark.parametrize("kind", ["delay", "hang"])
def test_slow_or_hung_store_degrades_and_answers_at_once(kind):
    # delay: a store honouring its timeout (TIMEOUT); hang: one ignoring it (the guard cuts it off).
    be, guard = open_guard(timeout_s=0.1)
    mon = monitor(guard, threshold=2, interval_s=0.05)
    be.set_faults(**{f"{kind}_s": {"exists": 0.3}})
    assert guard.exists(["a"]) == [Status.TIMEOUT]
    assert guard.exists(["a"]) == [Status.TIMEOUT]
    assert mon.degraded
    lookup = PoolLookup(guard, KeyBuilder("fp", RankPart()), 0.1)
    calls = backend_calls(be)
    hits = [lookup.prefix_hits("-", [f"{i:032x}" for i in range(6)], 0) for _ in range(20)]
    assert hits == [0] * 20
    assert guard.metrics.totals()["lookups_skipped_degraded"] == 20
    assert backend_calls(be) - calls <= mon.snapshot().probes + 1
    be.set_faults(**{f"{kind}_s": {}})
    assert wait_for(lambda: not mon.degraded)
    guard.close()


def test_a_working_backend_answering_misses_or_full_is_not_sick():
    be, guard = open_guard(fail_rate={"put": 1.0}, fail_status="NO_SPACE")
    mon = monitor(guard, threshold=2)
    data = np.zeros(4 * KiB, dtype=np.uint8)
    for _ in range(10):
        assert guard.put(["x"], [[region(data)]]) == [Status.NO_SPACE]
        assert guard.exists(["nope"]) == [Status.NOT_FOUND]
    assert not mon.degraded
    # Some sick keys in a call, fewer than half: not a failed call.
    be.set_faults(fail_rate={"exists": 0.1}, fail_status="UNAVAILABLE", seed=3)
    for _ in range(10):
        guard.exists([f"k{i}" for i in range(40)])
    assert not mon.degraded
    guard.close()


def test_flapping_backend_transitions_stay_few(health_log):
    """Down and up every 60 ms for 3 s: each re-degrade soon after a resume doubles
    the good probes needed, so transitions (and log lines) stay few."""
    be, guard = open_guard(timeout_s=0.1)
    mon = monitor(guard, threshold=2, interval_s=0.02, probes=1)
    stop = threading.Event()

    def flap() -> None:
        down = False
        while not stop.is_set():
            down = not down
            be.set_faults(down=down)
            time.sleep(0.06)

    t = threading.Thread(target=flap, daemon=True)
    t.start()
    sent = 0
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        guard.exists(["k"])
        sent += 1
        time.sleep(0.002)
    stop.set()
    t.join()
    be.set_faults(down=False)
    snap = mon.snapshot()
    lines = health_log()
    report("health_flapping", calls=sent, degraded=snap.degraded_count, recovered=snap.recovered_count,
           recovery_probes_needed=snap.recovery_probes_needed, log_lines=len(lines))
    assert snap.degraded_count >= 1
    # Without backoff: ~25 flaps in 3 s -> up to ~50 transitions.
    assert snap.degraded_count <= 8, snap
    assert snap.recovery_probes_needed > 1 or snap.degraded_count <= 2
    assert len(lines) == snap.degraded_count + snap.recovered_count
    assert wait_for(lambda: not mon.degraded, 15)
    guard.close()


def test_probe_exceptions_and_state_file(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    be, guard = open_guard()
    mon = monitor(guard, threshold=1, instance_id="inst-a")
    [(path, state, alive)] = read_states(instance_id="inst-a")
    assert state["state"] == "healthy" and alive and state["process"] == "test"
    be.set_faults(raise_rate={"exists": 1.0})  # a client that raises: UNAVAILABLE from the guard
    assert guard.exists(["k"]) == [Status.UNAVAILABLE]
    assert mon.degraded

    def state() -> dict:
        [(_, st, _)] = read_states(instance_id="inst-a")
        return st

    # (the file is written right after the state flips)
    assert wait_for(lambda: state()["state"] == "degraded")
    assert "exists" in state()["last_failure"]
    be.set_faults(raise_rate={})
    assert wait_for(lambda: state()["state"] == "healthy")
    assert state()["recovered_count"] == 1
    guard.close()
    assert read_states(instance_id="inst-a") == [], "the state file goes with the process's guard"


def test_monitor_off_and_metrics_state_reported_every_take():
    be, guard = open_guard()
    assert attach_health(guard, load_config({"health_failure_threshold": 0}), process="x") is None
    be.set_faults(down=True)
    for _ in range(20):
        guard.exists(["k"])
    assert guard.monitor is None
    guard.close()
    m = EngineMetrics()
    m.set_state(degraded=0)
    assert m.take() == {"degraded": 0}
    assert m.take() == {}, "an idle healthy process reports nothing"
    m.set_state(degraded=1)
    assert m.take() == {"degraded": 1}
    assert m.take() == {"degraded": 1}, "reported while degraded"
    m.set_state(degraded=0)
    assert m.take() == {"degraded": 0}, "a return to 0 must reach Prometheus"
    assert m.take() == {}
    assert EngineMetrics.merge({"degraded": 1}, {"degraded": 0})["degraded"] == 1


def test_a_lying_health_check_does_not_end_an_outage():
    """health() says OK while every keyed call fails: the probe's exists must pass too."""
    be, guard = open_guard()
    mon = monitor(guard, threshold=2, interval_s=0.02)
    be.set_faults(down=True, health_status="OK")
    guard.exists(["k"])
    guard.exists(["k"])
    assert mon.degraded
    assert wait_for(lambda: mon.snapshot().probes >= 10)
    assert mon.degraded and "probe: exists UNAVAILABLE" in mon.snapshot().last_failure
    assert be.injected["health_lie"] >= 10
    be.set_faults(down=False)
    assert wait_for(lambda: not mon.degraded)
    guard.close()


def test_a_backend_reporting_itself_sick_is_believed_while_quietly_failing():
    """Like a Mooncake client whose master died (exists answers 'absent', not an
    error): call outcomes look fine, the background health watch degrades."""
    be, guard = open_guard()
    mon = monitor(guard, threshold=3, interval_s=0.02)
    be.set_faults(health_status="UNAVAILABLE")
    for _ in range(20):
        assert guard.exists(["k"]) == [Status.NOT_FOUND]  # answers look fine
    assert wait_for(lambda: mon.degraded), "the watch (health every 5 probe intervals) must see it"
    assert "watch: health UNAVAILABLE" in mon.snapshot().last_failure
    assert guard.exists(["k"]) == [Status.UNAVAILABLE] and guard.metrics.totals()["degraded_skipped_keys"] >= 1
    be.set_faults(health_status=None)
    assert wait_for(lambda: not mon.degraded)
    assert guard.exists(["k"]) == [Status.NOT_FOUND]
    guard.close()
