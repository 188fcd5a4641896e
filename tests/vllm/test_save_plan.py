"""The scheduler skips running requests with no new full chunk (``_Tracker.save_at``)
without a call per request; it must plan exactly the saves the full per-request
planning does, through the real vLLM scheduler: chunked prefill, decode with and
without ``save_decode_cache``, partial tails kept or not, chunks of 1 or 4
blocks, loads from the pool (which move a request's save cursor), a preemption."""

from __future__ import annotations

import pytest
from ascendstore_vllm.testing import EngineHarness, EngineSpec
from conftest import pool_config

BS = 16
CONFIGS = {
    "default": {},
    "decode-saves": {"save_decode_cache": True},
    "tails-bpc4": {"discard_partial_chunks": False, "chunk_size": 4 * BS},
    "tails-decode-bpc4": {"discard_partial_chunks": False, "save_decode_cache": True, "chunk_size": 4 * BS},
    "bpc4": {"chunk_size": 4 * BS},
}


def _prompts() -> list[tuple[str, list[int], int]]:
    base = [(7 * i + 3) % 997 for i in range(300)]
    out = []
    for r in range(8):
        n = 40 + 37 * r  # block and chunk ends fall everywhere
        prompt = base[: n // 2] + [(13 * i + r) % 991 for i in range(n - n // 2)] if r % 2 else base[:n]
        out.append((f"r{r}", prompt, 20 + 9 * r))  # decodes cross block (and chunk) boundaries
    return out


def _run(root: str, cfg: dict, general: bool, stats: dict) -> list[list[tuple]]:
    eng = EngineHarness(EngineSpec(extra_config=pool_config(root, **cfg), max_num_batched_tokens=48,
                                   num_blocks=56, max_num_seqs=8, max_model_len=512))
    plans: list[list[tuple]] = []
    stats.clear()
    try:
        sched = eng.connector.scheduler
        if general:  # the full planning of every running request, every step
            sched._plan_running = lambda meta, so, save: sched._plan_running_general(meta, so, save, False, {})
        build = sched._build_meta

        def record(so):
            meta = build(so)
            plans.append([(s.req_id, [(c.index, c.chunk_hash, tuple(c.block_ids)) for c in s.chunks])
                          for s in meta.saves])
            return meta

        sched._build_meta = record
        for req_id, prompt, out in _prompts():
            eng.add_request(req_id, prompt, max_tokens=out)
        eng.run(timeout_s=120)
        stats.update(eng.stats_total())
        stats["preempted"] = sum(len(r.preempted) for r in eng.records)
    finally:
        eng.close()
    return plans


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_skipping_idle_requests_plans_the_same_saves(tmp_path, cfg):
    fast_root, full_root = tmp_path / "fast", tmp_path / "full"
    fast_root.mkdir()
    full_root.mkdir()
    # Twice each: the second run of a config loads the prefixes the first one saved.
    stats: dict = {}
    fast = [_run(str(fast_root), CONFIGS[cfg], False, stats) for _ in range(2)]
    assert stats.get("load_ops", 0) > 0, "the second run loads from the pool"
    assert stats["preempted"] > 0, "the device cache is small enough to preempt"
    full = [_run(str(full_root), CONFIGS[cfg], True, stats) for _ in range(2)]
    assert fast == full
    saves = [s for run in fast for step in run for s in step]
    assert saves, "the workload saves something"
    if CONFIGS[cfg].get("save_decode_cache"):
        prompt_len = {r: len(p) for r, p, _ in _prompts()}
        chunk = CONFIGS[cfg].get("chunk_size", BS)
        assert any((c[0] + 1) * chunk > prompt_len[r] for r, chunks in saves for c in chunks), \
            "decode saves chunks past the prompt"


def test_saves_say_whether_they_re_save_a_device_prefix_hit(tmp_path):
    """``SaveSpec.computed``: False only for the save that re-saves chunks of the
    request's device prefix hit (the pool usually holds them: a store that turns
    duplicate puts away is still asked exists first); the worker hands it on."""
    eng = EngineHarness(EngineSpec(extra_config=pool_config(str(tmp_path)), max_num_batched_tokens=48,
                                   max_model_len=512))
    specs: list[tuple[str, int, bool]] = []
    handed: list[tuple[str, bool]] = []
    try:
        sched = eng.connector.scheduler
        build = sched._build_meta

        def record(so):
            meta = build(so)
            specs.extend((s.req_id, s.chunks[0].index, s.computed) for s in meta.saves)
            return meta

        sched._build_meta = record
        engine = eng.workers[0].connector.worker.engine
        submit = engine.submit_save

        def submitted(req_id, ops, **kw):
            handed.append((req_id, kw.get("computed", False)))
            return submit(req_id, ops, **kw)

        engine.submit_save = submitted
        prompt = [(11 * i + 5) % 983 for i in range(100)]  # 6 full blocks, prefilled 48 tokens a step
        eng.add_request("cold", prompt)
        eng.run()
        eng.add_request("warm", prompt[:80] + [1, 2, 3])  # a device prefix hit of 5 blocks
        eng.run()
        cold = [s for s in specs if s[0] == "cold"]
        warm = [s for s in specs if s[0] == "warm"]
        assert len(cold) > 1 and all(c for _, _, c in cold), cold  # chunked prefill: every save computed
        assert warm and warm[0][1:] == (0, False), warm  # the hit's chunks, from the first
        assert all(c for _, _, c in warm[1:]), warm
        assert handed == [(r, c) for r, _, c in specs], "the worker hands each save's flag to the engine"
    finally:
        eng.close()
