"""KV events a router can trust: what the pool holds, announced when it holds it.

``BlockStored`` goes out once every object of a chunk (each rank's part, each
layer in layerwise mode) *landed* in the pool: the workers report the keys of
their saves that are in the pool afterwards — put OK, or found there and
skipped (the transfer engine's ``take_landed``; ``AscendStoreWorkerMeta``,
vLLM's worker-meta path, merged across TP ranks by vLLM's
``KVOutputAggregator``) — and the scheduler announces a chunk when the union
covers all of its objects. Events are produced only while vLLM publishes KV
events (its ``kv_events_config``). Saves that are planned but
dropped, fail or time out announce nothing.

``BlockRemoved`` goes out when the pool reports that an object of an announced
chunk left it (evicted, removed, expired): backends with the optional
capability ``removal_events`` keep a record read through
``removed_since(cursor, limit) -> (new cursor, events, lost)``; each event has
``key``, ``tier`` and ``reason``. Losing any object makes the whole chunk
unloadable (a lookup needs all of them), so one removal withdraws every block
of the chunk that no other announced object still covers (a partial tail and
the full chunk over it share blocks). Backends without the record never send
``BlockRemoved`` (docs/connector.md says what a router does then).

Ordering: the record is read after the step's landing reports are processed,
so a removal that happened before a chunk landed is seen no later than the
landing itself; a chunk whose objects were reported removed while its save was
in flight is checked with one ``exists`` before it is announced. Reads of the
record are bounded in time; a chunk waits for the next read that started after
it landed, so a slow record delays announcements but never orders them wrong.
When the record reports lost events (it overflowed), every announced chunk is
checked with ``exists`` and the absent ones are withdrawn.

Hybrid models (KV cache groups, groups.py) store one object per chunk and group;
each is announced on its own, as vLLM announces its own blocks: ``BlockStored``
with the group's index (``group_idx``), its spec kind and sliding window, and the
hashes of the blocks the object holds (a sliding-window object only the window's
blocks, a state object the one block whose state it is); ``BlockRemoved`` names
the group too.
"""

from __future__ import annotations

import logging
import queue
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ascendstore.contract import Status
from ascendstore.keys import PoolKey

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from ascendstore.engine import BackendGuard, KeyBuilder
    from ascendstore_vllm.metadata import ChunkRef

log = logging.getLogger(__name__)

#: vLLM's medium name (vllm.distributed.kv_events MEDIUM_CPU) for the pool tier
#: puts land in: host DRAM with every backend here (local, mooncake, memcache).
#: A withdrawal names the medium the chunk was announced in, whatever tier the
#: record says the object left (a router's entry is (block, medium)).
STORE_MEDIUM = "CPU"
#: vLLM medium of a tier as the removal record names it (``RemovalEvent.tier`` / ``moved_to``).
MEDIUM_OF_TIER = {"cpu": "CPU", "dram": "CPU", "disk": "STORAGE", "ssd": "STORAGE"}
#: announced chunks remembered for withdrawal (block hashes, parent, token ids
#: as 8-byte ints); beyond this the oldest is
#: withdrawn early (a router then under-counts, it is never told a lie it keeps).
MAX_TRACKED_CHUNKS = 1 << 17
#: saves in flight whose landing is awaited; the oldest is forgotten beyond this.
MAX_PENDING_CHUNKS = 1 << 16
#: events read from the removal record per call.
RECORD_BATCH = 4096
#: keys per exists call when re-checking announced chunks.
EXISTS_BATCH = 4096


def has_removal_record(backend: Any) -> bool:
    """The optional capability ``removal_events`` (checked by name, so backends
    built against a contract without it simply have none)."""
    return bool(getattr(backend.capabilities, "removal_events", False)) and hasattr(backend, "removed_since")


ChunkId = tuple[str, str, int]  # (tenant, chunk hash, KV cache group; -1 without groups)

#: vLLM's KVCacheSpecKind value per pooled group kind (GroupPlan.kind / spec class)
SPEC_KIND = {"full": "full_attention", "sliding": "sliding_window", "state": "mamba"}


@dataclass
class _Pending:
    """A planned chunk save whose objects have not all landed yet."""

    block_hashes: tuple[Any, ...]
    #: first block's position in the sequence: announcements go out in prefix order
    start: int
    parent: Any
    token_ids: list[int]
    lora_name: str | None
    needed: frozenset[str]
    group: int = -1
    got: set[str] = field(default_factory=set)
    reqs: set[str] = field(default_factory=set)
    #: an object of this chunk was reported removed since ``got`` began to fill.
    dirty: bool = False


@dataclass
class _Tracked:
    """An announced chunk: what it takes to withdraw it, or to announce it again
    in another medium when the pool moves it between tiers."""

    block_hashes: tuple[Any, ...]
    parent: Any
    token_ids: array  # compact: kept for every announced chunk
    lora_name: str | None
    group: int = -1
    medium: str = STORE_MEDIUM
    #: its objects now in the disk tier (one rank's part may spill before another's)
    on_disk: set[str] = field(default_factory=set)


@dataclass
class _Ready:
    cid: ChunkId
    chunk: _Pending
    #: read of the removal record this chunk waits for (the first that starts after it landed).
    after_read: int
    #: a removal of one of its objects was seen: check exists before announcing.
    dirty: bool = False


class RemovalRecord:
    """Bounded reads of a backend's removal record on one private thread."""

    def __init__(self, backend: Any, timeout_s: float) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        # One daemon thread: a record read that never returns must not hold up
        # the process's exit (a ThreadPoolExecutor's threads are joined at exit).
        self._calls: queue.SimpleQueue[tuple[Future, int] | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="ascendstore-events", daemon=True).start()
        self._fut: Future | None = None
        #: reads started so far; the one in flight has number ``started``.
        self.started = 0
        self.cursor = -1
        self.lost_total = 0
        self.failures = 0
        self._blind = False
        self.read()  # position the cursor at "now": earlier removals are not ours

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            fut, cursor = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self._call(cursor))
            except Exception as exc:
                fut.set_exception(exc)

    def _call(self, cursor: int) -> tuple[int, list[Any], int]:
        # Everything up to now: a read counts as done only once it reached the end
        # of the record (announcements wait for it), so read on while batches are full.
        events: list[Any] = []
        lost = 0
        while True:
            cursor, batch, n_lost = self.backend.removed_since(cursor, RECORD_BATCH)
            events.extend(batch)
            lost += n_lost
            if cursor < 0 or len(batch) < RECORD_BATCH:
                return cursor, events, lost

    def read(self) -> tuple[int, list[Any], int] | None:
        """Events since the last read: (read number, events, lost), or None while
        a read is still running (it is collected by a later call)."""
        if self._fut is None:
            self.started += 1
            # A cursor never positioned (the first read failed) starts at "now":
            # whatever was removed before is unknown, as if lost.
            self._blind = self.cursor < 0 and self.started > 1
            self._fut = Future()
            self._calls.put((self._fut, self.cursor))
        try:
            cursor, events, lost = self._fut.result(timeout=self.timeout_s)
        except TimeoutError:
            return None
        except Exception:
            self.failures += 1
            # Once loudly; a record that keeps failing is re-checked every step (debug log).
            (log.warning if self.failures == 1 else log.debug)(
                "reading the pool's removal record failed (%d so far); checking announced chunks",
                self.failures, exc_info=True)
            self._fut = None
            return self.started, [], 1
        finally:
            if self._fut is not None and self._fut.done():
                self._fut = None
        n = self.started
        self.cursor = cursor
        lost = max(lost, int(self._blind))
        self.lost_total += lost
        return n, events, lost

    def close(self) -> None:
        self._calls.put(None)


class KVEventLog:
    """Scheduler side: turns planned saves, landed keys and the pool's removal
    record into vLLM ``BlockStored`` / ``BlockRemoved`` events."""

    def __init__(
        self,
        keys: KeyBuilder,
        block_size: int,
        *,
        guard: BackendGuard | None = None,
        local: bool = True,
        timeout_s: float = 1.0,
        groups: Sequence[Any] = (),
    ) -> None:
        self.keys = keys
        #: hybrid models: the GroupPlans (objects per chunk and group)
        self.groups = tuple(groups)
        self._fp_group: dict[str, int] = {
            fp: i for i, fp in enumerate(getattr(keys, "group_fingerprints", ()) or ())} if groups else {}
        self.block_size = block_size
        self.guard = guard
        self.locality = "LOCAL" if local else None
        self.timeout_s = timeout_s
        self._pending: OrderedDict[ChunkId, _Pending] = OrderedDict()
        self._by_key: dict[str, ChunkId] = {}
        self._ready: list[_Ready] = []
        #: announced chunks (for withdrawal and tier moves)
        self._tracked: OrderedDict[ChunkId, _Tracked] = OrderedDict()
        #: announced objects covering each (block hash, medium): a tail and its full chunk share blocks
        self._covers: dict[tuple[Any, str, int], int] = {}
        self._out: list[Any] = []
        self.record: RemovalRecord | None = None
        if guard is not None and has_removal_record(guard.backend):
            self.record = RemovalRecord(guard.backend, timeout_s)
        #: counters (tests, logs)
        self.stored_chunks = 0
        self.removed_chunks = 0
        self.unconfirmed_chunks = 0

    @property
    def reports_removals(self) -> bool:
        return self.record is not None

    # -- inputs ---------------------------------------------------------------------------
    def planned(self, req: Request, tenant: str, chunks: Sequence[ChunkRef], blocks_per_chunk: int,
                bounds: Sequence[tuple[int, int]] = ()) -> None:
        """Saves planned this step: wait for their objects to land. Hybrid models:
        ``bounds[i]`` are chunk i's blocks, ``c.group`` the object's group."""
        bs = self.block_size
        lora = getattr(req, "lora_request", None)
        for c in chunks:
            group = c.group if self.groups else -1
            cid = (tenant, c.chunk_hash, group)
            p = self._pending.get(cid)
            if p is None:
                if group >= 0:  # the blocks this group's object holds
                    b0, b1 = self.groups[group].stored_blocks(*bounds[c.index])
                else:
                    b0 = c.index * blocks_per_chunk
                    b1 = b0 + len(c.block_ids)
                p = _Pending(
                    block_hashes=tuple(req.block_hashes[b0:b1]),
                    start=b0,
                    parent=req.block_hashes[b0 - 1] if b0 else None,
                    token_ids=list(req.all_token_ids[b0 * bs : b1 * bs]),
                    lora_name=getattr(lora, "lora_name", None) if lora is not None else None,
                    needed=frozenset(self._object_keys(cid)),
                    group=group,
                )
                self._pending[cid] = p
                for k in p.needed:
                    self._by_key[k] = cid
                if len(self._pending) > MAX_PENDING_CHUNKS:
                    self._forget(next(iter(self._pending)))
            p.reqs.add(req.request_id)

    def landed(self, keys: Iterable[str]) -> None:
        """Keys of the workers' saves now in the pool, from the worker meta."""
        for k in keys:
            cid = self._by_key.get(k)
            p = self._pending.get(cid) if cid is not None else None
            if p is None:
                continue
            p.got.add(k)
            if p.got >= p.needed:
                # Complete. The entry stays while other requests' saves of the same
                # chunk run: one of them may put it again after an eviction.
                nxt = self.record.started + 1 if self.record is not None else 0
                self._ready.append(_Ready(cid, p, nxt, p.dirty))
                p.got, p.dirty = set(), False

    def requests_done(self, req_ids: Iterable[str]) -> None:
        """Every save of these requests ended on every rank: objects that have not
        landed by now never will."""
        done = set(req_ids)
        if not done or not self._pending:
            return
        for cid in [c for c, p in self._pending.items() if p.reqs & done]:
            p = self._pending[cid]
            p.reqs -= done
            if not p.reqs:
                self._forget(cid)

    def _object_keys(self, cid: ChunkId) -> list[str]:
        """Keys of every object of a chunk (all ranks, layers); of one group's object."""
        tenant, chunk_hash, group = cid
        if group < 0:
            return self.keys.lookup_keys(tenant, chunk_hash)
        return [pre + chunk_hash for pre in self.keys.group_lookup_prefixes(tenant, group)]  # type: ignore[attr-defined]

    def _forget(self, cid: ChunkId) -> None:
        p = self._pending.pop(cid, None)
        if p is not None:
            for k in p.needed:
                if self._by_key.get(k) == cid:
                    del self._by_key[k]

    # -- output ---------------------------------------------------------------------------
    def take(self) -> list[Any]:
        """Events of this step, in order: withdrawals first, then announcements."""
        verify: set[ChunkId] = set()
        ready_now: list[_Ready]
        if self.record is None:
            ready_now, self._ready = self._ready, []
        else:
            got = self.record.read()
            if got is None:
                ready_now = []
            else:
                n, events, lost = got
                ready_now = [r for r in self._ready if r.after_read <= n]
                self._ready = [r for r in self._ready if r.after_read > n]
                hit = self._apply_removals(events)
                verify = {r.cid for r in ready_now if r.cid in hit or r.dirty}
                if lost:
                    log.warning("pool removal record lost %d events; re-checking %d announced chunks",
                                lost, len(self._tracked))
                    self._resync()
                    verify = {r.cid for r in ready_now}
        if verify:
            present = self._present(list(verify))
            for r in ready_now:
                if r.cid in verify and r.cid not in present:
                    self.unconfirmed_chunks += 1
            ready_now = [r for r in ready_now if r.cid not in verify or r.cid in present]
        # Parents before children (a router links a block to its parent).
        for r in sorted(ready_now, key=lambda r: r.chunk.start):
            self._announce(r.cid, r.chunk)
        out, self._out = self._out, []
        return out

    def _apply_removals(self, events: Sequence[Any]) -> set[ChunkId]:
        """Withdraw announced chunks that lost an object; mark pending ones dirty.
        Returns every chunk of ours that the events name."""
        hit: set[ChunkId] = set()
        fp = self.keys.fingerprint
        for ev in events:
            key = getattr(ev, "key", None)
            if not isinstance(key, str):
                continue
            try:
                pk = PoolKey.parse(key)
            except ValueError:
                continue  # a GR user key or another application's object
            if self._fp_group:
                group = self._fp_group.get(pk.fingerprint)
                if group is None:
                    continue  # another model or layout
            elif pk.fingerprint != fp:
                continue  # another model or layout
            else:
                group = -1
            cid = (pk.tenant, pk.chunk_hash, group)
            hit.add(cid)
            p = self._pending.get(cid)
            if p is not None:
                p.dirty = True
            for r in self._ready:
                if r.cid == cid:
                    r.dirty = True
            t = self._tracked.get(cid)
            if t is None:
                continue
            moved_to = getattr(ev, "moved_to", None)
            if moved_to is None:
                self._withdraw(cid)  # left the pool: the chunk cannot be loaded any more
                continue
            # Still in the pool, in another tier (spilled to disk, promoted back):
            # announce it under the medium it is loaded from now.
            if MEDIUM_OF_TIER.get(str(moved_to).lower(), "CPU") == "STORAGE":
                t.on_disk.add(key)
            else:
                t.on_disk.discard(key)
            self._set_medium(cid, t, "STORAGE" if t.on_disk else STORE_MEDIUM)
        return hit

    def _present(self, cids: list[ChunkId]) -> set[ChunkId]:
        """Chunks whose every object exists now (one batched exists per batch)."""
        if self.guard is None:
            return set()
        out: set[ChunkId] = set()
        width = max(len(self._object_keys(cids[0])), 1) if cids else 1
        step = max(1, EXISTS_BATCH // width)
        for i in range(0, len(cids), step):
            part = cids[i : i + step]
            per = [self._object_keys(cid) for cid in part]
            statuses = self.guard.exists([k for ks in per for k in ks], self.timeout_s)
            pos = 0
            for cid, ks in zip(part, per, strict=True):
                if all(s is Status.OK for s in statuses[pos : pos + len(ks)]):
                    out.add(cid)
                pos += len(ks)
        return out

    def _resync(self) -> None:
        tracked = list(self._tracked)
        present = self._present(tracked)
        for cid in tracked:
            if cid not in present:
                self._withdraw(cid)

    def _announce(self, cid: ChunkId, p: _Pending) -> None:
        t = self._tracked.get(cid)
        if t is not None:
            # Announced before (a second save of it landed): it is in DRAM now.
            self._tracked.move_to_end(cid)
            t.on_disk.clear()
            self._set_medium(cid, t, STORE_MEDIUM)
            return
        t = _Tracked(p.block_hashes, p.parent, array("q", p.token_ids), p.lora_name, p.group)
        self._emit_stored(t, t.block_hashes)
        self.stored_chunks += 1
        if self.record is None:
            return  # nothing will ever be withdrawn: keep no state
        self._tracked[cid] = t
        self._cover(t, +1)
        if len(self._tracked) > MAX_TRACKED_CHUNKS:
            self._withdraw(next(iter(self._tracked)))

    def _emit_stored(self, t: _Tracked, hashes: Sequence[Any]) -> None:
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        group: dict[str, Any] = {}
        if t.group >= 0:
            plan = self.groups[t.group]
            kind = "mla_attention" if plan.spec_type == "MLAAttentionSpec" else SPEC_KIND[plan.kind]
            group = {"group_idx": t.group, "kv_cache_spec_kind": kind,
                     "kv_cache_spec_sliding_window": plan.sliding_window}
        self._out.append(
            BlockStored(
                block_hashes=[maybe_convert_block_hash(h) for h in hashes],
                parent_block_hash=maybe_convert_block_hash(t.parent) if t.parent is not None else None,
                token_ids=list(t.token_ids),
                block_size=self.block_size,
                lora_id=None,
                medium=t.medium,
                lora_name=t.lora_name,
                locality=self.locality,
                **group,
            )
        )

    def _cover(self, t: _Tracked, delta: int) -> list[Any]:
        """Count t's blocks in its medium; returns the blocks no announced object
        covers any more (on -1) in that medium."""
        gone = []
        for h in t.block_hashes:
            k = (h, t.medium, t.group)
            n = self._covers.get(k, 0) + delta
            if n <= 0:
                self._covers.pop(k, None)
                gone.append(h)
            else:
                self._covers[k] = n
        return gone

    def _emit_removed(self, hashes: list[Any], medium: str, group: int = -1) -> None:
        from vllm.distributed.kv_events import BlockRemoved
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        if hashes:
            extra = {"group_idx": group} if group >= 0 else {}
            self._out.append(BlockRemoved(block_hashes=[maybe_convert_block_hash(h) for h in hashes],
                                          medium=medium, locality=self.locality, **extra))

    def _set_medium(self, cid: ChunkId, t: _Tracked, medium: str) -> None:
        if medium == t.medium:
            return
        self._emit_removed(self._cover(t, -1), t.medium, t.group)
        t.medium = medium
        self._cover(t, +1)
        self._emit_stored(t, t.block_hashes)

    def _withdraw(self, cid: ChunkId) -> None:
        t = self._tracked.pop(cid, None)
        if t is None:
            return
        self.removed_chunks += 1
        self._emit_removed(self._cover(t, -1), t.medium, t.group)

    def close(self) -> None:
        if self.record is not None:
            self.record.close()
