"""The creator's thread that makes 2 MiB pages of a pool as it fills
(ascendstore.local.hugefill, ``lazy_huge_pages``), on this host's own /dev/shm: which
pools get one, that it ends with its pool however that ends, and bytes under it.
The pages themselves, in a tmpfs mounted huge=never of the test's own, are checked in
test_local_thp.py (root)."""

from __future__ import annotations

import gc
import random
import threading
import uuid

import numpy as np
import pytest

from ascendstore.contract import BackendContext, Region, Status
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions
from ascendstore.local.pages import tmpfs_huge

GiB, MiB = 1 << 30, 1 << 20

#: the tests of real pools: where /dev/shm grants huge pages itself, no pool starts the thread
needs_huge_never = pytest.mark.skipif(
    tmpfs_huge("/dev/shm") != "never",
    reason="/dev/shm grants huge pages itself here (mounted huge=): no pool needs the thread",
)


def _open(**kw) -> LocalBackend:
    kw.setdefault("name", "hf-" + uuid.uuid4().hex[:8])
    return LocalBackend.create(LocalOptions(**kw), BackendContext())


def _filler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ascendstore-hugefill-") and t.is_alive()]


@needs_huge_never
def test_only_the_creator_of_a_large_pool_not_prefaulted_runs_the_thread():
    be = _open(capacity="1GiB")
    try:
        assert be.huge_page_filler is not None
        other = _open(name=be.options.name, capacity="1GiB")  # attaches: the creator's thread serves both
        try:
            assert other.huge_page_filler is None
        finally:
            other.close()
        for kw in ({"capacity": "512MiB"}, {"capacity": "1GiB", "lazy_huge_pages": False},
                   {"capacity": "1GiB", "prefault": True}):
            small = _open(**kw)
            try:
                assert small.huge_page_filler is None, kw
            finally:
                small.close()
    finally:
        be.close()


@needs_huge_never
@pytest.mark.parametrize("seed", range(6))
def test_objects_put_while_the_thread_works_read_back_exact_and_close_ends_it(seed):
    """Puts from two threads race the filler (random sizes and pauses); every
    object reads back exact; close() returns with the thread gone, at whatever point
    of its work it is (the first seeds close right after the puts, before it caught up)."""
    rng = random.Random(seed)
    before = set(_filler_threads())
    be = _open(capacity="1GiB")
    data: dict[str, np.ndarray] = {}
    lock = threading.Lock()

    def writer(w: int) -> None:
        r = np.random.default_rng(seed * 10 + w)
        for i in range(24):
            v = r.integers(0, 256, rng.choice([4096, 64 << 10, 1 << 20, 3 << 20]), dtype=np.uint8)
            k = f"{w}/{i}"
            assert be.put([k], [[Region(v.ctypes.data, v.size)]], 5.0) == [Status.OK]
            with lock:
                data[k] = v
            if rng.random() < 0.3:
                threading.Event().wait(rng.random() * 0.004)

    try:
        ts = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if seed >= 2:
            assert be.huge_page_filler.caught_up(60.0)
        for k, v in data.items():
            out = np.empty_like(v)
            assert be.get([k], [[Region(out.ctypes.data, out.size)]], 5.0) == [Status.OK], k
            assert np.array_equal(out, v), k
    finally:
        be.close()
    assert set(_filler_threads()) <= before


@needs_huge_never
def test_a_pool_that_is_dropped_unclosed_ends_its_thread():
    """The thread holds its pool weakly: a backend dropped without close() is freed as
    before, and the thread ends instead of keeping a 1 GiB mapping alive."""
    be = _open(capacity="1GiB")
    filler = be.huge_page_filler
    assert filler is not None
    del be
    gc.collect()
    assert filler.caught_up(10.0)
    assert not filler._thread.is_alive()


@needs_huge_never
def test_only_the_creator_s_handle_makes_pages():
    be = _open(capacity="1GiB")
    other = _open(name=be.options.name, capacity="1GiB")
    try:
        assert other._pool.collapse_step(4)[2] == -1  # an attached process's handle: not its work
        small = _open(capacity="64MiB", lazy_huge_pages=False)
        small.close()
        assert small._pool.collapse_step(4)[2] == 2  # a closed handle
    finally:
        other.close()
        be.close()


class _FakePool:
    """Stands in for the native handle: scripted collapse_step answers."""

    def __init__(self, answers: list) -> None:
        self.answers = answers
        self.calls = 0

    def collapse_step(self, n: int):  # type: ignore[no-untyped-def]
        self.calls += 1
        a = self.answers.pop(0) if self.answers else (0, self.last, 0)
        if isinstance(a, Exception):
            raise a
        self.last = a[1]
        return a


def test_a_kernel_that_refuses_is_said_once_and_the_thread_ends(caplog):
    from ascendstore.local.hugefill import HugePageFiller

    with caplog.at_level("INFO", logger="ascendstore.local.hugefill"):
        fake = _FakePool([(0, 0, -1)])
        f = HugePageFiller(fake, "refused")  # type: ignore[arg-type]
        assert f.caught_up(10.0)
        f.stop()
    assert fake.calls == 1 and f.made == 0
    (line,) = [r.getMessage() for r in caplog.records if "makes no 2 MiB pages" in r.getMessage()]
    assert "'refused'" in line and "4 KiB pages" in line


def test_a_failing_step_ends_the_thread_and_says_so(caplog):
    from ascendstore.local.hugefill import HugePageFiller

    with caplog.at_level("ERROR", logger="ascendstore.local.hugefill"):
        f = HugePageFiller(_FakePool([(2, 4 << 20, 0), OSError("boom")]), "boom")  # type: ignore[arg-type]
        assert f.caught_up(10.0)
        f.stop()
    assert f.made == 2
    assert any("goes on in 4 KiB pages" in r.getMessage() for r in caplog.records)


def test_stretches_the_kernel_could_not_make_do_not_stop_the_walk():
    """A step that moved the cursor without making a page (no free 2 MiB block) is
    followed at once by the next one, not by the idle wait: caught up means a step that
    found nothing left to do."""
    from ascendstore.local.hugefill import HugePageFiller

    answers = [(0, (k + 1) * 8 * (2 << 20), 0) for k in range(40)] + [(3, 41 * 8 * (2 << 20), 0)]
    fake = _FakePool(answers)
    f = HugePageFiller(fake, "eagain")  # type: ignore[arg-type]
    try:
        assert f.caught_up(60.0)
        assert not fake.answers and f.made == 3
        assert f.idle_waits <= 2, f.idle_waits  # the steps that found nothing to do, not one per step
    finally:
        f.stop()
