"""Scheduler side: lookups, the per-step plan, delayed frees, KV events."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ascendstore.contract import BackendContext, BackendSetupError
from ascendstore.engine import BackendGuard, EngineMetrics, PoolLookup
from ascendstore.keys import block_hash_hex
from ascendstore.registry import create_backend
from ascendstore_vllm.context import ConnectorContext, chunk_bounds
from ascendstore_vllm.groups import SlidingPins, load_refs, save_refs
from ascendstore_vllm.lookup_rpc import LookupClient
from ascendstore_vllm.metadata import AscendStoreMetadata, ChunkRef, LoadSpec, SaveSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: extension hook: (request) -> dict of request-level params for the workers
#: (GR/PD helpers register one; the result travels in metadata.extensions).
RequestParamsHook = Callable[["Request"], "dict[str, Any] | None"]


@dataclass
class _Tracker:
    request: Request
    tenant: str
    block_ids: list[int] = field(default_factory=list)
    #: hybrid models: block ids per KV cache group (groups.py)
    group_ids: list[list[int]] = field(default_factory=list)
    next_save_block: int = 0  # blocks below this are saved (or queued, or loaded)
    saves_planned: bool = False
    loading_async: bool = False


class AscendStoreScheduler:
    def __init__(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.metrics = EngineMetrics()
        self._lookup_timeout_s = cfg.lookup_timeout_ms / 1000
        self._lookup: PoolLookup | None = None
        self._rpc: LookupClient | None = None
        self._guard: BackendGuard | None = None
        self._open_lookup()
        self._trackers: dict[str, _Tracker] = {}
        self._matched: dict[str, tuple[int, int, bool]] = {}  # req -> (local, hit tokens, async)
        self._loads: list[LoadSpec] = []
        # Loads in flight: req -> (async?, [(chunk index, device blocks)]), and for a
        # request whose load failed the first chunk it must not be offered again.
        self._inflight_loads: dict[str, tuple[bool, list[tuple[int, set[int]]]]] = {}
        self._bad_from: dict[str, int] = {}
        self._delayed_free: list[str] = []
        self._events: list[Any] = []
        self.request_params_hooks: list[RequestParamsHook] = []
        #: hybrid models: sliding-window blocks held for saves in flight
        self.pins = SlidingPins(ctx.tp_size * ctx.pp_size)
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
                    self._lookup = PoolLookup(self._guard, self.ctx.key_builder(), self._lookup_timeout_s)
                    log.info("AscendStore lookups: scheduler-side client of backend %r", cfg.backend)
                    return
                backend.close()
        self._rpc = LookupClient(self.ctx.lookup_ipc_path(), self._lookup_timeout_s)
        log.info("AscendStore lookups: RPC to worker 0 at %s", self._rpc.path)

    def _prefix_hits(self, tenant: str, hashes: list[str], start: int) -> int:
        if self._lookup is not None:
            return self._lookup.prefix_hits(tenant, hashes, start)
        assert self._rpc is not None
        self.metrics.add(lookups=1)
        return self._rpc.prefix_hits(tenant, hashes, start)

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
        self._matched.pop(request.request_id, None)
        if not self.ctx.can_load or request.num_tokens < max(cfg.min_lookup_tokens, 1):
            return 0, False
        bounds = self._bounds(request, request.num_tokens)
        bs = self.ctx.block_size
        # First chunk not wholly on the device already.
        start = next((i for i, (_, end) in enumerate(bounds) if end * bs > num_computed_tokens), len(bounds))
        if start >= len(bounds):
            return 0, False
        # Only chunks beyond the device hit are queried (long prompts: skip the rest).
        hashes = [""] * start + [block_hash_hex(request.block_hashes[end - 1]) for _, end in bounds[start:]]
        tenant = self.ctx.tenant(request.cache_salt)
        hit = self._prefix_hits(tenant, hashes, start)
        # A chunk that failed to load for this request is not offered again: vLLM
        # rewinds a failed async load to token 0 and asks again; offering the same
        # broken entry would loop forever.
        hit = min(hit, self._bad_from.get(request.request_id, hit))
        hit_tokens = bounds[hit - 1][1] * bs if hit > start else 0
        if hit_tokens >= request.num_tokens:
            # vLLM must compute at least one token to sample from.
            hit_tokens = request.num_tokens - 1
        new = hit_tokens - num_computed_tokens
        self.metrics.add(
            lookup_hit_tokens=max(new, 0), lookup_miss_tokens=request.num_tokens - num_computed_tokens - max(new, 0)
        )
        if new <= 0:
            return 0, False
        is_async = cfg.load_async and not cfg.use_layerwise
        self._matched[request.request_id] = (num_computed_tokens, new, is_async)
        return new, is_async

    def _tracker(self, request: Request) -> _Tracker:
        tr = self._trackers.get(request.request_id)
        if tr is None or tr.request is not request:
            tr = _Tracker(request, self.ctx.tenant(request.cache_salt))
            self._trackers[request.request_id] = tr
        return tr

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tr = self._tracker(request)
        tr.block_ids = list(blocks.get_block_ids()[0])
        if self.ctx.hybrid:
            tr.group_ids = [list(ids) for ids in blocks.get_block_ids()]
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or matched is None:
            return
        local, _, is_async = matched
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
            return
        self._loads.append(LoadSpec(request.request_id, tr.tenant, chunks, is_async))
        self._inflight_loads[request.request_id] = (is_async, [(c.index, {b for b in c.block_ids if b >= 0})
                                                               for c in chunks])
        tr.loading_async = is_async
        # Loaded chunks are in the pool already; never save them back.
        tr.next_save_block = max(tr.next_save_block, bounds[chunks[-1].index][1])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> AscendStoreMetadata:
        t0 = time.perf_counter()
        try:
            return self._build_meta(scheduler_output)
        finally:
            self.busy_s += time.perf_counter() - t0

    def _build_meta(self, so: SchedulerOutput) -> AscendStoreMetadata:
        meta = AscendStoreMetadata(loads=self._loads, delayed_free=self._delayed_free)
        self._loads, self._delayed_free = [], []
        if so.preempted_req_ids:
            meta.preempted = list(so.preempted_req_ids)
        for r in so.finished_req_ids:
            self._trackers.pop(r, None)
        if self.ctx.can_save:
            for new in so.scheduled_new_reqs:
                tr = self._trackers.get(new.req_id)
                if tr is None:
                    continue
                tr.block_ids = list(new.block_ids[0])
                if self.ctx.hybrid:
                    tr.group_ids = [list(ids) for ids in new.block_ids]
                self._plan_save(meta, tr, new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0))
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
                done = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0)
                self._plan_save(meta, tr, done)
        for hook in self.request_params_hooks:
            for tr in self._trackers.values():
                params = hook(tr.request)
                if params:
                    meta.extensions[tr.request.request_id] = params
        return meta

    def _plan_save(self, meta: AscendStoreMetadata, tr: _Tracker, tokens_done: int) -> None:
        req = tr.request
        limit = tokens_done if self.ctx.config.save_decode_cache else min(tokens_done, req.num_prompt_tokens)
        # Fast path (every decode step of every running request): no new chunk yet.
        full_blocks = min(len(req.block_hashes), limit // self.ctx.block_size)
        new_blocks = full_blocks - tr.next_save_block
        if new_blocks <= 0 or (new_blocks < self.ctx.blocks_per_chunk and self.ctx.config.discard_partial_chunks):
            return
        bounds = self._bounds(req, limit)
        pin = -1
        if self.ctx.hybrid:
            chunks, pin = self._hybrid_saves(req, tr, bounds)
        else:
            chunks = [
                ChunkRef(i, block_hash_hex(req.block_hashes[b1 - 1]), tr.block_ids[b0:b1])
                for i, (b0, b1) in enumerate(bounds)
                if b0 >= tr.next_save_block and b1 <= len(tr.block_ids)
            ]
        if not chunks:
            return
        tr.next_save_block = bounds[chunks[-1].index][1]
        tr.saves_planned = True
        meta.saves.append(SaveSpec(req.request_id, tr.tenant, chunks, pin))
        if self.ctx.config.kv_events:
            self._record_stored(req, bounds, chunks)

    def _hybrid_saves(self, req: Request, tr: _Tracker, bounds: list[tuple[int, int]]) -> tuple[list[ChunkRef], int]:
        """Per-group refs of the new chunks; sliding-window blocks pinned until stored."""
        hashes = [block_hash_hex(req.block_hashes[b1 - 1]) if b0 >= tr.next_save_block else ""
                  for b0, b1 in bounds]
        chunks = save_refs(self.ctx.groups, bounds, hashes, tr.group_ids, tr.next_save_block, self._null_block())
        sliding = {p.index for p in self.ctx.groups if p.kind == "sliding"}
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

    def _record_stored(self, req: Request, bounds: list[tuple[int, int]], chunks: list[ChunkRef]) -> None:
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        b0 = bounds[chunks[0].index][0]
        b1 = bounds[chunks[-1].index][1]
        bs = self.ctx.block_size
        self._events.append(
            BlockStored(
                block_hashes=[maybe_convert_block_hash(h) for h in req.block_hashes[b0:b1]],
                parent_block_hash=maybe_convert_block_hash(req.block_hashes[b0 - 1]) if b0 else None,
                token_ids=list(req.all_token_ids[b0 * bs : b1 * bs]),
                block_size=bs,
                lora_id=None,
                medium="ascendstore",
                lora_name=None,
            )
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        wmeta = getattr(connector_output, "kv_connector_worker_meta", None)
        if wmeta is not None and getattr(wmeta, "pins_done", None):
            self.pins.reported(wmeta.pins_done)
        invalid = connector_output.invalid_block_ids
        if invalid:
            for req_id, (_, chunks) in self._inflight_loads.items():
                bad = [idx for idx, blocks in chunks if blocks & invalid]
                if bad:
                    self._bad_from[req_id] = min(self._bad_from.get(req_id, bad[0]), bad[0])
        done = set(connector_output.finished_recving or ())
        # Sync and layerwise loads report within the step they ran in; async ones
        # when finished_recving names them.
        self._inflight_loads = {r: v for r, v in self._inflight_loads.items() if v[0] and r not in done}

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        tr = self._trackers.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        self._bad_from.pop(request.request_id, None)
        self._inflight_loads.pop(request.request_id, None)
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
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> bool:
        # The pool is shared with other instances; only our scheduler state is
        # dropped. Delete pool content with the ascendstore CLI (by tenant).
        self._matched.clear()
        return True

    def shutdown(self) -> None:
        if self._guard is not None:
            self._guard.close()
        if self._rpc is not None:
            self._rpc.close()
