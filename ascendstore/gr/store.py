"""The user store: GR user keys over the backend contract.

Per user and rank the pool holds one ``token_id`` record (the cached history
token ids) and the ``kv_cache`` object(s) of those tokens' KV. The scheduler
side reads every rank's record in one batched ``get`` to learn how many
leading tokens of a request the pool can serve; a worker writes its own KV
first and its record last, so a record never describes KV that is not there,
and the shared ``generation`` number catches a reader racing a rewrite.

Lifecycle per user: TTL since last use (records carry their write time and a
hit refreshes them), a byte quota per user (a save keeps the leading blocks
that fit) and per tenant (least-recently-used users of the tenant leave the
pool first), delete of one user everywhere, and invalidation of the stale tail
when a request shows a rewritten history.

A user is a uid *of a tenant* (``tenant_id(cache_salt)``, ``-`` for none): the
tenant is part of every user key, so the same uid under two tenants is two
users that never share KV, and every method takes the tenant (default ``-``).
"""

from __future__ import annotations

import copy
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ascendstore.config import GRConfig
from ascendstore.contract import Backend, Region, Status
from ascendstore.engine.guard import PendingCall
from ascendstore.gr.inputs import check_uid
from ascendstore.gr.records import (
    KV_HEADER_BYTES,
    RecordError,
    TokenRecord,
    capacity_class,
    check_kv_header,
    class_search_order,
    common_prefix,
    kv_header,
    token_object_bytes,
)
from ascendstore.gr.stats import GRStats
from ascendstore.keys import NO_TENANT, UserKey, split_user_part

log = logging.getLogger(__name__)


def _region(buf: np.ndarray) -> Region:
    return Region(buf.ctypes.data, buf.nbytes)


#: one block of one layer: a region, or the runs of a non-contiguous block
BlockSpan = Region | Sequence[Region]


def _runs(block: BlockSpan) -> list[Region]:
    return [block] if isinstance(block, Region) else list(block)


#: ``call(regions, buffer)``: the backend's put or get over ``regions``, keeping
#: ``buffer`` alive while the call may run; returns (statuses, running or None).
StagedCall = Callable[[list[list[Region]], Any], tuple[list[Status], Callable[[], bool] | None]]


class ObjectStaging(Protocol):
    """Memory a user object's bytes pass through on their way to and from the
    backend, when the backend must see nothing but memory the connector owns for
    it: device KV it cannot read, host headers and records a device-memory or
    RDMA backend cannot address, or blocks a call that overran must never touch.
    ``transfer`` copies every region of a put into its buffer before the call
    and a get's objects out of it only when they arrived whole and in time."""

    def transfer(self, op: str, regions: list[list[Region]], call: StagedCall
                 ) -> tuple[list[Status], Callable[[], bool] | None]: ...


@dataclass(frozen=True)
class UserHit:
    """What the pool holds for one request's user."""

    uid: str
    #: leading history tokens every rank's pool copy serves (block-aligned)
    hit_tokens: int
    #: per rank, the record the hit was computed from (None: nothing usable)
    records: tuple[TokenRecord | None, ...]
    #: the stored history diverged from the request's (its tail was invalidated)
    rewritten: bool = False

    @property
    def stored_tokens(self) -> int:
        return min((r.n_tokens for r in self.records if r is not None), default=0) if all(
            self.records
        ) else 0

    def matches(self, history_tokens: int) -> bool:
        """The pool already holds exactly this (block-aligned) history: no save needed."""
        return all(self.records) and self.hit_tokens == history_tokens == self.stored_tokens


@dataclass
class _LateSave:
    """A save that failed while one of its puts was still running. The late put may
    still store its object, which no record would ever describe (space never
    reclaimed until the user is saved again): once the call has ended, the store
    removes what it left, unless a record names it."""

    done: Callable[[], bool]
    uid: str
    tenant: str
    generation: int
    kv_keys: list[str]
    kv_sizes: list[int]  # exact bytes of each KV object as this save wrote it
    kv_layers: list[int | None]  # the layer each KV header names (None: all layers in one object)
    n_blocks: int
    token_key: str
    token_size: int
    attempts: int = 0


@dataclass
class _UserEntry:
    tenant: str
    nbytes: int  # all ranks
    last_used: float


@dataclass
class UserIndex:
    """Users (uid of a tenant) this process has seen in the pool, least recently used first.

    Fed by lookups (records carry tenant and size) and saves, so an instance
    learns users written by others as requests for them arrive; with a
    listing backend it can be rebuilt from the pool (``UserStore.rebuild_index``).
    """

    _users: OrderedDict[tuple[str, str], _UserEntry] = field(default_factory=OrderedDict)  # (tenant, uid)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def touch(self, uid: str, tenant: str, nbytes: int, now: float) -> None:
        with self._lock:
            self._users[(tenant, uid)] = _UserEntry(tenant, nbytes, now)
            self._users.move_to_end((tenant, uid))

    def drop(self, uid: str, tenant: str = NO_TENANT) -> None:
        with self._lock:
            self._users.pop((tenant, uid), None)

    def tenant_bytes(self, tenant: str) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._users.values() if e.tenant == tenant)

    def lru(self, tenant: str) -> list[str]:
        """The tenant's uids, least recently used first."""
        with self._lock:
            return [u for (t, u) in self._users if t == tenant]

    def users(self) -> list[tuple[str, str]]:
        """Every known ``(uid, tenant)``, least recently used first."""
        with self._lock:
            return [(u, t) for (t, u) in self._users]

    def get(self, uid: str, tenant: str = NO_TENANT) -> _UserEntry | None:
        with self._lock:
            return self._users.get((tenant, uid))

    def __len__(self) -> int:
        return len(self._users)


class UserStore:
    """GR user objects of one model on one backend.

    ``worker_id`` is this process's rank (scheduler: any; it reads all ranks).
    ``num_layers`` > 0 with ``layerwise`` splits KV objects per layer.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        model: str,
        world_size: int,
        block_size: int,
        config: GRConfig | None = None,
        worker_id: int = 0,
        num_layers: int = 1,
        layerwise: bool = False,
        timeout_s: float = 5.0,
        max_history_tokens: int = 1 << 20,
        stats: GRStats | None = None,
        index: UserIndex | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if block_size <= 0 or world_size <= 0:
            raise ValueError("block_size and world_size must be positive")
        self.backend = backend
        self.model = model
        self.world_size = world_size
        self.block_size = block_size
        self.config = config or GRConfig(enabled=True)
        self.worker_id = worker_id
        self.num_layers = num_layers
        self.layerwise = layerwise
        self.timeout_s = timeout_s
        self.max_history_tokens = max_history_tokens
        self.stats = stats or GRStats()
        self.index = index or UserIndex()
        self.clock = clock
        self.caps = backend.capabilities
        self._scratch: np.ndarray | None = None
        #: set by the connector when the backend must see only memory it owns (None: regions go as they are)
        self.staging: ObjectStaging | None = None
        #: host buffers lent to calls the guard stopped waiting for, kept alive until
        #: those calls really end (shared with the variants of this store)
        self._held: list[tuple[Callable[[], bool], tuple[Any, ...]]] = []
        self._held_lock = threading.Lock()
        #: saves that failed while a put was still running (late puts): reclaimed once it ends
        self._late_saves: list[_LateSave] = []

    def with_variant(self, variant: str) -> UserStore:
        """This store for KV that depends on more than the token ids (a LoRA adapter,
        multimodal inputs): ``variant`` (a digest of that identity) joins the model
        part of every key, ``{model}+{variant}``. Stats, user index and config are
        shared; ``""`` is this store."""
        if not variant:
            return self
        if "@" in variant or "+" in variant:
            raise ValueError(f"variant {variant!r} must not contain '@' or '+'")
        other = copy.copy(self)
        other.model = f"{self.model}+{variant}"
        other._scratch = None
        return other  # (shares _held and _late_saves: the lists are the same objects)

    # -- keys ---------------------------------------------------------------------
    def token_key(self, uid: str, rank: int, tenant: str = NO_TENANT) -> str:
        return UserKey(uid, self.model, self.world_size, rank, "token_id", tenant=tenant).text()

    def kv_keys(self, uid: str, rank: int, tenant: str = NO_TENANT) -> list[str]:
        base = UserKey(uid, self.model, self.world_size, rank, "kv_cache", tenant=tenant)
        if not self.layerwise:
            return [base.text()]
        return [UserKey(uid, self.model, self.world_size, rank, "kv_cache", layer, tenant).text()
                for layer in range(self.num_layers)]

    def user_keys(self, uid: str, tenant: str = NO_TENANT) -> list[str]:
        keys = []
        for rank in range(self.world_size):
            keys.append(self.token_key(uid, rank, tenant))
            keys.extend(self.kv_keys(uid, rank, tenant))
        return keys

    # -- scheduler side: one read per request ---------------------------------------
    def read_records(self, uid: str, history_len: int, tenant: str = NO_TENANT) -> list[TokenRecord | None]:
        """Every rank's token record (None where absent, unreadable or failing)."""
        keys = [self.token_key(uid, r, tenant) for r in range(self.world_size)]
        out: list[TokenRecord | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for cap in class_search_order(history_len, self.max_history_tokens):
            if not pending:
                break
            bufs = [np.empty(token_object_bytes(cap), dtype=np.uint8) for _ in pending]
            statuses, _ = self._transfer("get", [keys[i] for i in pending], [[_region(b)] for b in bufs], bufs)
            still = []
            for i, st, buf in zip(pending, statuses, bufs, strict=True):
                if st is Status.OK:
                    try:
                        out[i] = TokenRecord.decode(buf)
                    except RecordError as exc:
                        log.warning("GR record %s unreadable (%s); treating as a miss", keys[i], exc)
                elif st is Status.INVALID:
                    still.append(i)  # another size class
                elif st is not Status.NOT_FOUND:
                    log.debug("GR record %s: %s", keys[i], st.name)
            pending = still
        return out

    def lookup(self, uid: str, history: Sequence[int] | np.ndarray, tenant: str = NO_TENANT) -> UserHit:
        """How many leading tokens of ``history`` the pool serves for ``uid`` of ``tenant``.

        Side effects are the lifecycle ones: an expired user is deleted, a
        rewritten history has its stale tail cut from the records, a hit
        refreshes the TTL clock when it is half spent.
        """
        hist = np.asarray(history, dtype=np.int64)
        records = self.read_records(uid, hist.shape[0], tenant)
        now = self.clock()
        if not all(records):
            return UserHit(uid, 0, tuple(records))
        recs = [r for r in records if r is not None]
        miss = UserHit(uid, 0, (None,) * self.world_size)
        if any(r.tenant != tenant for r in recs):
            # The key names the tenant, so this is a foreign or corrupt record: never
            # serve it, and leave it alone (it may be another tenant's data).
            log.warning("GR user %s: record of tenant %r under tenant %r's key; treating as a miss",
                        uid, next(r.tenant for r in recs if r.tenant != tenant), tenant)
            return miss
        if any(r.n_tokens > r.kv_blocks * self.block_size for r in recs):
            log.warning("GR user %s: record describes more tokens than its KV object; treating as a miss",
                        uid)
            return miss
        ttl = self.config.ttl_s
        if ttl and any(now - r.written_at > ttl for r in recs):
            self.stats.add(expired=1)
            self.delete_user(uid, everywhere=False, tenant=tenant)
            return miss
        if self.caps.evicts and not self._kv_present(uid, tenant):
            # the store dropped a KV object by itself: the records are now lies
            self._remove([self.token_key(uid, r, tenant) for r in range(self.world_size)])
            return miss
        bs = self.block_size
        prefixes = [common_prefix(r.tokens, hist) for r in recs]
        hit = (min(prefixes) // bs) * bs
        rewritten = any(p < min(r.n_tokens, hist.shape[0]) for p, r in zip(prefixes, recs, strict=True))
        if rewritten:
            # The request shows a different history: the stored tail is stale for
            # everyone. Keep the common, block-aligned prefix (same KV object).
            self.stats.add(invalidations=1)
            if hit == 0:
                self.delete_user(uid, everywhere=False, tenant=tenant)
                return UserHit(uid, 0, (None,) * self.world_size, rewritten=True)
            recs = [r.with_tokens(hit) for r in recs]
            self._write_records(uid, recs, tenant)
        elif ttl and hit and any(now - r.written_at > ttl / 2 for r in recs):
            recs = [r.with_tokens(r.n_tokens, written_at=now) for r in recs]
            self._write_records(uid, recs, tenant)
        self.index.touch(uid, tenant, sum(r.kv_bytes for r in recs), now)
        return UserHit(uid, hit, tuple(recs), rewritten=rewritten)

    def _kv_present(self, uid: str, tenant: str) -> bool:
        keys = [k for r in range(self.world_size) for k in self.kv_keys(uid, r, tenant)]
        return all(s is Status.OK for s in self.backend.exists(keys, self.timeout_s))

    def _write_records(self, uid: str, recs: Sequence[TokenRecord], tenant: str) -> None:
        keys = [self.token_key(uid, r, tenant) for r in range(len(recs))]
        bufs = [self._record_buffer(uid, rank, r) for rank, r in enumerate(recs)]
        if not self.caps.overwrite_on_put:
            self._remove(keys)
        self._transfer("put", keys, [[_region(b)] for b in bufs], bufs)

    def _record_buffer(self, uid: str, rank: int, rec: TokenRecord) -> np.ndarray:
        # Keep the size class of the full KV object's history so a reader with
        # that history finds the record on its first try.
        return rec.encode(capacity_class(max(rec.n_tokens, rec.kv_blocks * self.block_size)))

    # -- tenant quota (scheduler side, before a save is planned) ---------------------
    def make_room(self, uid: str, tenant: str, nbytes: int, protect: frozenset[str] | set[str] = frozenset()) -> bool:
        """Whether ``uid`` may store ``nbytes`` (all ranks) under the tenant quota,
        evicting the tenant's least-recently-used other users from the pool if needed."""
        quota = self.config.tenant_quota_bytes
        if not quota:
            return True
        if nbytes > quota:
            self.stats.add(quota_skips=1)
            return False
        cur = self.index.get(uid, tenant)
        used = self.index.tenant_bytes(tenant) - (cur.nbytes if cur else 0)
        for victim in self.index.lru(tenant):
            if used + nbytes <= quota:
                break
            if victim == uid or victim in protect:
                continue
            entry = self.index.get(victim, tenant)
            self.delete_user(victim, everywhere=False, tenant=tenant)
            used -= entry.nbytes if entry else 0
            self.stats.add(quota_evictions=1)
        if used + nbytes > quota:
            self.stats.add(quota_skips=1)
            return False
        return True

    # -- worker side --------------------------------------------------------------
    def save_kv(
        self,
        uid: str,
        tokens: Sequence[int] | np.ndarray,
        layer_blocks: Sequence[Sequence[BlockSpan]],
        tenant: str = NO_TENANT,
    ) -> Status:
        """Write this rank's KV of the user's history, then its token record.

        ``layer_blocks[l][b]`` is block ``b`` of layer ``l`` (same block count per
        layer, ``len(tokens) // block_size`` blocks). The per-user quota keeps the
        leading blocks that fit.
        """
        toks = np.asarray(tokens, dtype=np.int64)
        n_blocks = min(toks.shape[0] // self.block_size, min(len(b) for b in layer_blocks))
        block_bytes = sum(r.length for layer in layer_blocks for r in _runs(layer[0])) if n_blocks else 0
        quota = self.config.user_quota_bytes
        if quota and n_blocks * block_bytes * self.world_size > quota:
            fit = quota // (block_bytes * self.world_size)
            self.stats.add(quota_truncations=1)
            n_blocks = fit
        per_object = block_bytes  # KV bytes one block adds to one object
        if self.layerwise and n_blocks:
            per_object = max(sum(r.length for r in _runs(layer[0])) for layer in layer_blocks)
        max_obj = self.caps.max_object_bytes - KV_HEADER_BYTES
        if per_object and n_blocks * per_object > max_obj:
            # the backend's object size limit: keep the leading blocks (layerwise splits further)
            log.warning("GR user %s: history of %d blocks exceeds the backend's %d-byte objects; "
                        "pooling the first %d (use_layerwise stores one object per layer)",
                        uid, n_blocks, self.caps.max_object_bytes, max_obj // per_object)
            n_blocks = max_obj // per_object
        if n_blocks == 0:
            self.stats.add(quota_skips=1 if quota else 0)
            return Status.NO_SPACE if quota else Status.INVALID
        n_tokens = n_blocks * self.block_size
        generation = secrets.randbits(63)
        token_key = self.token_key(uid, self.worker_id, tenant)
        # Invalidate first: while the KV is being replaced no reader may trust the old record.
        self._remove([token_key])
        keys = self.kv_keys(uid, self.worker_id, tenant)
        headers: list[np.ndarray] = []
        regions: list[list[Region]] = []
        if self.layerwise:
            for layer, blocks in enumerate(layer_blocks):
                headers.append(kv_header(generation, n_blocks, layer))
                regions.append([_region(headers[-1])] + [r for b in blocks[:n_blocks] for r in _runs(b)])
        else:
            headers.append(kv_header(generation, n_blocks, None))
            regions.append([_region(headers[0])] + [r for layer in layer_blocks for b in layer[:n_blocks]
                                                    for r in _runs(b)])
        if not self.caps.overwrite_on_put:
            self._remove(keys)
        rec = TokenRecord(toks[:n_tokens].astype(np.int32), n_blocks, generation, self.clock(),
                          n_blocks * block_bytes, tenant)
        buf = self._record_buffer(uid, self.worker_id, rec)

        def late(done: Callable[[], bool]) -> None:
            layers: list[int | None] = list(range(len(keys))) if self.layerwise else [None]
            with self._held_lock:
                self._late_saves.append(_LateSave(done, uid, tenant, generation, keys,
                                                  [sum(r.length for r in rs) for rs in regions], layers,
                                                  n_blocks, token_key, buf.nbytes))

        statuses, running = self._transfer("put", keys, regions, headers)
        bad = next((s for s in statuses if s is not Status.OK), None)
        if bad is not None:
            self.stats.add(save_failures=1)
            self._remove(keys)
            if running is not None:
                late(running)  # the put may still land: remove it once it has ended
            return bad
        (st,), running = self._transfer("put", [token_key], [[_region(buf)]], [buf])
        if st is not Status.OK:
            self.stats.add(save_failures=1)
            if running is not None:
                late(running)  # the record may still land (then it is valid) or not (then reclaim)
            else:
                self._remove(keys)  # no record will describe this KV: do not leave it behind
            return st
        self.stats.add(saves=1, bytes_saved=rec.kv_bytes)
        self.index.touch(uid, tenant, rec.kv_bytes * self.world_size, rec.written_at)
        return Status.OK

    def load_kv(
        self,
        uid: str,
        generation: int,
        kv_blocks: int,
        layer_blocks: Sequence[Sequence[BlockSpan | None]],
        layers: Sequence[int] | None = None,
        tenant: str = NO_TENANT,
    ) -> Status:
        """Read this rank's KV object(s) of ``uid`` into ``layer_blocks``.

        ``layer_blocks[l]`` has ``kv_blocks`` entries; ``None`` entries (blocks the
        device already holds, or a stale tail) land in a scratch buffer. The
        result is OK only if every object read back whole and carries
        ``generation`` (the one the scheduler's record named).
        """
        if len(layer_blocks) == 0 or kv_blocks == 0:
            return Status.OK
        keys = self.kv_keys(uid, self.worker_id, tenant)
        headers: list[np.ndarray] = []
        regions: list[list[Region]] = []

        def fill(blocks: Sequence[BlockSpan | None]) -> list[Region]:
            if len(blocks) != kv_blocks:
                raise ValueError(f"need {kv_blocks} block regions per layer, got {len(blocks)}")
            shape = next((_runs(b) for b in blocks if b is not None), None)
            if shape is None:
                raise ValueError("a layer needs at least one target block")
            # blocks nobody wants (on the device already, or a stale tail) land in scratch
            scratch = self._scratch_region(max(r.length for r in shape))
            out: list[Region] = []
            for b in blocks:
                out.extend(_runs(b) if b is not None else [Region(scratch.addr, r.length) for r in shape])
            return out

        wanted_layers = list(range(len(layer_blocks))) if layers is None else list(layers)
        if self.layerwise:
            keys = [keys[layer] for layer in wanted_layers]
            for layer in wanted_layers:
                headers.append(np.zeros(KV_HEADER_BYTES, dtype=np.uint8))
                regions.append([_region(headers[-1]), *fill(layer_blocks[layer])])
        else:
            headers.append(np.zeros(KV_HEADER_BYTES, dtype=np.uint8))
            regions.append([_region(headers[0])] + [r for layer in layer_blocks for r in fill(layer)])
        owners = [*headers, self._scratch]
        statuses, held = self._transfer("get", keys, regions, owners)
        if held is not None:
            self._scratch = None  # a late write may still land in it: the next load gets a new one
        bad = next((s for s in statuses if s is not Status.OK), None)
        if bad is not None:
            return bad
        expect = [(h, layer if self.layerwise else None) for h, layer in zip(headers, wanted_layers, strict=False)]
        if not all(check_kv_header(h, generation, kv_blocks, layer) for h, layer in expect):
            return Status.CORRUPT  # another save replaced the object under us
        self.stats.add(bytes_loaded=sum(
            r.length for layer in wanted_layers for b in layer_blocks[layer] if b is not None for r in _runs(b)))
        return Status.OK

    def _transfer(
        self, op: str, keys: list[str], regions: list[list[Region]], owners: Sequence[Any]
    ) -> tuple[list[Status], Callable[[], bool] | None]:
        """``get``/``put`` of host buffers ``owners`` (the arrays behind ``regions``);
        returns the statuses and, when the call may still be running (using the
        memory, or storing an object), a predicate that turns True once it has ended.

        A call the guard stopped waiting for (TIMEOUT) may still write into or read
        its buffers later; had they been freed, that late write lands in reused heap
        memory (seen as crashes and endless loops far away). Such buffers stay
        referenced here until the guard says the call has really ended.
        With ``staging`` the backend is handed the staging's buffer instead (kept
        the same way) and the regions are copied into or out of it.
        """
        if self.staging is not None:
            return self.staging.transfer(op, regions, lambda staged, buf: self._call(op, keys, staged, (*owners, buf)))
        return self._call(op, keys, regions, owners)

    def _call(
        self, op: str, keys: list[str], regions: list[list[Region]], owners: Sequence[Any]
    ) -> tuple[list[Status], Callable[[], bool] | None]:
        self._release_held()
        backend = self.backend
        hold_for = getattr(backend, "hold_for", None)
        submit = getattr(backend, f"submit_{op}", None)
        if hold_for is None or submit is None or getattr(backend, "inline", False):
            # a bare backend, or a bounded one (the guard runs it on this thread): the
            # call is over when it returns, but a backend's own detached work may not be
            statuses = list(getattr(backend, op)(keys, regions, self.timeout_s))
            call = PendingCall(op, len(keys), None, self.timeout_s, statuses)
        else:
            call = submit(keys, regions, self.timeout_s) if op == "get" else submit(keys, regions)
            statuses = backend.result(call)
        release = hold_for(call, statuses) if hold_for is not None else None
        if release is None:
            return statuses, None
        with self._held_lock:
            self._held.append((release, tuple(owners)))
        return statuses, release

    def _release_held(self) -> None:
        if not self._held:
            return
        with self._held_lock:
            self._held[:] = [(done, owners) for done, owners in self._held if not done()]

    def reclaim_late_saves(self, max_attempts: int = 3) -> int:
        """Remove what failed saves' late puts stored once those calls have ended;
        returns how many objects were removed. Cheap when there is nothing to do
        (the worker calls it every step).

        An object is removed only if it is this save's: its KV header carries the
        save's generation (a random 63-bit number) and no token record names that
        generation. A newer save of the same user (another engine) has another
        generation and is left alone. (A save racing the removal itself loses its
        KV object: its record then finds no KV, the reader drops the record and
        recomputes -- a miss, never a wrong token.)"""
        if not self._late_saves:
            return 0
        with self._held_lock:
            ready = [j for j in self._late_saves if j.done()]
            self._late_saves[:] = [j for j in self._late_saves if all(j is not r for r in ready)]
        removed = 0
        for job in ready:
            try:
                n = self._reclaim(job)
            except Exception:  # a bug here must not take the worker down; the space stays used
                log.exception("GR: reclaiming a late save of user %s failed", job.uid)
                continue
            if n is None and job.attempts + 1 < max_attempts:
                job.attempts += 1
                with self._held_lock:
                    self._late_saves.append(job)  # the check itself failed: try again later
            removed += n or 0
        return removed

    def _reclaim(self, job: _LateSave) -> int | None:
        """Objects of ``job`` removed; None when the pool could not be read (retry)."""
        rec_buf = np.empty(job.token_size, dtype=np.uint8)
        (st,), running = self._transfer("get", [job.token_key], [[_region(rec_buf)]], [rec_buf])
        if running is not None:
            return None
        if st is Status.OK:
            try:
                if TokenRecord.decode(rec_buf).generation == job.generation:
                    return 0  # the late record landed: it describes the late KV, which is valid
            except RecordError:
                pass
        elif st not in (Status.NOT_FOUND, Status.INVALID):
            return None
        mine: list[str] = []
        for key, size, layer in zip(job.kv_keys, job.kv_sizes, job.kv_layers, strict=True):
            buf = np.empty(size, dtype=np.uint8)
            (st,), running = self._transfer("get", [key], [[_region(buf)]], [buf])
            if running is not None:
                return None
            if st is Status.OK and check_kv_header(buf[:KV_HEADER_BYTES], job.generation, job.n_blocks, layer):
                mine.append(key)
            elif st not in (Status.OK, Status.NOT_FOUND, Status.INVALID):
                return None  # INVALID: another size, so another save's object
        if mine:
            self._remove(mine)
            self.stats.add(late_saves_reclaimed=len(mine))
            log.info("GR user %s: removed %d object(s) a timed-out save stored late", job.uid, len(mine))
        return len(mine)

    def _scratch_region(self, nbytes: int) -> Region:
        if self._scratch is None or self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, dtype=np.uint8)
        return _region(self._scratch)

    # -- lifecycle ------------------------------------------------------------------
    def _remove(self, keys: list[str]) -> None:
        statuses = self.backend.remove(keys, self.timeout_s)
        for k, s in zip(keys, statuses, strict=True):
            if s not in (Status.OK, Status.NOT_FOUND):
                log.warning("GR remove %s: %s", k, s.name)

    def forget_record(self, uid: str, tenant: str = NO_TENANT) -> None:
        """Drop this rank's token record (its KV proved unreadable): lookups miss until
        the next save."""
        self._remove([self.token_key(uid, self.worker_id, tenant)])

    def delete_user(self, uid: str, everywhere: bool = True, tenant: str = NO_TENANT) -> int:
        """Remove user ``uid`` of ``tenant`` (other tenants' users of that uid stay):
        its objects of every model and deployment shape when ``everywhere`` (by key
        prefix, where the backend can), else this store's. Returns how many objects
        were removed."""
        uid = check_uid(uid)
        prefix = UserKey.user_prefix(uid, tenant)  # validates the tenant
        self.index.drop(uid, tenant)
        if everywhere:
            self.stats.add(deleted_users=1)
        if everywhere and self.caps.remove_by_prefix:
            st, n = self.backend.remove_prefix(prefix, self.timeout_s)
            if st is Status.OK:
                return n
        keys = self.user_keys(uid, tenant)
        return sum(s is Status.OK for s in self.backend.remove(keys, self.timeout_s))

    def sweep_expired(self) -> int:
        """Delete users whose records outlived the TTL; returns how many."""
        ttl = self.config.ttl_s
        if not ttl:
            return 0
        now = self.clock()
        gone = 0
        for uid, tenant in self.known_users():
            records = self.read_records(uid, 0, tenant)
            times = [r.written_at for r in records if r is not None]
            if times and now - min(times) > ttl:
                self.delete_user(uid, everywhere=False, tenant=tenant)
                self.stats.add(expired=1)
                gone += 1
        return gone

    def known_users(self) -> list[tuple[str, str]]:
        """``(uid, tenant)`` of this model's users: from the pool where it can list
        keys, else the index."""
        if self.caps.listing:
            suffix = f"@{self.model}@{self.world_size}@0@token_id"
            users = set()
            lister = getattr(self.backend, "list_keys", None) or self.backend.backend.list_keys
            try:
                for key in lister("", limit=1 << 30):
                    if key.endswith(suffix):
                        try:
                            users.add(split_user_part(key[: -len(suffix)]))
                        except ValueError:
                            continue  # not a user key of ours
            except NotImplementedError:
                pass
            else:
                return sorted(users)
        return self.index.users()

    def rebuild_index(self) -> int:
        """Refill the user index from the pool (listing backends); returns users found."""
        n = 0
        for uid, tenant in self.known_users():
            recs = self.read_records(uid, 0, tenant)
            if all(recs) and all(r.tenant == tenant for r in recs if r):
                r0 = recs[0]
                assert r0 is not None
                self.index.touch(uid, tenant, sum(r.kv_bytes for r in recs if r), r0.written_at)
                n += 1
        return n

