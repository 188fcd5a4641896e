"""Native calls bounded in time.

A native MemCache call can block for up to ``client_timeout_seconds`` (60 s by
default) or longer; the contract wants every call back within its
``timeout_s``. Calls run on a small thread pool; the caller waits until its
deadline and then reports TIMEOUT. A call that overran keeps its thread until
the library returns (a thread cannot be killed); ``drain`` lets ``close`` wait
for those before the client is torn down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class Deadline:
    def __init__(self, timeout_s: float) -> None:
        self.at = time.monotonic() + max(0.0, timeout_s)

    def left(self) -> float:
        return self.at - time.monotonic()


class CallTimeout(Exception):
    """The native call did not return before the deadline."""


class NativeCalls:
    def __init__(self, workers: int, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._inflight = 0
        self._cond = threading.Condition()

    def run(self, deadline: Deadline, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on a worker; its result, its exception, or CallTimeout."""
        left = deadline.left()
        if left <= 0:
            raise CallTimeout(getattr(fn, "__name__", "call"))
        with self._cond:
            self._inflight += 1
        fut: Future[T] = self._pool.submit(fn, *args)
        fut.add_done_callback(self._done)
        try:
            return fut.result(timeout=left)
        except FutureTimeout:
            fut.cancel()  # only helps if it never started
            raise CallTimeout(getattr(fn, "__name__", "call")) from None

    def _done(self, _fut: Future[Any]) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    @property
    def inflight(self) -> int:
        return self._inflight

    def drain(self, timeout_s: float) -> bool:
        """Wait until no call is running (True) or the time is up (False)."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while self._inflight:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
