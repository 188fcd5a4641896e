"""Removal records of the local pool (``removed_since``): every object that
leaves a tier, from any process, with the tier and the reason; a reader that
falls behind the bounded ring is told how many it lost; a replay of the
records (plus the puts) rebuilds exactly what the pool holds, tier by tier."""

from __future__ import annotations

import multiprocessing as mp
import random
import uuid

import numpy as np
import pytest

from ascendstore.contract import BackendContext, Region, RemovalEvent, Status
from ascendstore.local import _shmpool
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions

KiB, MiB = 1 << 10, 1 << 20
T = 5.0
OK = Status.OK


@pytest.fixture
def make_pool(tmp_path):
    made = []

    def make(**kw) -> LocalBackend:
        kw.setdefault("name", f"ev-{uuid.uuid4().hex[:10]}")
        if kw.pop("disk", False):
            kw.update(disk_path=str(tmp_path / "disk"))
        be = LocalBackend.create(LocalOptions(**kw), BackendContext())
        made.append(be)
        return be

    yield make
    for be in made:
        be.destroy()
        _shmpool.unlink(be.options.name)


def put(be: LocalBackend, keys: list[str], size: int, fill: int = 1) -> list[Status]:
    bufs = [np.full(size, (fill + i) % 251, np.uint8) for i in range(len(keys))]
    return be.put(keys, [[Region(b.ctypes.data, size)] for b in bufs], T)


def get(be: LocalBackend, keys: list[str], size: int) -> list[Status]:
    bufs = [np.zeros(size, np.uint8) for _ in keys]
    return be.get(keys, [[Region(b.ctypes.data, size)] for b in bufs], T)


def triples(events: list[RemovalEvent]) -> list[tuple]:
    return [(e.key, e.tier, e.reason, e.moved_to) for e in events]


def test_capability_and_cursor_from_now(make_pool):
    be = make_pool(capacity=1 * MiB)
    assert be.capabilities.removal_events
    assert put(be, ["a", "b"], 1000) == [OK, OK]
    assert be.remove(["a"], T) == [OK]
    now, events, lost = be.removed_since(-1)
    assert (now, events, lost) == (1, [], 0)  # -1: from now on; what happened before is not replayed
    assert be.remove(["b", "absent"], T) == [OK, Status.NOT_FOUND]
    nxt, events, lost = be.removed_since(now)
    assert triples(events) == [("b", "cpu", "removed", None)] and lost == 0
    assert [e.seq for e in events] == [1] and nxt == 2
    assert be.removed_since(nxt) == (nxt, [], 0)


def test_lru_eviction_and_explicit_removal(make_pool):
    be = make_pool(capacity=1 * MiB, page_size=64 * KiB)  # 16 pages: four 256 KiB objects
    cur, _, _ = be.removed_since(-1)
    assert put(be, [f"lru/{i}" for i in range(4)], 256 * KiB) == [OK] * 4
    assert get(be, ["lru/0"], 256 * KiB) == [OK]  # lru/0 is now the most recent
    assert put(be, ["lru/4", "lru/5"], 256 * KiB) == [OK, OK]
    # replaced in DRAM: no record for lru/4 (the new value's pages are taken
    # before the old ones are freed, so the LRU object makes room)
    assert put(be, ["lru/4"], 256 * KiB, fill=9) == [OK]
    assert be.remove(["lru/0"], T) == [OK]
    assert be.remove_prefix("lru/", T) == (OK, 2)
    cur, events, lost = be.removed_since(cur)
    assert lost == 0
    assert triples(events[:4]) == [
        ("lru/1", "cpu", "evicted", None),
        ("lru/2", "cpu", "evicted", None),
        ("lru/3", "cpu", "evicted", None),
        ("lru/0", "cpu", "removed", None),
    ]
    assert sorted(triples(events[4:])) == [("lru/4", "cpu", "removed", None), ("lru/5", "cpu", "removed", None)]
    assert [e.seq for e in events] == list(range(events[0].seq, events[0].seq + 6))


def test_spill_promotion_and_disk_eviction(make_pool):
    # DRAM: two 256 KiB objects; disk: 1 MiB in 256 KiB segments
    be = make_pool(capacity=512 * KiB, page_size=64 * KiB, disk=True, disk_capacity=1 * MiB,
                   disk_segment_size=256 * KiB)
    cur, _, _ = be.removed_since(-1)
    for k in ("s/0", "s/1", "s/2"):  # s/0 spills
        assert put(be, [k], 256 * KiB) == [OK]
    cur, events, _ = be.removed_since(cur)
    assert triples(events) == [("s/0", "cpu", "spilled", "disk")]
    assert get(be, ["s/0"], 256 * KiB) == [OK]  # a disk hit: promoted, which spills s/1
    cur, events, _ = be.removed_since(cur)
    assert triples(events) == [("s/1", "cpu", "spilled", "disk"), ("s/0", "disk", "promoted", "cpu")]
    assert put(be, ["s/1"], 256 * KiB, fill=5) == [OK]  # a new value of a disk object lands in DRAM
    cur, events, _ = be.removed_since(cur)
    assert triples(events) == [("s/2", "cpu", "spilled", "disk"), ("s/1", "disk", "promoted", "cpu")]
    # fill the disk tier: its oldest segments are dropped with their objects
    for i in range(8):
        assert put(be, [f"d/{i}"], 256 * KiB) == [OK]
    cur, events, _ = be.removed_since(cur)
    disk_evicted = [e.key for e in events if e.tier == "disk" and e.reason == "evicted"]
    assert disk_evicted[:2] == ["s/2", "s/0"], triples(events)
    assert all(e.reason in ("spilled", "evicted") for e in events)
    assert be.stats()["disk_drops"] == len(disk_evicted)
    # removal of a disk object names the disk tier
    on_disk = next(e.key for e in reversed(events) if e.reason == "spilled")
    assert be.remove([on_disk], T) == [OK]
    _, events, _ = be.removed_since(cur)
    assert triples(events) == [(on_disk, "disk", "removed", None)]


def test_a_reader_that_falls_behind_is_told_how_many_it_lost(make_pool):
    be = make_pool(capacity=64 * KiB, page_size=4 * KiB, max_keys=64)
    ring = be.stats()["removal_ring"]
    assert ring == 1024
    cur, _, _ = be.removed_since(-1)
    n = 1300
    for start in range(0, n + 16, 8):  # 16 pages: every put after the first 16 evicts one
        keys = [f"f/{i}" for i in range(start, min(start + 8, n + 16))]
        assert put(be, keys, 4 * KiB) == [OK] * len(keys)
    nxt, events, lost = be.removed_since(cur, limit=10)
    assert lost == n - ring and len(events) == 10
    assert events[0].key == f"f/{n - ring}" and events[0].seq == n - ring
    nxt, events, lost = be.removed_since(nxt)  # the rest, nothing more lost
    assert lost == 0 and len(events) == ring - 10 and events[-1].key == f"f/{n - 1}"
    assert be.removed_since(nxt) == (n, [], 0)


def _read_events(opts: dict, cursor: int, q) -> None:
    be = LocalBackend.create(LocalOptions(**opts), BackendContext())
    nxt, events, lost = be.removed_since(cursor)
    q.put((nxt, triples(events), lost))
    be.close()


def _evict_and_remove(opts: dict, q) -> None:
    be = LocalBackend.create(LocalOptions(**opts), BackendContext())
    q.put([put(be, [f"c/{i}"], 256 * KiB)[0] for i in range(6)])
    be.remove(["c/5"], T)
    be.close()


def test_records_are_seen_from_another_process(make_pool):
    be = make_pool(capacity=1 * MiB, page_size=64 * KiB)
    opts = be.options.model_dump()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    cur, _, _ = be.removed_since(-1)
    p = ctx.Process(target=_evict_and_remove, args=(opts, q))
    p.start()
    assert q.get(timeout=60) == [OK] * 6
    p.join(30)
    _, events, _ = be.removed_since(cur)  # another process's evictions, seen here
    assert triples(events) == [("c/0", "cpu", "evicted", None), ("c/1", "cpu", "evicted", None),
                               ("c/5", "cpu", "removed", None)]
    assert be.remove(["c/4"], T) == [OK]
    p = ctx.Process(target=_read_events, args=(opts, cur, q))  # ...and this one's, there
    p.start()
    nxt, seen, lost = q.get(timeout=60)
    p.join(30)
    assert seen[-1] == ("c/4", "cpu", "removed", None) and len(seen) == 4 and lost == 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_replaying_the_records_rebuilds_what_the_pool_holds(make_pool, seed):
    """An index fed by this process's puts and the pool's removal records ends
    up with exactly the pool's keys, and the right number in each tier."""
    be = make_pool(capacity=512 * KiB, page_size=16 * KiB, disk=True, disk_capacity=1 * MiB,
                   disk_segment_size=128 * KiB)
    rng = random.Random(seed)
    cpu: set[str] = set()
    disk: set[str] = set()
    cur, _, _ = be.removed_since(-1)

    def apply(events: list[RemovalEvent]) -> None:
        for e in events:
            (cpu if e.tier == "cpu" else disk).discard(e.key)
            if e.moved_to == "cpu":
                cpu.add(e.key)
            elif e.moved_to == "disk":
                disk.add(e.key)

    keys = [f"r/{i}" for i in range(60)]
    for _ in range(600):
        op = rng.random()
        batch = rng.sample(keys, rng.choice((1, 2, 3)))
        if op < 0.5:
            sts = put(be, batch, 48 * KiB, rng.randrange(200))
            cur, events, lost = be.removed_since(cur)
            assert lost == 0
            apply(events)
            # a put lands in DRAM (after the records of what it displaced)
            cpu.update(k for k, s in zip(batch, sts, strict=True) if s is OK)
        elif op < 0.8:
            get(be, batch, 48 * KiB)
        elif op < 0.95:
            be.remove(batch, T)
        else:
            be.remove_prefix(f"r/{rng.randrange(6)}", T)
        cur, events, lost = be.removed_since(cur)
        assert lost == 0
        apply(events)
        s = be.stats()
        assert cpu | disk == set(be.list_keys("r/", 10_000))
        assert not cpu & disk
        assert (len(cpu), len(disk)) == (s["objects"], s["disk_objects"]), (len(cpu), len(disk), s)
    assert be.stats()["spills"] > 50 and be.stats()["disk_drops"] > 0 and be.stats()["promotions"] > 10
