"""Randomized interleavings of the two-engine lifecycle (real vLLM 0.33 scheduler
and worker connector lifecycle, CPU), in every transfer mode.

Per mode, engine A writes random prompts into a ``faulty``-wrapped local pool
and engine B (own scheduler, own KV cache, same pool) serves prompts sharing
prefixes with them. Each round draws new faults (delays within the timeout,
key failures, now and then a hung call that ignores the timeout and then does
the wrong thing late), random step pacing, random output lengths and random
aborts. After every round:

* every request's blocks come back to vLLM within ``BOUND_S`` of its end
  (finish or abort): ``timeout_ms`` for a save still queued, the longest hang
  for a put that overran (its blocks stay held until it ends), plus slack for
  a loaded 2-core machine;
* every block is released exactly once: at the end of a round no block has a
  reference left and the free count is the whole pool (a double free would
  leave a negative count or a block twice in the free queue);
* loaded KV is byte-exact: the fake model checks every position each layer
  attends to, and the prompt KV of every request that ran to completion equals
  the model's.

``make test`` runs ``ASCENDSTORE_INTERLEAVE_ROUNDS`` (default 3) rounds per mode;
``make chaos`` runs 200 and prints the counts. ``ASCENDSTORE_INTERLEAVE_PIN_MS``
sets ``pin_lease_ms`` (default: the config's, pins on; 0: off);
``ASCENDSTORE_INTERLEAVE_TRACE=1`` records every backend call and load per key and
prints the history of the keys of a request that read wrong KV (interleave_trace.py).
"""

from __future__ import annotations

import os
import random
import time

import pytest
from chaos_helpers import pool_name, report
from chaos_scenarios import BS, exact, faulty_extra

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from ascendstore_vllm.testing import EngineHarness, EngineSpec, VllmAsyncRecomputeError  # noqa: E402

from ascendstore.chaos import live_backends  # noqa: E402

ROUNDS = int(os.environ.get("ASCENDSTORE_INTERLEAVE_ROUNDS", "3"))
TRACE = os.environ.get("ASCENDSTORE_INTERLEAVE_TRACE") == "1"
if TRACE:
    import interleave_trace

    interleave_trace.install()
TIMEOUT_MS = 150
MAX_HANG_S = 0.4
#: blocks of a finished request are back within this (see the module doc).
BOUND_S = TIMEOUT_MS / 1000 + MAX_HANG_S + 1.5
DEVICE = {"detaches": True, "device_memory": True, "registered_only": True}
MODES = {
    "plain": ({}, {}),
    "async": ({"load_async": True}, {}),
    "layerwise": ({"use_layerwise": True}, {}),
    "tp2": ({}, {"tp_size": 2}),
    "gr": ({"gr": {"enabled": True}}, {}),
    # vLLM's async scheduling (the default on GPU/NPU): step N+1 planned before step N's output.
    "plain-as": ({}, {"async_scheduling": True}),
    "async-as": ({"load_async": True}, {"async_scheduling": True}),
    "layerwise-as": ({"use_layerwise": True}, {"async_scheduling": True}),
    # KV "on a device" that a client like Mooncake's over rdma reads (CPU tensors
    # stand in): loads land in the device landing buffer (GR: user objects go
    # through device buffers), hung calls detach, only registered memory is taken.
    "plain-device": ({**DEVICE}, {}),
    "layerwise-device": ({"use_layerwise": True, **DEVICE}, {}),
    "gr-device": ({"gr": {"enabled": True}, **DEVICE}, {}),
}


def _faults(rng: random.Random) -> dict:
    f: dict = {"delay_s": {}, "hang_s": {}, "fail_rate": {}, "late_garbage": rng.random() < 0.5}
    for op in ("exists", "put", "get"):
        if rng.random() < 0.5:
            f["delay_s"][op] = rng.uniform(0, TIMEOUT_MS / 1000 * 0.6)
    if rng.random() < 0.3:
        f["hang_s"][rng.choice(["put", "get"])] = rng.uniform(TIMEOUT_MS / 1000 * 1.2, MAX_HANG_S)
    if rng.random() < 0.3:
        f["fail_rate"]["get"] = rng.uniform(0, 0.3)
    return f


def _set(**f) -> None:
    for b in live_backends():
        b.set_faults(**f)


class Run:
    """Drives one engine through a round, recording when each request's blocks came back."""

    def __init__(self, eng: EngineHarness, rng: random.Random) -> None:
        self.eng, self.rng = eng, rng
        self.ended: dict[str, float] = {}
        self.back: dict[str, float] = {}
        self.aborted: set[str] = set()
        self.prompts: dict[str, list[int]] = {}

    def add(self, req_id: str, prompt: list[int], extra_args: dict | None = None) -> None:
        self.prompts[req_id] = prompt
        self.eng.add_request(req_id, prompt, max_tokens=self.rng.randint(1, 4), extra_args=extra_args)

    def step_until_empty(self, timeout_s: float = 60.0) -> None:
        eng, rng = self.eng, self.rng
        deadline = time.monotonic() + timeout_s
        while eng.scheduler.requests:
            assert time.monotonic() < deadline, f"requests never freed: {list(eng.scheduler.requests)}"
            running = [r for r in eng.scheduler.requests if r not in self.ended]
            if running and rng.random() < 0.04:
                victim = rng.choice(running)
                eng.abort(victim)
                self.aborted.add(victim)
                self.ended[victim] = time.monotonic()
            rec = eng.step()
            now = time.monotonic()
            for r in rec.finished:
                self.ended.setdefault(r, now)
            for r in list(self.ended):
                if r not in self.back and r not in eng.scheduler.requests:
                    self.back[r] = now
            time.sleep(rng.choice([0, 0, 0.001, 0.003]))
        now = time.monotonic()
        for r in self.ended:
            self.back.setdefault(r, now)

    def worst_release_s(self) -> float:
        return max((self.back[r] - self.ended[r] for r in self.ended), default=0.0)


def _trace_dump(eng: EngineHarness, run: Run, errors: list, mode: str) -> None:
    bad = sorted({e[0] for e in errors})
    print(f"\nTRACE read errors: {errors[:40]}")
    for r in bad:
        p = run.prompts[r]
        print(f"TRACE {r}: aborted={r in run.aborted} first={eng.first_schedule(r) if r in eng.snapshots else None}"
              f" tokens%251={[t % 251 for t in p[:16]]} stored%251={interleave_trace.decode_tokens(eng, r, 16) if r in eng.snapshots else None}")
        for other, q in run.prompts.items():
            if other != r and q[:BS] == p[:BS]:
                print(f"TRACE   shares first block with {other}")
        layers = [None] if mode != "layerwise" else [0, 1]
        for layer in layers:
            print(interleave_trace.dump(interleave_trace.keys_of(eng, p, layer)[:3]))


def _blocks_all_free(eng: EngineHarness) -> None:
    pool = eng.scheduler.kv_cache_manager.block_pool
    refs = [b.ref_cnt for b in pool.blocks if not b.is_null]
    assert min(refs) == 0 and max(refs) == 0, f"block references left: {sorted(set(refs))}"
    assert pool.get_num_free_blocks() == len(pool.blocks) - 1, "a block was lost or freed twice"


def _gr_request(rng: random.Random, users: dict[str, list[int]]) -> tuple[list[int], dict]:
    """GR: a user's history (the pooled prefix) plus fresh candidate items."""
    uid = f"u{rng.randrange(4)}"
    hist = users.setdefault(uid, [rng.randint(10, 900) for _ in range(rng.randint(3, 6) * BS)])
    cands = [rng.randint(10, 900) for _ in range(rng.randint(BS // 2, 2 * BS))]
    return hist + cands, {"uid": uid, "user_history_len": len(hist)}


def _prompt(rng: random.Random, shared: list[list[int]]) -> list[int]:
    if shared and rng.random() < 0.6:
        base = rng.choice(shared)
        cut = rng.randint(1, len(base) // BS) * BS
        return base[:cut] + [rng.randint(10, 900) for _ in range(rng.randint(1, 3 * BS))]
    return [rng.randint(10, 900) for _ in range(rng.randint(2 * BS, 8 * BS))]


@pytest.mark.parametrize("mode", list(MODES))
def test_random_interleavings_release_blocks_once_and_load_exact(mode, monkeypatch):
    extra_mode, spec_kw = MODES[mode]
    if mode.endswith("-device"):
        from ascendstore_vllm.gr.wiring import GRAttachment
        from ascendstore_vllm.worker import AscendStoreWorker

        monkeypatch.setattr(AscendStoreWorker, "treat_kv_as_device", True)
        monkeypatch.setattr(GRAttachment, "treat_kv_as_device", True)
    name = pool_name(f"mix-{mode}")
    extra = faulty_extra(name, checksum=False, capacity="8MiB", timeout_ms=TIMEOUT_MS, lookup_timeout_ms=100,
                         **extra_mode)
    if "ASCENDSTORE_INTERLEAVE_PIN_MS" in os.environ:
        extra["pin_lease_ms"] = int(os.environ["ASCENDSTORE_INTERLEAVE_PIN_MS"])
    a = EngineHarness(EngineSpec(extra_config=extra, num_blocks=96, **spec_kw))
    b = EngineHarness(EngineSpec(extra_config=extra, num_blocks=96, **spec_kw))
    seed = int(os.environ.get("ASCENDSTORE_INTERLEAVE_SEED", str(random.randrange(1 << 30))))
    rng = random.Random(seed)
    print(f"\ninterleaving {mode}: ASCENDSTORE_INTERLEAVE_SEED={seed}", flush=True)
    worst = 0.0
    counts = {"requests": 0, "aborted": 0, "exact_checked": 0, "hit_tokens": 0}
    try:
        for rnd in range(ROUNDS):
            _set(**_faults(rng))
            shared: list[list[int]] = []
            users: dict[str, list[int]] = {}
            for eng, tag in ((a, "a"), (b, "b")):
                run = Run(eng, rng)
                if tag == "b":
                    eng.scheduler.reset_prefix_cache()
                for i in range(rng.randint(2, 5)):
                    if mode.startswith("gr"):
                        run.add(f"{tag}{rnd}-{i}", *_gr_request(rng, users))
                    else:
                        p = _prompt(rng, shared)
                        shared.append(p)
                        run.add(f"{tag}{rnd}-{i}", p)
                try:
                    run.step_until_empty()
                except VllmAsyncRecomputeError as e:
                    # A failed sync/layerwise load under async scheduling: vLLM's recompute
                    # keeps the request's output placeholders (harness.VllmAsyncRecomputeError).
                    pytest.xfail(f"seed {seed}, round {rnd}: {e}")
                if tag == "a":
                    ra = run
                else:
                    rb = run
            for run, eng in ((ra, a), (rb, b)):
                worst = max(worst, run.worst_release_s())
                _blocks_all_free(eng)
                if TRACE and eng.read_errors():
                    _trace_dump(eng, run, eng.read_errors(), mode)
                assert eng.read_errors() == [], f"seed {seed}: wrong KV read (round {rnd})"
                for r, p in run.prompts.items():
                    if r not in run.aborted:
                        assert exact(eng, r, p), f"seed {seed}: KV of {r} differs from the model's"
                        counts["exact_checked"] += 1
                counts["requests"] += len(run.prompts)
                counts["aborted"] += len(run.aborted)
            assert worst <= BOUND_S, f"seed {seed}: blocks came back {worst:.2f}s after the request ended"
        counts["hit_tokens"] = int(b.stats_total().get("lookup_hit_tokens", 0))
        if mode.endswith("-device"):
            refused = sum(x.injected["unregistered"] for x in live_backends())
            assert refused == 0, f"seed {seed}: {refused} transfers touched memory the backend cannot address"
        if mode.startswith("gr"):
            gr = b.connector.gr.totals()
            counts["gr_dram_hits"] = int(gr.get("dram_hits", 0))
            # (swap-ins are counted by the workers, rank 0 for all)
            done = b.workers[0].connector.gr.totals()
            counts["gr_swapin_attempts"] = int(done.get("swapin_attempts", 0))
            counts["gr_swapin_successes"] = int(done.get("swapin_successes", 0))
        report(f"interleaving_{mode}", seed=seed, rounds=ROUNDS, worst_release_s=round(worst, 3),
               bound_s=BOUND_S, **counts)
    finally:
        _set(delay_s={}, hang_s={}, fail_rate={}, late_garbage=False)
        b.close()
        a.close()
