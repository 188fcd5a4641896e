"""The Mooncake backend's exists cache stays bounded without a stall: stale answers
leave from its oldest end, about as many per call as the call added, never a fresh
one while the cache is within its bound."""

from __future__ import annotations

import random

import pytest
from ascendstore_mooncake import backend as mb
from mooncake_helpers import payload, region

from ascendstore.contract import Status

T = 5.0


def test_trim_drops_stale_answers_from_the_oldest_end_and_stops_at_a_fresh_one() -> None:
    cache = {"a": 1.0, "b": 2.0, "c": 9.0, "d": 3.0, "e": 9.5}  # d: stale, behind a fresh one
    mb._trim(cache, cutoff=5.0, limit=100, added=1)
    assert list(cache) == ["c", "d", "e"]  # d waits for c to go
    mb._trim(cache, cutoff=9.2, limit=100, added=1)
    assert list(cache) == ["e"]
    mb._trim(cache, cutoff=9.5, limit=100, added=1)
    assert cache == {}


def test_trim_drops_at_most_what_was_added_and_a_little_more_then_the_oldest_over_the_bound() -> None:
    cache = dict.fromkeys((f"k{i}" for i in range(5000)), 0.0)  # all stale
    mb._trim(cache, cutoff=1.0, limit=10_000, added=100)
    assert len(cache) == 5000 - 100 - mb._TRIM_EXTRA and next(iter(cache)) == f"k{100 + mb._TRIM_EXTRA}"
    fresh = dict.fromkeys((f"f{i}" for i in range(50)), 5.0)
    mb._trim(fresh, cutoff=1.0, limit=40, added=10)  # nothing stale: the oldest 10 go for the bound
    assert list(fresh) == [f"f{i}" for i in range(10, 50)]


def test_trim_keeps_the_cache_bounded_and_every_fresh_answer_while_within_it() -> None:
    # Random calls, each adding answers (some refreshing keys already in) and trimming,
    # against the rule: within the bound no fresh answer is dropped; the cache never
    # stays over it; what goes is always from the oldest end.
    rng = random.Random(3)
    limit, ttl, now = 500, 1.0, 0.0
    cache: dict[str, float] = {}
    for step in range(3000):
        now += rng.choice((0.0, 0.01, 0.1, 0.5))
        added = rng.randrange(1, 80)
        keys = [f"k{rng.randrange(2000)}" for _ in range(added)]
        cache.update((k, now) for k in keys)
        before = list(cache.items())
        mb._trim(cache, now - ttl, limit, added)
        gone = [k for k, _ in before if k not in cache]
        assert [k for k, _ in before[: len(gone)]] == gone  # a prefix of the oldest
        assert len(cache) <= limit
        if len(before) - len(gone) < limit:  # (not cut for the bound: only stale answers went)
            assert all(t <= now - ttl for k, t in before if k in gone), step


def test_a_small_bound_keeps_answers_right(open_backend, monkeypatch) -> None:
    # Through the backend: with room for 8 answers, batches of 6 present keys and
    # some missing ones keep every answer right and the cache at most 8 answers.
    monkeypatch.setattr(mb, "EXISTS_CACHE_MAX", 8)
    b = open_backend(exists_cache_ttl_s=30)
    src = payload(5, 256)
    present = [f"bound/p{i}" for i in range(20)]
    assert b.put(present, [[region(src)]] * 20, T) == [Status.OK] * 20
    rng = random.Random(11)
    for _ in range(30):
        keys = rng.sample(present, 6) + [f"bound/gone{rng.randrange(5)}"]
        rng.shuffle(keys)
        want = [Status.NOT_FOUND if "gone" in k else Status.OK for k in keys]
        assert b.exists(keys, T) == want
        assert b.pin(keys, 10.0, T) == want
        assert len(b._exists_cache) <= 8
    assert b.stats()["exists_cache_hits"] > 0  # (the cache still answers)


@pytest.mark.parametrize("n", [0, 1])
def test_trim_of_an_empty_or_tiny_cache(n) -> None:
    cache = dict.fromkeys([f"k{i}" for i in range(n)], 0.0)
    mb._trim(cache, cutoff=10.0, limit=0, added=0)
    assert cache == {}
