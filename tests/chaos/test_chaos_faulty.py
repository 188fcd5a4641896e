"""The ``faulty`` wrapper backend over the real ``local`` pool: every fault it
claims to inject is injected, and nothing else changes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from chaos_helpers import MiB, faulty_config, local_config, payload, pool_name, region

from ascendstore.chaos import FaultyBackend, FaultyOptions, live_backends
from ascendstore.contract import BackendContext, BackendSetupError, Status
from ascendstore.engine import BackendGuard
from ascendstore.errors import ConfigError
from ascendstore.registry import create_backend, installed_backends

OK, NOT_FOUND, NO_SPACE, TIMEOUT, UNAVAILABLE, CORRUPT = (
    Status.OK, Status.NOT_FOUND, Status.NO_SPACE, Status.TIMEOUT, Status.UNAVAILABLE, Status.CORRUPT,
)
T = 5.0
SLACK = 1.0  # thread hand-off on a loaded 2-core machine


@pytest.fixture
def make():
    opened: list[FaultyBackend] = []

    def _make(inner: dict | None = None, **faults) -> FaultyBackend:
        be = create_backend("faulty", faulty_config(inner or local_config(pool_name()), **faults), BackendContext())
        assert isinstance(be, FaultyBackend)
        opened.append(be)
        return be

    yield _make
    for be in opened:
        be.close()


def put_objects(be, n: int, size: int = 8192, seed: int = 0, prefix: str = "k") -> tuple[list[str], list[np.ndarray]]:
    keys = [f"{prefix}{i}" for i in range(n)]
    data = [payload(seed + i, size) for i in range(n)]
    assert be.put(keys, [[region(d)] for d in data], T) == [OK] * n
    return keys, data


def test_registered_and_transparent_without_faults(make):
    assert installed_backends()["faulty"] == "ascendstore.chaos.faulty:FaultyBackend"
    be = make()
    keys, data = put_objects(be, 4)
    assert be.exists(keys + ["absent"], T) == [OK] * 4 + [NOT_FOUND]
    out = [np.zeros_like(d) for d in data]
    assert be.get(keys, [[region(o)] for o in out], T) == [OK] * 4
    assert all(np.array_equal(a, b) for a, b in zip(out, data, strict=True))
    # Transparent but for one promise: it may be told to hang, so it never claims bounded calls.
    import dataclasses

    assert be.capabilities == dataclasses.replace(be.inner.capabilities, bounded_calls=False)
    assert be.remove(keys[:1], T) == [OK]
    assert be.stats()["injected"] == {}
    assert be in live_backends()


def test_delay_honours_the_timeout(make):
    be = make(delay_s={"get": 0.6})
    keys, data = put_objects(be, 1)
    out = np.zeros_like(data[0])
    t0 = time.monotonic()
    assert be.get(keys, [[region(out)]], 0.1) == [TIMEOUT]
    assert time.monotonic() - t0 < 0.1 + SLACK
    t0 = time.monotonic()
    assert be.get(keys, [[region(out)]], T) == [OK]  # slow but within the deadline
    assert 0.6 <= time.monotonic() - t0 < 0.6 + SLACK
    assert np.array_equal(out, data[0])


def test_hang_ignores_the_timeout_and_the_guard_cuts_it_off(make):
    be = make(hang_s={"exists": 0.8})
    put_objects(be, 1)
    t0 = time.monotonic()
    assert be.exists(["k0"], 0.05) == [OK]  # a contract breach: answered late
    assert time.monotonic() - t0 >= 0.8
    be.set_faults(hang_s={"exists": 3.0})
    guard = BackendGuard(be, timeout_s=0.1)
    try:
        t0 = time.monotonic()
        assert guard.exists(["k0"]) == [TIMEOUT]
        took = time.monotonic() - t0
        # the guard answered while the hung call was still running
        assert guard.stuck_calls == 1 and took < 3.0
        assert guard.metrics.totals()["timeouts"] == 1
    finally:
        guard.close()  # the late call then finds the client closed: UNAVAILABLE, no crash


def test_detaches_runs_a_save_threads_put_in_place_and_hands_the_rest_off(make):
    """``detaches`` plays the Mooncake client: a put of a thread that may block (the
    engine's save thread) hangs right there and answers late; the same put from
    any other thread (GR's, on vLLM's forward thread) is answered TIMEOUT at its
    deadline while it goes on (quiescent() False until it ends)."""
    from ascendstore.contract import blocking_caller

    be = make(detaches=True, hang_s={"put": 0.8})
    data = payload(3, 4096)
    with blocking_caller():
        t0 = time.monotonic()
        st = be.put(["p0"], [[region(data)]], 0.1)
        took = time.monotonic() - t0
    assert took >= 0.8 and st == [OK], (st, took)  # in place: late, with its own answer
    assert be.quiescent()
    t0 = time.monotonic()
    assert be.put(["p1"], [[region(data)]], 0.1) == [TIMEOUT]
    assert time.monotonic() - t0 < 0.1 + SLACK
    assert not be.quiescent() and be.injected["detached"] == 1
    deadline = time.monotonic() + 5
    while not be.quiescent():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_hung_get_that_scribbles_never_answers_ok(make):
    """late_garbage does the wrong thing (0xA5 over the regions once awake) but
    never claims it loaded: a hang that ends within the guard's grace reaches a
    caller still waiting, and an OK there would be corruption no engine sees."""
    from ascendstore.engine.guard import GRACE_S

    be = make(hang_s={"get": 0.1 + GRACE_S / 2}, late_garbage=True)
    keys, data = put_objects(be, 2)
    out = [np.zeros_like(d) for d in data]
    guard = BackendGuard(be, timeout_s=0.1)
    try:
        assert guard.get(keys, [[region(o)] for o in out]) == [TIMEOUT, TIMEOUT]
        assert guard.stuck_calls == 0  # answered within the grace: the guard was still waiting
        assert be.injected["late_garbage"] == 1
        assert all((o == 0xA5).all() for o in out), "the fault must still scribble"
        be.set_faults(hang_s={}, late_garbage=False)
        assert guard.get(keys, [[region(o)] for o in out]) == [OK, OK]  # not hung: no garbage
        assert all(np.array_equal(o, d) for o, d in zip(out, data, strict=True))
    finally:
        guard.close()


def test_failure_rate_is_seeded_and_per_key(make):
    inner = local_config(pool_name())

    def statuses(seed: int) -> list[Status]:
        be = make(inner, fail_rate={"exists": 0.3}, seed=seed)
        return be.exists([f"x{i}" for i in range(400)], T)

    a, b, c = statuses(1), statuses(1), statuses(2)
    assert a == b and a != c
    assert set(a) == {NOT_FOUND, UNAVAILABLE}
    assert 0.2 < a.count(UNAVAILABLE) / 400 < 0.4


def test_injected_failures_skip_the_store(make):
    be = make(fail_rate={"put": 1.0})
    data = payload(1, 4096)
    assert be.put(["p"], [[region(data)]], T) == [UNAVAILABLE]
    be.set_faults(fail_rate={})
    assert be.exists(["p"], T) == [NOT_FOUND]  # the failed put stored nothing
    assert be.stats()["injected"]["fail"] == 1


def test_exceptions_become_unavailable_through_the_guard(make):
    be = make(raise_rate={"get": 1.0})
    keys, data = put_objects(be, 2)
    guard = BackendGuard(be, timeout_s=1.0)
    try:
        assert guard.get(keys, [[region(np.zeros_like(d))] for d in data]) == [UNAVAILABLE] * 2
        assert guard.metrics.totals()["unavailable"] == 2
    finally:
        guard.close()


def test_planted_corruption_is_caught_by_checksums(make):
    be = make(local_config(pool_name(), checksum=True), corrupt_rate=1.0)
    keys, data = put_objects(be, 6)
    assert be.stats()["injected"]["corrupt"] == 6
    out = [np.zeros_like(d) for d in data]
    assert be.get(keys, [[region(o)] for o in out], T) == [CORRUPT] * 6


def test_without_checksums_the_store_serves_corrupt_bytes(make):
    """Why checksum must be on where corruption matters: the local pool without
    checksums cannot tell a damaged object from a good one."""
    be = make(local_config(pool_name(), checksum=False), corrupt_rate=1.0)
    keys, data = put_objects(be, 2)
    out = [np.zeros_like(d) for d in data]
    assert be.get(keys, [[region(o)] for o in out], T) == [OK] * 2
    assert not any(np.array_equal(a, b) for a, b in zip(out, data, strict=True))


def test_flip_rate_damages_bytes_after_a_good_read(make):
    be = make(flip_rate=1.0)
    keys, data = put_objects(be, 3)
    out = [np.zeros_like(d) for d in data]
    assert be.get(keys, [[region(o)] for o in out], T) == [OK] * 3
    assert [int((a != b).sum()) for a, b in zip(out, data, strict=True)] == [1, 1, 1]
    assert be.stats()["injected"]["flip"] == 3


def test_quota_models_a_full_store(make):
    be = make(quota_bytes=3 * 8192)
    data = [payload(i, 8192) for i in range(5)]
    got = be.put([f"q{i}" for i in range(5)], [[region(d)] for d in data], T)
    assert got == [OK, OK, OK, NO_SPACE, NO_SPACE]
    assert be.exists(["q3", "q4"], T) == [NOT_FOUND] * 2
    assert be.put(["q0"], [[region(data[0])]], T) == [OK]  # rewriting a key takes no more room
    assert be.remove(["q0"], T) == [OK]
    assert be.put(["q3"], [[region(data[3])]], T) == [OK]
    assert be.stats()["quota_used_bytes"] == 3 * 8192


def test_outage_switched_at_run_time_through_a_control_file(make, tmp_path):
    ctl = tmp_path / "faults.json"
    be = make(control_file=str(ctl))
    keys, _ = put_objects(be, 1)
    assert be.health(T).ok
    ctl.write_text(json.dumps({"down": True}))
    time.sleep(0.06)
    assert be.exists(keys, T) == [UNAVAILABLE]
    assert be.health(T).status is UNAVAILABLE
    ctl.write_text(json.dumps({"down": False, "delay_s": {"exists": 0.01}}))
    time.sleep(0.06)
    assert be.exists(keys, T) == [OK]
    assert be.options.delay_s == {"exists": 0.01}


def test_bad_fault_settings_are_clear_config_errors(make):
    with pytest.raises(ConfigError) as exc:
        create_backend("faulty", {"backend": "local", "delay_s": {"gte": 1}}, BackendContext())
    assert "delay_s" in str(exc.value) and "'get'" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        create_backend("faulty", {"backend": "local", "fail_rate": {"get": 2}}, BackendContext())
    assert "fail_rate" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        create_backend("faulty", {"backend": "local", "hang": {"get": 1}}, BackendContext())
    assert "Did you mean 'hang_s'" in str(exc.value)
    be = make()
    with pytest.raises(ConfigError):
        be.set_faults(backend="mooncake")
    with pytest.raises(ConfigError):
        be.set_faults(fail_status="FINE")


def test_corruption_needs_a_store_that_can_be_damaged(tmp_path, monkeypatch):
    # ``testdir`` (tests/testpool) is a backend without test hooks
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "testpool"))
    from ascendstore_testpool import DirPoolBackend, DirPoolOptions

    inner = DirPoolBackend(DirPoolOptions(root=str(tmp_path)), BackendContext())
    with pytest.raises(BackendSetupError) as exc:
        FaultyBackend(inner, FaultyOptions(backend="testdir", corrupt_rate=0.5), BackendContext())
    assert "corrupt(key)" in str(exc.value) and "flip_rate" in str(exc.value)


def test_closed_wrapper_answers_unavailable(make):
    be = make()
    be.close()
    assert be.exists(["a"], T) == [UNAVAILABLE]
    assert be not in live_backends()
    assert MiB  # (helpers import kept for the byte constants)
