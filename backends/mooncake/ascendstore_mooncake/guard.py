"""Bounded calls into the native Mooncake client.

The Mooncake client has no per-call timeout: with the master gone a call blocks
~4.5 s, with the master stopped (alive, not answering) 30 s, reading from or
writing to a stopped peer's segment 60 s; a set-up takes 4.4 s per retry and a
close ~5 s (docs/benchmarking.md has the measurements). Calls therefore run on a few
threads and the caller waits at most its deadline. A call the caller gave up on
may still finish later (``quiescent()`` in the backend says when none is left);
its answer is dropped and counted (``late_completions``).
After ``close`` no native call starts again (Mooncake crashes when used after
close or after a failed set-up).

Handing a call to a thread costs the caller a sleep and a wake-up (~40 us of
wall time per 32 x 64 KiB batch on a 2-core VM, a fifth of the call). A
caller that may block for as long as the client does can ask for ``inline``:
the call then runs on its own thread and this guard never abandons it. The
backend asks for it for puts of the engine's save thread, which nothing waits
on (``caller_may_block()``), and for gets on a thread the engine watches (its
load thread: the engine's watchdog gives up on an overrun get itself). Inline calls stop for
``inline_cooldown_s`` after one that overran its deadline anyway, while any
call is still on a worker, and while another inline call is past its deadline
(a slow or stuck native call: the store is not healthy); those go to the
workers as usual.

The client's set-up runs on a thread of its own (``call_alone``), never on a
worker: the thread that set the client up runs its later native calls slower.
"""

from __future__ import annotations

import _thread
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class Outcome(enum.Enum):
    DONE = "done"
    TIMEOUT = "timeout"  # still running (or queued) when the deadline passed
    CLOSED = "closed"  # the guard is closed: nothing was called


_SKIPPED = object()
_STOP = object()


class _Call:
    """One native call handed to a worker thread. The caller waits on ``done``
    (a raw lock it holds until the worker releases it): a hand-off through C-level
    primitives only (SimpleQueue, lock), ~half the cost of an executor's Future."""

    __slots__ = ("fn", "deadline", "done", "result", "error", "abandoned")

    def __init__(self, fn: Callable[[], Any], deadline: float) -> None:
        self.fn = fn
        self.deadline = deadline
        self.result: Any = _SKIPPED
        self.error: BaseException | None = None
        self.abandoned = False  # the caller stopped waiting at the deadline
        self.done = _thread.allocate_lock()
        self.done.acquire()


class NativeGuard:
    def __init__(
        self,
        workers: int,
        name: str = "mooncake",
        *,
        allow_inline: bool = True,
        inline_cooldown_s: float = 30.0,
    ) -> None:
        self._max_workers = max(1, workers)
        self._name = name
        #: calls made with ``inline=True`` may run on the caller's thread
        self.allow_inline = allow_inline
        self.inline_cooldown_s = inline_cooldown_s
        self._inline_off_until = 0.0
        #: inline calls running now: thread ident -> deadline
        self._inline_running: dict[int, float] = {}
        self.inline_calls = 0
        self.inline_overruns = 0
        self._queue: queue.SimpleQueue[_Call | object] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle_workers = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self._closed = False
        self.timeouts = 0
        self.late_completions = 0

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def inflight(self) -> int:
        return self._inflight

    def _enter(self, deadline: float) -> bool:
        with self._lock:
            if self._closed or time.monotonic() > deadline:
                return False
            self._inflight += 1
            return True

    def _leave(self) -> None:
        with self._lock:
            self._inflight -= 1
            self._idle.notify_all()

    def _submit(self, c: _Call) -> bool:
        with self._lock:
            if self._closed:
                return False
            # A worker per queued call while there is room (stuck calls keep theirs).
            if self._idle_workers == 0 and len(self._threads) < self._max_workers:
                t = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True)
                self._threads.append(t)
                self._idle_workers += 1
                t.start()
            self._idle_workers -= 1
        self._queue.put(c)
        return True

    def _work(self) -> None:
        q = self._queue
        while True:
            c = q.get()
            if c is _STOP:
                return
            assert isinstance(c, _Call)
            ran = self._enter(c.deadline)
            if ran:
                try:
                    c.result = c.fn()
                except BaseException as exc:  # handed to the caller (raised there) or dropped
                    c.error = exc
            # One lock round: the call is counted before quiescent() can say it ended.
            with self._lock:
                if ran:
                    self._inflight -= 1
                    self._idle.notify_all()
                self._idle_workers += 1
                if not c.abandoned:
                    c.done.release()
                elif ran and c.error is None:
                    self.late_completions += 1  # ran to its end after the caller gave up

    def _inline_ok(self, now: float) -> bool:
        if not self.allow_inline or now < self._inline_off_until:
            return False
        # No call of ours still on a worker: one there is slow, stuck, or a clean-up.
        # Read without the lock: a stale view only sends one call down the other path.
        if self._idle_workers != len(self._threads):
            return False
        # Nor an inline call past its deadline (a stuck client: the next would stick too).
        return not self._inline_running or all(d >= now for d in list(self._inline_running.values()))

    def _call_inline(self, fn: Callable[[], T], timeout_s: float, started: float) -> tuple[Outcome, T | None]:
        ident = _thread.get_ident()
        # One lock round on each side of the call: this path exists to be cheap.
        with self._lock:
            if self._closed:
                return Outcome.CLOSED, None
            self._inflight += 1
            self._inline_running[ident] = started + timeout_s
        try:
            result = fn()
        finally:
            ended = time.monotonic()
            overran = ended - started > timeout_s
            with self._lock:  # callers on several threads
                self._inflight -= 1
                del self._inline_running[ident]
                self.inline_calls += 1
                if overran:
                    # Blocked past the deadline by the client itself: the answer is still true
                    # (the memory was never left behind), but the store is not healthy.
                    self.inline_overruns += 1
                    self._inline_off_until = ended + self.inline_cooldown_s
                if self._closed:
                    self._idle.notify_all()  # close() waits for the last call
        if overran:
            log.warning("mooncake: a native call ran %.2f s past its %.2f s deadline on the caller's thread; "
                        "calls go to worker threads for %.0f s", ended - started - timeout_s, timeout_s,
                        self.inline_cooldown_s)
        return Outcome.DONE, result

    def call(self, fn: Callable[[], T], timeout_s: float, *, inline: bool = False) -> tuple[Outcome, T | None]:
        """Run ``fn`` on a native thread and wait at most ``timeout_s``; with
        ``inline``, on the caller's thread while the store looks healthy (the
        module doc), returning whenever the call does.

        A call still queued at its deadline never starts. One already running
        completes in the background; its result is dropped.
        """
        now = time.monotonic()
        if inline and self._inline_ok(now):
            return self._call_inline(fn, timeout_s, now)
        deadline = now + max(0.0, timeout_s)
        c = _Call(fn, deadline)
        if not self._submit(c):
            return Outcome.CLOSED, None
        if not self._wait(c, deadline - time.monotonic()):
            return Outcome.TIMEOUT, None
        if c.result is _SKIPPED:
            return (Outcome.CLOSED if self._closed else Outcome.TIMEOUT), None
        return Outcome.DONE, c.result

    def call_alone(self, fn: Callable[[], T], timeout_s: float) -> tuple[Outcome, T | None]:
        """Run ``fn`` on a thread of its own that runs nothing else, waiting at most
        ``timeout_s`` (a call still running then goes on alone; its result is dropped).

        For the client's set-up. The thread that set the client up runs every later
        native call of 512 x 64 KiB about a tenth slower than a fresh thread does (0.87-0.91
        of the raw client against 0.96-0.97, 2026-12-03; the gap closes with
        ``MALLOC_ARENA_MAX=1``, which points at the malloc arena that thread shares with
        the threads the client started during set-up), so no worker that runs data calls may be it."""
        with self._lock:
            if self._closed:
                return Outcome.CLOSED, None
            self._inflight += 1
        c = _Call(fn, time.monotonic() + max(0.0, timeout_s))

        def run() -> None:
            try:
                c.result = fn()
            except BaseException as exc:  # handed to the caller (raised there), or dropped if it left
                c.error = exc
            finally:
                self._leave()
                with self._lock:
                    if not c.abandoned:
                        c.done.release()

        threading.Thread(target=run, name=f"{self._name}_alone", daemon=True).start()
        if not self._wait(c, timeout_s):
            return Outcome.TIMEOUT, None
        return Outcome.DONE, c.result

    def _wait(self, c: _Call, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for a handed-off call; False (the call abandoned:
        its result dropped) at the deadline. Raises the call's error."""
        if not c.done.acquire(timeout=max(0.0, timeout_s)):
            with self._lock:
                # The thread may have finished between the timeout and here.
                finished = c.done.acquire(blocking=False)
                if not finished:
                    c.abandoned = True
            if not finished:
                self.timeouts += 1
                return False
        if c.error is not None:
            raise c.error
        return True

    def close(self, drain_timeout_s: float) -> bool:
        """Stop new calls; wait for running ones. True if none is left running."""
        with self._lock:
            self._closed = True
            drained = self._idle.wait_for(lambda: self._inflight == 0, timeout=drain_timeout_s)
            threads = len(self._threads)
        # Queued calls never start (closed); idle workers exit on the sentinels.
        for _ in range(threads):
            self._queue.put(_STOP)
        return drained
