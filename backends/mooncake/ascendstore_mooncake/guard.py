"""Bounded calls into the native Mooncake client.

The Mooncake client has no per-call timeout: with the master gone a put blocks
~4 s, a set-up 4.4 s per retry, and a close ~5 s. Calls therefore run on a few
threads and the caller waits at most its deadline. A call the caller gave up on
may still finish later; ``on_late`` lets the backend undo what such a call did.
After ``close`` no native call starts again (Mooncake crashes when used after
close or after a failed set-up).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class Outcome(enum.Enum):
    DONE = "done"
    TIMEOUT = "timeout"  # still running (or queued) when the deadline passed
    CLOSED = "closed"  # the guard is closed: nothing was called


_SKIPPED = object()


class NativeGuard:
    def __init__(self, workers: int, name: str = "mooncake") -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
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

    def _enter(self, deadline: float | None) -> bool:
        with self._lock:
            if self._closed or (deadline is not None and time.monotonic() > deadline):
                return False
            self._inflight += 1
            return True

    def _leave(self) -> None:
        with self._lock:
            self._inflight -= 1
            self._idle.notify_all()

    def call(
        self,
        fn: Callable[[], T],
        timeout_s: float,
        on_late: Callable[[T], None] | None = None,
    ) -> tuple[Outcome, T | None]:
        """Run ``fn`` on a native thread; wait at most ``timeout_s``.

        A call still queued at its deadline never starts. One already running
        completes in the background; its result then goes to ``on_late``.
        """
        deadline = time.monotonic() + max(0.0, timeout_s)

        def task() -> Any:
            if not self._enter(deadline):
                return _SKIPPED
            try:
                return fn()
            finally:
                self._leave()

        try:
            fut: Future[Any] = self._pool.submit(task)
        except RuntimeError:  # pool shut down by close()
            return Outcome.CLOSED, None
        try:
            result = fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            self.timeouts += 1
            fut.add_done_callback(lambda f: self._late(f, on_late))
            return Outcome.TIMEOUT, None
        if result is _SKIPPED:
            return (Outcome.CLOSED if self._closed else Outcome.TIMEOUT), None
        return Outcome.DONE, result

    def _late(self, fut: Future[Any], on_late: Callable[[Any], None] | None) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        result = fut.result()
        if result is _SKIPPED:
            return
        self.late_completions += 1
        if on_late is None:
            return
        try:
            on_late(result)
        except Exception:
            log.exception("mooncake: clean-up after a late call failed")

    def run_detached(self, fn: Callable[[], Any]) -> None:
        """Fire-and-forget native call (clean-ups); skipped once closed."""

        def task() -> None:
            if not self._enter(None):
                return
            try:
                fn()
            except Exception:
                log.exception("mooncake: detached call failed")
            finally:
                self._leave()

        try:
            self._pool.submit(task)
        except RuntimeError:
            pass

    def close(self, drain_timeout_s: float) -> bool:
        """Stop new calls; wait for running ones. True if none is left running."""
        with self._lock:
            self._closed = True
            drained = self._idle.wait_for(lambda: self._inflight == 0, timeout=drain_timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
        return drained
