"""KV events a router can trust, through vLLM's real scheduler and worker lifecycle.

A router replays the events vLLM's scheduler publishes (``BlockStored`` /
``BlockRemoved`` from ``take_events``, captured at the scheduler's event
publisher) into an index block hash -> set of media, and after every wave of
requests the index is compared with the pool's real content (``exists`` on
every object of every chunk the workload touched): every stored block is
announced, every evicted one withdrawn, and the medium names the tier.

The pool: ``testdir`` with a small LRU capacity and a removal record (the
interface of the local pool's eviction record, ``removed_since``). The same
test runs against any backend with the capability ``removal_events``: add a
``POOLS`` entry (the ``local`` one is skipped until the local pool has it).
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from ascendstore_vllm.context import chunk_bounds
from ascendstore_vllm.testing import EngineHarness, EngineSpec
from conftest import local_pool_config

from ascendstore.contract import BackendContext, Status
from ascendstore.keys import block_hash_hex
from ascendstore.registry import create_backend

BS = 16


# -- the router side ------------------------------------------------------------------------
@dataclass
class RouterIndex:
    """What a KV-aware router (llm-d's scorer, Dynamo's indexer) keeps: per
    block hash the media it may be loaded from."""

    media: dict[Any, set[str]] = field(default_factory=dict)
    stored: int = 0
    removed: int = 0

    def apply(self, event: Any) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        if isinstance(event, BlockStored):
            self.stored += 1
            for h in event.block_hashes:
                self.media.setdefault(h, set()).add(event.medium)
        elif isinstance(event, BlockRemoved):
            self.removed += 1
            for h in event.block_hashes:
                s = self.media.get(h)
                if s is not None:
                    s.discard(event.medium)
                    if not s:
                        del self.media[h]
        elif isinstance(event, AllBlocksCleared):
            # vLLM's prefix-cache reset: its device blocks ("GPU") are gone; what the
            # pool holds is not (docs/connector.md, KV events).
            for h in list(self.media):
                self.media[h].discard("GPU")
                if not self.media[h]:
                    del self.media[h]


class Recorder:
    """Stands in for vLLM's ZMQ event publisher: what the scheduler publishes."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(batch)

    def events(self) -> list[Any]:
        return [e for b in self.batches for e in b.events]

    def shutdown(self) -> None:
        pass


POOL_MEDIA = {"CPU", "STORAGE"}


def pool_events(rec: Recorder) -> list[Any]:
    """The connector's events (vLLM's own block pool publishes medium "GPU")."""
    return [e for e in rec.events() if getattr(e, "medium", None) in POOL_MEDIA]


def attach_router(eng: EngineHarness) -> Recorder:
    rec = Recorder()
    eng.scheduler.kv_event_publisher = rec
    return rec


# -- pools with a removal record ------------------------------------------------------------
def _testdir(tmp_path, capacity: int, **opts) -> tuple[str, dict]:
    root = tmp_path / f"pool-{uuid.uuid4().hex[:6]}"
    root.mkdir()
    return "testdir", {"root": str(root), "capacity_objects": capacity, "removal_record": True, **opts}


def _local(tmp_path, capacity: int, **opts) -> tuple[str, dict]:
    # ~8 KiB chunk objects here: capacity objects x 8 KiB pages' worth of DRAM.
    # (test-backend options such as jitter_s have no counterpart here)
    cfg = local_pool_config("t-" + uuid.uuid4().hex[:12], backend_config={"capacity": f"{capacity * 8}KiB"})
    return "local", cfg["backend_config"]


POOLS: dict[str, Callable[..., tuple[str, dict]]] = {"testdir": _testdir, "local": _local}


def open_pool(name: str, config: dict):
    return create_backend(name, config, BackendContext(role="tool"))


def require_removal_record(name: str, config: dict) -> None:
    from ascendstore_vllm.events import has_removal_record

    b = open_pool(name, config)
    try:
        if not has_removal_record(b):
            pytest.skip(f"backend {name!r} has no removal record (capability removal_events) yet")
    finally:
        b.close()


# -- the workload -----------------------------------------------------------------------------
@dataclass
class Chunk:
    tenant: str
    chunk_hash: str
    blocks: list[Any]  # vLLM block hashes (as events carry them)


def chunks_of(eng: EngineHarness, req: Any, tail: bool) -> list[Chunk]:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    ctx = eng.connector.scheduler.ctx
    nfull = min(len(req.block_hashes), req.num_prompt_tokens // BS)
    out = []
    for b0, b1 in chunk_bounds(nfull, ctx.blocks_per_chunk, tail):
        out.append(Chunk(ctx.tenant(req.cache_salt), block_hash_hex(req.block_hashes[b1 - 1]),
                         [maybe_convert_block_hash(h) for h in req.block_hashes[b0:b1]]))
    return out


def check_index(eng: EngineHarness, pool, index: RouterIndex, chunks: dict[tuple[str, str], Chunk]) -> int:
    """Index == pool truth, block by block. Returns the chunks present."""
    kb = eng.connector.scheduler.ctx.key_builder()
    cids = list(chunks)
    keys = [kb.lookup_keys(t, h) for t, h in cids]
    statuses = pool.exists([k for ks in keys for k in ks], 5.0)
    present: set[Any] = set()
    i = 0
    n_present = 0
    for cid, ks in zip(cids, keys, strict=True):
        ok = all(s is Status.OK for s in statuses[i : i + len(ks)])
        i += len(ks)
        if ok:
            n_present += 1
            present.update(chunks[cid].blocks)
    universe = {h for c in chunks.values() for h in c.blocks}
    in_pool = {h for h, media in index.media.items() if media & POOL_MEDIA}
    stale = [h for h in universe - present if h in in_pool]
    missing = [h for h in present if h not in in_pool]
    assert not stale, f"{len(stale)} blocks announced but not in the pool (not withdrawn)"
    assert not missing, f"{len(missing)} blocks in the pool but never announced"
    assert in_pool <= universe, "index holds pool blocks no request produced"
    # The pool's DRAM tier is "CPU", its disk tier "STORAGE"; vLLM's own device blocks
    # are "GPU" (its events, same stream).
    assert all(m <= POOL_MEDIA | {"GPU"} for m in index.media.values()), "unexpected medium"
    return n_present


MODES = {
    "plain": ({}, {}),
    "tails": ({"discard_partial_chunks": False}, {}),
    "tp2": ({}, {"tp_size": 2}),
    "layerwise-tp2": ({"use_layerwise": True}, {"tp_size": 2}),
    # random backend delays: saves, evictions and the scheduler's record reads interleave
    "jitter-async": ({"load_async": True, "backend_config": {"jitter_s": 0.004}}, {}),
    "jitter-layerwise-tp2": ({"use_layerwise": True, "backend_config": {"jitter_s": 0.004}}, {"tp_size": 2}),
}


@pytest.mark.parametrize("pool_kind", list(POOLS))
@pytest.mark.parametrize("mode", list(MODES))
def test_router_index_matches_pool_after_evictions(tmp_path, pool_kind, mode):
    extra, shape = dict(MODES[mode][0]), MODES[mode][1]
    tp = shape.get("tp_size", 1)
    width = tp * (2 if extra.get("use_layerwise") else 1)  # objects per chunk
    backend, bcfg = POOLS[pool_kind](tmp_path, capacity=16 * width, **extra.pop("backend_config", {}))
    require_removal_record(backend, bcfg)
    cfg = {"backend": backend, "backend_config": bcfg, "chunk_size": 2 * BS, **extra}
    # A small device cache: repeats must come back from the pool, not from vLLM's own prefix cache.
    eng = EngineHarness(EngineSpec(extra_config=cfg, num_blocks=48, max_model_len=256, kv_events=True, **shape))
    router = attach_router(eng)
    pool = open_pool(backend, bcfg)
    # EVENTS_TEST_SEED varies the workload between repeated runs (default: fixed).
    rng = random.Random(f"{mode}-{pool_kind}-{os.environ.get('EVENTS_TEST_SEED', '')}")
    systems = [[rng.randrange(3, 990) for _ in range(4 * BS)] for _ in range(5)]
    prompts: list[list[int]] = []
    chunks: dict[tuple[str, str], Chunk] = {}
    index = RouterIndex()
    seen = 0
    try:
        for wave in range(9):
            for j in range(4):
                if prompts and rng.random() < 0.4:
                    prompt = rng.choice(prompts)  # a repeat: pool hits
                else:
                    prompt = rng.choice(systems) + [rng.randrange(3, 990) for _ in range(rng.randrange(20, 90))]
                    prompts.append(prompt)
                rid = f"w{wave}-{j}"
                eng.add_request(rid, prompt, max_tokens=rng.choice([1, 3]))
                req = eng.scheduler.requests[rid]
                for c in chunks_of(eng, req, tail="discard_partial_chunks" in extra):
                    chunks[(c.tenant, c.chunk_hash)] = c
            eng.run()
            for e in router.events()[seen:]:
                index.apply(e)
            seen = len(router.events())
            check_index(eng, pool, index, chunks)
            # Forget vLLM's own prefix cache: the next waves' repeats come from the pool.
            assert eng.scheduler.reset_prefix_cache()
        stats = eng.stats_total()
        assert stats.get("save_ops", 0) > 0 and stats.get("load_ops", 0) > 0, stats
        ours = pool_events(router)
        assert any(type(e).__name__ == "BlockStored" for e in ours)
        assert any(type(e).__name__ == "BlockRemoved" for e in ours), "the workload must evict (capacity too large?)"
        # A chunk evicted between lookup and load fails its load and is recomputed
        # (vLLM discards that step): what every request ends with is exact KV.
        if eng.read_errors():
            assert stats.get("load_failures", 0) > 0, eng.read_errors()
        for rid in eng.finished:
            want = eng.expected_prompt_kv(eng.tokens[rid][: eng.prompt_len[rid]])
            assert all(torch.equal(x, y) for x, y in zip(eng.prompt_kv(rid), want, strict=True)), rid
    finally:
        eng.close()
        pool.close()


def test_failed_saves_announce_nothing(tmp_path):
    """A save that never lands (every put overruns timeout_ms) is not announced,
    although the scheduler planned it."""
    backend, bcfg = _testdir(tmp_path, capacity=0, hang_ops=["put"], hang_s=0.3)
    cfg = {"backend": backend, "backend_config": bcfg, "timeout_ms": 50}
    eng = EngineHarness(EngineSpec(extra_config=cfg, kv_events=True))
    router = attach_router(eng)
    try:
        eng.add_request("a", [(5 * i + 1) % 900 for i in range(4 * BS + 3)])
        eng.run()
        assert eng.stats_total().get("timeouts", 0) > 0
        assert pool_events(router) == []
        assert [e for e in router.events() if e.medium == "GPU"], "vLLM's own events are published"

    finally:
        eng.close()


def test_stored_only_once_the_put_landed(tmp_path):
    """Puts that take a while: BlockStored comes in a later step than the plan,
    never before the object exists in the pool."""
    backend, bcfg = _testdir(tmp_path, capacity=0, put_delay_s=0.05)
    cfg = {"backend": backend, "backend_config": bcfg}
    eng = EngineHarness(EngineSpec(extra_config=cfg, kv_events=True))
    rec = attach_router(eng)
    pool = open_pool(backend, bcfg)
    kb = eng.connector.scheduler.ctx.key_builder()
    try:
        prompt = [(3 * i + 7) % 900 for i in range(3 * BS + 5)]
        eng.add_request("a", prompt)
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        req = eng.scheduler.requests["a"]
        # events carry vLLM's external form of a block hash (as its own events do)
        chunk_of = {maybe_convert_block_hash(h): block_hash_hex(h) for h in req.block_hashes[:3]}
        tenant = eng.connector.scheduler.ctx.tenant(None)
        steps_with_events = []
        for step in range(2000):
            if not eng.scheduler.requests:
                break
            n = len(pool_events(rec))
            eng.step()
            new = pool_events(rec)[n:]
            if new:
                steps_with_events.append(step)
                # Everything announced exists right now.
                for ev in new:
                    for h in ev.block_hashes:
                        key = kb.lookup_keys(tenant, chunk_of[h])
                        assert pool.exists(key, 5.0) == [Status.OK] * len(key)
        assert steps_with_events and steps_with_events[0] > 0, "announced in the step that planned the save"
        stored = [h for ev in pool_events(rec) for h in ev.block_hashes]
        assert stored == list(chunk_of)
    finally:
        eng.close()
        pool.close()


def test_no_event_work_unless_vllm_publishes(tmp_path):
    """kv_events (default true) costs nothing while vLLM's KV events are off."""
    backend, bcfg = _testdir(tmp_path, capacity=0)
    eng = EngineHarness(EngineSpec(extra_config={"backend": backend, "backend_config": bcfg}))
    try:
        assert eng.connector.scheduler.events is None
        assert not eng.workers[0].connector.kv_events
        eng.add_request("a", [(5 * i + 1) % 900 for i in range(2 * BS + 3)])
        eng.run()
        assert eng.connector.take_events() == ()
        assert eng.workers[0].connector.build_connector_worker_meta() is None
        # The saves ran, and noted no landed keys: nobody would drain them.
        worker = eng.workers[0].connector.worker
        assert worker.metrics.totals()["save_ops"] == 2
        assert not worker.engine.keeps_landed and worker.engine.take_landed() == []
    finally:
        eng.close()
