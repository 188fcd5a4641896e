"""Lookup pins on a backend without a native scan (Mooncake's shape): the real
local pool behind the ``faulty`` wrapper, which hides the pool's scan, so pins go
through ``pin``/``unpin`` of key strings. A request's first lookup is one ``pin``
call that answers and pins; keys pinned past the first miss are let go of; the
ledger's per-key counts stay exact when requests share keys and let go in any
order."""

from __future__ import annotations

import hashlib
import random
import uuid
from collections import Counter

import numpy as np
import pytest
from engine_helpers import look_then_keep_or_release, run_threads

from ascendstore.chaos.faulty import FaultyBackend, FaultyOptions
from ascendstore.contract import BackendContext, Region, Status
from ascendstore.engine import BackendGuard, PoolLookup
from ascendstore.engine.pins import LookupPins
from ascendstore.engine.plan import KeyBuilder, RankPart
from ascendstore.local import _shmpool
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions

KiB, MiB = 1 << 10, 1 << 20
OBJ = 16 * KiB
T = 5.0


@pytest.fixture
def pool():
    name = f"kpin-{uuid.uuid4().hex[:10]}"
    be = LocalBackend.create(LocalOptions(name=name, capacity=2 * MiB, page_size=16 * KiB), BackendContext())
    yield be
    be.destroy()
    _shmpool.unlink(name)


def _put(be: LocalBackend, keys: list[str]) -> None:
    buf = np.full(OBJ, 3, np.uint8)
    assert be.put(keys, [[Region(buf.ctypes.data, OBJ)]] * len(keys), T) == [Status.OK] * len(keys)


def _lookup(pool: LocalBackend, ranks: int = 1, **faults) -> tuple[PoolLookup, KeyBuilder, list]:
    """A PoolLookup over the pool without its scan (``ranks`` keys a chunk), and a log
    of the guard's calls ((op, keys asked) in order)."""
    wrapped = FaultyBackend(pool, FaultyOptions(**faults), BackendContext())
    guard = BackendGuard(wrapped, T)
    kb = KeyBuilder("fp", RankPart(), all_ranks=tuple(RankPart(r) for r in range(ranks)))
    lk = PoolLookup(guard, kb, T, pin_lease_s=30.0)
    assert lk._scan is None and lk.pins is not None and not lk.pins.by_run
    calls: list[tuple[str, int]] = []
    for op in ("exists", "pin", "unpin"):
        real = getattr(guard, op)

        def logged(keys, *args, _op=op, _real=real, **kw):
            calls.append((_op, len(keys)))
            return _real(keys, *args, **kw)

        setattr(guard, op, logged)
    return lk, kb, calls


def test_a_first_lookup_is_one_pin_call_and_keeps_only_the_counted_run(pool):
    lk, kb, calls = _lookup(pool)
    hashes = [f"p{i}" for i in range(6)]
    keys = kb.lookup_keys_flat("", hashes)[0]
    _put(pool, keys[:3] + keys[4:])  # chunk 3 missing; 4 and 5 present past the miss
    assert lk.prefix_hits("", hashes, 0, "r") == 3
    # One call answered and pinned; the two pinned past the miss were let go of.
    assert calls == [("pin", 6), ("unpin", 2)]
    assert pool.pinned() == 3 and lk.pins._held["r"].units == keys[:3]
    assert lk.guard.metrics.totals()["lookups"] == 1
    # The request waits and is looked up again: its run is pinned (lease fresh), so
    # only the chunks after it are asked about, and no pin.
    calls.clear()
    assert lk.prefix_hits("", hashes, 0, "r") == 3
    assert calls == [("exists", 3)]
    # Another request's first lookup of the same prompt: its own pin call; both hold 0-2.
    calls.clear()
    assert lk.prefix_hits("", hashes, 0, "s") == 3
    assert calls == [("pin", 6), ("unpin", 2)]
    lk.pins.release("r")
    assert pool.pinned() == 3, "s still holds the run r let go of"
    lk.pins.release("s")
    assert pool.pinned() == 0 and lk.pins.holders() == 0


def test_a_waiting_request_is_not_asked_about_the_run_it_holds(pool):
    # vLLM looks a waiting request up every step. Its pinned run is not asked about
    # again while half its lease is left: a whole prompt held makes no call; more
    # present after the run, a renewal, or another start is one pin of every key.
    lk, kb, calls = _lookup(pool)
    now = [0.0]
    lk.pins._clock = lambda: now[0]
    hashes = [f"w{i}" for i in range(6)]
    keys = kb.lookup_keys_flat("", hashes)[0]
    _put(pool, keys[:4])
    assert lk.prefix_hits("", hashes, 0, "r") == 4
    calls.clear()
    assert lk.prefix_hits("", hashes, 0, "r") == 4
    assert calls == [("exists", 2)]  # chunks 4 and 5 only
    # Chunk 4 arrives (another engine saved it): the tail shows it, one pin takes the longer run.
    _put(pool, keys[4:5])
    calls.clear()
    assert lk.prefix_hits("", hashes, 0, "r") == 5
    assert calls == [("exists", 2), ("pin", 6)]
    assert lk.pins._held["r"].run == ("", 0, "w0", "w4", 5) and pool.pinned() == 5
    # The whole prompt held: no call, and the lookup is counted.
    _put(pool, keys[5:])
    assert lk.prefix_hits("", hashes, 0, "r") == 6
    calls.clear()
    looked = lk.guard.metrics.totals()["lookups"]
    assert lk.prefix_hits("", hashes, 0, "r") == 6
    assert calls == [] and lk.guard.metrics.totals()["lookups"] == looked + 1
    # Half the lease gone: one pin renews it (and would count a chunk that left since).
    now[0] += lk.pins.lease_s / 2
    calls.clear()
    assert lk.prefix_hits("", hashes, 0, "r") == 6
    assert calls == [("pin", 6)]
    assert lk.prefix_hits("", hashes, 0, "r") == 6 and calls == [("pin", 6)]
    # Another start (the device now has chunks 0-1): not the run it holds, one pin from there.
    calls.clear()
    assert lk.prefix_hits("", hashes, 2, "r") == 6
    assert calls == [("pin", 4), ("unpin", 2)]  # (chunks 0-1 let go of: no longer its)
    assert lk.pins._held["r"].run == ("", 2, "w2", "w5", 4) and pool.pinned() == 4
    # Another tenant's prompt of the same hashes: not its run either.
    calls.clear()
    assert lk.prefix_hits("t2", hashes, 2, "r") == 2
    assert calls == [("pin", 4), ("unpin", 4)]
    assert lk.pins.holders() == 0 and pool.pinned() == 0


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("seed", range(20))
def test_lookups_of_waiting_requests_answer_the_true_run_while_nothing_is_removed(pool, seed, ranks):
    # Random steps: chunks of two prompts sharing a prefix arrive (with two ranks, a
    # rank's object at a time: a chunk counts once all of its are in), requests are
    # looked up again from random starts (tenants, keeps, releases, a clock that runs
    # past half and past all of the lease). A waiting request's run is not asked
    # about again, yet with nothing removed every lookup answers exactly the run
    # present from its start, and pins exactly that run for the request.
    lk, kb, calls = _lookup(pool, ranks)
    now = [0.0]
    lk.pins._clock = lambda: now[0]
    rng = random.Random(seed * 8 + ranks)
    prompts = [[f"s{seed}-{i}" for i in range(8)], [f"s{seed}-{i}" for i in range(3)] + [f"s{seed}-b{i}" for i in range(3, 8)]]
    tenants = ["", "t1"]
    stored: set[str] = set()
    reqs = ["a", "b", "c"]
    for _ in range(120):
        op = rng.random()
        if op < 0.3:
            tenant, h = rng.choice(tenants), rng.choice(rng.choice(prompts))
            objects = kb.lookup_keys_flat(tenant, [h])[0]
            new = [k for k in objects[: rng.randint(1, ranks)] if k not in stored]
            if new:
                _put(pool, new)
                stored.update(new)
        elif op < 0.8:
            req, tenant, hashes = rng.choice(reqs), rng.choice(tenants), rng.choice(prompts)
            start = rng.choice([0, 0, 0, rng.randrange(len(hashes) + 1)])
            calls.clear()
            hits = lk.prefix_hits(tenant, hashes, start, req)
            true = start
            while true < len(hashes) and set(kb.lookup_keys_flat(tenant, [hashes[true]])[0]) <= stored:
                true += 1
            assert hits == true, (calls, start)
            if hits > start:
                assert lk.pins._held[req].units == kb.lookup_keys_flat(tenant, hashes[start:hits])[0]
            else:
                assert req not in lk.pins._held
        elif op < 0.9:
            req = rng.choice(reqs)
            if rng.random() < 0.5:
                lk.pins.keep(req, rng.randint(0, 3))
            else:
                lk.pins.release(req)
        else:
            now[0] += rng.choice([0.1, lk.pins.lease_s / 2, lk.pins.lease_s * 1.1])
        assert pool.pinned() == lk.pins.held_keys()
    lk.pins.release(reqs)
    assert pool.pinned() == 0


def test_a_degraded_backend_lets_a_waiting_request_go(pool):
    lk, kb, calls = _lookup(pool)
    hashes = ["g0", "g1"]
    _put(pool, kb.lookup_keys_flat("", hashes)[0])
    assert lk.prefix_hits("", hashes, 0, "r") == 2 and pool.pinned() == 2
    lk.guard.monitor = type("Sick", (), {"degraded": True})()  # type: ignore[assignment]
    calls.clear()
    assert lk.prefix_hits("", hashes, 0, "r") == 0  # a miss: the load is recomputed
    # (let go of in the ledger; the degraded guard sends nothing: the pool's pins end with the lease)
    assert calls == [("unpin", 2)] and lk.pins.holders() == 0


def test_a_first_lookup_from_an_offset_pins_from_there(pool):
    lk, kb, calls = _lookup(pool)
    hashes = [f"o{i}" for i in range(5)]
    keys = kb.lookup_keys_flat("", hashes)[0]
    _put(pool, keys)
    assert lk.prefix_hits("", hashes, 2, "r") == 5
    assert calls == [("pin", 3)] and lk.pins._held["r"].units == keys[2:]
    assert lk.pins._held["r"].run == ("", 2, "o2", "o4", 3)
    lk.pins.release("r")
    assert pool.pinned() == 0


def test_a_first_lookup_that_misses_at_once_holds_nothing(pool):
    lk, kb, calls = _lookup(pool)
    hashes = [f"m{i}" for i in range(4)]
    keys = kb.lookup_keys_flat("", hashes)[0]
    _put(pool, keys[1:])
    assert lk.prefix_hits("", hashes, 0, "r") == 0
    assert calls == [("pin", 4), ("unpin", 3)]
    assert pool.pinned() == 0 and lk.pins.holders() == 0


@pytest.mark.parametrize("seed", range(12))
def test_a_first_lookup_counts_up_to_the_first_failed_answer(pool, seed):
    # A third of the pin's keys fail (UNAVAILABLE, not pinned): the run ends at the
    # first failure, the lookup counts an error, and what is pinned is exactly the run.
    lk, kb, _ = _lookup(pool, seed=seed, fail_rate={"exists": 0.3})
    answers: list[list[Status]] = []
    pin = lk.guard.pin

    def recorded(keys, *args, **kw):
        answers.append(out := pin(keys, *args, **kw))
        return out

    lk.guard.pin = recorded  # type: ignore[method-assign]
    hashes = [f"f{seed}-{i}" for i in range(8)]
    _put(pool, kb.lookup_keys_flat("", hashes)[0])
    hits = lk.prefix_hits("", hashes, 0, "r")
    (got,) = answers
    first_bad = next((i for i, s in enumerate(got) if s is not Status.OK), len(got))
    assert hits == first_bad
    assert pool.pinned() == hits
    assert lk.guard.metrics.totals().get("lookup_errors", 0) == (1 if first_bad < len(got) else 0)
    lk.pins.release("r")
    assert pool.pinned() == 0


def test_a_degraded_backend_gets_no_first_lookup_call(pool):
    lk, kb, calls = _lookup(pool)
    hashes = ["d0", "d1"]
    _put(pool, kb.lookup_keys_flat("", hashes)[0])
    lk.guard.monitor = type("Sick", (), {"degraded": True})()  # type: ignore[assignment]
    assert lk.prefix_hits("", hashes, 0, "r") == 0
    assert calls == [] and pool.pinned() == 0 and lk.pins.holders() == 0


class _PinModel:
    """A backend client's pins of key strings, as the contract has them: per
    process (a key pinned twice is one pin; ``unpin`` ends it)."""

    class capabilities:  # (read as guard.capabilities.pins)
        pins = True

    def __init__(self) -> None:
        self.pinned: set[str] = set()

    def pin(self, keys, lease_s, timeout_s=None):
        self.pinned.update(keys)
        return [Status.OK] * len(keys)

    def unpin(self, keys, timeout_s=None):
        self.pinned.difference_update(keys)
        return [Status.OK] * len(keys)


def _keep_or_release(pins: LookupPins, held: dict[str, list[str]], req: str, rng: random.Random,
                     keep: bool) -> None:
    """A model test's step: ``req`` keeps a random number of its chunks (``keep``, when
    it holds any) or lets go of all; ``held`` (what each request holds) follows."""
    if keep and req in held:
        h = pins._held[req]
        chunks = rng.randint(0, len(h.units) // h.width)
        pins.keep(req, chunks)
        held[req] = held[req][: chunks * h.width]
        if not held[req]:
            held.pop(req)
    else:
        pins.release(req)
        held.pop(req, None)


@pytest.mark.parametrize("seed", range(30))
def test_key_pins_stay_exactly_the_union_of_what_requests_hold(seed):
    # Requests share a leading run of keys (a system prompt), hold their own after
    # it, sometimes hold a key twice, renew, keep less and let go in random order.
    # After every step the backend pins exactly the keys some request holds, and
    # the ledger counts each key's holders exactly.
    rng = random.Random(seed)
    model = _PinModel()
    pins = LookupPins(model, 60.0, T)  # type: ignore[arg-type]
    system = [f"sys/{i}" for i in range(rng.randint(0, 40))]
    held: dict[str, list[str]] = {}
    for step in range(300):
        req = f"r{rng.randrange(8)}"
        op = rng.random()
        if op < 0.5:
            own = [f"{req}/{step}/{i}" for i in range(rng.randint(0, 60))]
            keys = system[: rng.randint(0, len(system))] + own
            if keys and rng.random() < 0.1:
                keys.append(rng.choice(keys))  # a key twice in one holding
            width = rng.choice([1, 2]) if len(keys) % 2 == 0 else 1
            pins.pin(req, keys, width)
            held[req] = keys
            if not keys:
                held.pop(req)
        else:
            _keep_or_release(pins, held, req, rng, keep=op < 0.65)
        want = Counter(k for keys in held.values() for k in keys)
        assert model.pinned == set(want), f"step {step}: backend pins differ from what requests hold"
        assert pins._refs == want, f"step {step}: the ledger's counts are off"
    pins.release(list(held))
    assert not model.pinned and not pins._refs


def _chain(parent: str, n: int, rng: random.Random) -> list[str]:
    """``n`` chained chunk hashes after ``parent`` (as vLLM's: each names its prefix)."""
    out = []
    for _ in range(n):
        parent = hashlib.sha256(f"{parent}/{rng.random()}".encode()).hexdigest()[:16]
        out.append(parent)
    return out


@pytest.mark.parametrize("seed", range(30))
def test_placed_key_pins_stay_exactly_the_union_of_what_requests_hold(seed):
    # What PoolLookup pins: key strings of a tenant's prompt from a chunk position,
    # chunk-major (``width`` keys a chunk). What requests share is found by position
    # (chained hashes), not counted per key. Prompts grow from each other's prefixes
    # (a system prompt, a conversation's earlier turns); pin calls answer a miss and
    # keys present past it (let go unless another request holds them); requests
    # renew, keep less, release in any order; a holding of keys of unknown origin
    # (counted per key) sometimes shares keys with them. After every step the
    # backend pins exactly the keys some request holds.
    rng = random.Random(seed)
    model = _PinModel()
    pins = LookupPins(model, 60.0, T)  # type: ignore[arg-type]
    width = rng.choice([1, 2, 3])
    kb = KeyBuilder("fp", RankPart(), all_ranks=tuple(RankPart(head_rank=r) for r in range(width)))
    tenants = ["t0", "t1"]
    prompts: dict[str, list[list[str]]] = {t: [_chain(t, rng.randint(1, 30), rng)] for t in tenants}
    held: dict[str, list[str]] = {}
    for step in range(300):
        req = f"r{rng.randrange(8)}"
        op = rng.random()
        if op < 0.55:
            tenant = rng.choice(tenants)
            known = prompts[tenant]
            base = rng.choice(known)
            cut = rng.randint(0, len(base))
            prompt = base[:cut] + _chain(base[cut - 1] if cut else tenant, rng.randint(0, 20), rng)
            if not prompt:
                continue
            known.append(prompt)
            start = rng.randrange(len(prompt))
            flat, w = kb.lookup_keys_flat(tenant, prompt[start:])
            assert w == width
            n = len(prompt) - start
            hits = rng.randint(0, n)
            # answers: the run, a miss, then present or absent at random (some past it)
            statuses = [Status.OK] * (hits * width)
            if hits < n:
                statuses += [Status.NOT_FOUND] + [rng.choice([Status.OK, Status.NOT_FOUND])
                                                  for _ in range(len(flat) - len(statuses) - 1)]
            model.pin([k for k, s in zip(flat, statuses, strict=True) if s is Status.OK], 60.0)
            run = (tenant, start, prompt[start], prompt[start + hits - 1], hits) if hits else None
            pins.pinned(req, flat, width, statuses, hits, run, (tenant, start))
            held[req] = flat[: hits * width]
            if not hits:
                held.pop(req)
        elif op < 0.62:
            # keys of unknown origin (no place): counted per key; some shared with prompts
            pool = [k for keys in held.values() for k in keys]
            keys = rng.sample(pool, min(len(pool), rng.randint(0, 5))) + [f"{req}/{step}/x"]
            pins.pin(req, keys, 1)
            held[req] = keys
        else:
            _keep_or_release(pins, held, req, rng, keep=op < 0.75)
        want = {k for keys in held.values() for k in keys}
        assert model.pinned == want, f"step {step}: backend pins differ from what requests hold"
        assert pins.held_keys() == len(want)
    pins.release(list(held))
    assert not model.pinned and not pins._refs and pins.holders() == 0


@pytest.mark.parametrize("seed", range(5))
def test_threads_looking_up_keeping_and_releasing_leave_exactly_what_is_held(pool, seed):
    # Lookups, keeps and releases of overlapping prompts from several threads (the
    # RPC server and the scheduler may overlap), random delays. Once they stop, the
    # pool pins exactly the keys the ledger holds; once every request lets go, none.
    lk, kb, _ = _lookup(pool)
    hashes = [f"t{i}" for i in range(12)]
    _put(pool, kb.lookup_keys_flat("", hashes)[0])

    def work(tid: int) -> None:
        rng = random.Random(seed * 16 + tid)
        for j in range(80):
            rid = f"{tid}-{j % 3}" if rng.random() < 0.8 else f"shared-{j % 2}"
            n = rng.randint(1, len(hashes))
            look_then_keep_or_release(lk, rid, hashes[:n], rng.choice([0, 0, rng.randrange(n)]), rng, 3, 0.5)

    assert not run_threads(work, 4)
    assert pool.pinned() == lk.pins.held_keys()
    lk.pins.release(lk.pins.requests())
    assert pool.pinned() == 0 and lk.pins.held_keys() == 0 and not lk.pins._firsts
