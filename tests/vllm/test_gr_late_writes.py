"""GR transfers whose backend call overran the guard's deadline and writes late.

A wedged client (``faulty`` with ``hang_s`` on get, over the real ``local``
pool) ignores the timeout: the guard answers TIMEOUT and the call goes on,
then writes into the regions it was lent. Those regions include host buffers
the GR user store owns (object headers, the scratch block, record buffers).
They used to be freed as soon as the TIMEOUT came back, so the late write hit
reused heap memory: the randomized two-engine interleaving test in GR mode then
crashed (segfault, "corrupted double-linked list") or spun forever in a
corrupted dict inside vLLM's scheduler (seeds 568873311, 942318890).

The store-level test is deterministic (weak references to the buffers show
whether they were freed under the running call). The engine-level test runs
the interleaving seeds that crashed in a child process with a time limit, so a
hang fails the test instead of blocking the run.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import uuid
import weakref
from pathlib import Path

import numpy as np
import pytest

import ascendstore.gr.store as store_mod
from ascendstore.config import GRConfig
from ascendstore.contract import Region, Status
from ascendstore.engine import BackendGuard
from ascendstore.gr import UserStore
from ascendstore.registry import create_backend

BS = 4
LAYERS = 2
BLOCK_BYTES = 64
HANG_S = 0.4
TIMEOUT_S = 0.05
ROOT = Path(__file__).resolve().parents[2]


class _TrackedNumpy:
    """``numpy`` as the store sees it: every buffer it makes is a view of memory
    the test keeps (so a late write never corrupts this process, fixed or not),
    and a weak reference to the view tells whether the store let it go."""

    def __init__(self) -> None:
        self.made: list[weakref.ref] = []
        self._arena: list[np.ndarray] = []

    def __getattr__(self, name: str):
        return getattr(np, name)

    def _track(self, arr: np.ndarray) -> np.ndarray:
        self._arena.append(arr)
        view = arr[...]
        self.made.append(weakref.ref(view))
        return view

    def zeros(self, *a, **kw):
        return self._track(np.zeros(*a, **kw))

    def empty(self, *a, **kw):
        return self._track(np.empty(*a, **kw))

    def alive(self) -> int:
        return sum(r() is not None for r in self.made)


@pytest.fixture
def hung_store():
    inner = {"backend": "local", "backend_config": {"name": "grlate-" + uuid.uuid4().hex[:8],
                                                     "capacity": "8MiB", "page_size": "4KiB"}}
    raw = create_backend("faulty", {**inner, "late_garbage": True})
    guard = BackendGuard(raw, TIMEOUT_S, name="grlate")
    store = UserStore(guard, model="m.1", world_size=1, worker_id=0, block_size=BS,
                      config=GRConfig(enabled=True), num_layers=LAYERS, timeout_s=TIMEOUT_S)
    tracked = _TrackedNumpy()  # outlives any hung call: it owns the memory lent to it
    yield store, raw, guard, tracked
    raw.set_faults(hang_s={})
    _wait(lambda: guard.stuck_calls == 0)  # a hung call ends before the pool goes
    guard.close()


def _wait(cond, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "the hung call never ended"
        time.sleep(0.02)


def _device(num_blocks: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (LAYERS, num_blocks, BLOCK_BYTES), dtype=np.uint8)


def _regions(kv: np.ndarray, blocks: list[int | None]) -> list[list[Region | None]]:
    return [[None if b is None else Region(kv[layer, b].ctypes.data, BLOCK_BYTES) for b in blocks]
            for layer in range(LAYERS)]


def test_overrun_load_keeps_its_host_buffers_until_the_call_ends(hung_store, monkeypatch):
    store, raw, guard, tracked = hung_store
    src, dst = _device(seed=1), _device(seed=2)
    hist = list(range(100, 100 + 5 * BS))
    assert store.save_kv("u1", hist, _regions(src, [1, 2, 3, 4, 5])) is Status.OK
    rec = store.lookup("u1", hist).records[0]
    assert rec is not None and rec.kv_blocks == 5

    monkeypatch.setattr(store_mod, "np", tracked)
    raw.set_faults(hang_s={"get": HANG_S})
    # two leading blocks already on the device: they are read into the scratch block
    st = store.load_kv("u1", rec.generation, rec.kv_blocks, _regions(dst, [None, None, 8, 9, 10]))
    assert st is Status.TIMEOUT
    assert guard.stuck_calls == 1, "the guard should have stopped waiting for the hung get"
    gc.collect()
    # the header and the scratch block the hung get still writes into must not be freed
    assert tracked.made, "the load made no host buffers (test out of date?)"
    assert tracked.alive() == len(tracked.made), "a host buffer was freed while the overrun get may write it"

    # the late write lands in the buffers kept alive, not in freed memory
    _wait(lambda: guard.stuck_calls == 0)
    assert raw.injected["late_garbage"] >= 1
    raw.set_faults(hang_s={})
    # the next call sees the hung one ended and lets its buffers go (no leak)
    assert store.load_kv("u1", rec.generation, rec.kv_blocks, _regions(dst, [11, 12, 13, 14, 15])) is Status.OK
    assert (dst[:, 11:16] == src[:, 1:6]).all()
    gc.collect()
    # only the store's reusable scratch block stays; the hung call's buffers went
    live = [r() for r in tracked.made if r() is not None and r() is not store._scratch]
    assert not live, "buffers of an ended call were kept"


def test_overrun_record_read_keeps_its_buffers(hung_store, monkeypatch):
    """The scheduler's record lookup lends fresh buffers to a get as well."""
    store, raw, _, tracked = hung_store
    src = _device(seed=3)
    hist = list(range(500, 500 + 3 * BS))
    assert store.save_kv("u2", hist, _regions(src, [1, 2, 3])) is Status.OK
    monkeypatch.setattr(store_mod, "np", tracked)
    raw.set_faults(hang_s={"get": HANG_S})
    assert store.read_records("u2", len(hist)) == [None]
    gc.collect()
    assert tracked.made and tracked.alive() == len(tracked.made)


def _user_objects(raw, uid: str) -> list[str]:
    return sorted(k for k in raw.inner.list_keys(f"{uid}@", limit=100))


def _late_put(store, raw, guard, uid: str, hist: list[int], src: np.ndarray) -> None:
    """A save whose KV put hangs past the deadline and then stores its object late."""
    raw.set_faults(hang_s={"put": HANG_S})
    assert store.save_kv(uid, hist, _regions(src, [1, 2, 3])) is Status.TIMEOUT
    assert guard.stuck_calls == 1
    raw.set_faults(hang_s={})  # the hung put goes on regardless


def test_object_a_timed_out_save_stores_late_is_reclaimed(hung_store):
    """The save reported TIMEOUT and wrote no record; its put lands afterwards. No
    record will ever describe that object: the store removes it once the call ends."""
    store, raw, guard, _ = hung_store
    hist = list(range(700, 700 + 3 * BS))
    _late_put(store, raw, guard, "u3", hist, _device(seed=4))
    assert store.reclaim_late_saves() == 0, "reclaimed while the put still ran"
    _wait(lambda: guard.stuck_calls == 0)
    kv_key, token_key = store.kv_keys("u3", 0)[0], store.token_key("u3", 0)
    assert _user_objects(raw, "u3") == [kv_key], "the late put should have stored its object (test out of date?)"
    assert store.reclaim_late_saves() == 1
    assert _user_objects(raw, "u3") == [], "an object no record describes was left in the pool"
    assert token_key not in _user_objects(raw, "u3")
    assert store.stats.late_saves_reclaimed == 1
    assert store.reclaim_late_saves() == 0 and not store._late_saves


def test_reclaim_leaves_a_newer_save_alone(hung_store):
    """Another engine saved the user after the late put landed: its objects are
    not the late save's (another generation) and stay; its KV loads byte-exact."""
    store, raw, guard, _ = hung_store
    hist = list(range(800, 800 + 3 * BS))
    _late_put(store, raw, guard, "u4", hist, _device(seed=5))
    _wait(lambda: guard.stuck_calls == 0)
    other = UserStore(create_backend("local", raw.options.backend_config), model="m.1", world_size=1,
                      worker_id=0, block_size=BS, config=GRConfig(enabled=True), num_layers=LAYERS)
    try:
        newer = _device(seed=6)
        assert other.save_kv("u4", hist, _regions(newer, [1, 2, 3])) is Status.OK
        assert store.reclaim_late_saves() == 0
        rec = other.lookup("u4", hist).records[0]
        assert rec is not None and len(_user_objects(raw, "u4")) == 2
        dst = _device(seed=7)
        assert other.load_kv("u4", rec.generation, 3, _regions(dst, [4, 5, 6])) is Status.OK
        assert (dst[:, 4:7] == newer[:, 1:4]).all()
    finally:
        other.backend.close()


def test_late_put_landing_over_a_newer_save_is_never_served(hung_store):
    """The late put lands *after* another engine's save and overwrites its KV with
    the old bytes: the reclaim removes that object, and the newer record is then
    never served (a miss, or a failed load that vLLM recomputes), never old KV."""
    store, raw, guard, _ = hung_store
    hist = list(range(900, 900 + 3 * BS))
    _late_put(store, raw, guard, "u5", hist, _device(seed=8))
    other = UserStore(create_backend("local", raw.options.backend_config), model="m.1", world_size=1,
                      worker_id=0, block_size=BS, config=GRConfig(enabled=True), num_layers=LAYERS)
    try:
        assert other.save_kv("u5", hist, _regions(_device(seed=9), [1, 2, 3])) is Status.OK
        _wait(lambda: guard.stuck_calls == 0)  # the old bytes land over the newer object
        assert store.reclaim_late_saves() == 1
        hit = other.lookup("u5", hist)
        if hit.hit_tokens:
            rec = hit.records[0]
            assert other.load_kv("u5", rec.generation, rec.kv_blocks,
                                 _regions(_device(seed=10), [4, 5, 6])) is not Status.OK
    finally:
        other.backend.close()


@pytest.mark.parametrize("seed", [568873311, 942318890])
def test_two_engine_interleaving_seeds_that_crashed(seed):
    """The interleaving seeds that crashed or hung the GR scheduler, in a child with a time limit."""
    env = {**os.environ, "ASCENDSTORE_INTERLEAVE_SEED": str(seed), "ASCENDSTORE_INTERLEAVE_ROUNDS": "3"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
           "tests/chaos/test_interleaving.py", "-k", "gr"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"seed {seed}: the GR interleaving hung (over 240 s)")
    assert proc.returncode == 0, f"seed {seed}: rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
