"""Failures against a real mooncake_master: no master, master SIGKILL and restart, other processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import backend_config
from mooncake_helpers import payload, region

from ascendstore.contract import BackendContext, BackendSetupError, Status, blocking_caller, watched_caller
from ascendstore.engine import BackendGuard, ChunkOp, TransferEngine
from ascendstore.loopback import free_port
from ascendstore.registry import create_backend

pytestmark = pytest.mark.mooncake

#: slack over a call's timeout for thread hand-off on a loaded 2-core machine
SLACK = 1.5
#: how long the client itself blocks a call with its master dead (reconnecting), measured 4.3-4.5 s
MASTER_DEAD_STALL_S = 4.5


def _no_master_config(**over) -> dict:
    return {
        "master_server_address": f"127.0.0.1:{free_port()}",
        "local_hostname": "127.0.0.1",
        "global_segment_size": 16 << 20,
        "local_buffer_size": 8 << 20,
        **over,
    }


def test_setup_without_master_fails_fast_and_clearly() -> None:
    # Mooncake alone would retry for ~90 s (20 tries) holding the GIL; we probe the address first.
    cfg = _no_master_config()
    t0 = time.monotonic()
    with pytest.raises(BackendSetupError) as exc:
        create_backend("mooncake", cfg, BackendContext(role="worker"))
    assert time.monotonic() - t0 < SLACK
    msg = str(exc.value)
    assert cfg["master_server_address"] in msg and "cannot reach mooncake_master" in msg
    assert "MOONCAKE_MASTER" in msg


def _stop(proc: subprocess.Popen) -> None:
    """SIGSTOP the master and wait until every one of its threads is stopped: the
    signal is delivered asynchronously, and on a loaded machine a call made at once
    can still be answered before the stop takes hold."""
    proc.send_signal(signal.SIGSTOP)
    tasks = Path(f"/proc/{proc.pid}/task")
    deadline = time.monotonic() + 10
    while True:
        states = []
        for t in tasks.iterdir():
            try:  # the state follows the parenthesised command name
                states.append((t / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue  # a thread that just ended
        if states and all(st in "Tt" for st in states):
            return
        assert time.monotonic() < deadline, f"master not stopped: thread states {states}"
        time.sleep(0.005)


def _timed(fn):
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def test_master_sigkill_then_restart(master_factory, open_backend) -> None:
    m = master_factory()
    t = 1.5
    b = open_backend(m)  # default exists cache on: it must not answer for lost keys
    before = [payload(100 + i, 256 << 10) for i in range(4)]
    keys = [f"restart/old/{i}" for i in range(4)]
    assert b.put(keys, [[region(a)] for a in before], t) == [Status.OK] * 4
    assert b.exists(keys, t) == [Status.OK] * 4

    m.kill()
    seen: set[Status] = set()
    dst = np.zeros(256 << 10, dtype=np.uint8)
    end = time.monotonic() + 3.0
    i = 0
    overran = 0
    while time.monotonic() < end:  # a run that keeps going while the master is dead
        for op, call in (
            ("put", lambda i=i: b.put([f"restart/during/{i}"], [[region(before[0])]], t)),
            ("get", lambda: b.get([keys[0]], [[region(dst)]], t)),
            ("exists", lambda: b.exists(keys, t)),
        ):
            statuses, took = _timed(call)
            if op == "put" and took >= t + SLACK:
                # A put runs on its caller's thread while the store looked healthy and
                # returns when the client does: ~4.5 s against a dead master, once.
                overran += 1
                assert overran == 1 and took < MASTER_DEAD_STALL_S + SLACK, (overran, took)
            else:
                assert took < t + SLACK, f"{op} took {took:.2f} s with timeout {t} s"
            assert set(statuses) <= {Status.UNAVAILABLE, Status.TIMEOUT}, statuses
            seen |= set(statuses)
        i += 1
    assert seen  # the calls did fail
    assert b.stats()["inline_overruns"] == overran
    health, took = _timed(lambda: b.health(t))
    assert health.status is Status.UNAVAILABLE and took < t + SLACK
    assert health.detail["mooncake_health"] == "master unreachable"

    m.start()
    deadline = time.monotonic() + 30
    while not b.health(t).ok:
        assert time.monotonic() < deadline, "backend did not recover within 30 s of the master restart"
        time.sleep(0.2)
    # the new master knows nothing: every old key reads as a miss
    assert b.exists(keys, t) == [Status.NOT_FOUND] * 4
    assert b.get([keys[1]], [[region(dst)]], t) == [Status.NOT_FOUND]
    # and the pool works again (the client re-mounted its segment)
    fresh = payload(200, 256 << 10)
    deadline = time.monotonic() + 15
    while (st := b.put(["restart/new"], [[region(fresh)]], t)) != [Status.OK]:
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
    assert b.get(["restart/new"], [[region(dst)]], t) == [Status.OK]
    assert np.array_equal(dst, fresh)
    assert b.stats()["timeouts"] >= 0


def _save_put(b, keys, regions, timeout_s):
    with blocking_caller():  # as the engine's save thread puts
        return b.put(keys, regions, timeout_s)


def test_a_stopped_master_stalls_an_inline_put_once_never_a_get(master_factory, open_backend, monkeypatch) -> None:
    # A master that is alive but does not answer (SIGSTOP: a hung host, a partition)
    # blocks the client's calls until its RPC timeout (30 s by default; 2 s here).
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "2000")  # read when the client is made
    m = master_factory()
    b = open_backend(m, exists_cache_ttl_s=0)
    b._guard.inline_cooldown_s = 3.0  # 30 s by default
    data = payload(500, 64 << 10)
    dst = np.zeros_like(data)
    assert _save_put(b, ["stop/a"], [[region(data)]], 1.0) == [Status.OK]
    assert b.stats()["inline_calls"] == 1  # healthy: the put ran on this thread
    t = 0.3
    _stop(m.proc)
    try:
        st, took = _timed(lambda: b.get(["stop/a"], [[region(dst)]], t))
        assert st == [Status.TIMEOUT] and took < t + SLACK  # a get keeps its deadline
        deadline = time.monotonic() + 10
        while b.stats()["inflight_calls"]:  # the stalled get ends on the client's own timeout
            assert time.monotonic() < deadline
            time.sleep(0.05)
        st, took = _timed(lambda: _save_put(b, ["stop/b"], [[region(data)]], t))
        # The inline put returned when the client did: its own answer, late.
        assert st[0] in (Status.TIMEOUT, Status.UNAVAILABLE) and 1.5 < took < 2.0 + SLACK, (st, took)
        assert b.stats()["inline_overruns"] == 1
        st, took = _timed(lambda: _save_put(b, ["stop/c"], [[region(data)]], t))
        # Cooling down: a worker and its deadline (or UNAVAILABLE at once: by now the
        # client may itself report the master down).
        assert st[0] in (Status.TIMEOUT, Status.UNAVAILABLE) and took < t + SLACK, (st, took)
    finally:
        m.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 15
    while (st := _save_put(b, ["stop/d"], [[region(data)]], 1.0)) != [Status.OK]:
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
    time.sleep(3.0)  # the cool-down ends
    calls = b.stats()["inline_calls"]
    assert _save_put(b, ["stop/e"], [[region(data)]], 1.0) == [Status.OK]
    assert b.stats()["inline_calls"] == calls + 1  # inline again
    assert b.get(["stop/e"], [[region(dst)]], 1.0) == [Status.OK] and np.array_equal(dst, data)


def test_a_put_off_the_save_thread_keeps_its_deadline(master_factory, open_backend, monkeypatch) -> None:
    """GR saves on vLLM's forward thread and writes its token records from the
    scheduler: with the master stalled, a put there returns at its deadline, not
    when the client gives up (30 s by default; 2 s here)."""
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "2000")
    m = master_factory()
    b = open_backend(m, exists_cache_ttl_s=0)
    data = payload(501, 64 << 10)
    assert b.put(["off/a"], [[region(data)]], 1.0) == [Status.OK]
    assert b.stats()["inline_calls"] == 0  # healthy, but not the save thread: handed off
    t = 0.3
    _stop(m.proc)
    try:
        st, took = _timed(lambda: b.put(["off/b"], [[region(data)]], t))
        assert st == [Status.TIMEOUT] and took < t + SLACK, (st, took)
        assert b.stats()["inline_overruns"] == 0
    finally:
        m.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 10
    while not b.quiescent():  # the late put ends on the client's own timeout
        assert time.monotonic() < deadline, b.stats()
        time.sleep(0.05)


def test_a_late_put_removes_nothing_another_engine_stored(open_backend) -> None:
    """A put its caller stopped waiting for still completes. The master turns away
    the put of a key it holds and the client answers that with success, so a late
    put's answers cannot tell "stored" from "another engine had it first": removing
    what they call stored would remove the other engine's object. Nothing is
    removed; the caller keeps the memory until the call has ended (``quiescent()``,
    the contract), so what the late put did store holds the caller's bytes."""
    ours = open_backend(inline_puts=False)  # on a worker: given up at its deadline
    theirs = open_backend(exists_cache_ttl_s=0)
    size = 64 << 10
    shared, fresh = "late/shared", "late/fresh"
    their_bytes, our_bytes = payload(71, size), payload(72, 2 * size)
    assert theirs.put([shared], [[region(their_bytes)]], 2.0) == [Status.OK]
    ours.test_hooks().delay(0.5)
    try:
        st = ours.put([shared, fresh], [[region(our_bytes, 0, size)], [region(our_bytes, size, size)]], 0.1)
        assert st == [Status.TIMEOUT] * 2
        deadline = time.monotonic() + 10
        while ours.stats()["late_completions"] < 1 or not ours.quiescent():
            assert time.monotonic() < deadline, ours.stats()
            time.sleep(0.02)
    finally:
        ours.test_hooks().delay(0)
    time.sleep(0.3)  # room for any clean-up the late answer set off
    assert ours.quiescent()
    dst = np.zeros(2 * size, np.uint8)
    got = theirs.get([shared, fresh], [[region(dst, 0, size)], [region(dst, size, size)]], 2.0)
    assert got[0] is Status.OK, f"the object another engine stored was removed after our late put: {got[0]!r}"
    assert np.array_equal(dst[:size], their_bytes), "the late put overwrote another engine's object"
    assert got[1] is Status.OK and np.array_equal(dst[size:], our_bytes[size:]), (
        f"the late put's own object should be in the pool, whole: {got[1]!r}")


def _stalling_load_setup(master_factory, open_backend, monkeypatch, seed: int, prefix: str, **engine_kw):
    """A backend whose next calls stall once the master is stopped, 8 x 64 KiB
    objects stored, and an engine loading them into host "KV" (``kv``)."""
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "3000")  # the stall: 10x the load's deadline
    m = master_factory()
    b = open_backend(m, exists_cache_ttl_s=0)
    b._guard.inline_cooldown_s = 1.0
    obj, n, timeout = 64 << 10, 8, 0.3
    data = payload(seed, n * obj)
    kv = np.zeros_like(data)  # stands in for vLLM's host KV blocks
    keys = [f"{prefix}/{i}" for i in range(n)]
    assert b.put(keys, [[region(data, i * obj, obj)] for i in range(n)], 2.0) == [Status.OK] * n
    guard = BackendGuard(b, timeout)
    eng = TransferEngine(guard, **engine_kw)
    chunk_ops = [ChunkOp(k, [region(kv, i * obj, obj)], [i]) for i, k in enumerate(keys)]
    return m, b, guard, eng, chunk_ops, data, kv, n, timeout


def test_a_stopped_master_stalls_the_load_thread_and_the_watchdog_gives_the_load_up(
    master_factory, open_backend, monkeypatch
) -> None:
    """Async loads run their gets on the engine's load thread (no hand-off). With the
    master stopped the client blocks that thread; the engine's watchdog fails the
    load at its deadline while the native call still runs, a new load thread takes
    the next load (which goes to a worker: an inline call is overdue), and once the
    master is back loads are exact again. vLLM's memory never sees a late byte."""
    m, b, guard, eng, chunk_ops, data, kv, n, timeout = _stalling_load_setup(
        master_factory, open_backend, monkeypatch, 610, "watch")
    assert eng._watch is not None, "a detaching backend's loads must be watched"

    def load(req: str) -> set[int]:
        eng.submit_load(req, chunk_ops, deadline=time.monotonic() + timeout)
        assert eng.wait("load", [req], 30.0)
        return eng.take_results().loaded[req]

    try:
        calls = b.stats()["inline_calls"]
        assert load("r0") == set() and np.array_equal(kv, data)
        assert b.stats()["inline_calls"] == calls + 1, "a healthy async load's get runs on the load thread"
        kv[:] = 0
        _stop(m.proc)
        try:
            assert load("r1") == set(range(n))
            assert b.stats()["inflight_calls"] >= 1, "answered only once the native call ended: nothing was given up"
            assert guard.metrics.totals()["loads_abandoned"] == 1
            calls = b.stats()["inline_calls"]
            assert load("r2") == set(range(n))  # the new load thread; the store is not healthy
            assert guard.metrics.totals()["loads_abandoned"] == 1, "the next get must keep its deadline on a worker"
        finally:
            m.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 15
        while b.stats()["inflight_calls"]:  # the stalled calls end on the client's own timeout
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not kv.any(), "a late get wrote into the blocks its load was given up for"
        eng._reap()
        assert not eng._retired, "the retired landing buffer was not given back once its call ended"
        deadline = time.monotonic() + 15
        while (failed := load("r3")) != set():
            assert time.monotonic() < deadline, failed
            time.sleep(0.2)
        assert np.array_equal(kv, data)
    finally:
        eng.shutdown(timeout_s=2)
        guard.close()


def test_direct_async_loads_over_a_stopped_master_stay_unreported_until_the_native_gets_end(
    master_factory, open_backend, monkeypatch
) -> None:
    """``direct_async_loads``: an async load's get writes the KV blocks themselves.
    With the master stopped, the load thread's get stalls in the client; the
    watchdog fails the load at its deadline but keeps it unreported (vLLM would
    keep the blocks) until the native call has ended; the next load, on a worker
    (the store is not healthy), is held the same way once its call is detached.
    Reported, no native call is running; once the master is back loads are exact
    and never touch the landing buffer."""
    m, b, guard, eng, chunk_ops, data, kv, n, timeout = _stalling_load_setup(
        master_factory, open_backend, monkeypatch, 630, "direct", direct_async_loads=True)
    reported: dict[str, set[int]] = {}

    def submit(req: str) -> None:
        eng.submit_load(req, chunk_ops, deadline=time.monotonic() + timeout, holds_blocks=True)

    def collect(req: str, within_s: float) -> set[int]:
        deadline = time.monotonic() + within_s
        while req not in reported:
            assert time.monotonic() < deadline, f"{req} never reported"
            reported.update(eng.take_results().loaded)
            if req in reported:
                assert b.stats()["inflight_calls"] == 0, f"{req} reported while a native call still ran"
            time.sleep(0.01)
        return reported.pop(req)

    try:
        submit("r0")
        assert collect("r0", 10) == set() and np.array_equal(kv, data)
        kv[:] = 0
        _stop(m.proc)
        try:
            submit("r1")
            time.sleep(3 * timeout)  # past its deadline, the watchdog's grace and tick
            m_ = guard.metrics.totals()
            assert m_["loads_abandoned"] == 1 and m_["load_held_late"] == 1, m_
            assert "r1" not in eng.take_results().loaded and eng.pending("load", "r1"), \
                "reported while its native get still runs"
            submit("r2")  # a new load thread; the store is not healthy: a worker, detached at the deadline
            time.sleep(3 * timeout)
            assert b.stats()["inflight_calls"] >= 1
            assert "r2" not in eng.take_results().loaded and eng.pending("load", "r2")
        finally:
            m.proc.send_signal(signal.SIGCONT)
        assert collect("r1", 15) == set(range(n)) and collect("r2", 15) == set(range(n))
        assert guard.metrics.totals()["load_held_late"] == 2
        deadline = time.monotonic() + 15
        while True:
            kv[:] = 0
            submit("r3")
            if collect("r3", 15) == set():
                break
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert np.array_equal(kv, data)
        assert eng.landing is not None and eng.landing.region() is None, "an async load used the landing buffer"
    finally:
        eng.shutdown(timeout_s=2)
        guard.close()


def test_only_watched_gets_run_on_the_callers_thread_and_inline_gets_false_turns_them_off(open_backend) -> None:
    data = payload(620, 64 << 10)
    dst = np.zeros_like(data)
    for inline_gets in (True, False):
        b = open_backend(inline_gets=inline_gets)
        assert b.put(["watched/a"], [[region(data)]], 2.0) == [Status.OK]
        calls = b.stats()["inline_calls"]
        assert b.get(["watched/a"], [[region(dst)]], 2.0) == [Status.OK]
        assert b.stats()["inline_calls"] == calls, "an unwatched get (vLLM's forward thread) must keep the hand-off"
        with watched_caller():
            assert b.get(["watched/a"], [[region(dst)]], 2.0) == [Status.OK]
        assert b.stats()["inline_calls"] == calls + inline_gets
        assert np.array_equal(dst, data)
        b.remove(["watched/a"], 2.0)


CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[2])
    import numpy as np
    from ascendstore.contract import BackendContext, Status
    from ascendstore.registry import create_backend
    from mooncake_helpers import payload, region

    cfg = {"master_server_address": sys.argv[1], "local_hostname": "127.0.0.1",
           "global_segment_size": 32 << 20, "local_buffer_size": 8 << 20}
    b = create_backend("mooncake", cfg, BackendContext(role="worker", rank=1))
    data = [payload(300 + i, 100_000 + i) for i in range(8)]
    keys = [f"xproc/child/{i}" for i in range(8)]
    # each object gathered from two regions
    st = b.put(keys, [[region(d, 0, 4096), region(d, 4096)] for d in data], 5)
    assert st == [Status.OK] * 8, st
    print("READY", flush=True)
    sys.stdin.readline()  # the parent has read ours and written its own
    want = payload(400, 1 << 20)
    got = np.zeros_like(want)
    assert b.get(["xproc/parent"], [[region(got)]], 5) == [Status.OK]
    assert np.array_equal(got, want)
    print("CHILD-OK", flush=True)
    b.close()
    """
)


def test_what_one_process_puts_another_reads_byte_exact(master, open_backend, tmp_path: Path) -> None:
    helpers = str(Path(__file__).parent)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, master.address, helpers],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "child.log", "wb"),
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline()
        assert line.strip() == "READY", (tmp_path / "child.log").read_text()[-2000:]
        b = open_backend(**{k: v for k, v in backend_config(master).items() if k != "master_server_address"})
        for i in range(8):
            want = payload(300 + i, 100_000 + i)
            got = np.zeros_like(want)
            assert b.get([f"xproc/child/{i}"], [[region(got)]], 5) == [Status.OK]
            assert np.array_equal(got, want)
        mine = payload(400, 1 << 20)
        assert b.put(["xproc/parent"], [[region(mine)]], 5) == [Status.OK]
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "CHILD-OK", (tmp_path / "child.log").read_text()[-2000:]
        assert child.wait(30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_native_setup_failure_raises_clearly_and_never_crashes(master) -> None:
    """Mooncake itself refuses the set-up (a segment below its 16 MiB minimum, slipped past
    our validation on purpose); the client must never be touched again, even by the GC."""
    import gc

    from ascendstore_mooncake.backend import MooncakeBackend
    from ascendstore_mooncake.options import MooncakeOptions

    opts = MooncakeOptions.model_construct(
        **{**MooncakeOptions().model_dump(), "master_server_address": master.address,
           "local_hostname": "127.0.0.1", "global_segment_size": 8 << 20, "local_buffer_size": 8 << 20}
    )
    with pytest.raises(BackendSetupError) as exc:
        MooncakeBackend(opts, BackendContext(role="worker"))
    msg = str(exc.value)
    assert "returned -600" in msg and master.address in msg and "never called again" in msg
    gc.collect()  # the failed native client is kept alive, so its destructor cannot run
    # the process is fine and other clients still work
    b = create_backend("mooncake", backend_config(master), BackendContext(role="worker"))
    try:
        assert b.health(5).ok
    finally:
        b.close()
