"""Degraded mode with a real mooncake_master killed and restarted.

A Mooncake client whose master is dead answers ``exists`` with "absent" (no
error) and fails puts and gets after seconds, so without degraded mode every
step of every process keeps paying for calls to a dead master. Here the
scheduler's and the worker's monitors (one each, judging from their own
client) see the dead master (health watch, failed calls), stop all traffic but
their probes, and resume by themselves after the restart. Real vLLM 0.33
scheduler + worker lifecycle (CPU harness); every KV byte is checked.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import backend_config

pytest.importorskip("vllm")
pytestmark = [pytest.mark.mooncake, pytest.mark.vllm, pytest.mark.timeout(400)]

sys.path.insert(0, str(Path(__file__).parents[1] / "chaos"))
from ascendstore_vllm.testing import EngineHarness, EngineSpec  # noqa: E402
from chaos_helpers import report  # noqa: E402
from chaos_scenarios import BS, exact, run_timed  # noqa: E402

TIMEOUT_MS = 1000


def _prompts(n: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(31)
    return [rng.integers(10, 900, 6 * BS + 4).tolist() for _ in range(n)]


def _wave(eng: EngineHarness, ps: list[list[int]], tag: str) -> dict:
    assert eng.scheduler.reset_prefix_cache()
    s0 = eng.stats_total()
    for i, p in enumerate(ps):
        eng.add_request(f"{tag}-{i}", p)
    times = run_timed(eng, timeout_s=240)
    s1 = eng.stats_total()

    def d(k: str) -> float:
        return s1.get(k, 0) - s0.get(k, 0)

    return {
        "wave": tag, "exact": sum(exact(eng, f"{tag}-{i}", p) for i, p in enumerate(ps)), "requests": len(ps),
        "hit_rate": round(d("lookup_hit_tokens") / sum(len(p) for p in ps), 3),
        "worst_step_s": round(max(times), 3), "lookups_skipped": d("lookups_skipped_degraded"),
        "saves_skipped": d("save_skipped_degraded"), "skipped_keys": d("degraded_skipped_keys"),
        "timeouts": d("timeouts"), "unavailable": d("unavailable"),
    }


def _wait(pred, timeout_s: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if pred():
            return round(time.monotonic() - t0, 2)
        time.sleep(0.05)
    return None


def test_killed_master_degrades_every_process_then_resumes(master_factory, monkeypatch):
    for var in [v for v in os.environ if v.startswith("MOONCAKE_")]:
        monkeypatch.delenv(var)
    m = master_factory()
    extra = {
        "backend": "mooncake", "backend_config": backend_config(m), "timeout_ms": TIMEOUT_MS,
        "lookup_timeout_ms": 500, "health_failure_threshold": 3, "health_probe_interval_ms": 200,
        "health_recovery_probes": 2,
    }
    ps = _prompts()
    eng = EngineHarness(EngineSpec(extra_config=extra))
    mons = {"scheduler": eng.connector.scheduler._guard.monitor, "worker": eng.workers[0].connector.worker.guard.monitor}
    waves = []
    try:
        waves.append(_wave(eng, ps, "fill"))
        waves.append(_wave(eng, ps, "warm"))
        m.kill()
        t_degraded = _wait(lambda: all(x.degraded for x in mons.values()), 30)
        assert t_degraded is not None, {k: x.snapshot() for k, x in mons.items()}
        waves.append(_wave(eng, ps, "down"))
        m.start()
        restarted = time.monotonic()
        t_resumed = _wait(lambda: not any(x.degraded for x in mons.values()), 90)
        assert t_resumed is not None, {k: x.snapshot() for k, x in mons.items()}
        # The restarted master lost every key and every segment: the worker's client
        # re-mounts its segment on a heartbeat after it reconnects, which may come after
        # the monitors resumed (CI once ran four waves, every put short of space, before
        # it did). Until then saves fail for want of space, which is no fault of ours.
        assert _wait(lambda: m.capacity_bytes() > 0, 30) is not None, "no segment re-mounted within 30 s"
        t_remounted = round(time.monotonic() - restarted, 2)
        for i in range(3):  # refill, then hit
            waves.append(_wave(eng, ps, f"after{i}"))
            if waves[-1]["hit_rate"] > 0.8:
                break
    finally:
        eng.close()
    snaps = {k: x.snapshot() for k, x in mons.items()}
    report("mooncake_degraded_mode", degraded_after_kill_s=t_degraded, resumed_after_restart_s=t_resumed,
           remounted_after_restart_s=t_remounted, waves=waves,
           transitions={k: (s.degraded_count, s.recovered_count, s.last_failure) for k, s in snaps.items()})
    by = {w["wave"]: w for w in waves}
    assert all(w["exact"] == w["requests"] for w in waves), "KV differs from the model's"
    assert by["warm"]["hit_rate"] > 0.8
    down = by["down"]
    assert down["hit_rate"] == 0 and down["lookups_skipped"] >= len(ps) and down["saves_skipped"] > 0
    # Degraded: nothing waits on the dead master (no call is made: no timeouts at all).
    assert down["timeouts"] == 0 and down["worst_step_s"] < TIMEOUT_MS / 1000, down
    assert waves[-1]["hit_rate"] > 0.8, [w["hit_rate"] for w in waves]
    assert all(s.degraded_count >= 1 and s.recovered_count >= 1 for s in snaps.values())
