"""Ownership of vLLM's blocks under late backend calls (real vLLM 0.33 lifecycle, CPU).

The rule (docs/failure-semantics.md): once vLLM has a block back (finished
sending, load done or failed, request aborted), no backend call still running
may read or write it. The ``faulty`` wrapper does the *wrong* thing late: a hung
get scribbles 0xA5 over its regions when it wakes, a hung put reads its regions
only when it wakes. If the connector handed memory back too early, a later
request reads garbage (the harness checks every position each layer attends
to) or a wrong object lands in the pool (a second engine loads it and checks).
"""

from __future__ import annotations

import time

import pytest
import torch
from chaos_helpers import pool_name, report
from chaos_scenarios import exact, faulty_extra, prompts, run_timed

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from ascendstore_vllm.testing import EngineHarness, EngineSpec  # noqa: E402

from ascendstore.chaos import live_backends  # noqa: E402
from ascendstore.engine.guard import GRACE_S  # noqa: E402

HANG_S = 0.6
#: what a late get scribbles (``faulty`` late_garbage): 0xA5A5 as int16; the fake
#: model's KV is never negative, so this value in a block can only be garbage.
GARBAGE = -23131
TIMEOUT_MS = 100
MODES = {"sync": {}, "async": {"load_async": True}, "layerwise": {"use_layerwise": True}}
#: the same over a client that hangs like Mooncake's (``faulty`` detaches): on the
#: engine's load thread itself, which the engine's watchdog gives up on (async,
#: layerwise), or behind the client's own hand-off (sync loads, vLLM's thread).
DETACHING = {f"{m}-detaches": {**kw, "detaches": True} for m, kw in MODES.items()}
#: the same with KV "on a device" the backend reads (Mooncake over rdma/ascend,
#: MemCache's device pool): CPU tensors stand in for device memory, so a host
#: copy into them would not crash here as it would on an NPU; ``scatter`` (the
#: host landing buffer's copy out) is made to fail the test instead. The backend
#: takes registered memory only (``registered_only``, as RDMA): vLLM's KV, the
#: scratch block and the landing buffers must all have been registered.
DEVICE_FAULTS = {"detaches": True, "device_memory": True, "registered_only": True}
DEVICE = {f"{m}-device": {**kw, **DEVICE_FAULTS} for m, kw in MODES.items()}


def _refused() -> int:
    """Transfers the backend refused for touching memory never registered."""
    return sum(b.injected["unregistered"] for b in live_backends())


def _set(**changes) -> None:
    for b in live_backends():
        b.set_faults(**changes)


def _serve(eng: EngineHarness, ps: list[list[int]], tag: str, **kw) -> None:
    for i, p in enumerate(ps):
        eng.add_request(f"{tag}{i}", p, **kw)
    run_timed(eng)


def _workers(eng: EngineHarness):
    return [w.connector.worker for w in eng.workers]


def _garbage_in_blocks(eng: EngineHarness) -> int:
    return sum(int((t.contiguous().view(torch.int16) == GARBAGE).sum()) for w in eng.workers
               for t in w.kv_caches.values())


class GarbageWatch:
    """Scans vLLM's KV tensors for the late-garbage pattern every few ms on a thread,
    so garbage written into a free block is seen before a later prefill overwrites it."""

    def __init__(self, eng: EngineHarness) -> None:
        import threading

        self.eng, self.seen, self._stop = eng, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.seen += _garbage_in_blocks(self.eng)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.seen + _garbage_in_blocks(self.eng)


def _hung_gets_then_reuse(eng: EngineHarness, load, seed: int) -> tuple[int, int]:
    """Run ``load`` with every get hung and scribbling late, keep vLLM reusing
    blocks until the hung gets have woken, and return (garbage seen in vLLM's
    blocks, reuse rounds)."""
    watch = GarbageWatch(eng)
    _set(hang_s={"get": HANG_S}, late_garbage=True)
    load()  # every load overruns: recomputed
    _set(hang_s={})
    end = time.monotonic() + HANG_S + 0.3
    k = 0
    while time.monotonic() < end:
        _serve(eng, prompts(3, seed=seed + k), f"x{k}-", max_tokens=4)
        k += 1
    time.sleep(0.1)
    return watch.stop(), k


def _read_errors(eng: EngineHarness, tags: tuple[str, ...] = ()) -> list:
    # (The harness drops reads of steps vLLM discarded for a failed load.)
    return [e for e in eng.read_errors() if not tags or e[0].startswith(tags)]


@pytest.mark.parametrize("mode", [*MODES, *DETACHING, *DEVICE])
def test_late_get_never_writes_vllm_blocks(mode, monkeypatch):
    """Loads time out, the hung gets later write garbage: vLLM's blocks never see it."""
    host_copies: list[int] = []
    if mode in DEVICE:
        from ascendstore_vllm.worker import AscendStoreWorker

        from ascendstore.engine import transfer

        monkeypatch.setattr(AscendStoreWorker, "treat_kv_as_device", True)
        real_scatter = transfer.scatter
        monkeypatch.setattr(transfer, "scatter", lambda *a: (host_copies.append(1), real_scatter(*a)))
    name = pool_name("own-get")
    extra = faulty_extra(name, checksum=False, timeout_ms=TIMEOUT_MS, **{**MODES, **DETACHING, **DEVICE}[mode])
    eng = EngineHarness(EngineSpec(extra_config=extra, num_blocks=96))
    try:
        ps = prompts(4, seed=11)
        _serve(eng, ps, "w")
        assert eng.scheduler.reset_prefix_cache()
        seen, k = _hung_gets_then_reuse(eng, lambda: _serve(eng, ps, "r"), 100)
        _serve(eng, ps, "z")  # the fast path is back: loads hit and are exact
        injected = sum(b.injected["late_garbage"] for b in live_backends())
        stats = eng.stats_total()
        assert injected >= 1, "the fault never fired: the test proves nothing"
        assert seen == 0, "a late get wrote into vLLM's blocks"
        assert _read_errors(eng) == [], "a late get wrote into blocks vLLM had taken back"
        assert all(exact(eng, f"r{i}", p) and exact(eng, f"z{i}", p) for i, p in enumerate(ps))
        assert stats.get("lookup_hit_tokens", 0) > 0
        for w in _workers(eng):
            w.engine._reap()
            assert not w.engine._retired, "a retired landing buffer was never given back"
        if mode in ("async-detaches", "layerwise-detaches"):
            # The load thread's own gets hung: the watchdog, not a hand-off, gave up on them.
            assert stats.get("loads_abandoned", 0) >= 1, "no load thread's get was given up on"
        elif mode == "sync-detaches":
            assert sum(b.injected["detached"] for b in live_backends()) >= 1
        if mode in DEVICE:
            from ascendstore_vllm.device import DeviceLanding

            assert host_copies == [], "a load was copied into device KV by a host memmove"
            assert _refused() == 0, "a transfer touched memory the backend cannot address"
            assert all(isinstance(w.engine.landing, DeviceLanding) for w in _workers(eng))
            assert stats.get("load_buffers_retired", 0) >= 1, "no load landed in the device buffer"
        report(f"ownership_late_get_{mode}", late_writes=injected, reuse_rounds=k,
               retired=stats.get("load_buffers_retired", 0), timeouts=stats.get("timeouts", 0),
               abandoned=stats.get("loads_abandoned", 0))
    finally:
        _set(hang_s={}, late_garbage=False)
        eng.close()


def test_direct_async_loads_hold_their_requests_until_the_late_gets_end():
    """``direct_async_loads``: async gets write vLLM's blocks, no landing buffer.
    Every get hangs past the timeout, then scribbles into the blocks it was
    given. Each request must stay waiting for its KV (its blocks vLLM's loan)
    until its get has ended, one aborted meanwhile included, while other
    requests keep taking free blocks; then it is recomputed, and nothing vLLM
    reads is garbage. Reported at the deadline instead, a request would compute
    over blocks the late get then overwrites, or (aborted) free blocks that
    other requests reuse."""
    name = pool_name("own-direct")
    extra = faulty_extra(name, checksum=False, timeout_ms=TIMEOUT_MS, load_async=True, direct_async_loads=True,
                         detaches=True)
    eng = EngineHarness(EngineSpec(extra_config=extra, num_blocks=96))
    try:
        ps = prompts(3, seed=41)
        _serve(eng, ps, "w")
        assert eng.scheduler.reset_prefix_cache()
        watch = GarbageWatch(eng)
        _set(hang_s={"get": HANG_S}, late_garbage=True)
        t0 = time.monotonic()
        # One request at a time, each once the previous one's get was given up: a
        # load queued behind a hung get would expire unstarted (no get, no hold).
        added: dict[str, float] = {}
        recv_at: dict[str, float] = {}
        extra_reqs = iter(prompts(12, seed=42))
        aborted = False
        k = 0
        while eng.scheduler.requests or len(added) < len(ps):
            assert time.monotonic() - t0 < 30, f"requests still pending: {list(eng.scheduler.requests)}"
            given_up = eng.stats_total().get("loads_abandoned", 0)
            if len(added) < len(ps) and given_up >= len(added):
                i = len(added)
                eng.add_request(f"r{i}", ps[i], max_tokens=4)
                added[f"r{i}"] = time.monotonic()
            rec = eng.step()
            for r in rec.finished_recving:
                recv_at.setdefault(r, time.monotonic())
            if not aborted and given_up >= len(ps) and "r2" in eng.scheduler.requests:
                eng.abort("r2")  # its get may still be writing: vLLM must keep its blocks
                aborted = True
            if k < 12 and sum(r.startswith("x") for r in eng.scheduler.requests) < 2:
                # New prompts (pool misses, no gets): they take free blocks while the gets hang.
                eng.add_request(f"x{k}", next(extra_reqs), max_tokens=2)
                k += 1
            if not rec.scheduled:
                time.sleep(0.002)
        assert set(recv_at) >= set(added), recv_at
        waited = {r: round(recv_at[r] - t, 3) for r, t in added.items()}
        early = {r: w for r, w in waited.items() if w < HANG_S * 0.9}
        _set(hang_s={}, late_garbage=False)
        seen = watch.stop()
        stats = eng.stats_total()
        assert aborted and not eng.scheduler.requests
        assert stats.get("loads_abandoned", 0) == len(ps), "every request's get should have been given up"
        assert not early, f"loads reported at {early} s, before their gets ({HANG_S} s) ended"
        assert seen > 0, "no late get wrote vLLM's blocks: the loads were not direct, the test proves nothing"
        assert stats.get("load_held_late", 0) >= 1 and stats.get("load_buffers_retired", 0) == 0
        assert _read_errors(eng) == [], "vLLM read bytes a late get wrote"
        assert all(exact(eng, f"r{i}", p) for i, p in enumerate(ps[:2]))
        _serve(eng, ps, "z")  # the fast path is back: loads hit and are exact
        assert _read_errors(eng) == [] and all(exact(eng, f"z{i}", p) for i, p in enumerate(ps))
        report("ownership_direct_async_held", waited_s=waited, late_writes=seen, reuse=k,
               held=stats.get("load_held_late", 0))
    finally:
        _set(hang_s={}, late_garbage=False)
        eng.close()


@pytest.mark.parametrize("mode", [*MODES, "async-detaches", "layerwise-detaches"])
def test_get_answered_within_the_grace_never_loads_garbage(mode):
    """A hung get that wakes after its timeout but before the guard stops waiting
    (``GRACE_S``) and scribbles: its answer reaches the engine, and must not claim
    the garbage as loaded (the pins-on interleaving failure: a load reported OK
    whose bytes were 0xA5). With a detaching client, on the load thread the
    watchdog allows the same grace; sync loads have none to test (the client's
    own hand-off answers TIMEOUT at the timeout itself)."""
    name = pool_name("own-grace")
    extra = faulty_extra(name, checksum=False, timeout_ms=TIMEOUT_MS, **{**MODES, **DETACHING}[mode])
    eng = EngineHarness(EngineSpec(extra_config=extra, num_blocks=96))
    try:
        ps = prompts(4, seed=31)
        _serve(eng, ps, "w")
        assert eng.scheduler.reset_prefix_cache()
        # Past the timeout the backend was given, within the guard's grace.
        _set(hang_s={"get": TIMEOUT_MS / 1000 + GRACE_S / 2}, late_garbage=True)
        for i, p in enumerate(ps):
            eng.add_request(f"r{i}", p, max_tokens=2)
            run_timed(eng)  # one request at a time: its load's first get wakes within the grace
        _set(hang_s={}, late_garbage=False)
        injected = sum(b.injected["late_garbage"] for b in live_backends())
        # A get the guard gave up on retires its landing buffer; one that did not reached a waiting guard.
        retired = eng.stats_total().get("load_buffers_retired", 0)
        assert injected > retired, "no scribbling get answered within the grace: the test proves nothing"
        assert _read_errors(eng) == [], "a get that scribbled was taken as loaded"
        assert _garbage_in_blocks(eng) == 0
        assert all(exact(eng, f"r{i}", p) for i, p in enumerate(ps))
        report(f"ownership_grace_get_{mode}", late_writes=injected, timeouts=eng.stats_total().get("timeouts", 0))
    finally:
        _set(hang_s={}, late_garbage=False)
        eng.close()


@pytest.mark.parametrize("mode", ["sync", "layerwise", "sync-detaches"])
def test_late_put_holds_blocks_until_it_ends(mode):
    """A put that overruns keeps its request's blocks held until it has ended; the
    object it stores is the prefix's KV, loaded byte-exact by another engine.
    (``sync-detaches``: a client without timeouts, as Mooncake, whose put runs on
    the engine's save thread and hangs there.)"""
    name = pool_name("own-put")
    extra = faulty_extra(name, checksum=False, timeout_ms=TIMEOUT_MS, **{**MODES, **DETACHING}[mode])
    a = EngineHarness(EngineSpec(extra_config=extra, num_blocks=96))
    b = None
    try:
        # One writer: a second one's save would wait behind the hung put past
        # timeout_ms and be dropped (its blocks rightly given back at once).
        ps = prompts(1, seed=21)
        _set(hang_s={"put": HANG_S})
        for i, p in enumerate(ps):
            a.add_request(f"w{i}", p)
        t0 = time.monotonic()
        freed_at: dict[str, float] = {}
        # Other requests keep asking for blocks while the puts hang: if the
        # writers' blocks came back early, these would overwrite them.
        extra_reqs = iter(prompts(12, seed=22))
        k = 0
        while a.scheduler.requests and time.monotonic() - t0 < 30:
            rec = a.step()
            for r in rec.finished_sending:
                freed_at.setdefault(r, time.monotonic() - t0)
            if k < 12 and rec.finished:
                a.add_request(f"x{k}", next(extra_reqs), max_tokens=2)
                k += 1
            if not rec.scheduled:
                time.sleep(0.002)
        _set(hang_s={})
        assert "w0" in freed_at
        assert freed_at["w0"] >= HANG_S * 0.9, (
            f"blocks given back at {freed_at} s, before the hung puts ({HANG_S} s) ended")
        assert _read_errors(a) == []
        held = a.stats_total().get("save_held_late", 0)
        if mode in DETACHING:
            # The put hung on the save thread itself (nothing handed off, nothing
            # abandoned): the save ended when the put did, and the blocks with it.
            assert held == 0 and sum(be.injected["detached"] for be in live_backends()) == 0
        else:
            assert held >= 1
        b = EngineHarness(EngineSpec(extra_config=extra, num_blocks=96))
        _serve(b, ps, "r")
        assert b.read_errors() == [], "a late put stored bytes that were not the prefix's KV"
        assert all(exact(b, f"r{i}", p) for i, p in enumerate(ps))
        hit = b.stats_total().get("lookup_hit_tokens", 0)
        if mode.startswith("sync"):
            # (layerwise: the other layers' saves waited behind the hung put past
            # timeout_ms and were dropped, so the chunk is not whole: a miss.)
            assert hit > 0, "the late put's object should be in the pool"
        report(f"ownership_late_put_{mode}", freed_after_s=freed_at, held=held, hit_tokens=hit)
    finally:
        _set(hang_s={})
        if b is not None:
            b.close()
        a.close()


def _set_workers(**changes) -> None:
    """Faults on the workers' clients only: the scheduler's record reads stay fast."""
    for b in live_backends():
        if b.ctx.role != "scheduler":
            b.set_faults(**changes)


@pytest.mark.parametrize("kv", ["host", "device"])
def test_gr_late_get_never_writes_vllm_blocks(kv, monkeypatch):
    """GR swap-ins from a backend that may outlive its deadline land in buffers of
    their own: a hung get's late garbage never reaches vLLM's blocks.

    ``device``: KV taken for device KV and a backend that reads device memory and
    registered memory only (the ``-device`` faults above): the buffers are on the
    device, registered, retired while the hung gets run, and let go after.

    Only the workers' gets hang: a hung scheduler would miss at lookup and plan no
    swap-in at all (then nothing reads into vLLM's blocks, fixed or not). The test
    checks that the swap-ins really ran into the hung gets, so it fails when GR
    gets are given vLLM's blocks directly (gr/staging.py's buffers of their own
    bypassed)."""
    faults = {}
    if kv == "device":
        from ascendstore_vllm.gr import wiring
        from ascendstore_vllm.worker import AscendStoreWorker

        monkeypatch.setattr(wiring.GRAttachment, "treat_kv_as_device", True)
        monkeypatch.setattr(AscendStoreWorker, "treat_kv_as_device", True)
        faults = DEVICE_FAULTS
    name = pool_name("own-gr")
    extra = faulty_extra(name, checksum=False, timeout_ms=TIMEOUT_MS, gr={"enabled": True}, **faults)
    eng = EngineHarness(EngineSpec(extra_config=extra, num_blocks=96))
    hist = prompts(3, blocks=5, tail=0, seed=31)
    cands = prompts(12, blocks=1, tail=0, seed=32)

    def ask(tag: str, k: int, max_tokens: int = 1) -> None:
        for u, h in enumerate(hist):
            eng.add_request(f"{tag}{u}", h + cands[(k + u) % len(cands)], max_tokens=max_tokens,
                            extra_args={"uid": f"u{u}", "user_history_len": len(h)})
        run_timed(eng)

    try:
        ask("w", 0)
        assert eng.scheduler.reset_prefix_cache()
        before = eng.stats_total()
        watch = GarbageWatch(eng)
        _set_workers(hang_s={"get": HANG_S}, late_garbage=True)
        ask("r", 1)  # pool hits planned; every swap-in overruns: recomputed
        _set_workers(hang_s={})
        during = eng.stats_total()
        end = time.monotonic() + HANG_S + 0.3
        k = 0
        while time.monotonic() < end:  # vLLM reuses blocks while the hung gets wake
            _serve(eng, prompts(3, seed=200 + k), f"x{k}-", max_tokens=4)
            k += 1
        time.sleep(0.1)
        seen = watch.stop()
        injected = sum(b.injected["late_garbage"] for b in live_backends())
        attempts = during.get("gr_swapin_attempts", 0) - before.get("gr_swapin_attempts", 0)
        ok = during.get("gr_swapin_successes", 0) - before.get("gr_swapin_successes", 0)
        assert attempts == len(hist) and ok == 0, (
            f"every swap-in should have run into a hung get (attempts {attempts}, successes {ok}): "
            "the test proves nothing")
        assert injected >= 1, "the fault never fired: the test proves nothing"
        assert seen == 0, "a late GR get wrote into vLLM's blocks"
        assert _read_errors(eng) == []
        assert eng.scheduler.reset_prefix_cache()
        ask("z", 2)  # the fast path is back: the pool serves every user again, whole
        after = eng.stats_total()
        assert after.get("gr_swapin_successes", 0) - during.get("gr_swapin_successes", 0) == len(hist)
        staging = eng.workers[0].connector.gr.staging
        if kv == "device":
            from ascendstore_vllm.device import DeviceBuffers

            assert _refused() == 0, "a transfer touched memory the backend cannot address"
            assert type(staging.buffers) is DeviceBuffers
        assert staging.retired() == 0, "a buffer of a hung get was never let go"
        report(f"ownership_late_get_gr_{kv}", late_writes=injected, reuse_rounds=k, swapins=attempts)
    finally:
        _set(hang_s={}, late_garbage=False)
        eng.close()


def test_gr_save_that_times_out_leaves_no_object_behind():
    """A GR save whose put overruns reports TIMEOUT and writes no record; the put
    still stores its KV object when it wakes. The worker removes that object once
    the call has ended (at its next step), so the pool keeps no KV that no record
    describes. Without the reclaim the object stays until the user is saved again."""
    from ascendstore.registry import create_backend

    name = pool_name("own-gr-put")
    extra = faulty_extra(name, checksum=False, timeout_ms=TIMEOUT_MS, gr={"enabled": True})
    eng = EngineHarness(EngineSpec(extra_config=extra, num_blocks=96))
    pool = create_backend("local", extra["backend_config"]["backend_config"])
    hist = prompts(1, blocks=5, tail=0, seed=41)[0]
    try:
        _set_workers(hang_s={"put": HANG_S})
        eng.add_request("w0", hist + prompts(1, blocks=1, tail=3, seed=42)[0], max_tokens=1,
                        extra_args={"uid": "late-u", "user_history_len": len(hist)})
        run_timed(eng)
        _set_workers(hang_s={})
        assert eng.stats_total().get("gr_save_failures", 0) == 1, "the save should have timed out"
        deadline = time.monotonic() + 10 * HANG_S
        while not list(pool.list_keys("late-u@")) and time.monotonic() < deadline:
            time.sleep(0.02)
        keys = list(pool.list_keys("late-u@"))
        assert len(keys) == 1 and keys[0].endswith("@kv_cache"), f"the late put should have landed: {keys}"
        time.sleep(0.1)  # the guard's call has returned
        _serve(eng, prompts(1, seed=43), "x", max_tokens=2)  # a step: the worker reclaims
        assert list(pool.list_keys("late-u@")) == [], "a KV object that no record describes was left"
        assert eng.stats_total().get("gr_late_saves_reclaimed", 0) == 1
        report("ownership_late_put_gr", reclaimed=1)
    finally:
        _set(hang_s={})
        pool.close()
        eng.close()
