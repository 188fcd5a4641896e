"""Scheduler side: lookups, the per-step plan, delayed frees, KV events."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ascendstore.contract import BackendContext, BackendSetupError
from ascendstore.engine import BackendGuard, EngineMetrics, PoolLookup
from ascendstore.engine.admission import SaveAdmission
from ascendstore.engine.health import attach_health
from ascendstore.engine.metrics import LabelCap
from ascendstore.keys import NO_TENANT, block_hash_hex
from ascendstore.registry import create_backend
from ascendstore_vllm.compat import evict_from_prefix_cache
from ascendstore_vllm.context import ConnectorContext, chunk_bounds
from ascendstore_vllm.events import KVEventLog
from ascendstore_vllm.groups import GroupLookup, SlidingPins, has_state, load_refs, save_refs
from ascendstore_vllm.lookup_rpc import LookupClient
from ascendstore_vllm.metadata import AscendStoreMetadata, AscendStoreWorkerMeta, ChunkRef, LoadSpec, SaveSpec
from ascendstore_vllm.stale import Scheduled, StaleBlocks

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: extension hook: (request) -> dict of request-level params for the workers
#: (GR/PD helpers register one; the result travels in metadata.extensions).
RequestParamsHook = Callable[["Request"], "dict[str, Any] | None"]


@dataclass(slots=True)
class _Tracker:
    request: Request
    tenant: str
    block_ids: list[int] = field(default_factory=list)
    #: full chunks below this block are saved (or queued, or loaded); always on a
    #: chunk boundary, so a partial tail saved earlier never hides the full chunk
    #: that later covers it (chunked prefill).
    next_save_block: int = 0
    #: discard_partial_chunks false: end block of the partial tail saved (or
    #: loaded) for this request; 0 when none. A tail is saved once, at the end of
    #: the prefill: that is the only tail a repeat of the prompt looks up.
    tail_saved_end: int = 0
    #: hybrid models: block ids per KV cache group (groups.py)
    group_ids: list[list[int]] = field(default_factory=list)
    saves_planned: bool = False
    loading_async: bool = False
    #: tokens done below which _plan_save finds nothing new to save (a lower bound
    #: from next_save_block and tail_saved_end; 0: unknown, ask it). Lets a step
    #: skip every running request that has no new full chunk without a call.
    save_at: int = 0
    #: tokens of the request's device prefix hit (its chunks are re-saved in case
    #: the pool lost them; those saves are not ``SaveSpec.computed``).
    device_hit_tokens: int = 0


class AscendStoreScheduler:
    def __init__(self, ctx: ConnectorContext, *, kv_events: bool | None = None) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.metrics = EngineMetrics()
        self._lookup_timeout_s = cfg.lookup_timeout_ms / 1000
        self._pin_lease_s = cfg.pin_lease_ms / 1000
        #: requests holding pins of what their lookup counted (here or in worker 0)
        self._pinned: set[str] = set()
        #: sync and layerwise loads run in the step they are sent in: per built step
        #: (newest last) the requests whose pins end once it has run. A step's output
        #: is in before the step after next is scheduled, even with async scheduling,
        #: so the pins go then (async loads end with finished_recving).
        self._pins_by_step: deque[list[str]] = deque()
        self._lookup: PoolLookup | GroupLookup | None = None
        self._rpc: LookupClient | None = None
        self._guard: BackendGuard | None = None
        self._open_lookup()
        #: KV events (kv_events: true): BlockStored once saves land, BlockRemoved
        #: from the pool's removal record (ascendstore_vllm.events).
        self.events: KVEventLog | None = None
        if cfg.kv_events if kv_events is None else kv_events:
            self.events = KVEventLog(
                ctx.key_builder(), ctx.block_size, guard=self._guard,
                local=self._guard is not None and not self._guard.capabilities.shared_across_nodes,
                timeout_s=self._lookup_timeout_s, groups=ctx.groups if ctx.hybrid else (),
            )
            if not self.events.reports_removals:
                log.info("AscendStore KV events: BlockStored only; backend %r reports no removals%s", cfg.backend,
                         "" if self._guard is not None else " to the scheduler (lookup_mode rpc)")
        self._trackers: dict[str, _Tracker] = {}
        # req -> (local, hit tokens, async, first chunk looked up)
        self._matched: dict[str, tuple[int, int, bool, int]] = {}
        self._loads: list[LoadSpec] = []
        # Loads in flight: req -> (async?, [(chunk index, device blocks)]), and for a
        # request whose load failed the first chunk it must not be offered again.
        self._inflight_loads: dict[str, tuple[bool, list[tuple[int, set[int]]]]] = {}
        self._bad_from: dict[str, int] = {}
        #: blocks holding bytes vLLM may read as valid after a failed load (stale.py)
        self._stale = StaleBlocks(ctx.block_size)
        self._delayed_free: list[str] = []
        self.request_params_hooks: list[RequestParamsHook] = []
        # Operator metrics and admission (docs/failure-semantics.md, docs/benchmarking.md).
        self._lookup_local: dict[str, int] = {}  # req -> device hit tokens at its last lookup
        #: a waiting request's chunk hashes between its lookups (vLLM asks every step
        #: until it schedules the request): req -> (its block hash list, blocks, chunk
        #: hashes from chunk 0). Picking every bpc-th of a 128k prompt's 8192 block
        #: hashes touched ~2,000 scattered cache lines a lookup: the part of it that
        #: slowed most when the host's caches were contended.
        self._chunk_hashes: dict[str, tuple[list, int, list]] = {}
        self._tenant_label = LabelCap(cfg.metrics_max_tenants)
        self._admission = SaveAdmission(cfg.admit_after_hits, cfg.save_budget_bytes_per_step, cfg.admit_track_chunks)
        self._chunk_bytes = chunk_kv_bytes(ctx)
        #: hybrid models: sliding-window and state blocks held for saves in flight
        self.pins = SlidingPins(ctx.tp_size * ctx.pp_size)
        self._state_groups = has_state(ctx.groups)
        #: time spent in this connector's scheduler-side calls (bench/observability).
        self.busy_s = 0.0

    # -- lookup path ---------------------------------------------------------------
    def _open_lookup(self) -> None:
        cfg = self.ctx.config
        mode = cfg.lookup_mode
        if mode in ("auto", "scheduler"):
            try:
                backend = create_backend(
                    cfg.backend,
                    cfg.backend_config,
                    BackendContext(
                        role="scheduler",
                        instance_id=self.ctx.instance_id,
                        timeout_s=cfg.timeout_ms / 1000,
                        world_size=self.ctx.tp_size * self.ctx.pp_size,
                    ),
                )
            except BackendSetupError as exc:
                if mode == "scheduler":
                    raise
                log.info("backend %r has no scheduler-side client (%s); lookups go to worker 0", cfg.backend, exc)
            else:
                if backend.capabilities.scheduler_client or mode == "scheduler":
                    self._guard = BackendGuard(backend, cfg.timeout_ms / 1000, metrics=self.metrics)
                    # This process's own monitor: lookups answer 0 while it is degraded.
                    attach_health(self._guard, cfg, process="scheduler", instance_id=self.ctx.instance_id)
                    self._lookup = self.ctx.pool_lookup(self._guard, self._lookup_timeout_s,
                                                        pin_lease_s=self._pin_lease_s)
                    log.info("AscendStore lookups: scheduler-side client of backend %r", cfg.backend)
                    return
                backend.close()
        self._rpc = LookupClient(self.ctx.lookup_ipc_path(), self._lookup_timeout_s)
        log.info("AscendStore lookups: RPC to worker 0 at %s", self._rpc.path)

    def _prefix_hits(self, tenant: str, hashes: list[str] | list[bytes], start: int, req_id: str) -> int:
        """Chunks present from ``start``; with pins on, what is counted is pinned for ``req_id``."""
        if self._lookup is not None:
            pins = self._lookup.pins
            hits = self._lookup.prefix_hits(tenant, hashes, start, req_id if pins is not None else None)
            pinned = pins is not None and hits > start
        else:
            assert self._rpc is not None
            self.metrics.add(lookups=1)
            if start < len(hashes) and isinstance(hashes[start], bytes):
                hashes = [h.hex() if isinstance(h, bytes) else h for h in hashes]
            hits, pinned = self._rpc.prefix_hits_pinned(
                tenant, hashes, start, req_id if self._pin_lease_s > 0 else None  # type: ignore[arg-type]
            )
            pinned = pinned and hits > start
        if pinned:
            self._pinned.add(req_id)
        else:
            # Looked up again and nothing counted now: the lookup let go of its pins itself.
            self._pinned.discard(req_id)
        return hits

    # -- pins between lookup and load (ascendstore.engine.pins) -----------------------
    def _unpin(self, req_ids: Iterable[str], keep: list[tuple[str, int]] | None = None) -> None:
        """Let go of the pins of these requests (their loads ended, or none will run)."""
        ids = [r for r in req_ids if r in self._pinned]
        self._pinned.difference_update(ids)
        if not ids and not keep:
            return
        if self._lookup is not None:
            if self._lookup.pins is not None:
                for r, n in keep or ():
                    self._lookup.pins.keep(r, n)
                self._lookup.pins.release(ids)
        elif self._rpc is not None:
            self._rpc.release(ids, keep)

    def pinned_requests(self) -> set[str]:
        """Requests whose lookup pins are held (tests, observability)."""
        return set(self._pinned)

    def _bounds(self, request: Request, limit_tokens: int) -> list[tuple[int, int]]:
        nblocks = min(len(request.block_hashes), limit_tokens // self.ctx.block_size)
        return chunk_bounds(nblocks, self.ctx.blocks_per_chunk, not self.ctx.config.discard_partial_chunks)

    # -- KVConnector scheduler API ------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        t0 = time.perf_counter()
        try:
            return self._matched_tokens(request, num_computed_tokens)
        finally:
            self.busy_s += time.perf_counter() - t0

    def _matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        cfg = self.ctx.config
        # (what is read more than once is read once: this runs for every waiting
        # request every step, and a request's first lookup pays for each line)
        req_id, num_tokens = request.request_id, request.num_tokens
        self._matched.pop(req_id, None)
        self._lookup_local[req_id] = num_computed_tokens
        if not self.ctx.can_load or num_tokens < max(cfg.min_lookup_tokens, 1):
            return 0, False
        # Chunk i covers blocks [i*bpc, min((i+1)*bpc, nblocks)) (as chunk_bounds), computed
        # arithmetically: a 128k-token prompt has a thousand chunks, and this runs per
        # waiting request per step, so no per-chunk Python object is made but the hashes.
        bs, bpc = self.ctx.block_size, self.ctx.blocks_per_chunk
        nblocks = min(len(request.block_hashes), num_tokens // bs)
        if self._state_groups:
            # vLLM keeps recurrent state only at block boundaries: a hit must end on one
            # before the last prompt token (never the "all but one token" hit below).
            nblocks = min(nblocks, (num_tokens - 1) // bs)
        nchunks = nblocks // bpc + (1 if nblocks % bpc and not cfg.discard_partial_chunks else 0)
        # First chunk not wholly on the device already.
        start = num_computed_tokens // (bpc * bs)
        if start < nchunks and min((start + 1) * bpc, nblocks) * bs <= num_computed_tokens:
            start += 1  # the partial tail chunk is already on the device
        if start >= nchunks:
            return 0, False
        # Only chunks beyond the device hit are queried (long prompts: skip the rest).
        hashes = self._request_chunk_hashes(request, nblocks, nchunks)
        if start:
            hashes = [""] * start + hashes[start:]
        tenant = self.ctx.tenant(request.cache_salt)
        hit = self._prefix_hits(tenant, hashes, start, req_id)
        # A chunk that failed to load for this request is not offered again: vLLM
        # rewinds a failed async load to token 0 and asks again; offering the same
        # broken entry would loop forever.
        if self._bad_from:
            hit = min(hit, self._bad_from.get(req_id, hit))
        hit_tokens = min(hit * bpc, nblocks) * bs if hit > start else 0
        if hit_tokens >= num_tokens:
            # vLLM must compute at least one token to sample from.
            hit_tokens = num_tokens - 1
        new = hit_tokens - num_computed_tokens
        self.metrics.add(
            lookup_hit_tokens=max(new, 0), lookup_miss_tokens=num_tokens - num_computed_tokens - max(new, 0)
        )
        if new <= 0:
            self._unpin([req_id])
            return 0, False
        # Hybrid models load asynchronously: a state must land before vLLM copies it
        # forward at the start of the step, and vLLM takes block-level load errors only
        # from single-group models (hybrid failures go back as failed_recving).
        is_async = (cfg.load_async and not cfg.use_layerwise) or self.ctx.hybrid
        self._matched[req_id] = (num_computed_tokens, new, is_async, start)
        return new, is_async

    def _request_chunk_hashes(self, request: Request, nblocks: int, nchunks: int) -> list:
        """The hashes naming chunks 0..nchunks-1 of the request's first ``nblocks``
        blocks (kept while the request waits: vLLM only appends block hashes)."""
        bh = request.block_hashes
        kept = self._chunk_hashes.get(request.request_id)
        if kept is not None and kept[0] is bh and kept[1] == nblocks:  # (nblocks fixes nchunks)
            return kept[2]
        # A chunk's key is the chained hash of its last block: every bpc-th hash, a slice.
        bpc = self.ctx.blocks_per_chunk
        hashes = bh[bpc - 1 : nblocks : bpc]
        if len(hashes) < nchunks:
            hashes.append(bh[nblocks - 1])  # the partial tail chunk
        if type(hashes[0]) is not bytes:  # older vLLM block hashes: hex strings per chunk
            hashes = [block_hash_hex(h) for h in hashes]
        if len(self._chunk_hashes) >= 4096:  # a bound: the lists of requests vLLM dropped unseen
            self._chunk_hashes.clear()
        self._chunk_hashes[request.request_id] = (bh, nblocks, hashes)
        return hashes

    def _tracker(self, request: Request) -> _Tracker:
        tr = self._trackers.get(request.request_id)
        if tr is None or tr.request is not request:
            tr = _Tracker(request, self.ctx.tenant(request.cache_salt))
            self._trackers[request.request_id] = tr
        return tr

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tr = self._tracker(request)
        tr.block_ids = list(blocks.get_block_ids()[0])
        self._count_hits(tr, num_external_tokens)
        if self.ctx.hybrid:
            tr.group_ids = [list(ids) for ids in blocks.get_block_ids()]
        matched = self._matched.pop(request.request_id, None)
        self._chunk_hashes.pop(request.request_id, None)  # scheduled: no more lookups unless preempted
        if num_external_tokens <= 0 or matched is None:
            self._unpin([request.request_id])  # nothing will be loaded
            return
        local, _, is_async, first = matched
        bs = self.ctx.block_size
        end_tok = local + num_external_tokens
        chunks: list[ChunkRef] = []
        bounds = self._bounds(request, request.num_tokens)
        if self.ctx.hybrid:
            # One ref per chunk and KV cache group; sliding windows: only the blocks vLLM keeps.
            hashes = [block_hash_hex(request.block_hashes[b1 - 1]) for _, b1 in bounds]
            null = [[b.is_null for b in grp] for grp in blocks.blocks]
            chunks = load_refs(self.ctx.groups, bounds, hashes, tr.group_ids, null, local, end_tok, bs)
            bounds_iter: list[tuple[int, int]] = []
        else:
            bounds_iter = bounds
        for i, (b0, b1) in enumerate(bounds_iter):
            if b1 * bs <= local:
                continue
            if b0 * bs >= end_tok or b1 > len(tr.block_ids):
                break  # (vLLM allocated no block for the rest: load what has somewhere to land)
            # Blocks already on the device (local hit inside this chunk) land in scratch (-1).
            ids = [tr.block_ids[b] if b * bs >= local else -1 for b in range(b0, b1)]
            chunks.append(ChunkRef(i, block_hash_hex(request.block_hashes[b1 - 1]), ids))
        if not chunks:
            self._unpin([request.request_id])
            return
        if request.request_id in self._pinned:
            # Pinned chunks past what vLLM gave blocks to are not loaded: let them go now.
            last = max(c.index for c in chunks)
            self._unpin([], keep=[(request.request_id, last + 1 - first)])
        self._loads.append(LoadSpec(request.request_id, tr.tenant, chunks, is_async))
        self._inflight_loads[request.request_id] = (is_async, [(c.index, {b for b in c.block_ids if b >= 0})
                                                               for c in chunks])
        tr.loading_async = is_async
        # Loaded chunks are in the pool already; never save them back. A loaded
        # partial tail is in the pool too, but the full chunk that later covers
        # it (decode with save_decode_cache) is not.
        b0, b1 = bounds[chunks[-1].index]
        if b1 - b0 < self.ctx.blocks_per_chunk:
            tr.tail_saved_end = b1
            b1 = b0
        tr.next_save_block = max(tr.next_save_block, b1)
        tr.save_at = 0

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> AscendStoreMetadata:
        t0 = time.perf_counter()
        try:
            return self._build_meta(scheduler_output)
        finally:
            self.busy_s += time.perf_counter() - t0

    def _build_meta(self, so: SchedulerOutput) -> AscendStoreMetadata:
        meta = AscendStoreMetadata(loads=self._loads, delayed_free=self._delayed_free)
        if not self._pinned:
            self._pins_by_step.clear()  # nothing held: nothing to let go of later
        else:
            self._pins_by_step.append([ld.req_id for ld in self._loads if not ld.is_async])
            while len(self._pins_by_step) > 2:
                self._unpin(self._pins_by_step.popleft())
        self._loads, self._delayed_free = [], []
        self._admission.new_step()
        if so.preempted_req_ids:
            meta.preempted = list(so.preempted_req_ids)
            self._unpin(so.preempted_req_ids)  # looked up (and pinned) again when resumed
        for r in so.finished_req_ids:
            self._trackers.pop(r, None)
        stale = bool(self._stale) and not self.ctx.hybrid  # (hybrid loads report failures per request)
        if stale:
            self._stale.loaded(b for ld in meta.loads for c in ld.chunks for b in c.block_ids)
            pool = self.pins.block_pool
            if pool is not None:
                self._stale.forget_free(lambda b: pool.blocks[b].ref_cnt)
            stale = bool(self._stale)
        step: dict[str, Scheduled] = {}
        save = self.ctx.can_save
        for new in so.scheduled_new_reqs:
            tr = self._trackers.get(new.req_id)
            if tr is None:
                continue
            tr.block_ids = list(new.block_ids[0])
            if self.ctx.hybrid:
                tr.group_ids = [list(ids) for ids in new.block_ids]
            n = so.num_scheduled_tokens.get(new.req_id, 0)
            if stale:
                step[new.req_id] = Scheduled(tr.block_ids, new.num_computed_tokens, n)
            if save:
                self._plan_save(meta, tr, new.num_computed_tokens + n)
        if not stale and not self.ctx.hybrid:
            self._plan_running(meta, so, save)
        else:
            self._plan_running_general(meta, so, save, stale, step)
        if stale:
            readers = self._stale.step(step)
            if readers:
                meta.stale_blocks = sorted(set(readers.values()))
                log.warning("AscendStore: %d request(s) would read blocks of a failed load no request "
                            "recomputed (vLLM recompute policy); reported as load errors to recompute them: %s",
                            len(readers), sorted(readers))
        for hook in self.request_params_hooks:
            for tr in self._trackers.values():
                params = hook(tr.request)
                if params:
                    meta.extensions[tr.request.request_id] = params
        return meta

    def _plan_running(self, meta: AscendStoreMetadata, so: SchedulerOutput, save: bool) -> None:
        """Block lists and saves of the step's running requests. Every running
        request, every step: the usual case (decode, no new full chunk) costs a dict
        lookup, a block list update and one comparison (``_Tracker.save_at``)."""
        cached = so.scheduled_cached_reqs
        trackers, resumed, scheduled = self._trackers, cached.resumed_req_ids, so.num_scheduled_tokens
        for req_id, new_ids, done in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
                                         strict=True):
            tr = trackers.get(req_id)
            if tr is None:
                continue
            if req_id in resumed:
                tr.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tr.block_ids.extend(new_ids[0])
            if save:
                tokens = done + scheduled.get(req_id, 0)
                if tokens >= tr.save_at:
                    self._plan_save(meta, tr, tokens)

    def _plan_running_general(self, meta: AscendStoreMetadata, so: SchedulerOutput, save: bool, stale: bool,
                              step: dict[str, Scheduled]) -> None:
        """``_plan_running`` for hybrid models and steps that track stale blocks."""
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tr = self._trackers.get(req_id)
            if tr is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tr.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tr.block_ids.extend(new_ids[0])
            if self.ctx.hybrid:
                if req_id in cached.resumed_req_ids:
                    tr.group_ids = [list(ids) for ids in new_ids] if new_ids else []
                elif new_ids:
                    for have, more in zip(tr.group_ids, new_ids, strict=False):
                        have.extend(more)
            n = so.num_scheduled_tokens.get(req_id, 0)
            if stale:
                step[req_id] = Scheduled(tr.block_ids, cached.num_computed_tokens[i], n)
            if save:
                self._plan_save(meta, tr, cached.num_computed_tokens[i] + n)

    def _plan_save(self, meta: AscendStoreMetadata, tr: _Tracker, tokens_done: int) -> None:
        try:
            self._plan_save_now(meta, tr, tokens_done)
        finally:
            tr.save_at = self._save_at(tr)

    def _save_at(self, tr: _Tracker) -> int:
        """The fewest tokens done at which ``_plan_save_now`` can get past its fast
        path, from the tracker as it is now: a new full chunk after
        ``next_save_block``, or (partial chunks kept) the prompt's tail once the
        prefill is done. A lower bound (block hashes may lag the tokens): below it
        nothing is saved, at or above it ``_plan_save_now`` decides."""
        if self.ctx.hybrid:
            return 0
        cfg = self.ctx.config
        bs, prompt = self.ctx.block_size, tr.request.num_prompt_tokens
        never = 1 << 62
        # limit = tokens done, or with save_decode_cache off min(tokens done, prompt)
        at = (tr.next_save_block + self.ctx.blocks_per_chunk) * bs
        if not cfg.save_decode_cache and at > prompt:
            at = never
        if not cfg.discard_partial_chunks and not tr.tail_saved_end:
            one = (tr.next_save_block + 1) * bs  # at least one new full block
            if cfg.save_decode_cache or one <= prompt:
                at = min(at, max(prompt, one))
        return at

    def _plan_save_now(self, meta: AscendStoreMetadata, tr: _Tracker, tokens_done: int) -> None:
        req = tr.request
        cfg = self.ctx.config
        limit = tokens_done if cfg.save_decode_cache else min(tokens_done, req.num_prompt_tokens)
        bpc = self.ctx.blocks_per_chunk
        # Fast path (every decode step of every running request): no new chunk yet.
        full_blocks = min(len(req.block_hashes), limit // self.ctx.block_size)
        new_blocks = full_blocks - tr.next_save_block
        if new_blocks < bpc and (
            cfg.discard_partial_chunks
            or new_blocks <= 0
            or tr.tail_saved_end
            or tokens_done < req.num_prompt_tokens
        ):
            return
        pin = -1
        bounds: list[tuple[int, int]] = []
        if self.ctx.hybrid:
            bounds = self._bounds(req, limit)
            chunks, pin = self._hybrid_saves(req, tr, bounds)
            if chunks:
                tr.next_save_block = bounds[chunks[-1].index][1]
        else:
            nblocks = len(tr.block_ids)
            chunks = [
                ChunkRef(i, block_hash_hex(req.block_hashes[b0 + bpc - 1]), tr.block_ids[b0 : b0 + bpc])
                for i, b0 in enumerate(range(0, full_blocks - bpc + 1, bpc))
                if b0 >= tr.next_save_block and b0 + bpc <= nblocks
            ]
            if chunks:
                tr.next_save_block = (chunks[-1].index + 1) * bpc
            tail = (tr.next_save_block, full_blocks)
            if (
                not self.ctx.config.discard_partial_chunks
                and not tr.tail_saved_end
                and tokens_done >= req.num_prompt_tokens  # prefill done: the prompt's own tail
                and 0 < tail[1] - tail[0] < bpc
                and tail[1] <= nblocks
            ):
                # The trailing run of full blocks, as its own object (discard_partial_chunks
                # false). next_save_block stays on the chunk boundary: the full chunk
                # that covers this tail later (decode) is still saved.
                chunks.append(ChunkRef(tail[0] // bpc, block_hash_hex(req.block_hashes[tail[1] - 1]),
                                       tr.block_ids[tail[0] : tail[1]]))
                tr.tail_saved_end = tail[1]
        if not chunks:
            return
        if self._admission.active:
            chunks = self._admit(tr, chunks)
            if not chunks:
                return
        tr.saves_planned = True
        first = bounds[chunks[0].index][0] if self.ctx.hybrid else chunks[0].index * bpc
        computed = first * self.ctx.block_size >= tr.device_hit_tokens
        meta.saves.append(SaveSpec(req.request_id, tr.tenant, chunks, pin, computed))
        if self.events is not None:  # (hybrid: one object per chunk and group, announced per group)
            self.events.planned(req, tr.tenant, chunks, bpc, bounds)

    def _admit(self, tr: _Tracker, chunks: list[ChunkRef]) -> list[ChunkRef]:
        """The leading chunks admission lets this step save (the rest is skipped)."""
        keys = [f"{tr.tenant}/{c.chunk_hash}" for c in chunks]
        n, st = self._admission.admit(keys, self._chunk_bytes)
        if st.refused_hits or st.refused_budget:
            self.metrics.add(save_skipped_admission=st.refused_hits, save_skipped_budget=st.refused_budget)
        return chunks[:n]

    def _hybrid_saves(self, req: Request, tr: _Tracker, bounds: list[tuple[int, int]]) -> tuple[list[ChunkRef], int]:
        """Per-group refs of the new chunks; sliding-window blocks pinned until stored."""
        hashes = [block_hash_hex(req.block_hashes[b1 - 1]) if b0 >= tr.next_save_block else ""
                  for b0, b1 in bounds]
        chunks = save_refs(self.ctx.groups, bounds, hashes, tr.group_ids, tr.next_save_block, self._null_block())
        sliding = {p.index for p in self.ctx.groups if p.kind in ("sliding", "state")}
        held = [b for c in chunks if c.group in sliding for b in c.block_ids]
        if not held:
            return chunks, -1
        if self.pins.block_pool is None:
            # Without vLLM's block pool nothing keeps these blocks for the save: skip them.
            return [c for c in chunks if c.group not in sliding], -1
        return chunks, self.pins.pin(req.request_id, held)

    def _null_block(self) -> int:
        pool = self.pins.block_pool
        return pool.null_block.block_id if pool is not None else 0

    def _count_hits(self, tr: _Tracker, num_external_tokens: int) -> None:
        """Hits by tier (device prefix cache, pool) and pool hits by tenant, once
        per scheduling of a request (lookups repeat while a request waits)."""
        local = self._lookup_local.pop(tr.request.request_id, None)
        if local is None:
            return
        tr.device_hit_tokens = max(tr.device_hit_tokens, local)
        m = self.metrics
        tenant = self._tenant_label("default" if tr.tenant == NO_TENANT else tr.tenant)
        m.add(prompt_tokens=tr.request.num_prompt_tokens)
        m.add_labelled("tenant_prompt_tokens", tenant, tr.request.num_prompt_tokens)
        if local:
            m.add_labelled("hit_tokens", "device", local)
        if num_external_tokens > 0:
            m.add_labelled("hit_tokens", "pool_" + self.hit_tier().lower(), num_external_tokens)
            m.add_labelled("tenant_hit_tokens", tenant, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.events is not None:
            wm = connector_output.kv_connector_worker_meta
            if isinstance(wm, AscendStoreWorkerMeta):
                self.events.landed(wm.landed)
            # After the landed keys: a request's saves report done on every rank
            # no earlier than the keys they stored.
            self.events.requests_done(connector_output.finished_sending or ())
        wmeta = getattr(connector_output, "kv_connector_worker_meta", None)
        if wmeta is not None and getattr(wmeta, "pins_done", None):
            self.pins.reported(wmeta.pins_done)
        invalid = connector_output.invalid_block_ids
        if invalid:
            self._evict_failed(set(invalid))
            for req_id, (_, chunks) in self._inflight_loads.items():
                bad = [idx for idx, blocks in chunks if blocks & invalid]
                if bad:
                    self._bad_from[req_id] = min(self._bad_from.get(req_id, bad[0]), bad[0])
        # Hybrid models report a failed load per request (vLLM recomputes it from token 0):
        # none of its chunks from the first loaded one is offered to it again.
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            loaded = self._inflight_loads.get(req_id)
            if loaded is not None and loaded[1]:
                first = min(idx for idx, _ in loaded[1])
                self._bad_from[req_id] = min(self._bad_from.get(req_id, first), first)
        done = set(connector_output.finished_recving or ())
        # Sync and layerwise loads report within the step they ran in; async ones
        # when finished_recving names them.
        self._inflight_loads = {r: v for r, v in self._inflight_loads.items() if v[0] and r not in done}
        if done and self._pinned:
            self._unpin(done)  # async loads ended (loaded, or failed and reported invalid)

    def _evict_failed(self, invalid: set[int]) -> None:
        """Keep blocks whose load failed out of vLLM's prefix cache.

        vLLM caches a request's blocks (with their hashes) when it allocates them,
        before a synchronous or layerwise load has written them. Under the default
        ``kv_load_failure_policy`` "recompute" it leaves failed blocks cached for the
        request to recompute in place; a request aborted or preempted before that
        step frees them still hashed, and the next request with the prefix gets a
        device hit on stale bytes (docs/failure-semantics.md). So the failed blocks
        leave the prefix cache now, with every later block of each request holding
        one (those were computed this step over the failed KV): what vLLM's "fail"
        policy does. The request still recomputes them in place; they are simply not
        offered to other requests (async loads: never cached before they land).
        The same blocks are tracked as stale until rewritten (stale.py): other
        requests of the failed step that kept them as computed are made to recompute
        them if they would read them first."""
        evict = set(invalid)
        for tr in self._trackers.values():
            ids = tr.block_ids
            first = next((i for i, b in enumerate(ids) if b in invalid), None)
            if first is not None:
                evict.update(ids[first:])
        if not self.ctx.hybrid:
            self._stale.failed(evict)
        pool = self.pins.block_pool
        if pool is None:
            return
        evict_from_prefix_cache(pool, evict)
        log.debug("AscendStore: %d blocks of failed loads evicted from vLLM's prefix cache", len(evict))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        tr = self._trackers.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        self._lookup_local.pop(request.request_id, None)
        self._bad_from.pop(request.request_id, None)
        self._chunk_hashes.pop(request.request_id, None)
        self._inflight_loads.pop(request.request_id, None)
        self._unpin([request.request_id])  # finished or aborted (before or after loading)
        if tr is None or not tr.saves_planned:
            return False, None
        # Saves may still be reading these blocks: free them when every worker
        # reports the request's saves done (finished_sending).
        self._delayed_free.append(request.request_id)
        return True, None

    def hit_tier(self) -> str:
        """vLLM CacheHitSource name for pool hits: a node-local pool is host memory.

        Per-object tiers (a local pool's DRAM vs disk) are not reported by the
        backend contract, so a pool spanning nodes counts as unspecified."""
        if self._guard is not None and not self._guard.capabilities.shared_across_nodes:
            return "HOST"
        return "EXTERNAL_UNSPECIFIED"

    def take_events(self) -> Iterable[Any]:
        # vLLM calls this every step, after update_connector_output.
        return self.events.take() if self.events is not None else ()

    def reset_cache(self) -> bool:
        # The pool is shared with other instances; only our scheduler state is
        # dropped. Delete pool content with the ascendstore CLI (by tenant).
        self._matched.clear()
        self._chunk_hashes.clear()
        return True

    def shutdown(self) -> None:
        self._unpin(list(self._pinned))
        if self._lookup is not None and self._lookup.pins is not None:
            self._lookup.pins.close()
        if self.events is not None:
            self.events.close()
        if self._guard is not None:
            self._guard.close()
        if self._rpc is not None:
            self._rpc.close()


def chunk_kv_bytes(ctx: ConnectorContext) -> int:
    """KV bytes of one chunk on one rank, from the key fingerprint (what a save writes)."""
    import torch

    fp = ctx.fingerprint
    try:
        itemsize = getattr(torch, fp.dtype.removeprefix("torch.")).itemsize
    except (AttributeError, TypeError):
        itemsize = 2
    per_token = (1 if fp.use_mla else 2) * fp.num_kv_heads * fp.head_size * itemsize
    return per_token * fp.num_layers * ctx.chunk_size
