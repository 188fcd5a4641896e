"""Hybrid KV cache groups through the real vLLM 0.33 scheduler and worker lifecycle.

The lean install has no platform that turns vLLM's hybrid KV cache manager on,
so these engines turn it on by hand (``disable_hybrid_kv_cache_manager =
False``) and give vLLM mixed layer specs: vLLM then groups the layers, allocates
per-group block tables (null blocks below a sliding window) and hands the
connector one block list per group, as on a GPU/NPU. The fake model writes and
reads each layer through its own group's block table; a sliding-window layer
checks exactly the positions of its window (what vLLM keeps), a full layer every
earlier position.

Also: start-up refusals (recurrent state, unknown spec types, layerwise/GR with
hybrid groups) naming the model's group types, and MLA (vLLM's MLAAttentionSpec,
identical on every TP rank): one writer per chunk, every rank loads.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from ascendstore_vllm.testing import EngineHarness, EngineSpec
from ascendstore_vllm.testing.harness import RankWorker
from conftest import pool_config

from ascendstore.errors import ConfigError

BS = 16
WINDOW = 24  # 2 blocks of 16 hold the window of a token at a block boundary
PROMPT = [(7 * i + 5) % 911 for i in range(10 * BS + 5)]  # 10 full blocks
PROMPT_B = PROMPT[: 8 * BS] + [3, 1, 4, 1, 5, 9, 2, 6]  # shares 8 blocks = 2 chunks of 4


class HybridWorker(RankWorker):
    """Writes/reads each layer through its KV cache group's block table."""

    def __init__(self, engine, rank, vllm_config, kv_cache_config) -> None:
        super().__init__(engine, rank, vllm_config, kv_cache_config)
        self.group_of: dict[str, int] = {}
        self.window_of: dict[str, int | None] = {}
        for gi, g in enumerate(kv_cache_config.kv_cache_groups):
            for n in g.layer_names:
                self.group_of[n] = gi
                self.window_of[n] = getattr(g.kv_cache_spec, "sliding_window", None)

    def _forward(self, work) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        conn = get_kv_transfer_group()
        for layer, name in enumerate(self.layer_names):
            conn.wait_for_layer_load(name)
            t = self.kv_caches[name]
            for req_id, tokens, _, start, end in work:
                ids = self.engine.group_ids[req_id][self.group_of[name]]
                win = self.window_of[name]
                lo = 0 if win is None else max(0, start - win + 1)
                if start > lo and self.engine.check_reads:
                    pos = torch.arange(lo, start)
                    blocks = torch.tensor([ids[int(i)] for i in pos // BS], dtype=torch.long)
                    got = t[blocks, :, pos % BS, :]
                    want = self.expected(tokens, lo, start, layer)
                    bad = (got != want).flatten(1).any(1).nonzero().flatten().tolist()
                    self.read_errors.extend((req_id, layer, lo + int(p)) for p in bad[:4])
                pos = torch.arange(start, end)
                blocks = torch.tensor([ids[int(i)] for i in pos // BS], dtype=torch.long)
                t[blocks, :, pos % BS, :] = self.expected(tokens, start, end, layer)
            conn.save_kv_layer(name, t, None)


class HybridHarness(EngineHarness):
    """layer_types: "full" / "sliding" per layer, HMA on."""

    worker_class = HybridWorker
    layer_types: tuple[str, ...] = ("sliding", "full", "sliding", "full")
    window = WINDOW

    def __init__(self, spec: EngineSpec, **kw: Any) -> None:
        self.group_ids: dict[str, list[list[int]]] = {}
        super().__init__(spec, **kw)

    def layer_specs(self, vllm_config, names, full_spec):
        from vllm.v1.kv_cache_interface import SlidingWindowSpec

        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
        sw = SlidingWindowSpec(block_size=full_spec.block_size, num_kv_heads=full_spec.num_kv_heads,
                               head_size=full_spec.head_size, dtype=full_spec.dtype,
                               sliding_window=self.window, max_tp_shards=full_spec.max_tp_shards)
        return {n: (sw if kind == "sliding" else full_spec) for n, kind in zip(names, self.layer_types, strict=True)}

    def _track(self, so) -> None:
        super()._track(so)
        for new in so.scheduled_new_reqs:
            self.group_ids[new.req_id] = [list(ids) for ids in new.block_ids]
        c = so.scheduled_cached_reqs
        for i, r in enumerate(c.req_ids):
            ids = c.new_block_ids[i]
            if r in c.resumed_req_ids:
                self.group_ids[r] = [list(x) for x in ids] if ids else []
            elif ids:
                for have, more in zip(self.group_ids[r], ids, strict=True):
                    have.extend(more)

    def snapshot(self, req_id: str) -> None:
        pass  # sliding-window blocks are gone by then; reads are checked step by step


class AllSliding(HybridHarness):
    layer_types = ("sliding", "sliding", "sliding", "sliding")


def objects(root: str) -> dict[str, int]:
    return {f: os.path.getsize(os.path.join(root, f)) for f in os.listdir(root) if not f.startswith(".")}


def _spec(root: str, **extra) -> EngineSpec:
    # max_model_len 512: the harness sizes memory for full attention; HMA's sliding
    # groups need less per layer but vLLM checks one max-length request fits.
    return EngineSpec(extra_config=pool_config(root, chunk_size=4 * BS, **extra), num_layers=4, block_size=BS,
                      num_blocks=96, max_model_len=512, max_num_batched_tokens=256)


# 2 KV heads x (K+V) x head 16 x fp16 = 128 B per token and layer
BLOCK_LAYER = 2 * 2 * 16 * 2 * BS


@pytest.mark.parametrize("harness,full,sliding", [(HybridHarness, 2, 2), (AllSliding, 0, 4)])
def test_hybrid_groups_pool_window_blocks_only_and_resume_exactly(pool_root, harness, full, sliding):
    a = harness(_spec(pool_root))
    try:
        groups = a.kv_cache_config.kv_cache_groups
        assert {type(g.kv_cache_spec).__name__ for g in groups} == (
            {"SlidingWindowSpec", "FullAttentionSpec"} if full else {"SlidingWindowSpec"})
        assert type(a.connector).__name__ == "AscendStoreConnector"
        a.add_request("a", PROMPT)
        a.run()
        assert a.read_errors() == []
        pins = a.connector.scheduler.pins
        assert pins.pinned_total == 2 * 2, "each chunk's 2 window blocks were held while saved"
        assert pins.held_blocks == 0, "every sliding-window block pinned for a save was given back"
        assert a.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == a.kv_cache_config.num_blocks - 1
    finally:
        a.close()
    objs = objects(pool_root)
    # 10 full blocks = 2 chunks of 4 blocks; one object per chunk and group, each with its group's layers only.
    ngroups = len(groups)
    assert len(objs) == 2 * ngroups
    fps = {n.split("@")[2] for n in objs}
    assert len(fps) == ngroups, "each group has its own fingerprint"
    sizes = sorted(objs.values())
    per_group_layers = 2 if full else 4
    if full:
        # full group: 4 blocks x 2 layers; sliding group: the last 2 blocks (window 24 / 16) x 2 layers
        assert sizes == [2 * 2 * BLOCK_LAYER] * 2 + [4 * 2 * BLOCK_LAYER] * 2
    else:
        assert sizes == [2 * per_group_layers * BLOCK_LAYER] * 2
    stored = sum(sizes)
    every_block = 2 * 4 * 4 * BLOCK_LAYER
    print(f"{harness.__name__}: stored {stored} B of {every_block} B a full-attention pool would hold")

    # A second engine (fresh device cache) resumes B after the 2 shared chunks from the pool.
    b = harness(_spec(pool_root))
    try:
        b.add_request("b", PROMPT_B)
        b.run()
        assert b.first_schedule("b") == (8 * BS, len(PROMPT_B) - 8 * BS)
        assert b.read_errors() == [], "a window or full-attention position was not restored exactly"
        st = b.stats_total()
        # full layers: 2 chunks x 4 blocks; sliding: only the last chunk's 2 window blocks
        assert st["load_bytes"] == BLOCK_LAYER * (full * 8 + sliding * 2)
    finally:
        b.close()


def _sliding_object(engine, prompt: list[int], chunk: int, root: str) -> str:
    """File name of the sliding group's object of ``chunk`` of ``prompt`` in the test pool."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from ascendstore.keys import block_hash_hex

    req = Request("probe", list(prompt), SamplingParams(max_tokens=1), None, block_hasher=engine.block_hasher)
    chunk_hash = block_hash_hex(req.block_hashes[(chunk + 1) * 4 - 1])
    groups = engine.kv_cache_config.kv_cache_groups
    sliding = next(i for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__ == "SlidingWindowSpec")
    fp = engine.connector.scheduler.ctx.key_builder().group_fingerprints[sliding]
    (name,) = [f for f in objects(root) if fp in f and f.endswith(chunk_hash)]
    return name


@pytest.mark.parametrize("rpc", [False, True], ids=["scheduler-lookup", "rpc-lookup"])
@pytest.mark.parametrize("evicted,hit_chunks", [(0, 2), (1, 1)])
def test_sliding_lookup_needs_only_the_window_objects(pool_root, evicted, hit_chunks, rpc):
    """The pool evicted one sliding-window object: a hit needs only the objects inside
    the window at its end. Chunk 0's is outside the window at chunk 2's boundary (B
    still resumes after 2 chunks, byte-exact); chunk 1's holds that window (B resumes
    after chunk 1, whose window is chunk 0's object). The same rule on the scheduler and
    in worker 0's lookup server."""
    a = HybridHarness(_spec(pool_root))
    try:
        a.add_request("a", PROMPT)
        a.run()
        gone = _sliding_object(a, PROMPT, evicted, pool_root)
    finally:
        a.close()
    os.remove(os.path.join(pool_root, gone))

    # rpc: the backend has no scheduler-side client, worker 0 answers the lookups
    b = HybridHarness(_spec(pool_root, backend_config={"scheduler_client": not rpc}))
    try:
        assert (b.connector.scheduler._rpc is not None) == rpc
        b.add_request("b", PROMPT_B)
        b.run()
        assert b.first_schedule("b")[0] == hit_chunks * 4 * BS
        assert b.read_errors() == [], "a window or full-attention position was not restored exactly"
        # full layers (2): every block of the hit; sliding layers (2): the window's 2 blocks
        assert b.stats_total()["load_bytes"] == BLOCK_LAYER * (2 * 4 * hit_chunks + 2 * 2)
    finally:
        b.close()


def test_other_window_is_another_fingerprint(pool_root):
    a = HybridHarness(_spec(pool_root))
    try:
        a.add_request("a", PROMPT)
        a.run()
    finally:
        a.close()

    class Wider(HybridHarness):
        window = 40

    b = Wider(_spec(pool_root))
    try:
        b.add_request("b", PROMPT_B)
        b.run()
        assert b.first_schedule("b")[0] == 0, "KV of a model with another window was served"
        assert b.read_errors() == []
    finally:
        b.close()


def _context(kv_cache_groups, **extra):
    """ConnectorContext.from_vllm (what both roles run at start-up) for these groups."""
    from ascendstore_vllm.context import ConnectorContext
    from ascendstore_vllm.testing.harness import build_vllm_config
    from vllm.v1.kv_cache_interface import KVCacheConfig

    cfg = build_vllm_config(EngineSpec(extra_config={"backend": "local", **extra}))
    return ConnectorContext.from_vllm(cfg, KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                                                         kv_cache_groups=kv_cache_groups))


def _attn(cls_name: str, **kw):
    import vllm.v1.kv_cache_interface as kvi

    return getattr(kvi, cls_name)(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.float16, **kw)


def test_mamba_groups_without_align_mode_refused_naming_the_group_types():
    """mamba_cache_mode 'none' (prefix caching off) keeps no state at chunk boundaries."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec

    mamba = MambaSpec(block_size=BS, shapes=((4, 8), (2, 4, 8)), dtypes=(torch.float16, torch.float16))
    groups = [KVCacheGroupSpec(["l0", "l1"], _attn("FullAttentionSpec")), KVCacheGroupSpec(["l2", "l3"], mamba)]
    with pytest.raises(ConfigError) as e:
        _context(groups)
    msg = str(e.value)
    assert "0:FullAttentionSpec(2 layers), 1:MambaSpec(2 layers)" in msg
    assert "group 1 is MambaSpec" in msg and "mamba_cache_mode='none'" in msg


def test_mamba_speculative_state_blocks_refused():
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec

    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float16,), mamba_cache_mode="align",
                      num_speculative_blocks=1)
    with pytest.raises(ConfigError, match="group 1 is MambaSpec: speculative-decoding"):
        _context([KVCacheGroupSpec(["l0"], _attn("FullAttentionSpec")), KVCacheGroupSpec(["l1"], mamba)])


def test_mamba_align_groups_pooled_as_state():
    """Prefix caching on (mamba_cache_mode 'align'): the state group is pooled, its
    spec (shapes, dtypes, mode) in its key fingerprint."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec

    def ctx_for(shapes):
        mamba = MambaSpec(block_size=BS, shapes=shapes, dtypes=(torch.float16, torch.float16),
                          mamba_cache_mode="align")
        return _context([KVCacheGroupSpec(["l0", "l1"], _attn("FullAttentionSpec")),
                         KVCacheGroupSpec(["l2", "l3"], mamba)])

    ctx = ctx_for(((4, 8), (2, 4, 8)))
    assert [p.kind for p in ctx.groups] == ["full", "state"]
    assert ctx.hybrid
    fps = ctx.key_builder().group_fingerprints
    assert ctx_for(((4, 8), (2, 4, 16))).key_builder().group_fingerprints[1] != fps[1]


def test_unknown_group_type_refused_naming_it():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    class FancyAttentionSpec(FullAttentionSpec):
        pass

    spec = FancyAttentionSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.float16)
    with pytest.raises(ConfigError, match="group 0 is FancyAttentionSpec: a KV cache spec type AscendStore does not know"):
        _context([KVCacheGroupSpec(["l0"], spec)])


def test_chunked_local_attention_refused():
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    groups = [KVCacheGroupSpec(["l0"], _attn("ChunkedLocalAttentionSpec", attention_chunk_size=64))]
    with pytest.raises(ConfigError, match="ChunkedLocalAttentionSpec"):
        _context(groups)


@pytest.mark.parametrize("extra,what", [({"use_layerwise": True}, "use_layerwise"),
                                        ({"gr": {"enabled": True}}, "gr.enabled")])
def test_hybrid_groups_refuse_unsupported_modes(extra, what):
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    groups = [KVCacheGroupSpec(["l0"], _attn("FullAttentionSpec")),
              KVCacheGroupSpec(["l1"], _attn("SlidingWindowSpec", sliding_window=WINDOW))]
    with pytest.raises(ConfigError, match=what):
        _context(groups, **extra)


def test_single_full_group_keys_unchanged():
    """A plain model's keys do not change with HMA support (existing pools stay valid)."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    ctx = _context([KVCacheGroupSpec(["l0", "l1"], _attn("FullAttentionSpec"))])
    assert not ctx.hybrid
    assert ctx.fingerprint.group == ""
    assert ctx.key_builder().fingerprint == ctx.fingerprint.digest()


class MLAHarness(EngineHarness):
    """Layers with vLLM's MLAAttentionSpec (one latent per token, identical on every rank)."""

    def layer_specs(self, vllm_config, names, full_spec):
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        mla = MLAAttentionSpec(block_size=full_spec.block_size, num_kv_heads=1, head_size=32,
                               dtype=full_spec.dtype, max_tp_shards=1)
        return {n: mla for n in names}


def test_mla_one_writer_per_chunk_every_rank_loads(pool_root):
    spec = EngineSpec(extra_config=pool_config(pool_root), tp_size=2, replicated_kv=True, num_kv_heads=1,
                      head_size=32, block_size=BS)
    a = MLAHarness(spec)
    try:
        assert type(a.kv_cache_config.kv_cache_groups[0].kv_cache_spec).__name__ == "MLAAttentionSpec"
        assert a.kv_cache_config.kv_tp_replicas == 2
        a.add_request("a", PROMPT)
        a.run()
        assert a.read_errors() == []
        per_rank = [w.connector.worker.metrics.totals() for w in a.workers]
    finally:
        a.close()
    names = objects(pool_root)
    assert len(names) == 10 and all("@h0p0c0d0@" in n for n in names), "one object per chunk for both ranks"
    assert [m["save_ops"] for m in per_rank] == [5, 5], "exactly one writer per chunk, alternating"
    b = MLAHarness(spec)
    try:
        b.add_request("b", PROMPT_B)
        b.run()
        assert b.first_schedule("b") == (8 * BS, len(PROMPT_B) - 8 * BS)
        assert b.read_errors() == []
        assert [w.connector.worker.metrics.totals()["load_ops"] for w in b.workers] == [8, 8], "every rank loads"
    finally:
        b.close()


def _race(pool_root, pin: bool, monkeypatch) -> list:
    """Slow puts while vLLM frees window blocks mid-request and another request
    takes them: the pool must still hold the right window KV."""
    from ascendstore_vllm.groups import SlidingPins

    if not pin:  # the wrong thing: save window blocks without holding them
        monkeypatch.setattr(SlidingPins, "pin", lambda self, req_id, ids: -1)
    spec = EngineSpec(extra_config=pool_config(pool_root, chunk_size=BS, backend_config={"put_delay_s": 0.05}),
                      num_layers=4, block_size=BS, num_blocks=40, max_model_len=512, max_num_batched_tokens=32)
    other = [(13 * i + 2) % 907 for i in range(12 * BS)]
    a = AllSliding(spec)
    try:
        a.add_request("a", PROMPT)
        a.add_request("c", other)
        a.run()
        assert a.read_errors() == []
    finally:
        a.close()
    b = AllSliding(EngineSpec(extra_config=pool_config(pool_root, chunk_size=BS), num_layers=4, block_size=BS,
                              num_blocks=40, max_model_len=512))
    try:
        b.add_request("b", PROMPT_B)
        b.run()
        assert b.first_schedule("b")[0] == 8 * BS
        return b.read_errors()
    finally:
        b.close()


def test_window_blocks_freed_mid_request_are_held_until_saved(pool_root, monkeypatch):
    assert _race(pool_root, True, monkeypatch) == []


def test_unheld_window_blocks_would_store_wrong_kv(pool_root, monkeypatch):
    """Proves the race the pins prevent is real in this scenario."""
    assert _race(pool_root, False, monkeypatch) != []


@pytest.mark.parametrize("jitter_s", [0.0, 0.004])
def test_kv_events_per_group_match_the_pool_after_evictions(tmp_path, jitter_s):
    """KV events of a hybrid model: one BlockStored per (chunk, group) object once it
    landed, with the group's index, spec kind and window, and the hashes of exactly
    the blocks the object holds (a sliding-window object: the window's blocks); one
    BlockRemoved (same group) when the pool evicts it. A router index keyed by
    (group, block hash) equals the pool's content after every wave."""
    import random

    from ascendstore_vllm.context import chunk_bounds
    from test_kv_events import _testdir, attach_router, open_pool, pool_events
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from ascendstore.contract import Status
    from ascendstore.keys import block_hash_hex

    # jitter: random backend delays, so saves, evictions and record reads interleave
    backend, bcfg = _testdir(tmp_path, capacity=10, jitter_s=jitter_s)
    spec = _spec(str(tmp_path), backend=backend, backend_config=bcfg, load_async=True)
    spec.kv_events = True
    eng = HybridHarness(spec)
    router = attach_router(eng)
    pool = open_pool(backend, bcfg)
    ctx = eng.connector.scheduler.ctx
    kb = ctx.key_builder()
    # EVENTS_TEST_SEED varies the workload between repeated runs (default: fixed)
    rng = random.Random(f"hybrid-{jitter_s}-{os.environ.get('EVENTS_TEST_SEED', '')}")
    systems = [[rng.randrange(3, 900) for _ in range(8 * BS)] for _ in range(4)]
    objects_seen: dict[str, tuple[int, list]] = {}  # key -> (group, block hashes it holds)
    index: dict[tuple[int, object], set[str]] = {}
    seen = 0
    kinds: dict[int, tuple[str, int | None]] = {}
    try:
        for wave in range(6):
            for j in range(3):
                prompt = rng.choice(systems) + [rng.randrange(3, 900) for _ in range(rng.randrange(5, 40))]
                rid = f"w{wave}-{j}"
                eng.add_request(rid, prompt)
                req = eng.scheduler.requests[rid]
                tenant = ctx.tenant(None)
                for b0, b1 in chunk_bounds(len(prompt) // BS, ctx.blocks_per_chunk, False):
                    for p in ctx.groups:
                        s0, s1 = p.stored_blocks(b0, b1)
                        (pre,) = kb.group_lookup_prefixes(tenant, p.index)
                        objects_seen[pre + block_hash_hex(req.block_hashes[b1 - 1])] = (
                            p.index, [maybe_convert_block_hash(h) for h in req.block_hashes[s0:s1]])
            eng.run()
            assert eng.read_errors() == []
            for e in router.events()[seen:]:
                if getattr(e, "medium", None) != "CPU":
                    continue  # vLLM's own device blocks ("GPU")
                key = (e.group_idx,)
                if type(e).__name__ == "BlockStored":
                    kinds[e.group_idx] = (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
                    for h in e.block_hashes:
                        index.setdefault(key + (h,), set()).add(e.medium)
                else:
                    for h in e.block_hashes:
                        index.pop(key + (h,), None)
            seen = len(router.events())
            keys = list(objects_seen)
            statuses = pool.exists(keys, 5.0)
            want = {(objects_seen[k][0], h) for k, s in zip(keys, statuses, strict=True) if s is Status.OK
                    for h in objects_seen[k][1]}
            assert set(index) == want, f"wave {wave}: router index differs from the pool"
            assert eng.scheduler.reset_prefix_cache()
        ours = pool_events(router)
        assert any(type(e).__name__ == "BlockRemoved" for e in ours), "the workload must evict"
        groups = eng.kv_cache_config.kv_cache_groups
        for g, spec_ in enumerate(groups):
            sliding = type(spec_.kv_cache_spec).__name__ == "SlidingWindowSpec"
            assert kinds[g] == (("sliding_window", WINDOW) if sliding else ("full_attention", None))
            # a sliding object announces its window's 2 blocks; a full one its chunk's 4
            sizes = {len(e.block_hashes) for e in ours if type(e).__name__ == "BlockStored" and e.group_idx == g}
            assert sizes == ({2} if sliding else {4})
    finally:
        eng.close()
        pool.close()


def test_failed_loads_of_hybrid_models_are_recomputed_not_raised(pool_root):
    """vLLM maps block-level load errors back to requests only with one KV cache group
    (with several it raises). A hybrid model's failed load goes back per request
    (failed_recving): vLLM recomputes it from token 0, exactly."""
    a = HybridHarness(_spec(pool_root))
    try:
        a.add_request("a", PROMPT)
        a.run()
    finally:
        a.close()
    b = HybridHarness(_spec(pool_root, backend_config={"fail_get_every": 1}))
    try:
        b.add_request("b", PROMPT_B)
        b.run()
        st = b.stats_total()
        assert st.get("load_failures", 0) > 0, st
        assert "b" in b.finished
        # recomputed from token 0 (not from a block of the failed load), every position exact
        assert b.first_schedule("b") == (0, len(PROMPT_B))
        assert b.read_errors() == []
    finally:
        b.close()
