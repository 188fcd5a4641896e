"""Pins between lookup and load (``pin``/``unpin``): a pinned object is never
evicted or spilled, a put that finds only pinned victims reports NO_SPACE,
leases end by themselves, and a dead process's pins are released."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import uuid

import numpy as np
import pytest

from ascendstore.contract import BackendContext, Region, Status
from ascendstore.local import _shmpool
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions

KiB, MiB = 1 << 10, 1 << 20
T = 5.0
OK, NOT_FOUND, NO_SPACE = Status.OK, Status.NOT_FOUND, Status.NO_SPACE
OBJ = 256 * KiB  # four fit in the 1 MiB pools below


@pytest.fixture
def make_pool(tmp_path):
    made = []

    def make(**kw) -> LocalBackend:
        kw.setdefault("name", f"pin-{uuid.uuid4().hex[:10]}")
        kw.setdefault("capacity", 1 * MiB)
        kw.setdefault("page_size", 64 * KiB)
        if kw.pop("disk", False):
            kw.update(disk_path=str(tmp_path / "disk"))
        be = LocalBackend.create(LocalOptions(**kw), BackendContext())
        made.append(be)
        return be

    yield make
    for be in made:
        be.destroy()
        _shmpool.unlink(be.options.name)


def put(be: LocalBackend, key: str, fill: int = 1) -> Status:
    b = np.full(OBJ, fill, np.uint8)
    return be.put([key], [[Region(b.ctypes.data, OBJ)]], T)[0]


def read(be: LocalBackend, key: str) -> np.ndarray | None:
    b = np.zeros(OBJ, np.uint8)
    return b if be.get([key], [[Region(b.ctypes.data, OBJ)]], T) == [OK] else None


def test_capability_lookup_results_and_bad_leases(make_pool):
    be = make_pool()
    assert be.capabilities.pins
    assert put(be, "a") is OK
    assert be.pin(["a", "absent"], 5.0, T) == [OK, NOT_FOUND]
    assert be.unpin(["a", "absent"], T) == [OK, NOT_FOUND]
    for bad in (0.0, -1.0, float("nan"), 7200.0):
        with pytest.raises(ValueError, match="lease_s"):
            be.pin(["a"], bad, T)


def test_a_pinned_object_is_never_evicted(make_pool):
    be = make_pool()
    for i in range(4):
        assert put(be, f"k/{i}", i + 1) is OK
    assert be.pin(["k/0", "k/1"], 60.0, T) == [OK, OK]  # the two least recently used
    for i in range(4, 12):  # eight more puts: each evicts the LRU object not pinned
        assert put(be, f"k/{i}", i + 1) is OK
    assert be.exists([f"k/{i}" for i in range(12)], T) == [OK, OK] + [NOT_FOUND] * 8 + [OK, OK]
    assert (read(be, "k/0") == 1).all() and (read(be, "k/1") == 2).all()
    assert be.stats()["pinned_skips"] > 0
    # a put that finds only pinned victims: NO_SPACE, nothing evicted
    assert be.pin(["k/10", "k/11"], 60.0, T) == [OK, OK]
    assert put(be, "k/12") is NO_SPACE
    assert be.exists(["k/0", "k/1", "k/10", "k/11"], T) == [OK] * 4
    # an explicit remove still removes; unpin makes the rest evictable again
    assert be.remove(["k/11"], T) == [OK]
    assert put(be, "k/12") is OK
    assert be.unpin(["k/0"], T) == [OK]
    assert put(be, "k/13") is OK
    assert be.exists(["k/0", "k/1"], T) == [NOT_FOUND, OK]
    assert be.test_hooks().check() == ""


def test_a_new_value_of_a_pinned_key_stays_pinned(make_pool):
    be = make_pool()
    for i in range(4):
        assert put(be, f"k/{i}") is OK
    assert be.pin(["k/0"], 60.0, T) == [OK]
    assert put(be, "k/0", fill=7) is OK  # replaced (takes the LRU k/1's pages)
    for i in range(4, 10):
        assert put(be, f"k/{i}") is OK
    assert (read(be, "k/0") == 7).all()


def test_an_expired_lease_is_evictable(make_pool):
    be = make_pool()
    for i in range(4):
        assert put(be, f"k/{i}") is OK
    assert be.pin(["k/0", "k/1", "k/2", "k/3"], 0.3, T) == [OK] * 4
    assert put(be, "new") is NO_SPACE
    time.sleep(0.4)
    assert put(be, "new") is OK
    assert be.exists(["k/0"], T) == [NOT_FOUND]  # the LRU one went


def _pin_and_wait(opts: dict, keys: list[str], lease: float, q) -> None:
    be = LocalBackend.create(LocalOptions(**opts), BackendContext())
    q.put(be.pin(keys, lease, T))
    time.sleep(600)


def _spawn_pinner(be: LocalBackend, keys: list[str], lease: float) -> mp.Process:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_pin_and_wait, args=(be.options.model_dump(), keys, lease, q), daemon=True)
    p.start()
    assert q.get(timeout=60) == [OK] * len(keys)
    return p


def test_a_dead_process_pins_nothing(make_pool):
    be = make_pool()
    for i in range(4):
        assert put(be, f"k/{i}") is OK
    p = _spawn_pinner(be, [f"k/{i}" for i in range(4)], 600.0)
    try:
        assert put(be, "new") is NO_SPACE  # pinned by a live process
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    assert put(be, "new") is OK  # its pins went with it, long before the lease ends
    assert be.test_hooks().check() == ""


def test_a_pin_shared_with_a_dead_process_lasts_its_lease(make_pool):
    """Two processes pinned one key: the pin no longer names one owner, so it
    ends only with the longer of the leases (unpin by one does not end it)."""
    be = make_pool()
    for i in range(4):
        assert put(be, f"k/{i}") is OK
    p = _spawn_pinner(be, ["k/0"], 1.5)
    t0 = time.monotonic()
    assert be.pin(["k/0"], 1.0, T) == [OK]  # pinned by two processes: shared
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    assert be.unpin(["k/0"], T) == [OK]
    for i in range(4, 8):
        assert put(be, f"k/{i}") is OK
    if time.monotonic() - t0 < 1.4:  # (on a very slow machine the lease may be over already)
        assert be.exists(["k/0"], T) == [OK]  # the shared pin holds until its lease ends...
    time.sleep(max(0.0, 1.6 - (time.monotonic() - t0)))
    for i in range(8, 12):
        assert put(be, f"k/{i}") is OK
    assert be.exists(["k/0"], T) == [NOT_FOUND]  # ...and no longer


def test_pins_hold_across_the_disk_tier(make_pool):
    # DRAM: four objects; disk: 1 MiB in 256 KiB segments (one object each)
    be = make_pool(disk=True, disk_capacity=1 * MiB, disk_segment_size=256 * KiB)
    for i in range(4):
        assert put(be, f"k/{i}", i + 1) is OK
    assert be.pin(["k/0"], 60.0, T) == [OK]
    assert put(be, "k/4", 5) is OK  # spills k/1, not the pinned LRU object k/0
    cur, _, _ = be.removed_since(-1)
    assert be.stats()["disk_objects"] == 1
    assert be.exists(["k/0"], T) == [OK]
    # pin the object on disk, then push enough through the disk tier to drop its segment
    assert be.pin(["k/1"], 60.0, T) == [OK]
    for i in range(5, 14):
        assert put(be, f"k/{i}", i + 1) is OK
    _, events, _ = be.removed_since(cur)
    assert ("k/1", "disk") not in {(e.key, e.tier) for e in events}
    assert not any(e.key == "k/0" for e in events)
    assert be.exists(["k/0", "k/1"], T) == [OK, OK]
    assert (read(be, "k/1") == 2).all()  # read back from disk (and promoted)
    assert be.test_hooks().check() == ""
