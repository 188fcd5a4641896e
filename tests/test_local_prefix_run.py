"""The local pool's native prefix scan (``prefix_run``), which the scheduler's
lookup uses: it must answer exactly what a batched ``exists`` + first miss
answers (linear), never undercount when galloping, leave a prompt's chunks in
an LRU order that evicts a prefix from its tail, and fail like the batch calls."""

from __future__ import annotations

import random
import time
import uuid

import numpy as np
import pytest

from ascendstore.contract import BackendContext, Region, Status
from ascendstore.engine import BackendGuard, KeyBuilder, PoolLookup
from ascendstore.keys import RankPart
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions

KiB, MiB = 1 << 10, 1 << 20
T = 5.0


@pytest.fixture
def make_pool():
    opened: list[LocalBackend] = []

    def make(**kw) -> LocalBackend:
        kw.setdefault("name", f"t-{uuid.uuid4().hex[:10]}")
        kw.setdefault("capacity", 4 * MiB)
        kw.setdefault("page_size", 4 * KiB)
        be = LocalBackend.create(LocalOptions(**kw), BackendContext())
        opened.append(be)
        return be

    yield make
    for be in opened:
        be.destroy()


PAYLOAD = np.arange(64, dtype=np.uint8)
REGION = [Region(PAYLOAD.ctypes.data, 64)]


def store(be: LocalBackend, keys: list[str]) -> None:
    assert be.put(keys, [REGION] * len(keys), T) == [Status.OK] * len(keys)


def by_exists(be: LocalBackend, prefixes: list[str], hexes: list[str]) -> int:
    flat = [p + h for h in hexes for p in prefixes]
    st = be.exists(flat, T)
    first = next((i for i, s in enumerate(st) if s is not Status.OK), len(st))
    return first // len(prefixes)


@pytest.mark.parametrize("seed", range(6))
def test_linear_scan_matches_exists_with_random_holes(make_pool, seed):
    be = make_pool()
    rng = random.Random(seed)
    prefixes = [f"m@{r}@" for r in range(rng.choice([1, 2, 4]))]
    n = rng.choice([1, 5, 16, 17, 80, 300])
    raw = [rng.randbytes(32) for _ in range(n)]
    hexes = [h.hex() for h in raw]
    store(be, [p + h for h in hexes for p in prefixes])
    for _ in range(8):
        # knock out one object of a random chunk (a chunk is loadable only whole)
        i = rng.randrange(n)
        be.remove([rng.choice(prefixes) + hexes[i]], T)
        want = by_exists(be, prefixes, hexes)
        for suffixes in (hexes, raw):
            st, hits, probes = be.prefix_run(prefixes, suffixes, T)
            assert (st, hits) == (Status.OK, want)
            assert probes == min(want + 1, n)
        st, hits, _ = be.prefix_run(prefixes, raw, T, gallop=True)
        assert st is Status.OK and want <= hits <= n  # galloping may overcount past a hole, never under


def test_gallop_is_exact_without_holes_and_probes_logarithmically(make_pool):
    be = make_pool(max_keys=8192)
    for n in (1, 2, 3, 31, 32, 33, 1000):
        hexes = [f"{n}-{i:060x}" for i in range(n)]
        store(be, ["g@" + h for h in hexes])
        extra = [f"absent-{n}-{i}" for i in range(n // 2)]
        for upto in (0, 1, n // 2, n):
            q = hexes[:upto] + extra if upto < n else hexes
            st, hits, probes = be.prefix_run(["g@"], q, T, gallop=True)
            assert (st, hits) == (Status.OK, upto)
            assert probes <= 2 * max(1, len(q)).bit_length() + 1


def test_scan_leaves_chunk_zero_most_recently_used(make_pool):
    # room for 8 objects: a ninth put evicts the least recently used one
    be = make_pool(capacity=32 * KiB, page_size=4 * KiB, max_keys=64)
    keys = [f"c@{i:04d}" for i in range(8)]
    store(be, keys)  # saved in order: chunk 0 is the oldest now
    assert be.prefix_run(["c@"], [k[2:] for k in keys], T)[:2] == (Status.OK, 8)
    store(be, ["other"])
    st = be.exists(keys, T)
    assert st[:7] == [Status.OK] * 7 and st[7] is Status.NOT_FOUND  # the tail went, the prefix stays
    assert be.prefix_run(["c@"], [k[2:] for k in keys], T)[:2] == (Status.OK, 7)


def test_bad_input_and_failures(make_pool):
    be = make_pool()
    store(be, ["p@aa"])
    assert be.prefix_run(["p@"], ["aa", "x" * 400], T)[:2] == (Status.OK, 1)  # an impossible key is absent
    assert be.prefix_run(["p@"], [], T)[:2] == (Status.OK, 0)
    with pytest.raises(TypeError):
        be.prefix_run(["p@"], [1], T)
    with pytest.raises(TypeError):
        be.prefix_run([b"p@"], ["aa"], T)
    with pytest.raises(ValueError):
        be.prefix_run([], ["aa"], T)
    hooks = be.test_hooks()
    hooks.delay(1.0)
    assert be.prefix_run(["p@"], ["aa"], 0.05)[:2] == (Status.TIMEOUT, 0)
    hooks.delay(0)
    be.close()
    assert be.prefix_run(["p@"], ["aa"], T)[:2] == (Status.UNAVAILABLE, 0)


def test_pool_lookup_uses_the_scan(make_pool):
    be = make_pool()
    kb = KeyBuilder(fingerprint="f" * 16, rank=RankPart(), layerwise=True, num_layers=3)
    guard = BackendGuard(be, 1.0)
    try:
        lk = PoolLookup(guard, kb, 1.0)
        assert lk._scan is not None
        hashes = [bytes([i]) * 32 for i in range(6)]
        store(be, kb.lookup_keys_flat("-", [h.hex() for h in hashes[:4]])[0])
        before = guard.metrics.totals()
        assert lk.prefix_hits("-", hashes) == 4
        assert lk.prefix_hits("-", [h.hex() for h in hashes], start=2) == 4
        assert lk.prefix_hits("-", hashes, start=6) == 6
        after = guard.metrics.totals()
        assert after["lookups"] - before["lookups"] == 2
        assert after["lookup_keys"] - before["lookup_keys"] == 3 * (5 + 3)  # probes x objects per chunk
        generic = PoolLookup(guard, kb, 1.0)
        generic._scan = None
        assert generic.prefix_hits("-", hashes) == 4  # bytes work on the exists path too
        be.test_hooks().delay(2.0)
        assert lk.prefix_hits("-", hashes) == 0  # a timeout is a miss, counted as an error
        assert guard.metrics.totals()["lookup_errors"] - after["lookup_errors"] == 1
    finally:
        be.test_hooks().delay(0)
        guard.close()


@pytest.mark.parametrize("gallop", [False, True], ids=["linear", "gallop"])
def test_a_pinning_scan_pins_exactly_what_it_counts(make_pool, gallop):
    """prefix_run with a lease pins the chunks it counts in the same pass: the
    count is what survives eviction, a hole ends the run even when galloping
    (without a lease gallop overcounts past it), and unpin_run lets go."""
    be = make_pool(capacity=512 * KiB, page_size=4 * KiB, max_keys=1024)
    prefixes = ["k@0@", "k@1@"]
    hexes = [f"{i:04x}" for i in range(40)]
    store(be, [p + h for h in hexes for p in prefixes])
    assert be.remove([prefixes[1] + hexes[25]], T) == [Status.OK]  # chunk 25 is half gone
    if gallop:
        assert be.prefix_run(prefixes, hexes, T, gallop=True)[1] > 25  # probes jump the hole
    st, hits, _ = be.prefix_run(prefixes, hexes, T, gallop=gallop, lease_s=30.0)
    assert (st, hits) == (Status.OK, 25)
    assert be.pinned() == 25 * len(prefixes), "pinned other than the objects of the chunks counted"
    # Four times the pool's capacity: everything unpinned goes, the counted run stays.
    for i in range(512):
        store(be, [f"fill-{i}"])
    counted = [p + h for h in hexes[:25] for p in prefixes]
    assert be.exists(counted, T) == [Status.OK] * len(counted)
    assert be.exists([prefixes[0] + hexes[30]], T) == [Status.NOT_FOUND]
    assert be.unpin_run(prefixes, hexes, T) is Status.OK  # absent keys are skipped
    assert be.pinned() == 0
    assert be.unpin_run(prefixes, [bytes.fromhex(h) for h in hexes[:2]], T) is Status.OK  # raw hashes too
    with pytest.raises(ValueError):
        be.prefix_run(prefixes, hexes, T, lease_s=-1.0)
    with pytest.raises(ValueError):
        be.prefix_run(prefixes, hexes, T, lease_s=7200.0)
    with pytest.raises(ValueError):
        be.unpin_run([], hexes, T)
    be.close()
    assert be.unpin_run(prefixes, hexes, T) is Status.UNAVAILABLE


def test_a_chunk_removed_mid_scan_ends_the_pinned_run(make_pool):
    """A linear scan drops the lock between its blocks (16, 64, 256, ... chunks).
    A chunk of an earlier block removed meanwhile (its entry freed or reused)
    must end the run there, not be counted with a stale entry pinned."""
    import threading

    be = make_pool()
    hexes = [f"{i:04x}" for i in range(48)]
    keys = ["r@" + h for h in hexes]
    store(be, keys)
    be.test_hooks().stall_scans(0.3)
    got: list = []
    t = threading.Thread(target=lambda: got.append(be.prefix_run(["r@"], hexes, T, lease_s=30.0)))
    t.start()
    time.sleep(0.1)  # the scan saw chunks 0-15 and waits before the next block
    assert be.remove([keys[3]], T) == [Status.OK]
    store(be, ["other"])  # may take the freed entry
    t.join()
    be.test_hooks().stall_scans(0)
    st, hits, _ = got[0]
    assert (st, hits) == (Status.OK, 3), f"counted {hits} chunks; chunk 3 went during the scan"
    assert be.pinned() == 3
    assert be.unpin_run(["r@"], hexes, T) is Status.OK and be.pinned() == 0


def test_a_pinning_scan_racing_eviction_counts_only_what_it_pinned(make_pool):
    """A linear scan drops the lock between its blocks (16, 64, 256, ... chunks);
    a chunk evicted in between, its entry reused, must end the run rather than be
    counted with another object's entry pinned. A writer keeps the pool evicting
    (and re-saves the prompt's missing chunks) while lookups pin: after each,
    every counted object must still be there (pins stop eviction)."""
    import threading

    be = make_pool(capacity=256 * KiB, page_size=4 * KiB, max_keys=512)
    hexes = [f"{i:04x}" for i in range(48)]
    keys = ["r@" + h for h in hexes]
    store(be, keys)
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        rng = random.Random(3)
        i = 0
        try:
            while not stop.is_set():
                i += 1
                be.put([f"fill-{i}"], [REGION], T)
                if i % 8 == 0:
                    missing = [k for k, s in zip(keys, be.exists(keys, T), strict=True) if s is Status.NOT_FOUND]
                    if missing:
                        be.put(missing[: rng.randint(1, len(missing))], [REGION] * len(missing), T)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=writer)
    t.start()
    counted_total = 0
    try:
        for _ in range(1500):
            st, hits, _ = be.prefix_run(["r@"], hexes, T, lease_s=30.0)
            assert st is Status.OK
            got = be.exists(keys[:hits], T)
            assert got == [Status.OK] * hits, f"counted {hits} chunks, but {got.count(Status.NOT_FOUND)} are gone"
            counted_total += hits
            assert be.unpin_run(["r@"], hexes[:hits], T) is Status.OK
    finally:
        stop.set()
        t.join()
    assert not errors
    assert counted_total > 0
    assert be.pinned() == 0


def test_the_scan_hashes_a_key_as_put_does_wherever_prefix_and_suffix_split_it(make_pool):
    """The scan continues each prefix's hash state over the suffix (8-byte words, a
    word left open where a prefix ends) while put hashes the whole key: both must
    agree at every split, for str suffixes of any length (ASCII or not) and raw
    hashes of any length (hex-encoded 16 bytes at a time, the rest one by one)."""
    be = make_pool(max_keys=4096)
    rng = random.Random(7)
    base = "p" + "".join(rng.choice("abcdef0123456789@") for _ in range(40))
    cases = []
    for plen in range(0, 18):
        for slen in (0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65):
            cases.append((base[:plen] or "é", base[::-1][:slen]))
    cases += [("ключ@", "é" * 9), ("k@", "€x" * 20)]  # multi-byte UTF-8 on both sides
    raws = [rng.randbytes(n) for n in (1, 15, 16, 17, 31, 32, 33, 48, 64, 100)]
    cases += [("raw@" + "x" * k, r) for k in range(8) for r in raws]
    keys = [p + (s.hex() if isinstance(s, bytes) else s) for p, s in cases]
    store(be, keys)
    for p, s in cases:
        assert be.prefix_run([p], [s], T)[:2] == (Status.OK, 1), (p, s)
        assert be.prefix_run([p], [s + (b"\0" if isinstance(s, bytes) else "x")], T)[:2] == (Status.OK, 0)
    # and a whole prompt of them in one call, several prefixes per chunk
    prefixes = [base[:5], base[:13]]
    hashes = [rng.randbytes(32) for _ in range(40)]
    store(be, [p + h.hex() for h in hashes for p in prefixes])
    assert be.prefix_run(prefixes, hashes, T)[:2] == (Status.OK, 40)
    assert be.prefix_run(prefixes, [h.hex() for h in hashes], T)[:2] == (Status.OK, 40)


def test_a_repeated_scan_still_leaves_the_prompt_in_lru_order_after_other_reads(make_pool):
    """A scan whose run already opens the LRU list in order touches nothing; one
    whose run was disturbed (another key read since) restores the order, so the
    prompt's tail is still what eviction takes first."""
    be = make_pool(capacity=32 * KiB, page_size=4 * KiB, max_keys=64)  # room for 8 objects
    keys = [f"c@{i:04d}" for i in range(8)]
    sufs = [k[2:] for k in keys]
    store(be, keys)
    assert be.prefix_run(["c@"], sufs, T)[:2] == (Status.OK, 8)
    assert be.prefix_run(["c@"], sufs, T)[:2] == (Status.OK, 8)  # in order already: nothing moves
    assert be.exists([keys[7]], T) == [Status.OK]  # chunk 7 is the most recently used now
    assert be.prefix_run(["c@"], sufs, T)[:2] == (Status.OK, 8)  # back in prompt order
    store(be, ["other"])
    st = be.exists(keys, T)
    assert st[:7] == [Status.OK] * 7 and st[7] is Status.NOT_FOUND  # the tail went (not chunk 6)


@pytest.mark.parametrize("seed", range(3))
def test_a_crowded_pool_answers_every_probe_exactly(make_pool, seed):
    """Probes look ahead (the buckets and chain heads of keys 8 and 16 further on are
    asked for early). In a pool crowded with others' objects, whose buckets hold
    chains, the scan, the pinning scan, its unpin and the batched exists must still
    answer exactly what was stored, at every length around the look-ahead and the
    scan's blocks (16, 64, 256 chunks)."""
    be = make_pool(capacity=16 * MiB, max_keys=4096)  # 4096 pages, a small bucket table: chains
    rng = random.Random(seed)
    prefixes = [f"c{seed}@{r}@" for r in range(rng.choice([1, 3]))]
    n = 1100 // len(prefixes)
    raw = [rng.randbytes(32) for _ in range(n)]
    hexes = [h.hex() for h in raw]
    mine = [p + h for h in hexes for p in prefixes]
    others = [f"other-{seed}-{i}-{uuid.uuid4().hex}" for i in range(4096 - len(mine) - 8)]
    everything = mine + others
    rng.shuffle(everything)  # the prompt's entries scattered among the others'
    for i in range(0, len(everything), 512):
        store(be, everything[i : i + 512])
    for cut in (n, 0, 1, 7, 8, 9, 15, 16, 17, 24, 63, 64, 80, 255, 256, 257, n - 1, *rng.sample(range(n), 6)):
        if cut < n:  # one object of chunk ``cut`` gone: the run is ``cut`` chunks
            gone = rng.choice(prefixes) + hexes[cut]
            assert be.remove([gone], T) == [Status.OK]
        st = be.exists(mine, T)
        assert st == [Status.NOT_FOUND if cut < n and k == gone else Status.OK for k in mine]
        assert by_exists(be, prefixes, hexes) == cut
        for suffixes in (hexes, raw):
            assert be.prefix_run(prefixes, suffixes, T)[:2] == (Status.OK, cut)
        assert be.prefix_run(prefixes, raw, T, lease_s=30.0)[:2] == (Status.OK, cut)
        assert be.pinned() == cut * len(prefixes)
        assert be.unpin_run(prefixes, raw, T) is Status.OK
        assert be.pinned() == 0
        if cut < n:
            store(be, [gone])


def held(be: LocalBackend, keys: list[str]) -> list[bool]:
    """Which keys are in DRAM, read without an LRU touch (exists would move them)."""
    return [bool(p) for p in be.test_hooks().pages(keys)]


def lru_tail_order(be: LocalBackend, keys: list[str], newcomers: int) -> list[str]:
    """The order in which eviction takes ``keys`` from a full pool of one-page
    objects: ``newcomers`` new objects put at once, then one at a time."""
    store(be, [f"newcomer-{uuid.uuid4().hex}" for _ in range(newcomers)])
    order: list[str] = []
    left = keys
    while left:
        now = [k for k, h in zip(left, held(be, left), strict=True) if h]
        kept = set(now)
        order += [k for k in left if k not in kept]
        left = now
        if left:
            store(be, [f"newcomer-{uuid.uuid4().hex}"])
    return order


@pytest.mark.parametrize("seed", range(6))
def test_a_scan_of_scattered_chunks_leaves_them_in_prompt_order(make_pool, seed):
    """Wherever a prompt's entries were in the LRU list, scattered among others'
    (neighbours anyone's), a scan across the blocks it drops the lock between
    (16, 64, ... chunks) leaves them opening the list in prompt order: eviction
    must then take every other object first and the prompt from its tail, last
    key of the last chunk first; the lists stay whole (``check`` walks them)."""
    rng = random.Random(seed)
    nchunks, prefixes = [(40, ["a@"]), (90, ["a@", "b@"]), (20, ["a@", "b@", "c@"])][seed % 3]
    room = 512  # 4 KiB pages of a 2 MiB pool, one per object
    be = make_pool(capacity=room * 4 * KiB, max_keys=4096)
    hexes = [rng.randbytes(8).hex() for _ in range(nchunks)]
    mine = [p + h for h in hexes for p in prefixes]
    others = [f"other-{i}" for i in range(room - len(mine))]
    everything = mine + others
    rng.shuffle(everything)
    store(be, everything)
    assert all(held(be, everything))  # full, nothing evicted yet
    # read in a random order, mine between others': their LRU neighbours are anyone's
    rng.shuffle(everything)
    assert be.exists(everything, T) == [Status.OK] * room
    if seed >= 3:  # part of the run in place already (chunks 0-9 at the head, in order)
        assert be.exists(mine[: 10 * len(prefixes)][::-1], T) == [Status.OK] * 10 * len(prefixes)
    assert be.prefix_run(prefixes, hexes, T)[:2] == (Status.OK, nchunks)
    assert be.test_hooks().check() == ""
    order = lru_tail_order(be, others + mine, len(others))
    assert set(order[: len(others)]) == set(others), "a chunk of the prompt went before the others"
    assert order[len(others) :] == mine[::-1], "the prompt's chunks were not in prompt order"
    assert be.test_hooks().check() == ""


@pytest.mark.parametrize("what", ["removed", "replaced", "read"])
def test_an_entry_changing_between_a_scans_blocks_leaves_the_lists_whole(make_pool, what):
    """Between blocks the lock is dropped, and an entry the scan found in an
    earlier block (chunk 15's) may change: removed, its entry reused by another
    object, or read (moved to the head). Whatever the scan's LRU touch then does
    with it, the lists must stay whole (``check`` walks them) and keep working."""
    import threading

    be = make_pool(capacity=512 * 4 * KiB, max_keys=4096)
    hexes = [f"{i:04x}" for i in range(48)]
    keys = ["r@" + h for h in hexes]
    store(be, keys)
    store(be, [f"other-{i}" for i in range(100)])
    be.test_hooks().stall_scans(0.3)
    got: list = []
    t = threading.Thread(target=lambda: got.append(be.prefix_run(["r@"], hexes, T)))
    t.start()
    time.sleep(0.1)  # the scan found chunks 0-15 and waits before the next block
    if what == "read":
        assert be.exists([keys[15]], T) == [Status.OK]
    else:
        assert be.remove([keys[15]], T) == [Status.OK]
        if what == "replaced":
            store(be, ["newcomer"])  # takes the freed entry
    t.join()
    be.test_hooks().stall_scans(0)
    assert got[0][0] is Status.OK
    assert be.test_hooks().check() == ""
    # and the lists keep working: newcomers evict everything before them in turn
    for i in range(6):
        store(be, [f"later-{i}-{j}" for j in range(100)])
    assert not any(held(be, keys)) and be.test_hooks().check() == ""
