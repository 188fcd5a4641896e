"""A synchronous load that fails must never leave its blocks in vLLM's prefix
cache, through the real vLLM 0.33 scheduler and worker connector lifecycle.

vLLM caches a request's blocks (with their block hashes) when it allocates them,
before a synchronous or layerwise load has written them. When the load fails,
vLLM's default ``kv_load_failure_policy`` ("recompute") keeps the blocks cached
and lets the request recompute them in place. If that request is aborted (or
preempted) before its recompute step, the blocks go back to the free list still
hashed, holding whatever bytes were there before, and the next request with the
same prefix gets a *device* prefix-cache hit on them: wrong KV, with no load
involved. The connector closes that window itself by evicting the failed blocks
(and the blocks after them in the request, computed over them) from vLLM's
prefix cache when it sees the failure (docs/failure-semantics.md).

The test: X's load fails, X is aborted before it recomputes, Y with the same
prompt must see exactly the model's KV (and read nothing stale)."""

from __future__ import annotations

import uuid

import pytest
import torch
from ascendstore_vllm.testing import EngineHarness, EngineSpec

from ascendstore.chaos import live_backends
from ascendstore.local import _shmpool

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

PROMPT = [(7 * i + 3) % 911 for i in range(100)]  # 6 full blocks of 16 + a tail
STALE = 5.0  # what the reused blocks held before (no KV the fake model writes is 5.0 everywhere)


def _extra(name: str, mode: str, pins: bool) -> dict:
    local = {"name": name, "capacity": "4MiB", "page_size": "4KiB"}
    return {"backend": "faulty", "backend_config": {"backend": "local", "backend_config": local},
            "pin_lease_ms": 10_000 if pins else 0, "use_layerwise": mode == "layerwise"}


def _exact(eng: EngineHarness, req: str, prompt: list[int]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(eng.prompt_kv(req), eng.expected_prompt_kv(prompt), strict=True))


@pytest.mark.parametrize("pins", [False, True], ids=["no-pins", "pins"])
@pytest.mark.parametrize("mode", ["sync", "layerwise"])
@pytest.mark.parametrize("end", ["abort", "preempt"])
def test_failed_load_aborted_before_recompute_is_not_a_device_hit(mode, pins, end):
    name = "fl-" + uuid.uuid4().hex[:10]
    eng = EngineHarness(EngineSpec(extra_config=_extra(name, mode, pins)))
    try:
        eng.add_request("fill", PROMPT)
        eng.run()
        assert eng.scheduler.reset_prefix_cache()
        # The free blocks held other requests' KV since: make that visible.
        for w in eng.workers:
            for t in w.kv_caches.values():
                t.fill_(STALE)
        for b in live_backends():
            b.set_faults(fail_rate={"get": 1.0}, fail_status="UNAVAILABLE")
        eng.add_request("x", PROMPT, max_tokens=4)
        rec = eng.step()
        assert rec.invalid_block_ids, "the load did not fail"
        assert eng.scheduler.requests["x"].num_computed_tokens == 0  # to recompute from block 0
        sched = eng.scheduler
        if end == "preempt":
            # Preempted before its recompute, through vLLM's own preemption routine (what
            # memory pressure runs): x's blocks are freed, and x itself looks up again later.
            x = sched.requests["x"]
            sched.running.remove(x)
            sched._preempt_request(x, 0.0)
        else:
            eng.abort("x")
        for b in live_backends():
            b.clear_faults()
        eng.add_request("y", PROMPT)
        eng.run()
        assert eng.read_errors() == [], f"stale KV read: {eng.read_errors()[:4]}"
        for r in ("x", "y") if end == "preempt" else ("y",):
            assert _exact(eng, r, PROMPT), f"KV of {r} differs from the model's"
        if end == "abort":
            # The failed blocks left the prefix cache: y had no device hit. (Preempted: x
            # resumes first and computes the prefix again; y may then hit x's fresh blocks.)
            s = eng.stats_total()
            assert s.get("hit_tokens/device", 0) == 0, s
    finally:
        eng.close()
        _shmpool.unlink(name)


@pytest.mark.parametrize("mode", ["sync", "layerwise"])
def test_failed_load_shared_in_its_step_and_owner_aborted(mode):
    """y is scheduled in x's step with a device hit on x's blocks, allocated (and cached)
    for x's load. The load fails: vLLM truncates x to recompute, and y keeps the blocks
    as computed, trusting x to rewrite them in its next step. x is aborted first: y must
    not attend to the stale bytes (the connector reports them as failed again when y
    reads them, so vLLM has y recompute them)."""
    name = "fs-" + uuid.uuid4().hex[:10]
    eng = EngineHarness(EngineSpec(extra_config=_extra(name, mode, False)))
    short = PROMPT[:69]  # 4 full blocks of x's prompt + 5 tokens
    try:
        eng.add_request("fill", PROMPT)
        eng.run()
        assert eng.scheduler.reset_prefix_cache()
        for w in eng.workers:
            for t in w.kv_caches.values():
                t.fill_(STALE)
        for b in live_backends():
            b.set_faults(fail_rate={"get": 1.0}, fail_status="UNAVAILABLE")
        eng.add_request("x", PROMPT, max_tokens=4)
        eng.add_request("y", short, max_tokens=4)
        rec = eng.step()
        assert rec.invalid_block_ids, "the load did not fail"
        assert rec.computed_before["y"] == 64, "y had no device hit on x's blocks"
        sched = eng.scheduler
        assert sched.requests["x"].num_computed_tokens == 0  # x recomputes
        assert sched.requests["y"].num_computed_tokens == 64  # y trusts x to
        eng.abort("x")
        for b in live_backends():
            b.clear_faults()
        eng.run()
        assert eng.read_errors() == [], f"stale KV read: {eng.read_errors()[:4]}"
        assert _exact(eng, "y", short), "KV of y differs from the model's"
    finally:
        eng.close()
        _shmpool.unlink(name)
