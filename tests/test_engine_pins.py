"""Lookup pins (ascendstore.engine.pins) on the real local pool: a lookup with a
request id pins exactly the chunks it counted; several requests share a pin and
it ends when the last lets go; a chunk gone since the scan is not counted; the
ledger forgets expired holdings; nothing stays pinned."""

from __future__ import annotations

import random
import time
import uuid

import numpy as np
import pytest
from engine_helpers import look_then_keep_or_release, run_threads

from ascendstore.contract import BackendContext, Region, Status
from ascendstore.engine import BackendGuard, PoolLookup
from ascendstore.engine.pins import LookupPins
from ascendstore.engine.plan import KeyBuilder, RankPart
from ascendstore.local import _shmpool
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions

KiB, MiB = 1 << 10, 1 << 20
OBJ = 64 * KiB
T = 5.0


def _open_pool(capacity: int):
    name = f"lpin-{uuid.uuid4().hex[:10]}"
    be = LocalBackend.create(LocalOptions(name=name, capacity=capacity, page_size=16 * KiB), BackendContext())
    yield be
    be.destroy()
    _shmpool.unlink(name)


@pytest.fixture
def pool():
    yield from _open_pool(1 * MiB)


@pytest.fixture
def big_pool():
    yield from _open_pool(8 * MiB)


def _put(be: LocalBackend, keys: list[str]) -> list[Status]:
    buf = np.full(OBJ, 7, np.uint8)
    return be.put(keys, [[Region(buf.ctypes.data, OBJ)]] * len(keys), T)


def _lookup(be: LocalBackend, lease_s: float = 30.0) -> tuple[PoolLookup, KeyBuilder]:
    kb = KeyBuilder("fp", RankPart())
    lk = PoolLookup(BackendGuard(be, T), kb, T, pin_lease_s=lease_s)
    assert lk.pins is not None
    return lk, kb


def _keys(kb: KeyBuilder, hashes: list[str]) -> list[str]:
    return kb.lookup_keys_flat("", hashes)[0]


def _pressure(be: LocalBackend, n: int = 64) -> None:
    """Write four times the pool's capacity: everything unpinned is evicted."""
    for i in range(n):
        _put(be, [f"fill-{uuid.uuid4().hex}-{i}"])


def test_pins_exactly_the_counted_chunks(pool):
    lk, kb = _lookup(pool)
    hashes = [f"h{i:02d}" for i in range(6)]
    keys = _keys(kb, hashes)
    assert _put(pool, keys[:3] + keys[4:]) == [Status.OK] * 5  # chunk 3 missing: a run of 3
    assert lk.prefix_hits("", hashes, 0, "r1") == 3
    assert pool.pinned() == 3, "the chunks past the hole (4, 5) were found but not counted: not pinned"
    _pressure(pool)
    assert pool.exists(keys[:3], T) == [Status.OK] * 3, "a pinned chunk was evicted"
    assert pool.exists(keys[4:], T) == [Status.NOT_FOUND] * 2, "the unpinned chunks should have been evicted"
    lk.pins.release("r1")
    assert pool.pinned() == 0
    _pressure(pool)
    assert pool.exists(keys[:3], T) == [Status.NOT_FOUND] * 3, "released pins still held"


def test_a_lookup_from_an_offset_pins_from_there(pool):
    lk, kb = _lookup(pool)
    hashes = [f"o{i}" for i in range(4)]
    assert _put(pool, _keys(kb, hashes)) == [Status.OK] * 4
    assert lk.prefix_hits("", hashes, 2, "r") == 4
    assert pool.pinned() == 2  # chunks 0 and 1 are on the device already
    lk.pins.keep("r", 1)  # vLLM gave blocks to the first only
    assert pool.pinned() == 1
    lk.pins.release("r")
    assert pool.pinned() == 0


def test_requests_sharing_a_chunk_share_its_pin(pool):
    lk, kb = _lookup(pool)
    shared, a, b = ["s0", "s1"], ["a2"], ["b2"]
    assert _put(pool, _keys(kb, shared + a + b)) == [Status.OK] * 4
    assert lk.prefix_hits("", shared + a, 0, "A") == 3
    assert lk.prefix_hits("", shared + b, 0, "B") == 3
    assert pool.pinned() == 4
    lk.pins.release("A")
    assert pool.pinned() == 3, "A's release must not unpin the chunks B still counts on"
    _pressure(pool)
    assert pool.exists(_keys(kb, shared + b), T) == [Status.OK] * 3
    lk.pins.release("B")
    assert pool.pinned() == 0 and lk.pins.held_keys() == 0


def test_a_repeated_lookup_replaces_the_holding(pool):
    lk, kb = _lookup(pool)
    hashes = ["r0", "r1", "r2"]
    keys = _keys(kb, hashes)
    assert _put(pool, keys) == [Status.OK] * 3
    assert lk.prefix_hits("", hashes, 0, "r") == 3
    assert pool.remove([keys[1]], T) == [Status.OK]  # gone between two lookups of a waiting request
    assert lk.prefix_hits("", hashes, 0, "r") == 1
    assert pool.pinned() == 1, "chunk 2 is no longer counted: its pin must go"
    assert lk.prefix_hits("", ["zz"], 0, "r") == 0  # nothing counted: nothing held
    assert pool.pinned() == 0 and lk.pins.holders() == 0


def _count_pins(lk: PoolLookup) -> list[int]:
    """Chunks pinned by each pin the lookup takes: a pinning scan (the local pool's
    native pins) or a backend pin() of the counted keys (every other backend)."""
    calls: list[int] = []
    if lk.pins is not None and lk.pins.by_run:
        scan = lk._scan

        def counting_scan(prefixes, suffixes, timeout_s, gallop=False, lease_s=0.0):
            got = scan(prefixes, suffixes, timeout_s, gallop=gallop, lease_s=lease_s)
            if lease_s:
                calls.append(got[1])
            return got

        lk._scan = counting_scan  # type: ignore[method-assign]
    else:
        pin = lk.guard.pin

        def counting_pin(keys, lease_s, timeout_s=None):
            calls.append(len(keys))
            return pin(keys, lease_s, timeout_s)

        lk.guard.pin = counting_pin  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("by_run", [True, False], ids=["native-scan-pins", "key-pins"])
def test_a_waiting_request_renews_its_pins_only_when_half_the_lease_is_gone(pool, by_run):
    # A waiting request is looked up every step; the same run needs no pin call
    # (one per key) until half its lease has passed. Anything else pins again.
    lk, kb = _lookup(pool, lease_s=10.0)
    if not by_run:  # the ledger of a backend without a pinning scan: pins key strings
        lk.pins = LookupPins(lk.guard, 10.0, T)
    assert lk.pins.by_run is by_run
    now = [1000.0]
    lk.pins._clock = lambda: now[0]
    calls = _count_pins(lk)
    hashes = [f"w{i}" for i in range(4)]
    keys = _keys(kb, hashes)
    assert _put(pool, keys[:3]) == [Status.OK] * 3
    assert lk.prefix_hits("", hashes, 0, "r") == 3 and calls == [3]
    for _ in range(5):  # later steps, same run, lease well within
        now[0] += 0.9
        assert lk.prefix_hits("", hashes, 0, "r") == 3
    assert calls == [3] and pool.pinned() == 3
    now[0] += 0.6  # 5.1 s of the 10 s lease gone: renew
    assert lk.prefix_hits("", hashes, 0, "r") == 3 and calls == [3, 3]
    assert lk.prefix_hits("", hashes, 0, "r") == 3 and calls == [3, 3]
    assert lk.prefix_hits("", hashes, 0, "other") == 3 and calls == [3, 3, 3]  # another request: its own pins
    assert _put(pool, keys[3:]) == [Status.OK]  # the run grew: pin again
    assert lk.prefix_hits("", hashes, 0, "r") == 4 and calls[-1] == 4
    assert lk.prefix_hits("", hashes, 1, "r") == 4 and calls[-1] == 3  # from an offset: another run
    lk.pins.keep("r", 1)  # the load covers less than counted: no longer the counted run
    n = len(calls)
    assert lk.prefix_hits("", hashes, 1, "r") == 4 and len(calls) == n + 1
    lk.pins.release(["r", "other"])
    assert pool.pinned() == 0 and lk.pins.holders() == 0


def test_a_chunk_gone_between_scan_and_pin_is_not_counted(pool):
    """The scan said 3; the pin finds chunk 1 gone: the request counts 1 chunk."""
    kb = KeyBuilder("fp", RankPart())
    guard = BackendGuard(pool, T)
    pins = LookupPins(guard, 30.0, T)
    keys = _keys(kb, ["g0", "g1", "g2"])
    assert _put(pool, keys) == [Status.OK] * 3
    pool.remove([keys[1]], T)
    assert pins.pin("r", keys, 1) == 1
    assert pool.pinned() == 1, "the chunk after the hole was pinned by the call but is not counted: unpinned"
    pins.release("r")
    assert pool.pinned() == 0


def test_expired_holdings_are_forgotten(pool):
    now = [100.0]
    guard = BackendGuard(pool, T)
    pins = LookupPins(guard, 0.5, T, clock=lambda: now[0])
    kb = KeyBuilder("fp", RankPart())
    keys = _keys(kb, ["e0", "e1"])
    assert _put(pool, keys) == [Status.OK] * 2
    assert pins.pin("old", keys, 1) == 2
    now[0] += 1.0
    time.sleep(0.6)  # the pool's own lease (0.5 s) ends too
    pins.expire()
    assert pins.holders() == 0 and pins.held_keys() == 0
    assert pool.pinned() == 0


def test_a_scans_first_holding_expires_too(pool):
    """A request's first pins taken by the native scan (the ledger's shortcut for a
    request holding nothing yet) end with their lease like any other holding."""
    lk, kb = _lookup(pool, lease_s=0.5)
    assert lk.pins.by_run
    hashes = [bytes([i]) * 32 for i in range(3)]
    assert _put(pool, _keys(kb, [h.hex() for h in hashes])) == [Status.OK] * 3
    assert lk.prefix_hits("", hashes, 0, "first") == 3
    assert lk.pins.holders() == 1 and pool.pinned() == 3
    time.sleep(0.6)
    lk.pins.expire()
    assert lk.pins.holders() == 0 and lk.pins.held_keys() == 0, "a first holding outlived its lease"
    assert pool.pinned() == 0


def test_no_backend_pins_no_ledger():
    from ascendstore.contract import Capabilities

    guard = type("G", (), {"capabilities": Capabilities(pins=False)})()
    assert not LookupPins.supported(guard)  # type: ignore[arg-type]
    assert not LookupPins.supported(None)


def test_threads_pinning_and_releasing_leave_no_pin(pool):
    """Lookups and releases from several threads (the RPC server and the scheduler
    may overlap), random delays: the pool ends with nothing pinned."""
    lk, kb = _lookup(pool)
    hashes = [f"t{i}" for i in range(8)]
    assert _put(pool, _keys(kb, hashes)) == [Status.OK] * 8
    rng = random.Random(5)

    def work(tid: int) -> None:
        for j in range(60):
            rid = f"{tid}-{j % 3}"
            n = rng.randint(1, 8)
            look_then_keep_or_release(lk, rid, hashes[:n], rng.randint(0, n - 1), rng, 2, 0.6)

    assert not run_threads(work, 4)
    lk.pins.release(lk.pins.requests())
    assert lk.pins.held_keys() == 0
    assert pool.pinned() == 0


def test_the_local_pools_lookup_pins_in_its_scan(pool, monkeypatch):
    """On the local pool a lookup's pins are taken by the scan itself: no backend
    pin() and no key string per object (what made a request's first lookup cost
    3.4x the raw exists of a 131k-token prompt); the count is what is pinned."""
    lk, kb = _lookup(pool)
    assert lk.pins.by_run
    hashes = [bytes([i]) * 32 for i in range(6)]
    assert _put(pool, _keys(kb, [h.hex() for h in hashes[:4]])) == [Status.OK] * 4

    def refused(*a, **k):
        raise AssertionError("the lookup took the key-string path")

    lk.guard.pin = refused  # type: ignore[method-assign]
    monkeypatch.setattr(KeyBuilder, "lookup_keys_flat", refused)
    assert lk.prefix_hits("", hashes, 0, "r") == 4
    assert lk.prefix_hits("", hashes[:3], 0, "s") == 3  # shares three chunks with r
    assert pool.pinned() == 4 and lk.pins.held_keys() == 4
    lk.pins.release("r")
    assert pool.pinned() == 3, "chunks s still holds were unpinned with r"
    lk.pins.keep("s", 1)
    assert pool.pinned() == 1
    lk.pins.release("s")
    assert pool.pinned() == 0 and lk.pins.held_keys() == 0


@pytest.mark.parametrize("seed", range(8))
def test_requests_holding_overlapping_runs_keep_exactly_their_union_pinned(big_pool, seed):
    """Prompts sharing prefixes of chained hashes (as vLLM's are), requests looking
    them up from various chunks, keeping part, being looked up again for another
    prompt, released, in random order: what the pool has pinned is always the
    union of what the requests hold (nothing unpinned early, nothing left)."""
    import hashlib

    rng = random.Random(seed)
    pool = big_pool
    lk, kb = _lookup(pool)
    assert lk.pins.by_run
    # a tree of prompts: each continues a random prefix of an earlier one (chained hashes)
    prompts: list[list[bytes]] = []
    for p in range(6):
        base = prompts[rng.randrange(len(prompts))][: rng.randint(0, 5)] if prompts else []
        chain = list(base)
        while len(chain) < 8:
            chain.append(hashlib.sha256((chain[-1] if chain else b"root") + f"{p}-{len(chain)}".encode()).digest())
        prompts.append(chain)
    stored = sorted({h for c in prompts for h in c})
    for i in range(0, len(stored), 8):
        assert _put(pool, _keys(kb, [h.hex() for h in stored[i : i + 8]])) == [Status.OK] * len(stored[i : i + 8])
    held: dict[str, list[bytes]] = {}
    for _ in range(120):
        rid = f"r{rng.randrange(5)}"
        op = rng.random()
        if op < 0.5:
            chain = prompts[rng.randrange(len(prompts))]
            start = rng.randint(0, 7)
            assert lk.prefix_hits("", chain, start, rid) == 8
            held[rid] = chain[start:]
        elif op < 0.75 and rid in held:
            k = rng.randint(0, len(held[rid]))
            lk.pins.keep(rid, k)
            held[rid] = held[rid][:k]
        else:
            lk.pins.release(rid)
            held.pop(rid, None)
        want = {h for units in held.values() for h in units}
        assert pool.pinned() == len(want), f"pinned {pool.pinned()}, the requests hold {len(want)} chunks"
        assert lk.pins.held_keys() == len(want)
    lk.pins.release(list(held))
    assert pool.pinned() == 0


def _scan_calls(lk: PoolLookup) -> list[tuple[int, float]]:
    """(chunks asked about, lease) of every native scan the lookup makes."""
    calls: list[tuple[int, float]] = []
    scan = lk._scan

    def counting_scan(prefixes, suffixes, timeout_s, gallop=False, lease_s=0.0):
        calls.append((len(suffixes), lease_s))
        return scan(prefixes, suffixes, timeout_s, gallop=gallop, lease_s=lease_s)

    lk._scan = counting_scan  # type: ignore[method-assign]
    return calls


def test_a_waiting_requests_unbroken_pinned_run_is_not_probed_again(pool):
    """vLLM looks a waiting request up every step. While the run it pinned is
    whole (no pinned object left the pool since: ``pin_breaks``), a later lookup
    asks only about the chunks after that run: none when the whole prompt was
    counted, one probe when the next chunk is still missing."""
    lk, kb = _lookup(pool)
    calls = _scan_calls(lk)
    hashes = [bytes([i]) * 32 for i in range(6)]
    keys = _keys(kb, [h.hex() for h in hashes])
    assert _put(pool, keys[:4]) == [Status.OK] * 4
    assert lk.prefix_hits("", hashes, 0, "r") == 4 and calls == [(6, 30.0)]
    for _ in range(3):  # later steps: two chunks after the run asked about, none pinned
        assert lk.prefix_hits("", hashes, 0, "r") == 4
    assert calls[1:] == [(2, 0.0)] * 3
    assert lk.prefix_hits("", hashes[:4], 0, "r") == 4 and len(calls) == 4, "the whole prompt is held: no scan"
    assert _put(pool, keys[4:5]) == [Status.OK]  # another engine saved chunk 4: the longer run is pinned
    assert lk.prefix_hits("", hashes, 0, "r") == 5 and calls[-2:] == [(2, 0.0), (6, 30.0)]
    assert pool.pinned() == 5
    assert lk.prefix_hits("", hashes, 0, "r") == 5 and calls[-1] == (1, 0.0)
    # a request whose prompt differs after chunk 1 (same id): not its held run
    other = hashes[:2] + [b"\xee" * 32] * 4
    assert lk.prefix_hits("", other, 0, "r") == 2 and calls[-1][1] == 30.0
    assert lk.prefix_hits("", hashes, 1, "r") == 5 and calls[-1] == (5, 30.0)  # from another chunk: another run
    lk.pins.release("r")
    assert pool.pinned() == 0


def test_a_pinned_chunk_removed_makes_the_waiting_lookup_scan_again(pool):
    """An operator's removal (or a loss) of a pinned chunk is seen at the next
    lookup: the count drops to what is there, and is pinned anew."""
    lk, kb = _lookup(pool)
    calls = _scan_calls(lk)
    hashes = [f"x{i}" for i in range(5)]
    keys = _keys(kb, hashes)
    assert _put(pool, keys) == [Status.OK] * 5
    b0 = pool.pin_breaks()
    assert lk.prefix_hits("", hashes, 0, "r") == 5 and pool.pin_breaks() == b0
    assert _put(pool, keys[:2]) == [Status.OK] * 2  # a newer value of a pinned key keeps the pin
    _pressure(pool)  # evicting the unpinned breaks nothing
    assert pool.pin_breaks() == b0
    assert lk.prefix_hits("", hashes, 0, "r") == 5 and len(calls) == 1, "the held run was scanned again"
    assert pool.remove([keys[3]], T) == [Status.OK]
    assert pool.pin_breaks() == b0 + 1
    assert lk.prefix_hits("", hashes, 0, "r") == 3 and calls[-1] == (5, 30.0)
    assert pool.pinned() == 3
    lk.pins.release("r")


def test_a_degraded_backend_answers_a_miss_even_to_a_held_run(pool):
    lk, kb = _lookup(pool)
    hashes = [f"d{i}" for i in range(3)]
    assert _put(pool, _keys(kb, hashes)) == [Status.OK] * 3
    assert lk.prefix_hits("", hashes, 0, "r") == 3
    lk.guard.monitor = type("Sick", (), {"degraded": True})()  # type: ignore[assignment]
    assert lk.prefix_hits("", hashes, 0, "r") == 0
    assert pool.pinned() == 0 and lk.pins.holders() == 0


def test_pin_breaks_reads_minus_one_once_closed():
    name = f"lpin-{uuid.uuid4().hex[:10]}"
    be = LocalBackend.create(LocalOptions(name=name, capacity=1 * MiB, page_size=16 * KiB), BackendContext())
    assert be.pin_breaks() == 0
    be.destroy()
    assert be.pin_breaks() == -1
    _shmpool.unlink(name)


@pytest.mark.parametrize("seed", range(6))
def test_every_lookup_answers_exactly_the_run_present(big_pool, seed):
    """Random steps of several waiting requests (repeated lookups, from various
    chunks), puts by 'other engines', evicting pressure, removals of chunks
    (pinned or not), keeps, releases and a clock that runs leases out: every
    lookup answers exactly the run the pool holds at that moment (what a raw
    exists of its keys says), whether it probed the whole run or only what
    follows the run it held."""
    rng = random.Random(100 + seed)
    pool = big_pool
    lk, kb = _lookup(pool, lease_s=30.0)
    now = [0.0]
    lk.pins._clock = lambda: now[0]
    prompts = [[f"p{p}-{i}" for i in range(12)] for p in range(3)]
    shortcut = 0
    calls = _scan_calls(lk)
    for _ in range(300):
        op = rng.random()
        chain = prompts[rng.randrange(3)]
        if op < 0.45:
            rid, start = f"r{rng.randrange(4)}", rng.choice([0, 0, 0, rng.randrange(12)])
            for _ in range(rng.randint(1, 4)):  # a waiting request: looked up step after step
                n = len(calls)
                got = lk.prefix_hits("", chain, start, rid)
                statuses = pool.exists(_keys(kb, chain[start:]), T)
                want = start + next((i for i, s in enumerate(statuses) if s is not Status.OK), len(statuses))
                assert got == want, f"lookup said {got}, the pool holds a run to {want}"
                shortcut += len(calls) == n or (len(calls) == n + 1 and calls[-1][0] < len(chain) - start)
                now[0] += 0.5
        elif op < 0.6:
            lo = rng.randrange(12)
            _put(pool, _keys(kb, chain[lo : lo + rng.randint(1, 4)]))
        elif op < 0.7:
            _pressure(pool, 24)
        elif op < 0.8:
            pool.remove(_keys(kb, [chain[rng.randrange(12)]]), T)
        elif op < 0.87:
            lk.pins.keep(f"r{rng.randrange(4)}", rng.randint(0, 3))
        elif op < 0.95:
            lk.pins.release(f"r{rng.randrange(4)}")
        else:
            now[0] += rng.choice([2.0, 8.0, 16.0])
    assert shortcut > 10, "the held-run path was hardly taken: the test proves little"
    lk.pins.release(lk.pins.requests())
    assert pool.pinned() == 0


@pytest.mark.parametrize("seed", range(20))
def test_the_pool_pins_exactly_what_the_ledger_holds_as_leases_run_out(big_pool, seed):
    """Random steps with nothing removed: puts, lookups of waiting requests from
    various chunks, keeps, releases, evicting pressure, and a clock that runs the
    ledger's leases out. After every step the pool pins exactly the chunks the
    ledger holds: a holding that ran out, let go of when another request's scan has
    just pinned the same chunks, must not unpin them under it."""
    rng = random.Random(200 + seed)
    pool = big_pool
    lk, kb = _lookup(pool, lease_s=30.0)
    now = [0.0]
    lk.pins._clock = lambda: now[0]
    prompts = [[f"q{p}-{i}" for i in range(10)] for p in range(2)]
    for _ in range(150):
        op = rng.random()
        chain = prompts[rng.randrange(2)]
        if op < 0.4:
            rid, start = f"r{rng.randrange(4)}", rng.choice([0, 0, 0, rng.randrange(10)])
            lk.prefix_hits("", chain, start, rid)
        elif op < 0.6:
            lo = rng.randrange(10)
            _put(pool, _keys(kb, chain[lo : lo + rng.randint(1, 4)]))
        elif op < 0.65:
            _pressure(pool, 24)
        elif op < 0.75:
            lk.pins.keep(f"r{rng.randrange(4)}", rng.randint(0, 3))
        elif op < 0.85:
            lk.pins.release(f"r{rng.randrange(4)}")
        else:
            now[0] += rng.choice([0.5, 16.0, 40.0])
        assert pool.pinned() == lk.pins.held_keys()
    lk.pins.release(lk.pins.requests())
    assert pool.pinned() == 0

