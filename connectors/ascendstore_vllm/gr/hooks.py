"""GR hooks a vLLM connector calls: scheduler-side policy, worker-side transfers.

The scheduler side (``GRSchedulerHooks``) decides per request: is it a GR
request, how many history tokens the device already has (vLLM's own prefix
cache), how many more the pool serves (one record read), what to load into
which blocks, and when the user's history is complete on the device and must
be saved. It also installs the optional device-side user LRU.

The worker side (``GRWorkerHooks``) turns the plan into ``UserStore`` loads
(before the forward) and saves (after it) against the worker's KV regions.

A connector wires them in a few lines; a request the hooks do not claim
(``get_num_new_matched_tokens`` returns None) takes the connector's ordinary
path. Only the user-history part is ever pooled, never the candidates.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ascendstore.config import GRConfig
from ascendstore.contract import Region, Status
from ascendstore.gr import GRInputError, GRRequest, GRStats, UserHit, UserStore, parse_gr_request
from ascendstore.keys import NO_TENANT, tenant_id
from ascendstore_vllm.gr.user_lru import UserKVLRU

log = logging.getLogger(__name__)


# -- plan (scheduler -> workers; plain dataclasses, pickled by vLLM) ---------------
@dataclass
class GRLoad:
    req_id: str
    uid: str
    generations: list[int]  # per rank: the record the hit was computed from
    kv_blocks: int  # blocks in the stored object
    block_ids: list[int]  # per object block: device block to fill, -1 to skip
    tenant: str = NO_TENANT  # the user's tenant (part of its keys)
    variant: str = ""  # adapter / multimodal identity (part of its keys)


@dataclass
class GRSave:
    req_id: str
    uid: str
    tenant: str
    tokens: list[int]  # the block-aligned history
    block_ids: list[int]  # its device blocks
    variant: str = ""  # adapter / multimodal identity (part of its keys)


@dataclass
class GRPlan:
    loads: list[GRLoad] = field(default_factory=list)
    saves: list[GRSave] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.loads or self.saves)


@dataclass
class _ReqState:
    gr: GRRequest
    history: int  # block-aligned history tokens (what the pool stores for this request)
    request: Any  # vLLM's live Request (token ids, progress)
    local: int = 0  # device prefix-cache hit at the last lookup
    hit: UserHit | None = None
    save_needed: bool = False
    save_planned: bool = False
    counted: bool = False
    #: adapter / multimodal identity of the history's KV ("" for none): part of the user keys
    variant: str = ""


def kv_identity(request: Any, history_len: int) -> str:
    """What besides the token ids decides the KV of a request's history: the LoRA
    adapter (name and path, as vLLM's block hashes name it) and the multimodal
    inputs inside the history (vLLM's content hash and position). ``""`` for a
    plain request; else a short digest that the user keys carry (``UserStore.with_variant``),
    so KV computed under another adapter or image is never served for the same tokens."""
    parts: list[str] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora:{getattr(lora, 'lora_name', '')}:{getattr(lora, 'lora_path', '')}")
    for f in getattr(request, "mm_features", None) or ():
        pos = getattr(f, "mm_position", None)
        offset = int(getattr(pos, "offset", 0)) if pos is not None else 0
        if offset < history_len:
            parts.append(f"mm:{getattr(f, 'identifier', None) or getattr(f, 'mm_hash', '')}:{offset}")
    if not parts:
        return ""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


# -- scheduler side ------------------------------------------------------------------
class GRSchedulerHooks:
    def __init__(
        self,
        store: UserStore,
        *,
        config: GRConfig,
        block_size: int,
        bytes_per_block: int = 0,
        default_tenant: str | None = None,
        stats: GRStats | None = None,
        load_async: bool = False,
    ) -> None:
        self.store = store
        self.config = config
        self.block_size = block_size
        #: KV bytes of one block over all layers and ranks (tenant quota accounting)
        self.bytes_per_block = bytes_per_block
        self.default_tenant = default_tenant
        self.stats = stats or store.stats
        self.lru: UserKVLRU | None = None
        self._kcm: Any = None
        self._reqs: dict[str, _ReqState] = {}
        self._loads: list[GRLoad] = []
        self._warned: set[str] = set()
        #: async swap-ins not yet reported done (their blocks must outlive an abort)
        self.load_async = load_async
        self._loading: set[str] = set()

    # vLLM hands the scheduler's KV cache manager to connectors after construction.
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kcm = kv_cache_manager
        if self.config.user_lru and self.lru is None:
            self.lru = UserKVLRU(
                max_resident_users=self.config.max_resident_users,
                min_free_blocks=self.config.min_free_blocks,
                stats=self.stats,
                gr_of=self.gr_of,
            ).install(kv_cache_manager)

    def gr_of(self, request: Any) -> GRRequest | None:
        st = self._state(request)
        return st.gr if st is not None else None

    def _state(self, request: Any) -> _ReqState | None:
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is not None:
            return st
        sp = getattr(request, "sampling_params", None)
        try:
            gr = parse_gr_request(
                getattr(request, "kv_transfer_params", None), getattr(sp, "extra_args", None),
                request.num_prompt_tokens, cache_salt=getattr(request, "cache_salt", None),
                default_tenant=self.default_tenant,
            )
        except GRInputError as exc:
            if rid not in self._warned:
                self._warned.add(rid)
                self.stats.add(invalid_inputs=1)
                log.warning("request %s: %s; served as an ordinary request", rid, exc)
            return None
        if gr is None or request.prompt_token_ids is None:
            return None  # ordinary request (or prompt embeddings: no token ids to key on)
        # vLLM recomputes at least the last prompt token, and pools whole blocks.
        usable = min(gr.history_len, request.num_prompt_tokens - 1)
        history = max(0, usable) // self.block_size * self.block_size
        st = _ReqState(gr, history, request, variant=kv_identity(request, history))
        self._reqs[rid] = st
        return st

    def is_gr(self, request: Any) -> bool:
        return self._state(request) is not None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool] | None:
        """(pool tokens to load, async?) for a GR request; None: not GR, use the ordinary path."""
        st = self._state(request)
        if st is None:
            return None
        st.local = num_computed_tokens
        if st.history == 0:
            return 0, False
        hist = request.prompt_token_ids[: st.history]
        st.hit = self.store.with_variant(st.variant).lookup(st.gr.uid, hist, tenant=st.gr.tenant)
        # save unless the pool already serves this whole history (a stored history that
        # this one is a prefix of is kept: requests may send shorter windows of it)
        st.save_needed = st.hit.hit_tokens < st.history
        n = max(0, st.hit.hit_tokens - num_computed_tokens)
        recs = st.hit.records
        if n and len({r.kv_blocks for r in recs if r is not None}) != 1:
            log.warning("GR user %s: ranks disagree on the stored shape; not loading", st.gr.uid)
            n = 0
        # async: vLLM parks the request until the workers report the swap-in done
        return n, bool(n and self.load_async)

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or st.history == 0:
            return
        if not st.counted:  # three-level hit, counted once at admission
            st.counted = True
            if st.local >= st.history:
                self.stats.add(device_hits=1, hit_tokens_device=st.history)
            elif num_external_tokens > 0:
                self.stats.add(dram_hits=1, hit_tokens_pool=num_external_tokens,
                               hit_tokens_device=st.local)
            else:
                self.stats.add(dram_misses=1, hit_tokens_device=st.local)
        if num_external_tokens <= 0 or st.hit is None:
            return
        bs = self.block_size
        recs = st.hit.records
        assert all(recs)
        kv_blocks = recs[0].kv_blocks  # type: ignore[union-attr]
        if self.load_async:
            self._loading.add(request.request_id)
        block_ids = self._kcm.get_block_ids(request.request_id)[0]
        first, end = st.local // bs, (st.local + num_external_tokens) // bs
        targets = [block_ids[i] if first <= i < end else -1 for i in range(kv_blocks)]
        generations = [r.generation for r in recs]  # type: ignore[union-attr]
        self._loads.append(GRLoad(request.request_id, st.gr.uid, generations, kv_blocks, targets, st.gr.tenant,
                                  st.variant))

    def build_plan(self, scheduler_output: Any) -> GRPlan:
        plan = GRPlan(loads=self._loads)
        self._loads = []
        for rid, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None or not st.save_needed or st.save_planned or st.history == 0:
                continue
            req = st.request
            if req.num_computed_tokens + n_sched < st.history:
                continue  # the history is not complete on the device yet
            st.save_planned = True
            nbytes = st.history // self.block_size * self.bytes_per_block
            if not self.store.make_room(st.gr.uid, st.gr.tenant, nbytes,
                                        protect=self._running_users(st.gr.tenant)):
                continue  # full tenant quota: skip the write (a future miss, never an error)
            block_ids = self._kcm.get_block_ids(rid)[0][: st.history // self.block_size]
            plan.saves.append(GRSave(rid, st.gr.uid, st.gr.tenant,
                                     list(req.prompt_token_ids[: st.history]), list(block_ids), st.variant))
        return plan

    def _running_users(self, tenant: str) -> set[str]:
        """uids of ``tenant`` with a running request (the quota never evicts them)."""
        if self.lru is not None:
            return {u for t, u in self.lru.running_users() if t == tenant}
        return {st.gr.uid for st in self._reqs.values() if st.gr.tenant == tenant}

    def update_connector_output(self, finished_recving: Any) -> None:
        self._loading -= set(finished_recving or ())

    def request_finished(self, request: Any) -> bool:
        """Whether vLLM must keep the request's blocks until the workers report it
        (finished_sending): an async swap-in may still be writing them."""
        self._reqs.pop(request.request_id, None)
        self._warned.discard(request.request_id)
        if request.request_id in self._loading:
            self._loading.discard(request.request_id)
            return True
        return False

    def delete_user(self, uid: str, cache_salt: str | None = None) -> int:
        """Delete a user's KV everywhere: the pool (every model and shape) and this
        engine's device prefix cache (when the user LRU is on).

        The user is ``uid`` of the tenant of ``cache_salt`` (None: the engine's
        default tenant, as for a request without a salt); the same uid under
        other tenants keeps its pool KV."""
        tenant = tenant_id(cache_salt or self.default_tenant)
        if self.lru is not None:
            self.lru.evict_user(uid, tenant)  # this tenant's user only, as in the pool
        return self.store.delete_user(uid, tenant=tenant)


# -- worker side ---------------------------------------------------------------------
BlockRegions = Callable[[Sequence[int]], list[list[Sequence[Region]]]]


class GRWorkerHooks:
    """Executes a ``GRPlan`` on one rank.

    ``block_regions(block_ids)`` gives, per layer, the byte runs of each block
    (the connector derives it from vLLM's KV views). ``before_save(block_ids)``
    makes the forward's writes visible (a device sync). Where the backend must
    not be handed vLLM's memory as it is, the store's ``staging`` moves each user
    object through buffers of the connector's (``ascendstore_vllm.gr.staging``).

    With ``load_async`` the swap-ins of a step run on one transfer thread while
    the forward goes on (vLLM holds those requests in WAITING_FOR_REMOTE_KVS);
    ``finished()`` reports them done, as the chunk pool's async loads are."""

    def __init__(self, store: UserStore, *, count_stats: bool = True, load_async: bool = False) -> None:
        self.store = store
        self.stats = store.stats
        self.count_stats = count_stats  # one rank counts swap-ins, so sums stay per request
        self.block_regions: BlockRegions | None = None
        self.before_save: Callable[[list[int]], None] = lambda block_ids: None
        self.load_async = load_async
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: dict[str, Future[set[int]]] = {}  # req id -> its async swap-in
        self._ended: set[str] = set()  # finished (aborted) while loading: report as sending
        self._errors: set[int] = set()

    # -- loads -------------------------------------------------------------------------
    def load(self, plan: GRPlan) -> set[int]:
        """Swap in; returns the device blocks that did not load (vLLM recomputes them).
        Async: starts the loads and returns at once (errors come with ``finished``)."""
        loads = [ld for ld in plan.loads if any(b >= 0 for b in ld.block_ids)]
        if not self.load_async:
            failed: set[int] = set()
            for ld in loads:
                failed |= self._load_one(ld)
            return failed
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ascendstore-gr-load")
        for ld in loads:
            self._inflight[ld.req_id] = self._pool.submit(self._load_one, ld)
        # a planned request whose blocks all sit on the device already: done at once
        for ld in plan.loads:
            if ld.req_id not in self._inflight:
                done: Future[set[int]] = Future()
                done.set_result(set())
                self._inflight[ld.req_id] = done
        return set()

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(ended requests whose loads are over: free their blocks now, swap-ins done)."""
        # saves that timed out while their put ran on: remove what the put stored late
        self.store.reclaim_late_saves()
        self._ended |= finished_req_ids & set(self._inflight)
        sending, recving = set(), set()
        for rid, fut in list(self._inflight.items()):
            if not fut.done():
                continue
            del self._inflight[rid]
            try:
                self._errors |= fut.result()
            except Exception:  # _load_one catches; this is a bug guard
                log.exception("GR async swap-in of %s failed", rid)
            if rid in self._ended:
                self._ended.discard(rid)
                sending.add(rid)
            else:
                recving.add(rid)
        return sending, recving

    def take_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    def _load_one(self, ld: GRLoad) -> set[int]:
        wanted = [b for b in ld.block_ids if b >= 0]
        assert self.block_regions is not None, "register_kv_caches first"
        regions = self.block_regions(wanted)
        by_block = {b: i for i, b in enumerate(wanted)}
        layer_blocks = [[layer[by_block[b]] if b >= 0 else None for b in ld.block_ids] for layer in regions]
        rank = self.store.worker_id
        store = self.store.with_variant(ld.variant)

        def read(spans: Any) -> Status:
            return store.load_kv(ld.uid, ld.generations[rank], ld.kv_blocks, spans, tenant=ld.tenant)

        try:
            st = read(layer_blocks)
        except Exception:  # a bug must not take the engine down: recompute instead
            log.exception("GR swap-in of user %s failed", ld.uid)
            st = Status.INVALID
        if self.count_stats:
            self.stats.add(swapin_attempts=1, swapin_successes=int(st is Status.OK))
        if st is Status.OK:
            return set()
        log.warning("GR swap-in of user %s: %s; recomputing %d blocks", ld.uid, st.name, len(wanted))
        if st in (Status.NOT_FOUND, Status.CORRUPT, Status.INVALID):
            # the record promised KV that is not (or no longer) there: drop it, so the
            # next lookup misses and that request saves the history again
            store.forget_record(ld.uid, ld.tenant)
        return set(wanted)

    # -- saves -------------------------------------------------------------------------
    def save(self, plan: GRPlan) -> None:
        if not plan.saves:
            return
        self.before_save(sorted({b for sv in plan.saves for b in sv.block_ids}))
        for sv in plan.saves:
            assert self.block_regions is not None, "register_kv_caches first"

            def write(spans: Any, sv: GRSave = sv) -> Status:
                return self.store.with_variant(sv.variant).save_kv(sv.uid, sv.tokens, spans, tenant=sv.tenant)

            try:
                regions = self.block_regions(sv.block_ids)
                st = write(regions)
            except Exception:
                log.exception("GR save of user %s failed", sv.uid)
                st = Status.INVALID
            if st is not Status.OK:
                log.info("GR save of user %s: %s (a later request recomputes)", sv.uid, st.name)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=False)
