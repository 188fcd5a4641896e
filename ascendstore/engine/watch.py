"""A watchdog for backend calls the engine lets block its own load thread.

A backend whose client has no per-call timeout (Mooncake) hands each call to a
worker of its own and stops waiting at the deadline; that hand-off is a sleep
and a wake-up, a sizeable share of a small get. On the engine's load thread
nothing but the engine waits, so the engine can take the deadline over: the
backend runs the call right there (``caller_is_watched()``) and this watchdog,
ticking a few times per deadline, gives up on a call that overran. What giving
up means is the caller's ``on_overrun``: for a load, fail its blocks (vLLM
recomputes), keep the landing buffer out of use until the call returns, and
start another load thread, since this one is stuck in the client.

Whoever of the two comes first wins, under one lock: the call returning (its
answer is used) or the watchdog abandoning it (its answer is dropped).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ascendstore.contract import watched_caller

log = logging.getLogger(__name__)


class WatchedCall:
    """One call in progress on a watched thread; the ``with`` block that makes it.

    Entering registers it with its watch and marks the thread watched
    (``caller_is_watched()``); leaving undoes both. A plain class rather than a
    generator: the exit runs on the cold caches a native call leaves, where a
    generator's exit cost 5-8 us more per call (docs/benchmarking.md)."""

    __slots__ = ("deadline", "payload", "returned", "abandoned", "settled", "_watch", "_ident", "_mark")

    def __init__(self, deadline: float, payload: Any, watch: CallWatch) -> None:
        self.deadline = deadline
        #: what ``on_overrun`` needs to undo the call (the engine's task and buffer).
        self.payload = payload
        self.returned = False
        self.abandoned = False
        #: set once ``on_overrun`` has run: the stuck thread waits for it before
        #: it lets go of anything (so nobody sees the buffer half swapped).
        self.settled = threading.Event()
        self._watch = watch
        self._ident = 0
        self._mark = watched_caller()

    # Entered once (``CallWatch.watching`` makes one per block). It reaches into its
    # watch's table and lock directly: a method call more per side is what this saves.
    def __enter__(self) -> WatchedCall:
        self._ident = threading.get_ident()
        self._watch._calls[self._ident] = self
        self._mark.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mark.__exit__(None, None, None)  # the mark ignores how the block ended
        with self._watch._lock:
            self.returned = True
        self._watch._calls.pop(self._ident, None)


class CallWatch:
    def __init__(self, on_overrun: Callable[[WatchedCall], None], tick_s: float, name: str = "ascendstore") -> None:
        self._on_overrun = on_overrun
        self.tick_s = tick_s
        #: thread ident -> its call in progress (one at a time per thread).
        self._calls: dict[int, WatchedCall] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.abandoned = 0
        # Ticks instead of being told of each call: waking it per call would cost
        # the hand-off this exists to save.
        self._thread = threading.Thread(target=self._run, name=f"{name}-watchdog", daemon=True)
        self._thread.start()

    def watching(self, deadline: float, payload: Any) -> WatchedCall:
        """Watch the calls made in the ``with`` block of what this returns until
        ``deadline`` (monotonic)."""
        return WatchedCall(deadline, payload, self)

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            now = time.monotonic()
            for call in list(self._calls.values()):
                if now <= call.deadline:
                    continue
                with self._lock:
                    if call.returned or call.abandoned:
                        continue
                    call.abandoned = True  # the entry goes when the call returns
                self.abandoned += 1
                try:
                    self._on_overrun(call)
                except Exception:
                    log.exception("clean-up of an overrun call failed")
                finally:
                    call.settled.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
