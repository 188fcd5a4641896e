"""The generic lookup path (backends without a native scan) and the engine's counters.

The generic path finds a prompt's first missing chunk among a batched exists'
answers with ``list.index`` per kind of answer, and builds keys from raw hashes
in one pass; the counters write one dict per ``add`` and fold at ``take``. Each
test pins down an answer those shortcuts could get wrong.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time

import pytest
from engine_helpers import MemBackend

from ascendstore.contract import Status
from ascendstore.engine import BackendGuard, EngineMetrics, KeyBuilder, PoolLookup
from ascendstore.engine.lookup import first_other
from ascendstore.engine.metrics import COUNTERS, GAUGES
from ascendstore.keys import RankPart
from ascendstore.local import _shmpool

OK, NF, TO, UN = Status.OK, Status.NOT_FOUND, Status.TIMEOUT, Status.UNAVAILABLE


@pytest.mark.parametrize(
    ("items", "want"),
    [
        ([], 0),
        ([OK] * 5, 5),
        ([NF, OK, OK], 0),
        ([OK, OK, OK, NF], 3),
        ([OK, OK, NF, TO, NF], 2),
        ([OK, TO, NF, UN], 1),  # the first of several kinds, whichever kind it is
        ([OK, OK, UN, OK, TO], 2),
    ],
)
def test_first_other_is_the_first_answer_that_is_not_ok(items, want) -> None:
    assert first_other(items, set(items), OK) == want
    # the same as the plain loop it replaces
    assert want == next((i for i, s in enumerate(items) if s is not OK), len(items))


class Answers(MemBackend):
    """Answers exists with a planted status list (what a real store answers)."""

    def __init__(self, answers: list[Status]) -> None:
        super().__init__()
        self.answers = answers

    def exists(self, keys, timeout_s):
        self._enter("exists", keys)
        assert len(keys) == len(self.answers)
        return list(self.answers)


def _lookup(backend: MemBackend, ranks: int = 2) -> PoolLookup:
    kb = KeyBuilder("fp", RankPart(0), all_ranks=tuple(RankPart(r) for r in range(ranks)))
    return PoolLookup(BackendGuard(backend, 1.0), kb, 1.0)


@pytest.mark.parametrize(
    ("answers", "hits", "errors"),
    [
        ([OK] * 8, 4, 0),
        ([OK, OK, OK, NF, OK, OK, OK, OK], 1, 0),  # rank 1 misses chunk 1: the run ends there
        ([OK, OK, OK, OK, TO, OK, NF, OK], 2, 1),  # a timeout counts as a miss and an error
        ([OK, OK, OK, OK, OK, OK, UN, TO], 3, 1),  # two kinds of error in the last chunk
        ([NF, TO, OK, OK, OK, OK, OK, OK], 0, 1),
    ],
)
def test_generic_lookup_stops_at_the_first_chunk_with_any_object_not_ok(answers, hits, errors) -> None:
    lk = _lookup(Answers(answers))
    assert lk.prefix_hits("-", ["h0", "h1", "h2", "h3"]) == hits
    m = lk.guard.metrics.totals()
    assert m["lookups"] == 1 and m["lookup_keys"] == 8 and m["lookup_errors"] == errors


def test_raw_hashes_make_the_same_keys_as_their_hex() -> None:
    raw = [hashlib.sha256(str(i).encode()).digest() for i in range(5)]
    hexes = [h.hex() for h in raw]
    for ranks in (1, 3):
        kb = KeyBuilder("fp", RankPart(0), all_ranks=tuple(RankPart(r) for r in range(ranks)))
        assert kb.lookup_keys_flat("t1", raw) == kb.lookup_keys_flat("t1", hexes)
        assert kb.lookup_keys_flat("t1", raw)[0][: ranks] == kb.lookup_keys("t1", hexes[0])
    assert KeyBuilder("fp", RankPart(0)).lookup_keys_flat("t1", []) == ([], 1)
    # and a lookup given raw hashes asks for exactly the keys of their hex
    be = MemBackend()
    kb = KeyBuilder("fp", RankPart(0))
    for k in kb.lookup_keys_flat("-", hexes[:3])[0]:
        be.data[k] = b"x"
    lk = PoolLookup(BackendGuard(be, 1.0), kb, 1.0)
    assert lk.prefix_hits("-", raw) == lk.prefix_hits("-", hexes) == 3
    assert be.calls[0][1] == be.calls[1][1]



@pytest.mark.parametrize("fingerprint", ["fp", "fp-\u00e9"])  # the second: a non-ASCII prefix (Python's path)
def test_keys_of_raw_hashes_are_each_prefix_then_the_hex(fingerprint) -> None:
    # Built in C (hex_keys) where every prefix is ASCII, in Python otherwise: the
    # same keys either way, chunk-major, hashes of any length (an empty one too).
    raw = [hashlib.sha256(str(i).encode()).digest() for i in range(300)] + [b"", b"\x00\xff\x0a", bytes(range(256))]
    for ranks in (1, 2, 5):
        kb = KeyBuilder(fingerprint, RankPart(0), all_ranks=tuple(RankPart(r) for r in range(ranks)))
        prefixes = kb.lookup_keys("t1", "")
        flat, width = kb.lookup_keys_flat("t1", raw)
        assert width == ranks and flat == [p + h.hex() for h in raw for p in prefixes]
        assert all(k.isascii() for k in flat) == fingerprint.isascii()


def test_hex_keys_refuses_what_is_not_an_ascii_prefix_or_raw_hash() -> None:
    assert _shmpool.hex_keys(["a/"], [b"\x01", b"\xfe"]) == ["a/01", "a/fe"]
    assert _shmpool.hex_keys(["a/", "b/"], []) == [] and _shmpool.hex_keys([], [b"\x01"]) == []
    for prefixes, hashes in ((["a/"], ["01"]), (["a/"], [b"\x01", None]), (["\u00e9/"], [b"\x01"]), ([1], [b"\x01"])):
        with pytest.raises(TypeError):
            _shmpool.hex_keys(prefixes, hashes)


# -- counters ------------------------------------------------------------------------------
def test_totals_are_every_take_plus_what_is_not_taken_yet() -> None:
    m = EngineMetrics()
    m.add(lookups=2, lookup_keys=10)
    m.peak(queue_depth_max=5)
    m.add_labelled("hit_tokens", "dram", 7)
    assert m.take() == {"lookups": 2, "lookup_keys": 10, "queue_depth_max": 5, "hit_tokens/dram": 7}
    m.add(lookups=1)
    m.peak(queue_depth_max=3)  # lower than the peak taken before: totals keep 5
    m.add_labelled("hit_tokens", "dram", 1)
    m.set_state(degraded=1)
    t = m.totals()
    assert t["lookups"] == 3 and t["lookup_keys"] == 10 and t["queue_depth_max"] == 5
    assert t["hit_tokens/dram"] == 8 and t["degraded"] == 1
    assert set(COUNTERS + GAUGES) <= set(t)  # every field, zeros too
    assert m.take() == {"lookups": 1, "queue_depth_max": 3, "hit_tokens/dram": 1, "degraded": 1}
    m.peak(queue_depth_max=9)
    m.set_state(degraded=0)
    t = m.totals()
    assert t["lookups"] == 3 and t["queue_depth_max"] == 9 and t["hit_tokens/dram"] == 8 and t["degraded"] == 0
    assert m.take() == {"queue_depth_max": 9, "degraded": 0}  # a state that changed is reported once
    idle = m._data
    assert m.take() == {}
    assert m._data is idle  # an idle take (most steps) builds no fresh dict of zeros
    assert m.totals() == t
    m.add(lookups=4)
    assert m.take() == {"lookups": 4} and m.take() == {}
    assert m.totals()["lookups"] == 7


def test_counters_added_by_many_threads_while_taken_lose_nothing() -> None:
    # Adders on several threads, a taker taking at random moments: every delta
    # shows in exactly one take, and the totals are their sums.
    m = EngineMetrics()
    names = ("lookups", "lookup_keys", "load_ops", "save_ops")
    threads, per_thread = 4, 3000
    taken: list[dict[str, float]] = []
    stop = threading.Event()
    want = dict.fromkeys(names, 0)
    want_lock = threading.Lock()

    def adder(seed: int) -> None:
        rng = random.Random(seed)
        mine = dict.fromkeys(names, 0)
        for i in range(per_thread):
            a, b = rng.sample(names, 2)
            da, db = rng.randrange(1, 5), rng.randrange(1, 5)
            m.add(**{a: da, b: db})
            mine[a] += da
            mine[b] += db
            if i % 97 == 0:
                time.sleep(rng.random() * 0.001)
        with want_lock:
            for k, v in mine.items():
                want[k] += v

    def taker() -> None:
        rng = random.Random(99)
        while not stop.is_set():
            taken.append(m.take())
            time.sleep(rng.random() * 0.002)

    t = threading.Thread(target=taker)
    t.start()
    adders = [threading.Thread(target=adder, args=(s,)) for s in range(threads)]
    for a in adders:
        a.start()
    for a in adders:
        a.join()
    stop.set()
    t.join()
    taken.append(m.take())
    assert len(taken) > 2  # it did take while they added
    for k in names:
        assert sum(d.get(k, 0) for d in taken) == want[k], k
        assert m.totals()[k] == want[k], k
