"""The local pool's ``put_absent``: a save's dedup inside the put (one native
call, one lock), the same outcome as an exists and then a put of the keys not
found, with the keys it held reported. Read back byte for byte."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

from ascendstore.contract import BackendContext, Region, Status
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions

KiB, MiB = 1 << 10, 1 << 20
T = 5.0


@pytest.fixture
def make_pool():
    opened: list[LocalBackend] = []

    def make(**kw) -> LocalBackend:
        kw.setdefault("name", f"t-{uuid.uuid4().hex[:10]}")
        be = LocalBackend.create(LocalOptions(**kw), BackendContext())
        opened.append(be)
        return be

    yield make
    for be in opened:
        be.destroy()


def value(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def regions(arr: np.ndarray, parts: int = 1) -> list[Region]:
    step = arr.nbytes // parts
    return [Region(arr.ctypes.data + i * step, step if i < parts - 1 else arr.nbytes - i * step) for i in range(parts)]


def read(be: LocalBackend, key: str, n: int) -> np.ndarray | None:
    out = np.zeros(n, np.uint8)
    (st,) = be.get([key], [regions(out)], T)
    return out if st is Status.OK else None


def test_held_keys_keep_their_value_and_are_reported(make_pool):
    be = make_pool(capacity=8 * MiB, page_size=4 * KiB)
    n = 48 * KiB + 100
    old = [value(i, n) for i in range(3)]
    assert be.put(["k0", "k2", "k4"], [regions(v) for v in old], T) == [Status.OK] * 3
    new = [value(100 + i, n) for i in range(6)]
    present: list[int] = []
    keys = [f"k{i}" for i in range(6)]
    assert be.put_absent(keys, [regions(v, parts=3) for v in new], present, T) == [Status.OK] * 6
    assert present == [0, 2, 4]
    for i, k in enumerate(keys):
        want = old[i // 2] if i % 2 == 0 else new[i]
        got = read(be, k, n)
        assert got is not None and np.array_equal(got, want), f"{k}: wrong bytes"
    # a plain put of the same keys replaces (the test can tell the two apart)
    assert be.put(["k0"], [regions(new[0])], T) == [Status.OK]
    assert np.array_equal(read(be, "k0", n), new[0])


def test_nothing_is_evicted_when_every_key_is_held(make_pool):
    be = make_pool(capacity=1 * MiB, page_size=4 * KiB)
    n = 62 * KiB  # 16 pages each: 16 objects fill the pool
    vals = [value(i, n) for i in range(16)]
    keys = [f"k{i}" for i in range(16)]
    assert be.put(keys, [regions(v) for v in vals], T) == [Status.OK] * 16
    before = be.stats()
    assert before["pages_free"] < 16, "the pool should be full"
    present: list[int] = []
    assert be.put_absent(keys, [regions(value(99, n))] * 16, present, T) == [Status.OK] * 16
    after = be.stats()
    assert present == list(range(16))
    assert after["evictions"] == before["evictions"] and after["puts"] == before["puts"]
    for k, v in zip(keys, vals, strict=True):
        assert np.array_equal(read(be, k, n), v)


@pytest.mark.parametrize("absent_only", [True, False], ids=["put_absent", "put"])
def test_a_key_stored_by_another_writer_meanwhile_keeps_the_first_value(make_pool, absent_only):
    """put_absent reserves, then copies with the pool unlocked (stalled here);
    another client stores the key meanwhile: its value stays, and the stalled
    call reports the key as held. A plain put in the same race replaces it."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    a = make_pool(name=name, capacity=8 * MiB, page_size=4 * KiB)
    b = make_pool(name=name, capacity=8 * MiB, page_size=4 * KiB)
    n = 20 * KiB
    mine, theirs = value(1, n), value(2, n)
    a.test_hooks().stall_puts(0.5)
    present: list[int] = []
    out: list = []

    def write() -> None:
        if absent_only:
            out.append(a.put_absent(["k"], [regions(mine)], present, T))
        else:
            out.append(a.put(["k"], [regions(mine)], T))

    t = threading.Thread(target=write)
    t.start()
    end = time.monotonic() + 5
    while b.stats()["pages_reserved"] == 0 and time.monotonic() < end:
        time.sleep(0.005)  # until the stalled call holds its reservation
    assert b.stats()["pages_reserved"] > 0, "the stalled put never reserved"
    assert b.put(["k"], [regions(theirs)], T) == [Status.OK]
    t.join(10)
    a.test_hooks().stall_puts(0)
    assert out == [[Status.OK]]
    assert present == ([0] if absent_only else [])
    assert np.array_equal(read(b, "k", n), theirs if absent_only else mine)
    assert a.stats()["pages_reserved"] == 0, "the dropped reservation's pages were not given back"


def test_a_key_on_the_disk_tier_counts_as_held(make_pool, tmp_path):
    be = make_pool(capacity=1 * MiB, page_size=4 * KiB, disk_path=str(tmp_path), disk_capacity=8 * MiB)
    n = 200 * KiB
    first = value(7, n)
    assert be.put(["spilled"], [regions(first)], T) == [Status.OK]
    for i in range(8):  # push it out of DRAM
        assert be.put([f"f{i}"], [regions(value(i, n))], T) == [Status.OK]
    assert be.stats()["disk_objects"] >= 1
    present: list[int] = []
    assert be.put_absent(["spilled"], [regions(value(8, n))], present, T) == [Status.OK]
    assert present == [0]
    assert np.array_equal(read(be, "spilled", n), first)


def test_statuses_of_keys_it_cannot_store_beside_held_ones(make_pool):
    be = make_pool(capacity=1 * MiB, page_size=4 * KiB)
    small = value(1, 4 * KiB)
    assert be.put(["held"], [regions(small)], T) == [Status.OK]
    huge = np.zeros(2 * MiB, np.uint8)  # larger than the pool: never storable
    present: list[int] = []
    out = be.put_absent(["new", "held", "huge"], [regions(small), regions(small), regions(huge)], present, T)
    assert out == [Status.OK, Status.OK, Status.INVALID] and present == [1]


def test_a_closed_pool_answers_unavailable_and_reports_nothing_held(make_pool):
    be = make_pool(capacity=1 * MiB, page_size=4 * KiB)
    small = value(1, 4 * KiB)
    assert be.put(["held"], [regions(small)], T) == [Status.OK]
    be.test_hooks().break_store()
    present: list[int] = []
    assert be.put_absent(["held", "new"], [regions(small)] * 2, present, T) == [Status.UNAVAILABLE] * 2
    assert present == []
