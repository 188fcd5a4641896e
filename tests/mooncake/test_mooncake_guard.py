"""The bound around native calls (pure Python: no Mooncake needed)."""

from __future__ import annotations

import random
import threading
import time

import pytest
from ascendstore_mooncake.errors import status_of
from ascendstore_mooncake.guard import NativeGuard, Outcome

from ascendstore.contract import Status

pytestmark = pytest.mark.mooncake


def test_call_returns_result() -> None:
    g = NativeGuard(2)
    assert g.call(lambda: 7, 1.0) == (Outcome.DONE, 7)
    assert g.close(1.0)


def test_slow_call_times_out_and_its_late_result_goes_to_on_late() -> None:
    g = NativeGuard(1)
    late: list[str] = []
    got = threading.Event()

    def on_late(r: str) -> None:
        late.append(r)
        got.set()

    t0 = time.monotonic()
    assert g.call(lambda: time.sleep(0.5) or "done", 0.1, on_late) == (Outcome.TIMEOUT, None)
    assert time.monotonic() - t0 < 0.4
    assert got.wait(5) and late == ["done"]
    assert g.timeouts == 1 and g.late_completions == 1
    g.close(1.0)


def test_call_queued_past_its_deadline_never_runs() -> None:
    g = NativeGuard(1)
    ran: list[int] = []
    blocker = threading.Event()
    threading.Thread(target=lambda: g.call(blocker.wait, 5.0), daemon=True).start()
    time.sleep(0.05)
    assert g.call(lambda: ran.append(1), 0.1)[0] is Outcome.TIMEOUT
    blocker.set()
    time.sleep(0.2)
    assert ran == []
    g.close(1.0)


def test_no_call_after_close_and_close_waits_for_running_calls() -> None:
    g = NativeGuard(2)
    release = threading.Event()
    threading.Thread(target=lambda: g.call(release.wait, 5.0), daemon=True).start()
    time.sleep(0.05)
    assert g.close(0.1) is False  # a call is still running
    release.set()
    assert g.call(lambda: 1, 1.0) == (Outcome.CLOSED, None)


def test_an_exception_reaches_the_caller() -> None:
    g = NativeGuard(1)

    def boom() -> None:
        raise RuntimeError("native failure")

    with pytest.raises(RuntimeError, match="native failure"):
        g.call(boom, 1.0)
    assert g.call(lambda: 3, 1.0) == (Outcome.DONE, 3)  # the worker survived
    assert g.close(1.0)


def test_results_racing_the_deadline_go_to_exactly_one_side() -> None:
    # Calls finishing around their deadline: each result reaches the caller (DONE)
    # or on_late, never both and never neither (the hand-off's race window).
    g = NativeGuard(4)
    rng = random.Random(5)
    late: list[int] = []
    lock = threading.Lock()

    def on_late(r: int) -> None:
        with lock:
            late.append(r)

    done: list[int] = []
    timed_out: list[int] = []
    for i in range(300):
        delay = rng.uniform(0, 0.004)
        outcome, r = g.call(lambda i=i, d=delay: time.sleep(d) or i, 0.002, on_late)
        if outcome is Outcome.DONE:
            done.append(i)
        else:
            timed_out.append(i)
    assert g.close(5.0)
    time.sleep(0.05)
    assert not set(done) & set(late)
    queued_skips = len(timed_out) - len(late)  # timed out before they started: never ran
    assert queued_skips >= 0 and set(late) <= set(timed_out)
    assert g.late_completions == len(late)
    assert done and timed_out  # both sides of the race were exercised


@pytest.mark.parametrize(
    ("code", "status"),
    [(0, Status.OK), (4096, Status.OK), (-200, Status.NO_SPACE), (-600, Status.INVALID), (-704, Status.NOT_FOUND),
     (-706, Status.UNAVAILABLE), (-800, Status.UNAVAILABLE), (-900, Status.UNAVAILABLE), (-901, Status.TIMEOUT),
     (-705, Status.OK), (-1, Status.UNAVAILABLE), (-12345, Status.UNAVAILABLE)],
)
def test_error_code_mapping(code: int, status: Status) -> None:
    assert status_of(code) is status
