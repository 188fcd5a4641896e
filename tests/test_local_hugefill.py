"""The thread that makes 2 MiB pages of a pool as it fills (ascendstore.local.hugefill,
``lazy_huge_pages``), on this host's own /dev/shm: which pools get one, that one process
at a time does the work and another takes over when it is gone, that it ends with its
pool however that ends, and bytes under it. The pages of a pool whose creator and an
attached process fill it, in a tmpfs mounted huge=never of the test's own, are checked
in test_local_thp.py (root)."""

from __future__ import annotations

import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
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
def test_every_handle_of_a_large_pool_not_prefaulted_runs_the_thread_and_one_does_the_work():
    be = _open(capacity="1GiB")
    try:
        mine = be.huge_page_filler
        assert mine is not None and mine.caught_up(30.0) and mine.filling and be._pool.filling
        other = _open(name=be.options.name, capacity="1GiB")  # attaches: a handle and slot of its own
        try:
            theirs = other.huge_page_filler
            assert theirs is not None and theirs.caught_up(30.0)
            assert theirs.state == 3 and not theirs.filling and theirs.made == 0  # the creator's thread works
            assert theirs._thread.is_alive()  # and it looks again later
        finally:
            other.close()
        assert mine.filling and mine._thread.is_alive()
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
def test_one_handle_at_a_time_makes_pages_and_the_role_passes_on_when_it_lets_go_or_closes():
    """The native steps without threads (lazy_huge_pages off): the first handle to step
    takes the role; another's step answers 3 (another fills) until the first gives it up
    (collapse_release) or closes."""
    a = _open(capacity="1GiB", lazy_huge_pages=False)
    b = _open(name=a.options.name, capacity="1GiB", lazy_huge_pages=False)
    c = None
    try:
        assert not a._pool.filling and not b._pool.filling  # nobody asked yet
        assert a._pool.collapse_step(4)[2] == 0 and a._pool.filling
        assert b._pool.collapse_step(4) == (0, 0, 3) and not b._pool.filling
        a._pool.collapse_release()
        assert not a._pool.filling
        assert b._pool.collapse_step(4)[2] == 0 and b._pool.filling
        assert a._pool.collapse_step(4)[2] == 3
        c = _open(name=a.options.name, capacity="1GiB", lazy_huge_pages=False)
        b.close()  # closing gives the role up too
        assert not b._pool.filling and b._pool.collapse_step(4)[2] == 2  # a closed handle
        assert c._pool.collapse_step(4)[2] == 0 and c._pool.filling  # c asked first
        assert a._pool.collapse_step(4)[2] == 3
    finally:
        for be in (a, b, c):
            if be is not None:
                be.close()


@needs_huge_never
def test_a_handle_that_stops_stepping_has_the_role_taken_after_stale_s():
    """A live holder that has not stepped for the asker's stale_s loses the role to it;
    its own next step answers 3. Before that, the asker is told another fills."""
    a = _open(capacity="1GiB", lazy_huge_pages=False)
    b = _open(name=a.options.name, capacity="1GiB", lazy_huge_pages=False)
    try:
        assert a._pool.collapse_step(4)[2] == 0 and a._pool.filling
        time.sleep(0.3)
        assert b._pool.collapse_step(4, 30.0)[2] == 3  # 0.3 s without a step: not stale at 30 s
        assert a._pool.collapse_step(4)[2] == 0 and a._pool.filling  # (a steps: its beat is fresh)
        time.sleep(0.3)
        assert b._pool.collapse_step(4, 0.1)[2] == 0 and b._pool.filling  # stale at 0.1 s: taken
        assert a._pool.collapse_step(4)[2] == 3 and not a._pool.filling  # it finds it gone
        assert b._pool.collapse_step(4)[2] == 0 and b._pool.filling
        with pytest.raises(ValueError, match="stale_s"):
            b._pool.collapse_step(4, 0.0)
    finally:
        a.close()
        b.close()


@needs_huge_never
def test_a_forked_child_does_not_inherit_the_role():
    """A child forked from the process at work has its handle but not its role: the role
    belongs to the parent's slot. Once the child has a slot of its own (its first call),
    its step answers that another process fills."""
    a = _open(capacity="1GiB", lazy_huge_pages=False)
    try:
        assert a._pool.collapse_step(4)[2] == 0 and a._pool.filling
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = 2 if a._pool.filling else 3
                v = np.ones(4096, dtype=np.uint8)
                if code == 3 and a.put(["child"], [[Region(v.ctypes.data, v.size)]], 5.0) == [Status.OK]:
                    code = 0 if a._pool.collapse_step(4)[2] == 3 and not a._pool.filling else 4
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # 2: it held the role; 4: it took up the work too
        assert a._pool.filling and a._pool.collapse_step(4)[2] == 0
    finally:
        a.close()


#: a process that creates a 1 GiB pool (its thread doing the work), puts objects,
#: says so, and waits to be killed
_CREATOR = textwrap.dedent("""
    import sys, time
    import numpy as np
    from ascendstore.contract import BackendContext, Region, Status
    from ascendstore.local.backend import LocalBackend
    from ascendstore.local.options import LocalOptions

    be = LocalBackend.create(LocalOptions(name=sys.argv[1], capacity="1GiB"), BackendContext())
    for i in range(16):
        v = np.random.default_rng(i).integers(0, 256, 1 << 20, dtype=np.uint8)
        assert be.put([f"c/{i}"], [[Region(v.ctypes.data, v.size)]], 5.0) == [Status.OK]
    filler = be.huge_page_filler
    assert filler.caught_up(60.0) and filler.filling
    print("ready", flush=True)
    for line in sys.stdin:  # each line asks whether its thread still does the work
        print(filler.filling, filler.state, flush=True)
    time.sleep(600)
""")


@needs_huge_never
def test_a_process_that_attached_takes_over_when_the_one_at_work_is_killed():
    """Engines sharing a pool outlive the one that created it. The creator's thread does
    the work while it lives; once it is killed (SIGKILL: nothing let go of the role), the
    attached process's thread takes over, and what it puts then lands in 2 MiB pages.
    Everything both put reads back exact."""
    from ascendstore.local.pages import collapse_works

    name = "hf-" + uuid.uuid4().hex[:8]
    child = subprocess.Popen([sys.executable, "-c", _CREATOR, name], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, text=True)
    be = None
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        be = _open(name=name, capacity="1GiB")
        filler = be.huge_page_filler
        assert filler is not None and filler.caught_up(30.0)
        assert filler.state == 3 and not filler.filling  # the creator is at it
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
        deadline = time.monotonic() + 30.0
        while not filler.filling and time.monotonic() < deadline:
            filler.caught_up(5.0)
        assert filler.filling, filler.state  # the attached process took over
        def mib(seed: int) -> np.ndarray:  # (as the creator made its objects)
            return np.random.default_rng(seed).integers(0, 256, 1 << 20, dtype=np.uint8)

        mine = {f"a/{i}": mib(100 + i) for i in range(48)}
        for k, v in mine.items():
            assert be.put([k], [[Region(v.ctypes.data, v.size)]], 5.0) == [Status.OK]
        assert filler.caught_up(60.0)
        for k, v in {**mine, **{f"c/{i}": mib(i) for i in range(16)}}.items():
            out = np.empty_like(v)
            assert be.get([k], [[Region(out.ctypes.data, out.size)]], 5.0) == [Status.OK], k
            assert np.array_equal(out, v), k
        if collapse_works():
            # its 48 MiB beyond the creator's 16: made 2 MiB pages by this process's thread
            assert filler.made >= 48 // 2, filler.made
            assert be.dram_pages().huge_bytes >= 48 << 20, be.dram_pages()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(30)
        if be is not None:
            be.close()


@needs_huge_never
def test_a_process_stopped_while_at_work_has_the_role_taken_and_finds_it_gone_when_it_runs_again(monkeypatch):
    """A process stopped (SIGSTOP: a paused container) while its thread does the work is
    alive, so it would hold the role forever: once it has not stepped for _STALE_S, the
    attached process's thread takes the role over. When the stopped one runs again its
    thread finds the role gone and does not take it back from a holder at work."""
    from ascendstore.local import hugefill

    # (this process's thread judges staleness; the holder steps at least every 0.5 s)
    monkeypatch.setattr(hugefill, "_STALE_S", 2.0)
    monkeypatch.setattr(hugefill, "_OTHER_S", 0.2)
    name = "hf-" + uuid.uuid4().hex[:8]
    child = subprocess.Popen([sys.executable, "-c", _CREATOR, name], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None

    def child_fills() -> str:
        child.stdin.write("?\n")
        child.stdin.flush()
        return child.stdout.readline().strip()

    be = None
    try:
        assert child.stdout.readline().strip() == "ready"
        be = _open(name=name, capacity="1GiB")
        filler = be.huge_page_filler
        assert filler is not None and filler.caught_up(30.0)
        time.sleep(3.0)  # beyond _STALE_S: a holder stepping as it should keeps the role
        assert filler.caught_up(30.0) and filler.state == 3 and not filler.filling
        assert child_fills() == "True 0"
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30.0
        while not filler.filling and time.monotonic() < deadline:
            filler.caught_up(5.0)
        assert filler.filling, filler.state  # taken from the stopped process
        os.kill(child.pid, signal.SIGCONT)
        deadline, answer = time.monotonic() + 30.0, ""
        while answer != "False 3" and time.monotonic() < deadline:
            time.sleep(0.2)
            answer = child_fills()
        assert answer == "False 3"  # it runs again, and another process does the work
        time.sleep(1.0)
        assert filler.filling and child_fills() == "False 3"
        v = np.random.default_rng(7).integers(0, 256, 4 << 20, dtype=np.uint8)
        assert be.put(["mine"], [[Region(v.ctypes.data, v.size)]], 5.0) == [Status.OK]
        out = np.empty_like(v)
        assert be.get(["mine"], [[Region(out.ctypes.data, out.size)]], 5.0) == [Status.OK]
        assert np.array_equal(out, v)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
            child.wait(30)
        if be is not None:
            be.close()


class _FakePool:
    """Stands in for the native handle: scripted collapse_step answers."""

    def __init__(self, answers: list) -> None:
        self.answers = answers
        self.calls = 0
        self.filling = False
        self.releases = 0

    def collapse_step(self, n: int, stale_s: float):  # type: ignore[no-untyped-def]
        self.calls += 1
        a = self.answers.pop(0) if self.answers else (0, self.last, 0)
        if isinstance(a, Exception):
            raise a
        self.last = a[1]
        self.filling = a[2] != 3
        return a

    def collapse_release(self) -> None:
        self.releases += 1
        self.filling = False


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


def test_while_another_process_does_the_work_the_thread_looks_again_and_takes_over():
    """State 3 (another live process fills) neither ends the thread nor counts as work:
    it looks again later (here woken by caught_up) and takes over when the other is gone.
    When it ends, it gives the role up, so that a third process can take it."""
    from ascendstore.local.hugefill import HugePageFiller

    fake = _FakePool([(0, 0, 3), (0, 0, 3), (2, 4 << 20, 0)])
    f = HugePageFiller(fake, "other")  # type: ignore[arg-type]
    try:
        for _ in range(3):
            assert f.caught_up(10.0)
            assert f._thread.is_alive()
        deadline = time.monotonic() + 10.0
        while fake.answers and time.monotonic() < deadline:
            f.caught_up(1.0)
        assert f.caught_up(10.0)
        assert f.made == 2 and f.filling and fake.releases == 0
    finally:
        f.stop()
    assert fake.releases == 1 and not f.filling


def test_a_thread_that_never_took_the_role_gives_nothing_up():
    from ascendstore.local.hugefill import HugePageFiller

    fake = _FakePool([(0, 0, 3)])
    fake.answers += [(0, 0, 3)] * 1000
    f = HugePageFiller(fake, "never")  # type: ignore[arg-type]
    assert f.caught_up(10.0)
    f.stop()
    assert fake.releases == 0 and f.made == 0
