"""The local pool shared by processes in different PID namespaces, as two
containers sharing /dev/shm (``--ipc=host``) are: liveness is judged by the
slot locks, never by pids, so a live writer in another namespace is never
reclaimed, a SIGKILLed one is, no object is ever a mix of two writers, and
the segment stays while any namespace still uses it.

Every other process runs ``tests/local_ns_child.py`` under
``unshare --pid --fork`` (its own PID namespace, where it is pid 1 and the
test's pids mean nothing)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from ascendstore.contract import BackendContext, Region, Status
from ascendstore.local import _shmpool
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions

KiB, MiB = 1 << 10, 1 << 20
HELPER = str(Path(__file__).with_name("local_ns_child.py"))
sys.path.insert(0, str(Path(__file__).parent))
from local_ns_child import make_value, value_ok  # noqa: E402


def _unshare_works() -> str:
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    r = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"unshare --pid --fork fails here (needs root or user namespaces): {r.stderr.strip()}"
    return ""


_WHY = _unshare_works()
pytestmark = pytest.mark.skipif(bool(_WHY), reason=_WHY or "unshare works")


class Child:
    """tests/local_ns_child.py in its own PID namespace (or in ours)."""

    def __init__(self, cfg: dict, namespace: bool = True) -> None:
        cmd = [sys.executable, HELPER, json.dumps(cfg)]
        if namespace:
            cmd = ["unshare", "--pid", "--fork", "--kill-child", *cmd]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.namespace = namespace
        assert self.read().get("ready"), "child did not open the pool"

    def read(self, timeout: float = 60.0) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"child exited early (rc={self.proc.poll()})"
        return json.loads(line)

    @property
    def python_pid(self) -> int:
        """pid (in our namespace) of the python process doing the work."""
        if not self.namespace:
            return self.proc.pid
        kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        assert len(kids) == 1, kids
        return int(kids[0])

    def kill(self) -> None:
        os.kill(self.python_pid, signal.SIGKILL)
        self.proc.wait(30)

    def finish(self) -> dict:
        self.proc.stdin.close()
        out = self.read()
        assert self.proc.wait(60) == 0
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def opts():
    o = {"name": f"ns-{uuid.uuid4().hex[:10]}", "page_size": 64 * KiB, "checksum": False}
    children: list[Child] = []
    yield o, children
    for c in children:
        c.stop()
    _shmpool.unlink(o["name"])


def open_pool(o: dict) -> LocalBackend:
    return LocalBackend.create(LocalOptions(**o), BackendContext())


def wait_for(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.mark.parametrize("stalled_in", ["other-namespace", "this-namespace"])
def test_a_stalled_writer_is_never_reclaimed_while_alive_and_is_once_killed(opts, stalled_in):
    o, children = opts
    o["capacity"] = 1 * MiB
    be = open_pool(o)
    try:
        hooks = be.test_hooks()
        # the writer reserves 3/4 of the pool and stalls between reserve and publish
        stall = Child({"role": "stall", "opts": o, "key": "stalled", "size": 768 * KiB, "secs": 120},
                      namespace=stalled_in == "other-namespace")
        children.append(stall)
        wait_for(lambda: hooks.holder() != 0)
        # a process of another namespace needs those pages: it must not take them
        reader = Child({"role": "put_stats", "opts": o, "size": 512 * KiB},
                       namespace=stalled_in == "this-namespace")
        children.append(reader)
        r = reader.read()
        assert r["status"] == "NO_SPACE", r
        assert r["stats"]["dead_reservations_reclaimed"] == 0
        assert r["stats"]["processes"] == 3  # this test, the writer, the reader: each sees all three
        assert r["stats"]["pages_reserved"] == 12
        assert reader.proc.wait(30) == 0  # the reader closed (detached) and exited
        assert be.stats()["dead_reservations_reclaimed"] == 0
        # the same from this process
        v = make_value("here", 512 * KiB, 1, 1)
        assert be.put(["here"], [[Region(v.ctypes.data, len(v))]], 5.0) == [Status.NO_SPACE]
        # once the writer is SIGKILLed its reservation is reclaimed
        stall.kill()
        assert be.put(["here"], [[Region(v.ctypes.data, len(v))]], 5.0) == [Status.OK]
        s = be.stats()
        assert s["dead_reservations_reclaimed"] == 1 and s["pages_reserved"] == 0 and s["processes"] == 1
        assert hooks.check() == ""
    finally:
        be.destroy()


@pytest.mark.parametrize("then", ["finishes", "is-killed"])
@pytest.mark.parametrize("stalled_in", ["other-namespace", "this-namespace"])
def test_a_stalled_put_never_shares_its_pages_with_another_namespace(opts, stalled_in, then):
    """The issue's reproduction: writer W reserves 3/4 of the pool, stalls, then
    copies its bytes in; R, in another PID namespace, puts x meanwhile. With pid
    liveness R judged W dead and took its pages for x; W's late copy then
    overwrote x, which R read back as OK (checksums off)."""
    o, children = opts
    o["capacity"] = 1 * MiB
    be = open_pool(o)
    try:
        hooks = be.test_hooks()
        # R is started (and has the pool open) first: its put comes within the writer's stall
        r = Child({"role": "hold", "opts": o, "keys": ["x"], "size": 512 * KiB, "wait": True},
                  namespace=stalled_in == "this-namespace")
        children.append(r)
        w = Child({"role": "put", "opts": o, "key": "late", "size": 768 * KiB, "secs": 3.0},
                  namespace=stalled_in == "other-namespace")
        children.append(w)
        wait_for(lambda: hooks.holder() != 0)  # reserved, not yet copied in
        r.proc.stdin.write("go\n")
        r.proc.stdin.flush()
        x_put = r.read()["put"]
        if then == "finishes":
            w_put = w.read()["status"]
            assert w.proc.wait(30) == 0
        else:
            w.kill()
        x_read = r.finish()
        assert x_read["get"] != ["OK"] or x_read["intact"] == [True], "x was overwritten by the late writer"
        assert x_put == ["NO_SPACE"]  # W's pages stayed W's while it lived
        if then == "finishes":
            assert w_put == "OK"  # not UNAVAILABLE: W was never taken for dead
        s = be.stats()
        assert s["dead_reservations_reclaimed"] == (1 if then == "is-killed" else 0)
        if then == "finishes":  # W's object was published whole
            out = np.zeros(768 * KiB, np.uint8)
            assert be.get(["late"], [[Region(out.ctypes.data, len(out))]], 5.0) == [Status.OK]
            assert value_ok("late", out)
        else:  # the killed writer's pages came back
            x = make_value("x", 512 * KiB, 1, 1)
            assert be.put(["x"], [[Region(x.ctypes.data, len(x))]], 5.0) == [Status.OK]
        assert s["pages_reserved"] == 0 and hooks.check() == ""
    finally:
        be.destroy()


def test_writers_and_readers_in_many_namespaces_never_mix_objects(opts):
    """Three writers, two in their own PID namespaces, put 600 KiB values that
    stall at random between reserve and copy, into a pool that holds two of
    them, and read back; a fourth process (own namespace) only reads. With pid liveness the others reclaim a stalled
    writer's pages, it then copies into another object's pages: mixed objects
    served as OK (checksums are off). With lock liveness: none."""
    o, children = opts
    o["capacity"] = 1536 * KiB  # 24 pages: two stalled reservations leave no room for a third put
    be = open_pool(o)
    try:
        seconds = float(os.environ.get("ASCENDSTORE_NS_STRESS_S", "4"))
        for w, ns, put_ratio in ((1, True, 0.5), (2, True, 0.5), (3, False, 0.5), (4, True, 0.0)):
            children.append(
                Child(
                    {"role": "stress", "opts": o, "writer": w, "seconds": seconds, "size": 600 * KiB,
                     "n_keys": 4, "stall": [0.02, 0.2], "put_ratio": put_ratio, "wait": True},
                    namespace=ns,
                )
            )
        for c in children:  # all open: start together
            c.proc.stdin.write("go\n")
            c.proc.stdin.flush()
        results = [c.read(timeout=seconds + 60) for c in children]
        for c in children:
            assert c.proc.wait(60) == 0
        total = {k: sum(r["counts"].get(k, 0) for r in results) for r in results for k in r["counts"]}
        assert total["torn"] == 0 and total["get_other"] == 0, str(total)
        # a put is OK or, while the others' stalled reservations fill the pool, NO_SPACE; never
        # UNAVAILABLE (what a writer wrongly judged dead gets when it publishes)
        assert total["put_other"] == total.get("put_NO_SPACE", 0), str(total)
        assert total["get_ok"] > 10 and total["put_ok"] > 10, total
        s = be.stats()
        assert s["dead_reservations_reclaimed"] == 0, s
        assert s["no_space"] > 0, s  # the pool really ran out while writers were stalled
        assert s["pages_reserved"] == 0 and s["processes"] == 1
        assert be.test_hooks().check() == ""
        # what is left is intact
        for k in be.list_keys("stress/"):
            out = np.zeros(600 * KiB, np.uint8)
            if be.get([k], [[Region(out.ctypes.data, len(out))]], 5.0) == [Status.OK]:
                assert value_ok(k, out), k
    finally:
        be.destroy()


def test_the_segment_survives_while_another_namespace_still_uses_it(opts):
    o, children = opts
    o["capacity"] = 4 * MiB
    path = Path("/dev/shm/ascendstore-pool." + o["name"])
    lock = Path("/dev/shm/ascendstore-lock." + o["name"])
    be = open_pool(o)
    mine = make_value("mine", 100 * KiB, 1, 1)
    assert be.put(["mine"], [[Region(mine.ctypes.data, len(mine))]], 5.0) == [Status.OK]
    keys = [f"theirs/{i}" for i in range(3)]
    user = Child({"role": "hold", "opts": o, "keys": keys, "size": 64 * KiB})
    children.append(user)
    assert user.read()["put"] == ["OK"] * 3
    be.close()  # this namespace's last user leaves; the other namespace still uses the pool
    assert path.exists() and lock.exists()
    again = open_pool(o)  # and the pool is the same one, contents and all
    out = np.zeros(len(mine), np.uint8)
    assert again.get(["mine"], [[Region(out.ctypes.data, len(out))]], 5.0) == [Status.OK]
    assert value_ok("mine", out)
    assert again.exists(keys, 5.0) == [Status.OK] * 3
    assert again.stats()["processes"] == 2
    again.close()
    assert path.exists()
    r = user.finish()  # the other namespace reads its objects back, then closes: last user
    assert r == {"get": ["OK"] * 3, "intact": [True] * 3}
    assert not path.exists() and not lock.exists()


def _stall_with_a_forked_bystander(o: dict, pid_file: str) -> None:
    be = open_pool(o)
    pid = os.fork()
    if pid == 0:  # never touches the pool, outlives its parent
        time.sleep(120)
        os._exit(0)
    Path(pid_file).write_text(str(pid))
    be.test_hooks().stall_put("stalled", 768 * KiB, 120)


def test_a_forked_child_that_never_uses_the_pool_does_not_keep_its_parent_alive(opts, tmp_path):
    """A fork shares the parent's open lock file, so it would hold the parent's
    slot lock for as long as it lives: the fork handler closes it in the child."""
    import multiprocessing as mp

    o, _children = opts
    o["capacity"] = 1 * MiB
    be = open_pool(o)
    bystander = 0
    try:
        hooks = be.test_hooks()
        pid_file = tmp_path / "bystander"
        p = mp.get_context("spawn").Process(target=_stall_with_a_forked_bystander, args=(o, str(pid_file)))
        p.start()
        wait_for(lambda: hooks.holder() != 0 and pid_file.exists() and pid_file.read_text() != "")
        bystander = int(pid_file.read_text())
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert os.path.exists(f"/proc/{bystander}")  # the fork is still alive...
        v = make_value("k", 512 * KiB, 1, 1)
        assert be.put(["k"], [[Region(v.ctypes.data, len(v))]], 5.0) == [Status.OK]  # ...its parent is dead
        s = be.stats()
        assert s["dead_reservations_reclaimed"] == 1 and s["processes"] == 1
    finally:
        if bystander:
            os.kill(bystander, signal.SIGKILL)
        be.destroy()


def test_the_lock_file_cannot_be_another_pools_segment(opts):
    """Pool names may contain dots: the lock file's name is outside the pools' names."""
    o, _children = opts
    o["capacity"] = 1 * MiB
    other = dict(o, name=o["name"] + ".lock")
    a, b = open_pool(o), open_pool(other)
    try:
        v = make_value("k", 64 * KiB, 1, 1)
        assert b.put(["k"], [[Region(v.ctypes.data, len(v))]], 5.0) == [Status.OK]
        a.close()  # the last user of pool a removes its segment and lock file, nothing of pool b
        assert Path("/dev/shm/ascendstore-pool." + other["name"]).exists()
        out = np.zeros(len(v), np.uint8)
        assert b.get(["k"], [[Region(out.ctypes.data, len(out))]], 5.0) == [Status.OK]
        assert value_ok("k", out)
    finally:
        b.destroy()
        _shmpool.unlink(other["name"])
