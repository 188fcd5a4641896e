"""A deadline around every backend call, and who owns memory after it.

The backend contract asks each call to return within ``timeout_s``, but a
buggy or wedged client may not. The guard runs calls on its own small thread
pool and stops waiting at the deadline: the caller gets TIMEOUT for those keys
and carries on (recompute). A call that never returns keeps its thread; once
``max_stuck`` threads are stuck the guard answers UNAVAILABLE at once instead
of piling up more threads, so nothing in the engine ever waits forever.

A call the guard stopped waiting for may still read or write the memory it was
given, and so may a backend's own library call it gave up waiting for
(``detaches_calls``, ``quiescent()``). ``hold_for`` tells the caller until when
that memory is not its own: the transfer engine keeps such buffers (and, for
puts, vLLM's blocks) out of use until the call has really ended. Backends that
declare ``bounded_calls`` return by themselves within their timeout: they run
on the caller's thread and are never abandoned; if they also never detach a
call (``direct``), their calls may use vLLM's blocks directly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ascendstore.contract import Backend, Health, Region, Status
from ascendstore.engine.metrics import EngineMetrics

if TYPE_CHECKING:
    from ascendstore.engine.health import HealthMonitor

log = logging.getLogger(__name__)

#: extra wait on top of the backend's own timeout before the guard gives up.
GRACE_S = 0.05


@dataclass
class PendingCall:
    op: str
    n: int
    fut: Future | None
    timeout: float
    ready: list[Status] | None
    deadline: float = 0.0
    #: the guard stopped waiting; the call may still be running.
    overran: bool = False
    observe: bool = True  # False: answered by the degraded gate, not by the backend

#: a predicate that turns True once memory lent to a call is the caller's again.
Release = Callable[[], bool]


_STATUS_BY_VALUE: dict[int, Status] = {int(st): st for st in Status}

class BackendGuard:
    def __init__(
        self,
        backend: Backend,
        timeout_s: float,
        *,
        metrics: EngineMetrics | None = None,
        max_stuck: int = 4,
        name: str = "ascendstore-io",
    ) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.metrics = metrics or EngineMetrics()
        self._max_stuck = max_stuck
        self._stuck = 0
        self._lock = threading.Lock()
        # One spare thread per possible stuck call plus the working ones.
        self._pool = ThreadPoolExecutor(max_workers=max_stuck + 4, thread_name_prefix=name)
        self._closed = False
        caps = backend.capabilities
        #: the backend returns by itself in time: call it on the caller's thread, never abandon it.
        self.inline = bool(caps.bounded_calls)
        #: ... and is done with a call's memory when it returns: it may use vLLM's blocks.
        self.direct = self.inline and not caps.detaches_calls
        #: health monitor: sees every keyed call's statuses and, while degraded,
        #: has the guard answer UNAVAILABLE without calling the backend.
        self.monitor: HealthMonitor | None = None
        #: more observers of (op, statuses) per keyed call (metrics, tests).
        self.observers: list[Callable[[str, list[Status]], None]] = []

    @property
    def capabilities(self):
        return self.backend.capabilities

    @property
    def stuck_calls(self) -> int:
        return self._stuck

    def _unstuck(self, _fut: Future) -> None:
        with self._lock:
            self._stuck -= 1

    def _call(
        self, op: str, n: int, args: tuple[Any, ...], timeout_s: float | None, gated: bool = True
    ) -> list[Status]:
        if self.inline and n:
            return self._call_inline(op, n, args, timeout_s, gated)
        return self.result(self._submit(op, n, args, timeout_s, gated))

    def _call_inline(self, op: str, n: int, args: tuple[Any, ...], timeout_s: float | None, gated: bool,
                     fn: Callable[..., Any] | None = None) -> list[Status]:
        """``_submit`` then ``result`` for a bounded backend, with the same outcome,
        but no PendingCall and a few calls fewer. A step's save and load run it
        right after the previous step's copy, which evicted the caches: every
        function and object it touches is read from memory. A save's exists of 64
        keys took 31-34 us through the general path, 25-28 this way, the backend's
        own 14-15 (docs/benchmarking.md). The refusals below repeat ``_gate`` and
        ``_submit``'s by hand: a helper shared with them cost 2-5 us of that back
        (scratch, four alternating pairs). test_a_bounded_backend_called_inline_answers_as_the_general_path
        keeps the two the same."""
        monitor = self.monitor
        if gated and monitor is not None and monitor.degraded:
            self.metrics.add(degraded_skipped_keys=n)
            return [Status.UNAVAILABLE] * n
        # (an inline call is never abandoned, so none is stuck; max_stuck 0 still
        # refuses every call, as in the general path)
        if self._closed or self._stuck >= self._max_stuck:
            self.metrics.add(unavailable=n)
            out = [Status.UNAVAILABLE] * n
            if not self._closed:
                self.observe(op, out)
            return out
        out = self._run_inline(op, n, args, self.timeout_s if timeout_s is None else timeout_s, fn)
        if monitor is not None or self.observers:
            self._observe(op, out)
        return out

    def _run_inline(self, op: str, n: int, args: tuple[Any, ...], timeout: float,
                    fn: Callable[..., Any] | None = None) -> list[Status]:
        # No thread hop: a lone small save or lookup costs one call, not two hand-offs.
        try:
            result = (fn or getattr(self.backend, op))(*args, timeout)
        except Exception:
            log.exception("backend %s of %d keys raised; reporting UNAVAILABLE", op, n)
            self.metrics.add(unavailable=n)
            return [Status.UNAVAILABLE] * n
        return self._check(op, result, n)

    def _gate(self, n: int) -> bool:
        """Degraded mode: answer without calling the sick backend (its probes find out when it is back)."""
        if self.monitor is not None and self.monitor.degraded:
            self.metrics.add(degraded_skipped_keys=n)
            return True
        return False

    def _submit(
        self, op: str, n: int, args: tuple[Any, ...], timeout_s: float | None, gated: bool = True
    ) -> PendingCall:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if n == 0:
            return PendingCall(op, 0, None, timeout, [])
        if gated and self._gate(n):
            return PendingCall(op, n, None, timeout, [Status.UNAVAILABLE] * n, observe=False)
        with self._lock:
            if self._closed or self._stuck >= self._max_stuck:
                self.metrics.add(unavailable=n)
                # Stuck calls are the backend's failure; a closed guard is ours.
                return PendingCall(op, n, None, timeout, [Status.UNAVAILABLE] * n, observe=not self._closed)
        if self.inline:
            # Returns by itself in time: run it here and now (the caller collects it with result()).
            return PendingCall(op, n, None, timeout, self._run_inline(op, n, args, timeout))
        fut = self._pool.submit(getattr(self.backend, op), *args, timeout)
        return PendingCall(op, n, fut, timeout, None, time.monotonic() + timeout + GRACE_S)

    def result(self, call: PendingCall) -> list[Status]:
        """Statuses of a submitted call, waiting at most until its deadline."""
        out = self._result(call)
        if call.observe and out and (self.monitor is not None or self.observers):
            self._observe(call.op, out)
        return out

    def observe(self, op: str, statuses: list[Status]) -> None:
        """Tell the health monitor and observers of a call's outcome decided
        outside the guard (the engine's watchdog gave up on a call)."""
        if self.monitor is not None or self.observers:
            self._observe(op, statuses)

    def _observe(self, op: str, statuses: list[Status]) -> None:
        try:
            if self.monitor is not None:
                self.monitor.record(op, statuses)
            for fn in self.observers:
                fn(op, statuses)
        except Exception:
            log.exception("backend call observer failed")

    def _result(self, call: PendingCall) -> list[Status]:
        if call.fut is None:
            return call.ready or []
        op, n, fut = call.op, call.n, call.fut
        try:
            # A bounded backend returns by itself: wait for it (never abandon its memory).
            result = fut.result(timeout=None if self.inline else max(0.0, call.deadline - time.monotonic()))
        except FutureTimeout:
            call.overran = True
            with self._lock:
                self._stuck += 1
            fut.add_done_callback(self._unstuck)
            log.warning("backend %s of %d keys overran %.3fs; reporting TIMEOUT", op, n, call.timeout)
            self.metrics.add(timeouts=n)
            return [Status.TIMEOUT] * n
        except Exception:
            log.exception("backend %s of %d keys raised; reporting UNAVAILABLE", op, n)
            self.metrics.add(unavailable=n)
            return [Status.UNAVAILABLE] * n
        return self._check(op, result, n)

    def hold_for(self, call: PendingCall, statuses: Sequence[Status]) -> Release | None:
        """None when the memory lent to ``call`` is the caller's again now; else a
        predicate that turns True once the call (and the backend's own work for
        it) has really ended. Until then nothing else may use that memory."""
        backend = self.backend
        fut = call.fut
        if call.overran and fut is not None:
            return lambda: fut.done() and backend.quiescent()
        if not self.direct and Status.TIMEOUT in statuses and not backend.quiescent():
            # The backend answered in time but left a native call running.
            return backend.quiescent
        return None

    def submit_get(
        self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float | None = None
    ) -> PendingCall:
        """Start a get; collect it with ``result`` (lets the caller prepare the next batch)."""
        return self._submit("get", len(keys), (list(keys), regions), timeout_s)

    def submit_put(self, keys: Sequence[str], regions: Sequence[Sequence[Region]]) -> PendingCall:
        return self._submit("put", len(keys), (list(keys), regions), None)

    def submit_remove(self, keys: Sequence[str]) -> PendingCall:
        """Start a remove nobody needs to wait for (e.g. dropping a corrupt object)."""
        return self._submit("remove", len(keys), (list(keys),), None)

    def _check(self, op: str, result: Any, n: int) -> list[Status]:
        if type(result) is list and len(result) == n and result.count(Status.OK) == n:
            # Every key OK, the usual answer: one C-level pass instead of a lookup per key.
            return [Status.OK] * n
        if type(result) is list and len(result) == n and result.count(Status.NOT_FOUND) == n:
            return [Status.NOT_FOUND] * n  # none there: a save's exists, usually
        try:
            # A dict lookup per key: Status(s) costs ~0.4 us each, which adds up on
            # the lookup of a long prompt (thousands of keys).
            out = [_STATUS_BY_VALUE[s] for s in result]
        except (KeyError, TypeError):
            out = []
        if len(out) != n:
            log.error("backend %s returned %r for %d keys; treating as INVALID", op, result, n)
            return [Status.INVALID] * n
        timeouts = out.count(Status.TIMEOUT)  # C speed: lookups of long prompts pass thousands
        if timeouts:
            self.metrics.add(timeouts=timeouts)
        return out

    # -- the contract, guarded ------------------------------------------------------
    def exists(self, keys: Sequence[str], timeout_s: float | None = None, *, gated: bool = True) -> list[Status]:
        return self._call("exists", len(keys), (list(keys),), timeout_s, gated)

    def put(self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float | None = None) -> list[Status]:
        return self._call("put", len(keys), (list(keys), regions), timeout_s)

    def put_absent(self, keys: Sequence[str], regions: Sequence[Sequence[Region]], present: list[int]) -> list[Status]:
        """A put of only the keys the store lacks, in one call: the backend's own
        ``put_absent`` (not in the contract; ``has_put_absent``), for a bounded
        backend only. A held key keeps its value and answers OK, and its index is
        appended to ``present``. Seen by the monitor and observers as a put."""
        return self._call_inline("put", len(keys), (list(keys), regions, present), None, True,
                                 self.backend.put_absent)  # type: ignore[attr-defined]

    @property
    def has_put_absent(self) -> bool:
        """The backend runs on the caller's thread and offers ``put_absent``."""
        return self.inline and callable(getattr(self.backend, "put_absent", None))

    def get(self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float | None = None) -> list[Status]:
        return self._call("get", len(keys), (list(keys), regions), timeout_s)

    def remove(self, keys: Sequence[str], timeout_s: float | None = None) -> list[Status]:
        return self._call("remove", len(keys), (list(keys),), timeout_s)

    def pin(self, keys: Sequence[str], lease_s: float, timeout_s: float | None = None) -> list[Status]:
        """exists + pin (backends declaring ``pins``; ascendstore.engine.pins)."""
        return self._call("pin", len(keys), (list(keys), lease_s), timeout_s)

    def unpin(self, keys: Sequence[str], timeout_s: float | None = None) -> list[Status]:
        return self._call("unpin", len(keys), (list(keys),), timeout_s)

    def remove_prefix(self, prefix: str, timeout_s: float | None = None) -> tuple[Status, int]:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        fut = self._pool.submit(self.backend.remove_prefix, prefix, timeout)
        try:
            return fut.result(timeout=timeout + GRACE_S)
        except FutureTimeout:
            return Status.TIMEOUT, 0
        except Exception:
            log.exception("backend remove_prefix(%r) raised", prefix)
            return Status.UNAVAILABLE, 0

    def register(self, regions: Sequence[Region]) -> Status:
        return self._memory("register", regions)

    def unregister(self, regions: Sequence[Region]) -> Status:
        return self._memory("unregister", regions)

    def _memory(self, op: str, regions: Sequence[Region]) -> Status:
        # Registering large regions pins memory and can take a while: the set-up bound.
        fut = self._pool.submit(getattr(self.backend, op), list(regions))
        try:
            return Status(fut.result(timeout=max(self.timeout_s, 30.0)))
        except FutureTimeout:
            return Status.TIMEOUT
        except Exception:
            log.exception("backend %s of %d regions raised", op, len(regions))
            return Status.UNAVAILABLE

    def health(self) -> Health:
        fut = self._pool.submit(self.backend.health, self.timeout_s)
        try:
            return fut.result(timeout=self.timeout_s + GRACE_S)
        except FutureTimeout:
            return Health(Status.TIMEOUT)
        except Exception as exc:
            return Health(Status.UNAVAILABLE, {"error": repr(exc)})

    def close(self, timeout_s: float = 2.0) -> None:
        """Close the backend (bounded) and let go of the threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.monitor is not None:
            # First: a closing client must not read as a sick backend.
            self.monitor.close()
        fut = self._pool.submit(self.backend.close)
        try:
            fut.result(timeout=timeout_s)
        except FutureTimeout:
            log.warning("backend close() overran %.1fs; abandoning it", timeout_s)
        except Exception:
            log.exception("backend close() raised")
        self._pool.shutdown(wait=False, cancel_futures=True)
