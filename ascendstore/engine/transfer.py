"""Transfer threads: loads and saves off the model's critical path.

One thread per direction, each fed by a bounded queue. A task is a batch of
chunk objects for one request (or one layer of it in layerwise mode); the
thread issues it as few backend calls as the in-flight byte limit allows.
Loads report the device blocks that failed, so vLLM recomputes exactly those;
saves skip objects the pool already has (one batched exists per task) and are
written by one rank of a replica group (the caller filters with ReplicaGroup).
Every wait here is bounded.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ascendstore.contract import Region, Status
from ascendstore.engine.guard import GRACE_S, BackendGuard, PendingCall
from ascendstore.engine.plan import ChunkOp, stagger

log = logging.getLogger(__name__)

Hook = Callable[[], None]

#: batch size when building regions overlaps the previous batch's copy. Large:
#: each batch costs a thread hand-off, and the connector caches region lists.
PIPELINE_BYTES = 64 << 20
#: allowance for a load thread to hand a finished task to the forward pass.
HANDOFF_S = 0.05


class Stager(Protocol):
    """Moves KV between memory the backend cannot read (device) and host buffers.

    ``capacity`` bounds the bytes of one batch (one host buffer per direction)."""

    capacity: int

    def stage_out(self, ops: Sequence[ChunkOp]) -> list[list[Region]]:
        """Copy the ops' bytes into the save buffer; host regions per op (for put)."""

    def stage_in(self, ops: Sequence[ChunkOp]) -> list[list[Region]]:
        """Host regions per op in the load buffer (for get)."""

    def commit_in(self, ops: Sequence[ChunkOp], ok: Sequence[bool]) -> None:
        """Copy the loaded ops (ok[i]) from the load buffer to their device regions."""


class SharedExists:
    """One batched exists for keys saved by several tasks (layerwise: every
    layer's objects of a step), asked by the first task that needs it."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = list(keys)
        self._present: set[str] | None = None
        self._lock = threading.Lock()

    def present(self, guard: BackendGuard) -> set[str]:
        with self._lock:
            if self._present is None:
                statuses = guard.exists(self.keys)
                self._present = {k for k, s in zip(self.keys, statuses, strict=True) if s is Status.OK}
            return self._present


@dataclass
class TransferResult:
    """Loads finished since the last take: request -> block ids that failed."""

    loaded: dict[str, set[int]] = field(default_factory=dict)
    saved: set[str] = field(default_factory=set)


@dataclass(eq=False)
class _Task:
    kind: str  # "load" | "save"
    req_id: str
    ops: list[ChunkOp]
    layer: int | None = None
    before: Hook | None = None  # e.g. wait for the device to finish writing KV
    after: Callable[[list[ChunkOp], list[Status]], None] | None = None
    skip_existing: bool = True
    shared_exists: SharedExists | None = None
    #: monotonic time by which a load must be done: one per step, shared by all its loads.
    deadline: float | None = None
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    failed: set[int] = field(default_factory=set)


class _ByteBudget:
    """Caps bytes in flight for one rank across both directions."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.inflight = 0
        self._cv = threading.Condition()

    def acquire(self, n: int, timeout_s: float) -> bool:
        if not self.limit:
            return True
        deadline = time.monotonic() + timeout_s
        with self._cv:
            # A batch larger than the limit still goes through, alone.
            while self.inflight and self.inflight + n > self.limit:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cv.wait(left):
                    return False
            self.inflight += n
            return True

    def release(self, n: int) -> None:
        if not self.limit:
            return
        with self._cv:
            self.inflight -= n
            self._cv.notify_all()


def batches(ops: Sequence[ChunkOp], max_bytes: int) -> Iterable[list[ChunkOp]]:
    """Split ops into batches of at most max_bytes (at least one op each)."""
    if not max_bytes:
        if ops:
            yield list(ops)
        return
    cur: list[ChunkOp] = []
    size = 0
    for op in ops:
        if cur and size + op.nbytes > max_bytes:
            yield cur
            cur, size = [], 0
        cur.append(op)
        size += op.nbytes
    if cur:
        yield cur


class TransferEngine:
    def __init__(
        self,
        guard: BackendGuard,
        *,
        queue_size: int = 64,
        max_inflight_bytes: int = 0,
        stagger_index: int = 0,
        stagger_size: int = 1,
        stagger_delay_s: float = 0.0,
        name: str = "ascendstore",
        stager: Stager | None = None,
    ) -> None:
        self.guard = guard
        self.stager = stager
        # One staging buffer per direction; sync loads share the load one.
        self._stage_locks = {"load": threading.Lock(), "save": threading.Lock()}
        self.metrics = guard.metrics
        self.timeout_s = guard.timeout_s
        self.max_inflight_bytes = max_inflight_bytes
        self.stagger_index = stagger_index
        self.stagger_size = stagger_size
        self.stagger_delay_s = stagger_delay_s
        self._budget = _ByteBudget(max_inflight_bytes)
        self._queues = {k: queue.Queue(maxsize=queue_size) for k in ("load", "save")}
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, list[_Task]]] = {"load": defaultdict(list), "save": defaultdict(list)}
        self._loaded: dict[str, set[int]] = {}
        self._saved: set[str] = set()
        self._layer_tasks: dict[int, list[_Task]] = defaultdict(list)
        #: first keys of recent load batches, in issue order (staggering is visible here).
        self.load_order: deque[list[str]] = deque(maxlen=64)
        self._stop = threading.Event()
        self._graveyard: list[ctypes.Array] = []
        self._threads = [
            threading.Thread(target=self._run, args=(k,), name=f"{name}-{k}", daemon=True) for k in ("load", "save")
        ]
        for t in self._threads:
            t.start()

    # -- loads ------------------------------------------------------------------------
    def load_now(
        self, req_id: str, ops: Sequence[ChunkOp], after: Callable | None = None, *, deadline: float | None = None
    ) -> set[int]:
        """Load on the calling thread (synchronous mode). Returns failed block ids.

        ``deadline`` (monotonic) bounds this load together with the others of its
        step; without it each backend call gets the full timeout."""
        task = _Task("load", req_id, list(ops), after=after, deadline=deadline)
        self._execute(task)
        return task.failed

    def submit_load(
        self,
        req_id: str,
        ops: Sequence[ChunkOp],
        *,
        layer: int | None = None,
        after: Callable | None = None,
        deadline: float | None = None,
    ) -> None:
        task = _Task("load", req_id, list(ops), layer=layer, after=after, deadline=deadline)
        if layer is not None:
            with self._lock:
                self._layer_tasks[layer].append(task)
        self._enqueue(task)

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> set[int]:
        """Wait (bounded) for this step's loads of one layer; returns failed blocks."""
        with self._lock:
            tasks = self._layer_tasks.pop(layer, [])
        failed: set[int] = set()
        if timeout_s is not None:
            deadline = time.monotonic() + timeout_s
        elif tasks and all(t.deadline is not None for t in tasks):
            # The step's deadline bounds every layer's loads; allow the guard's
            # grace and the hand-off from the load thread.
            deadline = max(t.deadline for t in tasks) + GRACE_S + HANDOFF_S  # type: ignore[type-var]
        else:
            deadline = time.monotonic() + self._task_timeout(tasks)
        for t in tasks:
            if not t.done.wait(max(0.0, deadline - time.monotonic())):
                log.warning("layer %d load of %s not done in time; marking its blocks failed", layer, t.req_id)
                t.cancelled = True
                failed.update(b for op in t.ops for b in op.block_ids)
            failed.update(t.failed)
        return failed

    # -- saves ------------------------------------------------------------------------
    def submit_save(
        self,
        req_id: str,
        ops: Sequence[ChunkOp],
        *,
        layer: int | None = None,
        before: Hook | None = None,
        skip_existing: bool = True,
        shared_exists: SharedExists | None = None,
    ) -> bool:
        """Queue a save; False if the queue was full (the save is dropped, a future miss)."""
        task = _Task("save", req_id, list(ops), layer=layer, before=before, skip_existing=skip_existing,
                     shared_exists=shared_exists)
        return self._enqueue(task, drop_if_full=True)

    # -- bookkeeping ------------------------------------------------------------------
    def _task_timeout(self, tasks: Sequence[_Task]) -> float:
        # Each batch call is bounded by timeout_s; allow for every batch queued ahead.
        return self.timeout_s * (2 + sum(1 + len(t.ops) // 64 for t in tasks)) + self.stagger_delay_s

    def _enqueue(self, task: _Task, drop_if_full: bool = False) -> bool:
        with self._lock:
            self._pending[task.kind][task.req_id].append(task)
        q = self._queues[task.kind]
        try:
            if drop_if_full:
                q.put_nowait(task)
            else:
                q.put(task, timeout=self.timeout_s)
        except queue.Full:
            if task.kind == "save":
                self.metrics.add(save_dropped_queue_full=len(task.ops))
            else:
                self.metrics.add(load_failures=len(task.ops))
                task.failed.update(b for op in task.ops for b in op.block_ids)
            self._finish(task)
            return False
        self.metrics.peak(queue_depth_max=q.qsize())
        return True

    def _finish(self, task: _Task) -> None:
        with self._lock:
            lst = self._pending[task.kind].get(task.req_id, [])
            if task in lst:
                lst.remove(task)
            if task.kind == "load":
                self._loaded.setdefault(task.req_id, set()).update(task.failed)
                if not lst:
                    self._pending["load"].pop(task.req_id, None)
            elif not lst:
                self._pending["save"].pop(task.req_id, None)
                self._saved.add(task.req_id)
        task.done.set()

    def pending(self, kind: str, req_id: str) -> bool:
        with self._lock:
            return bool(self._pending[kind].get(req_id))

    def take_results(self) -> TransferResult:
        """Requests whose loads all finished (with failed blocks) and whose saves all finished."""
        with self._lock:
            loaded = {r: f for r, f in self._loaded.items() if not self._pending["load"].get(r)}
            for r in loaded:
                del self._loaded[r]
            saved, self._saved = self._saved, set()
        return TransferResult(loaded, saved)

    def wait(self, kind: str, req_ids: Iterable[str], timeout_s: float) -> bool:
        """Wait (bounded) until the given requests have no queued or running tasks."""
        deadline = time.monotonic() + timeout_s
        for r in req_ids:
            with self._lock:
                tasks = list(self._pending[kind].get(r, []))
            for t in tasks:
                if not t.done.wait(max(0.0, deadline - time.monotonic())):
                    return False
        return True

    def cancel(self, req_ids: Iterable[str], timeout_s: float | None = None) -> set[int]:
        """Preemption: drop queued loads of these requests and wait (bounded) for
        running ones and for their saves, so freed blocks are not touched after.
        Returns the blocks whose loads did not complete."""
        req_ids = list(req_ids)
        with self._lock:
            loads = [t for r in req_ids for t in self._pending["load"].get(r, [])]
        for t in loads:
            t.cancelled = True
        timeout = self._task_timeout(loads) if timeout_s is None else timeout_s
        ok = self.wait("load", req_ids, timeout) and self.wait("save", req_ids, timeout)
        if not ok:
            log.warning("transfers of preempted requests %s still running after %.1fs", req_ids, timeout)
        failed: set[int] = set()
        with self._lock:
            for r in req_ids:
                failed |= self._loaded.pop(r, set())
        return failed

    # -- the threads ------------------------------------------------------------------
    def _run(self, kind: str) -> None:
        q = self._queues[kind]
        while not self._stop.is_set():
            try:
                task = q.get(timeout=0.1)
            except queue.Empty:
                continue
            if task is None:
                break
            try:
                self._execute(task)
            except Exception:
                log.exception("%s task for %s failed", kind, task.req_id)
                if kind == "load":
                    task.failed.update(b for op in task.ops for b in op.block_ids)
                self._finish(task)

    def _execute(self, task: _Task) -> None:
        if task.cancelled:
            if task.kind == "load":
                task.failed.update(b for op in task.ops for b in op.block_ids)
            self._finish(task)
            return
        if task.kind == "load":
            self._do_load(task)
        else:
            self._do_save(task)
        self._finish(task)

    def _time_left(self, task: _Task) -> float:
        """Seconds the task's next backend call may take: the timeout, capped by the step's deadline."""
        if task.deadline is None:
            return self.timeout_s
        return min(self.timeout_s, task.deadline - time.monotonic())

    def _pipelined(self) -> bool:
        # Host staging and the bounce path copy around each call: keep them simple.
        return self.stager is None and not self.guard.overran

    def _batch_limit(self, pipelined: bool = False) -> int:
        limits = [x for x in (self.max_inflight_bytes, self.stager.capacity if self.stager else 0,
                              PIPELINE_BYTES if pipelined else 0) if x]
        return min(limits) if limits else 0

    def _do_load(self, task: _Task) -> None:
        ops = stagger(task.ops, self.stagger_index, self.stagger_size)
        if ops:
            self.load_order.append([op.key for op in ops])
        if self.stagger_delay_s and self.stagger_index:
            time.sleep(max(0.0, min(self.stagger_delay_s * self.stagger_index, self._time_left(task))))
        pipelined = self._pipelined()
        pending: tuple[list[ChunkOp], int, PendingCall, float] | None = None
        for batch in batches(ops, self._batch_limit(pipelined)):
            # Build this batch's regions while the previous batch is being copied.
            regions = [op.materialize() for op in batch]
            if pending is not None:
                self._collect_load(task, *pending)
                pending = None
            nbytes = sum(op.nbytes for op in batch)
            left = self._time_left(task)
            if left <= 0 or not self._budget.acquire(nbytes, left):
                # The step's time is spent: fail fast (recompute) instead of waiting again.
                self._load_done(task, batch, [Status.TIMEOUT] * len(batch), 0.0)
                continue
            t0 = time.perf_counter()
            if pipelined:
                left = self._time_left(task)
                if left <= 0:
                    self._budget.release(nbytes)
                    self._load_done(task, batch, [Status.TIMEOUT] * len(batch), 0.0)
                    continue
                pending = (batch, nbytes, self.guard.submit_get([op.key for op in batch], regions, left), t0)
                continue
            try:
                if self.stager is None:
                    statuses = self._get(batch, regions, self._time_left(task))
                elif self._stage_locks["load"].acquire(timeout=max(0.0, self._time_left(task))):
                    try:
                        statuses = self._get(batch, self.stager.stage_in(batch), self._time_left(task))
                        self.stager.commit_in(batch, [st is Status.OK for st in statuses])
                    finally:
                        self._stage_locks["load"].release()
                else:
                    statuses = [Status.TIMEOUT] * len(batch)
            finally:
                self._budget.release(nbytes)
            self._load_done(task, batch, statuses, time.perf_counter() - t0)
        if pending is not None:
            self._collect_load(task, *pending)

    def _collect_load(self, task: _Task, batch: list[ChunkOp], nbytes: int, call: PendingCall, t0: float) -> None:
        try:
            statuses = self.guard.result(call)
        finally:
            self._budget.release(nbytes)
        self._load_done(task, batch, statuses, time.perf_counter() - t0)

    def _load_done(self, task: _Task, batch: list[ChunkOp], statuses: list[Status], dt: float) -> None:
        good = [op for op, s in zip(batch, statuses, strict=True) if s is Status.OK]
        if dt:
            self.metrics.add(load_ops=len(good), load_bytes=sum(op.nbytes for op in good), load_time_s=dt)
        bad = [op for op, s in zip(batch, statuses, strict=True) if s is not Status.OK]
        if bad:
            self.metrics.add(load_failures=len(bad))
            for op in bad:
                task.failed.update(op.block_ids)
            corrupt = [op.key for op, s in zip(batch, statuses, strict=True) if s is Status.CORRUPT]
            if corrupt:
                self._drop_corrupt(corrupt)
        if task.after is not None:
            task.after(batch, statuses)

    def _drop_corrupt(self, keys: list[str]) -> None:
        """A damaged object would fail every later load, and saves skip keys that
        exist: remove it so the next save of that chunk writes it afresh."""
        self.metrics.add(load_corrupt=len(keys))
        log.warning("pool returned %d corrupt object(s), removing them (recomputed): %s",
                    len(keys), ", ".join(keys[:4]) + (" ..." if len(keys) > 4 else ""))
        # Off the load path: a synchronous step must not wait for the repair.
        self.guard.submit_remove(keys)

    def _get(self, batch: list[ChunkOp], regions: list[list[Region]], timeout_s: float | None = None) -> list[Status]:
        keys = [op.key for op in batch]
        if timeout_s is not None and timeout_s <= 0:
            return [Status.TIMEOUT] * len(batch)
        if not self.guard.overran:
            return self.guard.get(keys, regions, timeout_s)
        # The backend has overrun a deadline before: a call we stop waiting for
        # could still write later, into KV blocks vLLM may have reused. Read into
        # a private buffer and copy only what arrived in time; a buffer a stuck
        # call may still write is kept alive until the guard has no stuck calls.
        buf = ctypes.create_string_buffer(max(1, sum(op.nbytes for op in batch)))
        base = ctypes.addressof(buf)
        bounce: list[list[Region]] = []
        pos = 0
        for op in batch:
            bounce.append([Region(base + pos, op.nbytes)])
            pos += op.nbytes
        statuses = self.guard.get(keys, bounce, timeout_s)
        if any(s is Status.TIMEOUT for s in statuses) and self.guard.stuck_calls:
            self._graveyard.append(buf)
        elif not self.guard.stuck_calls:
            self._graveyard.clear()
        for dst, s, (src,) in zip(regions, statuses, bounce, strict=True):
            if s is Status.OK:
                off = src.addr
                for r in dst:
                    ctypes.memmove(r.addr, off, r.length)
                    off += r.length
        return statuses

    def _do_save(self, task: _Task) -> None:
        if task.before is not None:
            task.before()
        ops = task.ops
        if task.skip_existing and ops:
            if task.shared_exists is not None:
                present = task.shared_exists.present(self.guard)
                keep = [op for op in ops if op.key not in present]
            else:
                exists = self.guard.exists([op.key for op in ops])
                keep = [op for op, s in zip(ops, exists, strict=True) if s is not Status.OK]
            self.metrics.add(save_skipped_existing=len(ops) - len(keep))
            ops = keep
        pipelined = self._pipelined()
        pending: tuple[list[ChunkOp], int, PendingCall, float] | None = None
        for batch in batches(ops, self._batch_limit(pipelined)):
            regions = [op.materialize() for op in batch]
            if pending is not None:
                self._collect_save(*pending)
                pending = None
            nbytes = sum(op.nbytes for op in batch)
            if not self._budget.acquire(nbytes, self.timeout_s):
                self.metrics.add(save_failures=len(batch))
                continue
            t0 = time.perf_counter()
            keys = [op.key for op in batch]
            if pipelined:
                pending = (batch, nbytes, self.guard.submit_put(keys, regions), t0)
                continue
            try:
                if self.stager is None:
                    statuses = self.guard.put(keys, regions)
                else:
                    with self._stage_locks["save"]:
                        statuses = self.guard.put(keys, self.stager.stage_out(batch))
            finally:
                self._budget.release(nbytes)
            self._save_done(batch, statuses, time.perf_counter() - t0)
        if pending is not None:
            self._collect_save(*pending)

    def _collect_save(self, batch: list[ChunkOp], nbytes: int, call: PendingCall, t0: float) -> None:
        try:
            statuses = self.guard.result(call)
        finally:
            self._budget.release(nbytes)
        self._save_done(batch, statuses, time.perf_counter() - t0)

    def _save_done(self, batch: list[ChunkOp], statuses: list[Status], dt: float) -> None:
        good = [op for op, s in zip(batch, statuses, strict=True) if s is Status.OK]
        no_space = sum(s is Status.NO_SPACE for s in statuses)
        self.metrics.add(
            save_ops=len(good),
            save_bytes=sum(op.nbytes for op in good),
            save_time_s=dt,
            save_failures=len(batch) - len(good) - no_space,
            save_no_space=no_space,
        )

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Finish queued saves (bounded), then stop the threads."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            reqs = list(self._pending["save"])
        self.wait("save", reqs, timeout_s)
        self._stop.set()
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
