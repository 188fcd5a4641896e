"""Chaos through the real vLLM 0.33 scheduler and worker connector lifecycle (CPU).

Each test fills a private ``local`` pool through an engine, empties vLLM's own
prefix cache so the next requests must come from the pool, switches faults on
in the ``faulty`` wrapper the connector opened, and serves the same prompts
again. Every request must finish, every step stays bounded, and the KV in
vLLM's blocks must equal the model's byte for byte (failed loads recomputed).
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from chaos_helpers import MiB, pool_name, report
from chaos_scenarios import BS, exact, faulty_extra, prompts, run_timed, serve_and_report

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from ascendstore_vllm.testing import EngineHarness, EngineSpec, run_in_subprocess  # noqa: E402

from ascendstore.chaos import live_backends, shm_entries, snapshot  # noqa: E402
from ascendstore.chaos.hygiene import wait_for_threads  # noqa: E402

SLACK = 1.0  # seconds: thread hand-off and vLLM's own step work on a loaded 2-core machine


@pytest.fixture
def engines():
    made: list[EngineHarness] = []

    def make(extra: dict, **spec) -> EngineHarness:
        made.append(EngineHarness(EngineSpec(extra_config=extra, **spec)))
        return made[-1]

    yield make
    for e in reversed(made):
        e.close()


def fill_then_reset(eng: EngineHarness, ps: list[list[int]], tag: str = "w") -> None:
    for i, p in enumerate(ps):
        eng.add_request(f"{tag}{i}", p)
    run_timed(eng)
    assert eng.scheduler.reset_prefix_cache(), "vLLM's prefix cache must be empty for the pool to serve"


def faults(**changes) -> None:
    bs = live_backends()
    assert bs, "the connector did not open the faulty backend"
    for b in bs:
        b.set_faults(**changes)


def serve_again(eng: EngineHarness, ps: list[list[int]], tag: str = "r") -> list[float]:
    for i, p in enumerate(ps):
        eng.add_request(f"{tag}{i}", p)
    return run_timed(eng)


def figures(eng: EngineHarness, times: list[float], tag: str = "r") -> dict:
    s = eng.stats_total()
    recs = [r for r in eng.records]
    return {
        "requests": sum(1 for r in eng.finished if r.startswith(tag)),
        "steps": len(times),
        "worst_step_s": round(max(times), 3),
        "hit_tokens": s.get("lookup_hit_tokens", 0),
        "load_failures": s.get("load_failures", 0),
        "recomputed_blocks": sum(len(r.invalid_block_ids) for r in recs),
        "timeouts": s.get("timeouts", 0),
        "unavailable": s.get("unavailable", 0),
    }


@pytest.mark.parametrize("kind", ["hang", "delay"])
@pytest.mark.parametrize("mode", [{}, {"use_layerwise": True}], ids=["sync", "layerwise"])
def test_slow_or_hanging_store_bounds_every_step_and_recomputes(engines, kind, mode):
    ps = prompts(6, seed=1)
    eng = engines(faulty_extra(pool_name(), timeout_ms=300, lookup_timeout_ms=200, **mode))
    fill_then_reset(eng, ps)
    # exists answers (a hit is planned); get and put are slow or hung
    faults(**{f"{kind}_s": {"get": 1.5, "put": 1.5}})
    t0 = time.monotonic()
    times = serve_again(eng, ps)
    f = figures(eng, times) | {"wall_s": round(time.monotonic() - t0, 2), "kind": kind, "mode": mode}
    report("vllm_slow_store", **f)
    faults(hang_s={}, delay_s={})
    # (The fake model's per-layer read check fires in the step whose loads failed;
    # vLLM discards that step's output and recomputes, so only the final KV counts.)
    assert all(exact(eng, f"r{i}", p) for i, p in enumerate(ps)), "recomputed KV must equal the model's"
    assert f["hit_tokens"] > 0 and f["recomputed_blocks"] > 0, "loads were planned and failed"
    layers = 2 if mode else 1
    # The step's loads are bounded by the configured timeout (per layer when
    # layerwise), whatever the number of requests loading in that step.
    assert f["worst_step_s"] < layers * 0.3 + SLACK, (
        f"a step waited {f['worst_step_s']} s with timeout_ms=300: each request's load is bounded, "
        "the step's loads together are not", f)


def test_hanging_lookup_is_a_miss_and_nothing_waits(engines):
    ps = prompts(3, seed=2)
    eng = engines(faulty_extra(pool_name(), timeout_ms=300, lookup_timeout_ms=150))
    fill_then_reset(eng, ps)
    faults(hang_s={"exists": 2.0})
    times = serve_again(eng, ps)
    f = figures(eng, times)
    report("vllm_hanging_lookup", **f)
    assert f["hit_tokens"] == 0 and all(eng.first_schedule(f"r{i}")[0] == 0 for i in range(3))
    assert all(exact(eng, f"r{i}", p) for i, p in enumerate(ps))
    assert max(times) < 0.3 + SLACK


def test_planted_corruption_is_never_served(engines):
    ps = prompts(6, seed=3)
    eng = engines(faulty_extra(pool_name(), checksum=True, corrupt_rate=0.4, seed=5))
    fill_then_reset(eng, ps)
    planted = sum(b.stats()["injected"].get("corrupt", 0) for b in live_backends())
    faults(corrupt_rate=0.0)
    times = serve_again(eng, ps)
    f = figures(eng, times) | {"planted_corrupt_objects": planted}
    served_wrong = [i for i, p in enumerate(ps) if not exact(eng, f"r{i}", p)]
    f["corrupt_loads_served"] = len(served_wrong)
    report("vllm_planted_corruption", **f)
    assert planted > 0
    assert f["corrupt_loads_served"] == 0, "a damaged object reached vLLM's KV cache"
    assert f["load_failures"] >= planted and f["recomputed_blocks"] > 0
    assert f["hit_tokens"] > 0, "undamaged chunks are still served"


def test_full_pool_skips_writes_and_no_error_reaches_vllm(engines):
    """A store that is full and does not evict (quota stand-in): writes are skipped,
    requests finish, nothing is reported as an error, memory stays bounded."""
    chunk_bytes = 2 * 2 * BS * 32 * 2  # layers * kv heads * tokens * (K+V head size) * fp16
    eng = engines(faulty_extra(pool_name(), quota_bytes=8 * chunk_bytes))
    warm = prompts(2, seed=9)
    fill_then_reset(eng, warm, tag="warm")
    before = snapshot()
    ps = prompts(12, seed=4)
    times = serve_again(eng, ps)
    after = snapshot()
    s = eng.stats_total()
    f = figures(eng, times) | {
        "saved_chunks": s.get("save_ops", 0), "skipped_no_space": s.get("save_no_space", 0),
        "save_failures": s.get("save_failures", 0), "rss_growth_mib": round((after.rss_bytes - before.rss_bytes) / MiB, 1),
    }
    report("vllm_pool_full", **f)
    assert all(exact(eng, f"r{i}", p) for i, p in enumerate(ps))
    assert f["skipped_no_space"] >= 12 * 6 - 8 and f["save_failures"] == 0
    assert f["load_failures"] == 0 and f["recomputed_blocks"] == 0
    assert after.rss_bytes - before.rss_bytes < 64 * MiB


def test_store_outage_mid_workload_then_recovery(engines):
    """The store goes down between steps and comes back: requests during the
    outage are computed, none fails, and the hit rate recovers afterwards."""
    ps = prompts(6, seed=6)
    eng = engines(faulty_extra(pool_name()))
    fill_then_reset(eng, ps)
    faults(down=True)
    times = serve_again(eng, ps[:3], tag="down")
    during = eng.stats_total().get("lookup_hit_tokens", 0)
    assert eng.scheduler.reset_prefix_cache()
    faults(down=False)
    times += serve_again(eng, ps, tag="up")
    s = eng.stats_total()
    f = figures(eng, times, tag="") | {"hit_tokens_during_outage": during,
                                       "hit_tokens_after": s["lookup_hit_tokens"] - during}
    report("vllm_outage_recovery", **f)
    assert during == 0
    assert f["hit_tokens_after"] >= 6 * 6 * BS - 3 * 6 * BS, "hits recover once the store is back"
    assert all(exact(eng, f"up{i}", p) for i, p in enumerate(ps))
    assert all(exact(eng, f"down{i}", p) for i, p in enumerate(ps[:3]))


def test_cache_salt_tenants_never_hit_each_other(engines):
    p = prompts(1, seed=7)[0]
    eng = engines(faulty_extra(pool_name()))
    eng.add_request("alice-1", p, cache_salt="alice")
    run_timed(eng)
    assert eng.scheduler.reset_prefix_cache()
    eng.add_request("bob", p, cache_salt="bob")
    eng.add_request("nosalt", p)
    run_timed(eng)
    assert eng.scheduler.reset_prefix_cache()
    eng.add_request("alice-2", p, cache_salt="alice")
    run_timed(eng)
    firsts = {r: eng.first_schedule(r)[0] for r in ("bob", "nosalt", "alice-2")}
    report("vllm_cache_salt", computed_before=firsts)
    assert firsts["bob"] == 0 and firsts["nosalt"] == 0, "another tenant's KV was served"
    assert firsts["alice-2"] == 6 * BS, "the same tenant is served from the pool"
    assert all(exact(eng, r, p) for r in ("bob", "nosalt", "alice-2"))


@pytest.mark.parametrize("first", [None, "acme"], ids=["default-tenant", "salted-tenant"])
def test_gr_users_of_different_tenants_never_share_kv(engines, first):
    """GR keys name the user; the same uid under two tenants is two users: the
    second tenant misses, and its request does not disturb the first's user."""
    hist = prompts(1, blocks=6, tail=0, seed=8)[0]
    cand = prompts(1, blocks=1, tail=0, seed=9)[0]
    extra = faulty_extra(pool_name(), gr={"enabled": True})
    eng = engines(extra, max_num_batched_tokens=1024)
    fields = {"uid": "42", "candidate_num": len(cand)}
    eng.add_request("first-1", hist + cand, cache_salt=first, extra_args=fields)
    run_timed(eng)
    assert eng.scheduler.reset_prefix_cache()
    eng.add_request("globex", hist + cand, cache_salt="globex", extra_args=fields)
    run_timed(eng)
    assert eng.scheduler.reset_prefix_cache()
    eng.add_request("first-2", hist + cand[::-1], cache_salt=first, extra_args=fields)
    run_timed(eng)
    before = eng.first_schedule("globex")[0]
    same = eng.first_schedule("first-2")[0]
    report("vllm_gr_tenants", first_tenant=first, globex_computed_before=before, first_again_computed_before=same)
    assert before == 0, f"tenant globex was served tenant {first}'s user 42"
    assert same == len(hist), "the first tenant's user is served from the pool (saved, and not disturbed)"
    assert exact(eng, "globex", hist + cand) and exact(eng, "first-2", hist + cand[::-1])


def test_two_instances_on_one_host_do_not_clash(engines):
    """Two engines, same extra config (same lookup port), lookups over IPC to
    their own worker: both serve, each on its own IPC path."""
    pool = pool_name()
    extra = faulty_extra(pool, lookup_mode="rpc", lookup_rpc_port=5555)
    ps = prompts(2, seed=10)
    a = engines(extra)
    a.add_request("a0", ps[0])
    run_timed(a)
    # B (own process) starts while A is up and its lookup server is bound
    b = run_in_subprocess(serve_and_report, extra, [("b0", ps[0]), ("b1", ps[1])], timeout_s=240)
    path_a = a.workers[0].connector.worker.ctx.lookup_ipc_path()
    report("vllm_two_instances", ipc_a=path_a, ipc_b=b["ipc"], b_first=b["first"])
    assert path_a != b["ipc"]
    assert b["exact"] and b["read_errors"] == []
    assert b["first"]["b0"][0] == 6 * BS, "B reads what A stored (shared pool, separate IPC)"
    a.add_request("a1", ps[1])
    run_timed(a)
    assert exact(a, "a1", ps[1]) and a.first_schedule("a1")[0] == 6 * BS


def test_two_instances_forced_to_one_identity_fail_fast(engines):
    """An operator who pins the same instance_id and port on two instances gets a
    start-up error naming the fix, never a lookup socket taken over."""
    from ascendstore.errors import ConfigError

    # (an identity of this run's own: another test run on this host holds none of it)
    extra = faulty_extra(pool_name(), lookup_mode="rpc", lookup_rpc_port=5556,
                         instance_id=f"same-host-a-{uuid.uuid4().hex[:8]}")
    engines(extra)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as exc:
        EngineHarness(EngineSpec(extra_config=extra))
    report("vllm_identity_clash", fail_s=round(time.monotonic() - t0, 2), error=str(exc.value)[:160])
    assert "instance_id" in str(exc.value) and "lookup_rpc_port" in str(exc.value)


def test_connector_shutdown_releases_threads_shm_and_sockets():
    pool = pool_name("hyg")
    extra = faulty_extra(pool, lookup_mode="rpc")
    ps = prompts(2, seed=11)

    def cycle() -> str:
        eng = EngineHarness(EngineSpec(extra_config=extra))
        ipc = eng.workers[0].connector.worker.ctx.lookup_ipc_path()
        for i, p in enumerate(ps):
            eng.add_request(f"h{i}", p)
        run_timed(eng)
        eng.close()
        return ipc.removeprefix("ipc://")

    cycle()  # warm-up: vLLM's process-wide state (gloo group, zmq context)
    wait_for_threads("ascendstore", 5)
    before = snapshot()
    ipc = cycle()
    deadline = time.monotonic() + 5
    while (left := before.new_threads(snapshot())) and time.monotonic() < deadline:
        time.sleep(0.05)
    # zmq's I/O thread closes sockets asynchronously: allow it a bounded moment
    deadline = time.monotonic() + 3
    while True:
        after = snapshot()
        growth = before.growth(after)
        if growth["fds"] <= 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    report("vllm_shutdown_hygiene", before=before.summary(), after=after.summary(), growth=growth,
           threads_left=left, python_threads=[t.name for t in threading.enumerate()])
    assert not left, f"connector threads left after shutdown: {left}"
    assert not [s for s in shm_entries() if pool in s], "the pool's shared memory outlived the engine"
    import os

    assert not os.path.exists(ipc), "the lookup IPC socket file was left behind"
    assert growth.get("fd_socket", 0) <= 0, growth
    assert growth["fds"] <= 0 and growth["shm_maps"] <= 0, growth
