"""Opening a pool while another process creates it.

A creator holds an OFD lock on its segment's byte 0 until the pool is ready, so a process
that opens the pool meanwhile can tell a creator at work (wait while the segment's blocks
grow, however long creating a large prefaulted pool takes), a stuck one (fail after
``open_timeout_s`` without progress) and a dead one (replace its segment at once).

The first three tests use a stand-in creator, a child process that makes the segment file
the way the pool's creator does and then behaves as told; the last uses real creators.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import numpy as np
import pytest

from ascendstore.contract import BackendContext, BackendSetupError, Region, Status
from ascendstore.local import _shmpool
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions

KiB, MiB = 1 << 10, 1 << 20

# The stand-in: creates the segment with O_EXCL, takes the init lock, sizes the file (header
# zeroed, so not ready), signals the parent by printing, then per mode:
#   progress N  - allocates one more 4 KiB page every 0.1 s for N steps, then exits unready
#   stall       - allocates nothing and sleeps until killed
#   die         - exits at once (the lock goes with it)
STAND_IN = textwrap.dedent(
    """
    import fcntl, os, struct, sys, time
    path, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhxxxxqqixxxx", fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))
    os.ftruncate(fd, 4 << 20)
    print("sized", flush=True)
    if mode == "progress":
        for i in range(steps):
            time.sleep(0.1)
            os.pwrite(fd, b"x", (16 + i) * 4096)
    elif mode == "stall":
        time.sleep(600)
    """
)


def segment(name: str) -> str:
    return f"/dev/shm/ascendstore-pool.{name}"


def start_stand_in(name: str, mode: str, steps: int = 0) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", STAND_IN, segment(name), mode, str(steps)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "sized"
    return child


def open_pool(name: str, timeout_s: float, **kw) -> LocalBackend:
    opts = LocalOptions(name=name, capacity=kw.pop("capacity", 4 * MiB), open_timeout_s=timeout_s, **kw)
    return LocalBackend.create(opts, BackendContext())


def usable(be: LocalBackend, key: str = "k") -> bool:
    v = np.arange(4096, dtype=np.uint8)
    if be.put([key], [[Region(v.ctypes.data, v.nbytes)]], 5.0) != [Status.OK]:
        return False
    out = np.zeros_like(v)
    return be.get([key], [[Region(out.ctypes.data, out.nbytes)]], 5.0) == [Status.OK] and bool((out == v).all())


@pytest.fixture
def name():
    n = f"open-{uuid.uuid4().hex[:10]}"
    yield n
    _shmpool.unlink(n)
    if os.path.exists(segment(n)):
        os.unlink(segment(n))


def test_a_creator_that_shows_progress_is_waited_for_past_open_timeout(name):
    # 3 s of progress, a page every 0.1 s, against a 1 s bound: the opener waits it out,
    # and once the stand-in exits without making the pool ready, replaces its segment
    creator = start_stand_in(name, "progress", steps=30)
    try:
        be = open_pool(name, timeout_s=1.0)
        # it waited for the creator: before the init lock it gave up after 1 s
        assert creator.poll() is not None
        assert usable(be)
        be.close()
    finally:
        creator.kill()
        creator.wait()


def test_a_creator_without_progress_fails_the_opener_after_open_timeout(name):
    creator = start_stand_in(name, "stall")
    try:
        with pytest.raises(BackendSetupError, match=r"being initialised by another process that has shown no progress for 0\.3 s"):
            open_pool(name, timeout_s=0.3)
        assert creator.poll() is None  # it judged a live creator stuck, not dead
    finally:
        creator.kill()
        creator.wait()
    # the stuck creator is gone now: its segment is replaced
    be = open_pool(name, timeout_s=0.3)
    assert usable(be)
    be.close()


def test_a_dead_creators_segment_is_replaced_without_waiting(name):
    start_stand_in(name, "die").wait()
    dead_ino = os.stat(segment(name)).st_ino
    t0 = time.monotonic()
    be = open_pool(name, timeout_s=120.0)
    # the lock tells at once that nobody is initialising: no waiting out the 120 s bound
    assert time.monotonic() - t0 < 60
    assert os.stat(segment(name)).st_ino != dead_ino
    assert usable(be)
    be.close()


def test_a_segment_that_never_got_a_size_still_fails_after_open_timeout(name):
    # a creator that died between creating the file and sizing it leaves nothing to lock by
    os.close(os.open(segment(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    with pytest.raises(BackendSetupError, match="exists but was never sized"):
        open_pool(name, timeout_s=0.2)


CREATOR = textwrap.dedent(
    """
    import sys, numpy as np
    from ascendstore.contract import BackendContext, Region
    from ascendstore.local.backend import LocalBackend
    from ascendstore.local.options import LocalOptions
    be = LocalBackend.create(LocalOptions(name=sys.argv[1], capacity=int(sys.argv[2]), prefault=True,
                                          unlink_on_last_close=False), BackendContext())
    v = np.full(4096, 7, dtype=np.uint8)
    assert be.put(["from-creator"], [[Region(v.ctypes.data, v.nbytes)]], 5.0)[0].name == "OK"
    print("ready", flush=True)
    sys.stdin.readline()
    be.close()
    """
)


@pytest.mark.parametrize("round_", range(4))
def test_openers_racing_a_real_prefaulting_creator_all_join_its_pool(name, round_):
    # Openers start as soon as the segment has a size, while the creator prefaults 256 MiB.
    # Were the creator's lock missing, they would take it for dead and replace its segment:
    # the creator would then be alone in a pool nobody else sees.
    capacity = 256 * MiB
    creator = subprocess.Popen(
        [sys.executable, "-c", CREATOR, name, str(capacity)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (os.path.exists(segment(name)) and os.stat(segment(name)).st_size > 0):
            assert time.monotonic() < deadline and creator.poll() is None
            time.sleep(0.0005)
        opened: list[LocalBackend] = []
        errors: list[BaseException] = []

        rng = random.Random(round_)
        delays = [rng.uniform(0, 0.2) for _ in range(3)]  # into the prefault, or after it

        def attach(delay: float) -> None:
            time.sleep(delay)
            try:
                opened.append(open_pool(name, timeout_s=10.0, capacity=capacity, prefault=True,
                                        unlink_on_last_close=False))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=attach, args=(d,)) for d in delays]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert creator.stdout.readline().strip() == "ready"
        out = np.zeros(4096, dtype=np.uint8)
        for be in opened:
            assert be.get(["from-creator"], [[Region(out.ctypes.data, out.nbytes)]], 5.0) == [Status.OK]
            assert (out == 7).all()
            be.close()
    finally:
        creator.communicate("\n", timeout=60)
