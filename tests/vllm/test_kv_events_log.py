"""The scheduler's event log (ascendstore_vllm.events.KVEventLog) in the orders
the lifecycle test cannot force: a removal seen while a save is in flight, a
removal record that overflowed, a record read that overruns its deadline, an
object of a multi-object chunk evicted. The pool is a dict with a removal record
(a stand-in for a backend with ``removal_events``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace

from ascendstore_vllm.events import KVEventLog
from ascendstore_vllm.metadata import ChunkRef
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as ext

from ascendstore.contract import Status
from ascendstore.engine import KeyBuilder
from ascendstore.keys import RankPart

BS = 4
FP = "ab" * 8


@dataclass(frozen=True)
class Ev:
    key: str
    tier: str = "cpu"
    reason: str = "evicted"
    moved_to: str | None = None


class Pool:
    """Objects + a removal record with a bounded length (older entries lost)."""

    def __init__(self, record_len: int = 1000) -> None:
        self.objects: set[str] = set()
        self.record: list[tuple[int, Ev]] = []
        self.seq = 0
        self.record_len = record_len
        self.capabilities = SimpleNamespace(removal_events=True, shared_across_nodes=False)
        self.gate = threading.Event()
        self.gate.set()

    def put(self, key: str) -> None:
        self.objects.add(key)

    def evict(self, key: str) -> None:
        self.objects.discard(key)
        self._log(Ev(key))

    def move(self, key: str, frm: str, to: str) -> None:
        """Spill (cpu -> disk) or promote (disk -> cpu): still in the pool."""
        self._log(Ev(key, frm, "spilled" if to == "disk" else "promoted", to))

    def _log(self, ev: Ev) -> None:
        self.seq += 1
        self.record.append((self.seq, ev))
        self.record = self.record[-self.record_len :]

    def removed_since(self, cursor: int, limit: int):
        self.gate.wait(10)
        if cursor < 0:
            return self.seq, [], 0
        first = self.record[0][0] if self.record else self.seq + 1
        lost = max(0, first - cursor - 1)
        out = [e for s, e in self.record if s > cursor][:limit]
        return cursor + lost + len(out), out, lost


class Guard:
    def __init__(self, pool: Pool) -> None:
        self.backend = pool
        self.capabilities = pool.capabilities

    def exists(self, keys, timeout_s=None):
        return [Status.OK if k in self.backend.objects else Status.NOT_FOUND for k in keys]


def request(rid: str, nblocks: int, seed: int = 0):
    hashes = [bytes([seed, i]) * 16 for i in range(nblocks)]
    return SimpleNamespace(request_id=rid, block_hashes=hashes, all_token_ids=list(range(nblocks * BS)),
                           lora_request=None)


def setup(ranks: int = 1, record_len: int = 1000, timeout_s: float = 1.0):
    pool = Pool(record_len)
    kb = KeyBuilder(fingerprint=FP, rank=RankPart(), all_ranks=tuple(RankPart(h) for h in range(ranks)))
    log = KVEventLog(kb, BS, guard=Guard(pool), timeout_s=timeout_s)
    return pool, kb, log


def chunk(req, i: int) -> ChunkRef:
    return ChunkRef(i, req.block_hashes[i].hex(), [i])


def keys_of(kb, c: ChunkRef) -> list[str]:
    return kb.lookup_keys("-", c.chunk_hash)


def land(pool, log, kb, c: ChunkRef) -> None:
    for k in keys_of(kb, c):
        pool.put(k)
    log.landed(keys_of(kb, c))


def kinds(events):
    return [(type(e).__name__, len(e.block_hashes)) for e in events]


def test_announced_when_landed_withdrawn_when_evicted():
    pool, kb, log = setup()
    r = request("a", 2)
    c0, c1 = chunk(r, 0), chunk(r, 1)
    log.planned(r, "-", [c0, c1], 1)
    assert log.take() == []  # planned is not stored
    land(pool, log, kb, c0)
    ev = log.take()
    assert kinds(ev) == [("BlockStored", 1)] and ev[0].medium == "CPU" and ev[0].block_hashes == [ext(r.block_hashes[0])]
    pool.evict(keys_of(kb, c0)[0])
    ev = log.take()
    assert kinds(ev) == [("BlockRemoved", 1)] and ev[0].medium == "CPU"
    assert log.take() == []


def test_removal_while_in_flight_is_checked_before_announcing():
    """An old copy's eviction is seen while the re-put is in flight: the chunk is
    announced only if it exists when it completes."""
    pool, kb, log = setup()
    r = request("a", 1)
    c = chunk(r, 0)
    log.planned(r, "-", [c], 1)
    key = keys_of(kb, c)[0]
    pool.put(key)
    pool.evict(key)  # reported while pending
    assert log.take() == []
    log.landed([key])  # the report says present, but it is gone now
    assert log.take() == []
    assert log.unconfirmed_chunks == 1
    # A later re-put (another save of the same request) lands for real.
    land(pool, log, kb, c)
    assert kinds(log.take()) == [("BlockStored", 1)]


def test_every_rank_must_land():
    pool, kb, log = setup(ranks=2)
    r = request("a", 1)
    c = chunk(r, 0)
    log.planned(r, "-", [c], 1)
    k0, k1 = keys_of(kb, c)
    pool.put(k0)
    log.landed([k0])
    assert log.take() == []
    pool.put(k1)
    log.landed([k1])
    assert kinds(log.take()) == [("BlockStored", 1)]
    # Losing one rank's object makes the chunk unloadable: withdrawn.
    pool.evict(k1)
    assert kinds(log.take()) == [("BlockRemoved", 1)]


def test_lost_record_events_resync_with_exists():
    pool, kb, log = setup(record_len=2)
    r = request("a", 6)
    cs = [chunk(r, i) for i in range(6)]
    log.planned(r, "-", cs, 1)
    for c in cs:
        land(pool, log, kb, c)
    assert len(log.take()) == 6
    for c in cs[:4]:
        pool.evict(keys_of(kb, c)[0])  # 4 evictions, the record keeps 2: 2 lost
    ev = log.take()
    removed = {h for e in ev if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed == {ext(h) for h in r.block_hashes[:4]}
    assert not [e for e in ev if isinstance(e, BlockStored)]


def test_slow_record_read_holds_announcements_until_a_later_read():
    pool, kb, log = setup(timeout_s=0.05)
    r = request("a", 1)
    c = chunk(r, 0)
    log.planned(r, "-", [c], 1)
    pool.gate.clear()  # the record read hangs
    land(pool, log, kb, c)
    assert log.take() == []  # read overran: nothing announced, nothing lost
    pool.gate.set()
    out: list = []
    for _ in range(3):
        out += log.take()
    assert kinds(out) == [("BlockStored", 1)]


def test_tail_and_full_chunk_share_blocks():
    """A partial tail [0,2) and the full chunk [0,4) over it: a block stays
    announced while any object covering it is in the pool."""
    pool, kb, log = setup()
    r = request("a", 4)
    tail = ChunkRef(0, r.block_hashes[1].hex(), [0, 1])
    full = ChunkRef(0, r.block_hashes[3].hex(), [0, 1, 2, 3])
    log.planned(r, "-", [tail], 4)
    land(pool, log, kb, tail)
    log.planned(r, "-", [full], 4)
    land(pool, log, kb, full)
    assert kinds(log.take()) == [("BlockStored", 2), ("BlockStored", 4)]
    pool.evict(keys_of(kb, tail)[0])
    assert kinds(log.take()) == []  # blocks 0, 1 are still in the full chunk
    pool.evict(keys_of(kb, full)[0])
    ev = log.take()
    assert kinds(ev) == [("BlockRemoved", 4)]


def test_other_models_and_user_keys_are_ignored():
    pool, kb, log = setup()
    r = request("a", 1)
    c = chunk(r, 0)
    log.planned(r, "-", [c], 1)
    land(pool, log, kb, c)
    log.take()
    other = keys_of(kb, c)[0].replace(FP, "cd" * 8)
    pool.put(other)
    pool.evict(other)
    pool.put("u1@model@1@0@kv_cache")
    pool.evict("u1@model@1@0@kv_cache")
    assert log.take() == []


def test_dropped_saves_are_forgotten_when_the_request_is_done():
    pool, kb, log = setup()
    r = request("a", 2)
    log.planned(r, "-", [chunk(r, 0), chunk(r, 1)], 1)
    log.requests_done(["a"])
    land(pool, log, kb, chunk(r, 0))  # a late report for a forgotten save
    assert log.take() == []
    assert not log._pending and not log._by_key


def test_a_long_record_is_read_to_its_end_in_one_step(monkeypatch):
    import ascendstore_vllm.events as events

    monkeypatch.setattr(events, "RECORD_BATCH", 2)
    pool, kb, log = setup()
    r = request("a", 5)
    cs = [chunk(r, i) for i in range(5)]
    log.planned(r, "-", cs, 1)
    for c in cs:
        land(pool, log, kb, c)
    assert len(log.take()) == 5
    for c in cs:
        pool.evict(keys_of(kb, c)[0])
    assert kinds(log.take()) == [("BlockRemoved", 1)] * 5


def test_a_failing_record_read_rechecks_announced_chunks():
    pool, kb, log = setup()
    r = request("a", 2)
    cs = [chunk(r, 0), chunk(r, 1)]
    log.planned(r, "-", cs, 1)
    for c in cs:
        land(pool, log, kb, c)
    assert len(log.take()) == 2
    real = pool.removed_since
    pool.removed_since = lambda cursor, limit: (_ for _ in ()).throw(RuntimeError("record down"))
    pool.evict(keys_of(kb, cs[0])[0])
    ev = log.take()  # the read fails: announced chunks are checked with exists
    assert kinds(ev) == [("BlockRemoved", 1)]
    pool.removed_since = real
    assert log.take() == []  # the eviction, now read from the record, was already withdrawn


def test_spill_and_promotion_move_the_chunk_between_media():
    """The local pool's record reports tier moves (moved_to): the chunk stays
    announced, under the medium it is loaded from now."""
    pool, kb, log = setup(ranks=2)
    r = request("a", 1)
    c = chunk(r, 0)
    log.planned(r, "-", [c], 1)
    land(pool, log, kb, c)
    assert [(type(e).__name__, e.medium) for e in log.take()] == [("BlockStored", "CPU")]
    k0, k1 = keys_of(kb, c)
    pool.move(k0, "cpu", "disk")  # one rank's part spilled: the chunk now loads partly from disk
    ev = log.take()
    assert [(type(e).__name__, e.medium) for e in ev] == [("BlockRemoved", "CPU"), ("BlockStored", "STORAGE")]
    assert ev[1].token_ids == r.all_token_ids[:BS] and ev[1].block_hashes == [ext(r.block_hashes[0])]
    pool.move(k1, "cpu", "disk")
    assert log.take() == []  # still STORAGE
    pool.move(k0, "disk", "cpu")  # promoted on a hit; k1 still on disk
    assert log.take() == []
    pool.move(k1, "disk", "cpu")
    assert [(type(e).__name__, e.medium) for e in log.take()] == [("BlockRemoved", "STORAGE"), ("BlockStored", "CPU")]
    pool.evict(k0)
    assert [(type(e).__name__, e.medium) for e in log.take()] == [("BlockRemoved", "CPU")]
