"""Chaos with a real mooncake_master: SIGKILL mid-workload, then restart.

The real vLLM 0.33 scheduler and worker connector lifecycle (CPU harness) serve
waves of requests whose prompts repeat, so the pool should serve most of each
wave. The master is killed while a wave is in flight and restarted later (it
keeps metadata in memory: every key is lost). Every request must finish, every
KV byte must equal the model's (failed loads recomputed), and the hit rate must
recover once the master is back. Figures are printed (``-s``).
"""

from __future__ import annotations

import json
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

N_PROMPTS = 8
BLOCKS = 6


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(21)
    return [rng.integers(10, 900, BLOCKS * BS + 4).tolist() for _ in range(N_PROMPTS)]


def _worker_backend(eng: EngineHarness):
    return eng.workers[0].connector.worker.guard.backend


def _wave(eng: EngineHarness, ps: list[list[int]], tag: str, *, kill_after_steps: int = 0, master=None) -> dict:
    assert eng.scheduler.reset_prefix_cache(), "vLLM's own prefix cache must not serve the wave"
    s0 = eng.stats_total()
    n0 = len(eng.records)
    for i, p in enumerate(ps):
        eng.add_request(f"{tag}-{i}", p, max_tokens=3)
    t0 = time.monotonic()
    times: list[float] = []
    if kill_after_steps:
        for _ in range(kill_after_steps):
            t = time.monotonic()
            eng.step()
            times.append(time.monotonic() - t)
        assert eng.scheduler.requests, "the kill must land while requests are in flight"
        master.kill()
    times += run_timed(eng, timeout_s=240)
    s1 = eng.stats_total()
    recs = eng.records[n0:]
    hit = s1.get("lookup_hit_tokens", 0) - s0.get("lookup_hit_tokens", 0)
    total = sum(len(p) for p in ps)
    return {
        "wave": tag,
        "requests": len(ps),
        "finished": sum(1 for i in range(len(ps)) if f"{tag}-{i}" in eng.snapshots),
        "exact": sum(exact(eng, f"{tag}-{i}", p) for i, p in enumerate(ps)),
        "hit_rate": round(hit / total, 3),
        "load_failures": s1.get("load_failures", 0) - s0.get("load_failures", 0),
        "recomputed_blocks": sum(len(r.invalid_block_ids) for r in recs),
        "save_failures": s1.get("save_failures", 0) - s0.get("save_failures", 0),
        "timeouts": s1.get("timeouts", 0) - s0.get("timeouts", 0),
        "unavailable": s1.get("unavailable", 0) - s0.get("unavailable", 0),
        "wall_s": round(time.monotonic() - t0, 2),
        "worst_step_s": round(max(times), 2),
    }


@pytest.mark.parametrize("health", [
    pytest.param({"health_failure_threshold": 0}, id="no-degraded-mode"),
    # Degraded mode resumes only after health_recovery_probes good probes, one per
    # health_probe_interval_ms (here 2 x 1 s, the defaults) once the master is back.
    pytest.param({}, id="degraded-mode"),
])
def test_master_sigkill_mid_workload_then_restart(master_factory, monkeypatch, tmp_path, health):
    for var in [v for v in os.environ if v.startswith("MOONCAKE_")]:
        monkeypatch.delenv(var)
    m = master_factory()
    timeout_ms = 1000
    extra = {
        "backend": "mooncake",
        "backend_config": backend_config(m),
        "timeout_ms": timeout_ms,
        "lookup_timeout_ms": 500,
        **health,
    }
    ps = _prompts()
    # at most 4 requests run at once: half of each wave is looked up and loaded
    # after the kill, half is in flight when it lands
    eng = EngineHarness(EngineSpec(extra_config=extra, max_num_batched_tokens=256, max_num_seqs=4))
    waves: list[dict] = []
    try:
        waves.append(_wave(eng, ps, "fill"))
        waves.append(_wave(eng, ps, "warm"))
        waves.append(_wave(eng, ps, "killed", kill_after_steps=1, master=m))
        waves.append(_wave(eng, ps, "down"))
        m.start()
        deadline = time.monotonic() + 60
        while not _worker_backend(eng).health(2.0).ok:
            assert time.monotonic() < deadline, "the worker's client did not reconnect within 60 s"
            time.sleep(0.2)
        recovered_after = round(60 - (deadline - time.monotonic()), 1)
        # The first wave after the restart finds nothing and stores again (retrying
        # while the clients re-mount their segments); later waves hit. Recovery is
        # judged by time, not by a count of waves: with degraded mode on, no process
        # sends traffic until its monitor has seen its good probes (2 s here), and a
        # wave of this tiny model takes a few tenths of a second (counting four waves
        # was the xfail "never regains hits": they all ran before the monitors resumed).
        restarted = time.monotonic()
        recover_by = restarted + 30
        i = 0
        while True:
            waves.append(_wave(eng, ps, f"after{i}"))
            i += 1
            if waves[-1]["hit_rate"] > 0.8 or time.monotonic() > recover_by:
                break
            time.sleep(0.25)
        hits_back_s = round(time.monotonic() - restarted, 1)
    finally:
        eng.close()
    totals = {k: sum(w[k] for w in waves) for k in ("requests", "finished", "exact", "load_failures",
                                                    "recomputed_blocks", "save_failures")}
    report("mooncake_master_sigkill", reconnect_s=recovered_after, hits_back_s=hits_back_s, totals=totals,
           waves=waves)
    (tmp_path / "figures.json").write_text(json.dumps(waves))
    by = {w["wave"]: w for w in waves}
    assert totals["finished"] == totals["requests"], "a request did not finish"
    assert totals["exact"] == totals["requests"], "KV differs from the model's"
    assert by["warm"]["hit_rate"] > 0.8, "the pool serves the repeated prompts before the fault"
    assert by["down"]["hit_rate"] == 0
    assert waves[-1]["hit_rate"] > 0.8, f"the hit rate did not recover: {[w['hit_rate'] for w in waves]}"
    # with the master gone, a step may wait for its bounded calls, never longer
    assert by["down"]["worst_step_s"] < 5 * timeout_ms / 1000 + 2, by["down"]
