"""Transfer threads: loads and saves off the model's critical path.

One thread per direction, each fed by a bounded queue. A task is a batch of
chunk objects for one request (or one layer of it in layerwise mode); the
thread issues it as few backend calls as the in-flight byte limit allows.
Loads report the device blocks that failed, so vLLM recomputes exactly those;
saves skip objects the pool already has (one batched exists per task, or inside
a backend's ``put_absent``) and are written by one rank of a replica group (the
caller filters with ReplicaGroup).
Every wait here is bounded.

Ownership: once vLLM has a block back, no backend call may touch it. With a
backend that declares ``bounded_calls`` (and not ``detaches_calls``) calls are
never abandoned, so they use vLLM's blocks directly. Otherwise loads land in connector-owned buffers
(``HostBounce`` or the device stager's host buffers) and are copied into the
blocks only after the call returned in time; a buffer whose call overran is
retired until the call really ends, except for loads whose request vLLM keeps
waiting until they are reported (async loads: ``holds_blocks``) when the engine is
told so (``direct_async_loads``): those get straight into vLLM's blocks, and a get
that overran keeps the request unreported, so the blocks stay vLLM's loan, until
the call has ended. A backend that runs calls on the caller's
thread but may outlive them (``bounded_calls`` and ``detaches_calls``) may block
the load thread itself in a get (``caller_is_watched()``); the watchdog of
engine/watch.py then gives up on it at its deadline (``_abandon``: the load
fails, the buffer is retired, another load thread takes over). A put reads vLLM's blocks (or a staging
buffer) directly; if it overruns, the request's save stays pending (vLLM keeps
the blocks, as its delayed-free contract allows) until the put has ended.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import queue
import threading
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Protocol

from ascendstore.contract import Region, Status, blocking_caller
from ascendstore.engine.guard import GRACE_S, BackendGuard, PendingCall, Release
from ascendstore.engine.plan import ChunkOp, stagger
from ascendstore.engine.watch import CallWatch, WatchedCall
from ascendstore.local._shmpool import scatter  # the core's one C extension holds its copy helpers

log = logging.getLogger(__name__)

Hook = Callable[[], None]

#: batch size when building regions overlaps the previous batch's copy. Large:
#: each batch costs a thread hand-off, and the connector caches region lists.
PIPELINE_BYTES = 64 << 20
#: allowance for a load thread to hand a finished task to the forward pass.
HANDOFF_S = 0.05
#: landing/staging buffers that may be held by calls still running after their
#: deadline; past this, loads fail fast (recompute) instead of allocating more.
MAX_RETIRED_BUFFERS = 4
#: default bytes of queued saves per rank (a step's saves are admitted whole).
SAVE_QUEUE_BYTES = 1 << 30
#: the watchdog's longest interval between looks at the load thread's calls (engine/watch.py).
WATCH_TICK_S = 0.05


class _Abandoned(Exception):
    """Raised on a load thread whose call the watchdog gave up on: the thread ends."""

#: memory lent to calls still running when their engine shut down (buffers,
#: vLLM's KV tensors), kept alive until those calls end: a late write into freed
#: memory would corrupt the heap. Pruned whenever any engine reaps.
_LINGER: list[tuple[object, Release]] = []
_LINGER_LOCK = threading.Lock()


def _prune_linger() -> None:
    if _LINGER:
        with _LINGER_LOCK:
            _LINGER[:] = [(obj, r) for obj, r in _LINGER if not r()]


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

    def detach(self, direction: str) -> tuple[object, Region | None]:
        """A call that overran still uses the ``direction`` ("load"/"save") buffer:
        hand it over (the caller keeps it alive until the call ends) and use a
        fresh one from now on. Returns (old buffer, region of the new one or None
        if it is allocated lazily)."""


def page_aligned(nbytes: int) -> ctypes.Array:
    """``nbytes`` of zeroed memory starting on a page (an anonymous mapping, which the
    array keeps alive). A malloc'd buffer this large starts 16 bytes past one, and on
    AMD Zen 4 glibc's ``memcpy`` (``rep movsb``), which a backend's client copies with,
    runs 1.6-6x slower into such a destination than into one on 64 bytes: a Mooncake
    get into the landing buffer took 5.1-5.5 ms for 32 MiB against 2.9-3.4 on a page
    (docs/benchmarking.md). vLLM's blocks and the pool's objects start on 64 bytes."""
    return (ctypes.c_char * nbytes).from_buffer(mmap.mmap(-1, nbytes))


class HostBounce:
    """Connector-owned landing buffer for loads into host KV from a backend whose
    calls may outlive their deadline: the backend writes here, and only what
    arrived in time is copied into vLLM's blocks (a ``Stager`` for loads only)."""

    def __init__(self, capacity: int, on_alloc: Callable[[Region], None] | None = None) -> None:
        self.capacity = capacity
        self._buf: ctypes.Array | None = None
        #: e.g. register the new buffer with a backend that needs registered memory.
        self._on_alloc = on_alloc

    def _buffer(self, nbytes: int) -> ctypes.Array:
        if self._buf is None or len(self._buf) < nbytes:
            # Allocated on first use (most deployments never bounce), grown for
            # an object larger than the batch limit.
            self._buf = page_aligned(max(nbytes, self.capacity, 1))
            if self._on_alloc is not None:
                self._on_alloc(Region(ctypes.addressof(self._buf), len(self._buf)))
        return self._buf

    def region(self) -> Region | None:
        return None if self._buf is None else Region(ctypes.addressof(self._buf), len(self._buf))

    def stage_out(self, ops: Sequence[ChunkOp]) -> list[list[Region]]:
        raise NotImplementedError("puts read vLLM's blocks directly")

    def stage_in(self, ops: Sequence[ChunkOp]) -> list[list[Region]]:
        buf = self._buffer(sum(op.nbytes for op in ops))
        base, pos, out = ctypes.addressof(buf), 0, []
        for op in ops:
            out.append([Region(base + pos, op.nbytes)])
            pos += op.nbytes
        return out

    def commit_in(self, ops: Sequence[ChunkOp], ok: Sequence[bool]) -> None:
        assert self._buf is not None
        # One native call for the batch, the GIL released: a ctypes memmove per
        # region cost ~a third of the copy itself (512 x 64 KiB objects).
        scatter(ctypes.addressof(self._buf), [op.materialize() for op in ops], ok)

    def detach(self, direction: str) -> tuple[object, Region | None]:
        old, self._buf = self._buf, None
        return old, None


class SharedExists:
    """State shared by one step's layerwise saves: one batched exists for every
    layer's objects (asked by the first task that needs it), and each chunk's
    per-layer outcomes, so a chunk is never left with some layers stored."""

    def __init__(self, keys: Sequence[str], num_layers: int = 0) -> None:
        self.keys = list(keys)
        self.num_layers = num_layers
        self._present: set[str] | None = None
        self._lock = threading.Lock()
        #: (request, chunk index) -> [layers settled, layers failed, keys we stored]
        self._chunks: dict[tuple[str, int], list] = {}

    def present(self, guard: BackendGuard) -> set[str]:
        with self._lock:
            if self._present is None:
                statuses = guard.exists(self.keys)
                self._present = {k for k, s in zip(self.keys, statuses, strict=True) if s is Status.OK}
            return self._present

    def settle(self, req_id: str, ops: Sequence[ChunkOp], landed: Sequence[bool], stored: Sequence[bool]) -> list[str]:
        """Record one layer's outcome per chunk; returns keys to remove: the layers
        this step stored of chunks whose other layers failed (never a hit, only
        wasted pool space)."""
        if not self.num_layers:
            return []
        drop: list[str] = []
        with self._lock:
            for op, ok, put in zip(ops, landed, stored, strict=True):
                st = self._chunks.setdefault((req_id, op.chunk_index), [0, 0, []])
                st[0] += 1
                st[1] += not ok
                if put:
                    st[2].append(op.key)
                if st[0] == self.num_layers:
                    if st[1]:
                        drop.extend(st[2])
                    del self._chunks[(req_id, op.chunk_index)]
        return drop


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
    #: save: bytes and slots reserved in the save queue (released when it ends).
    reserved: int = 0
    #: calls that overran and may still read (save) or write (a direct async load)
    #: the blocks; the task is done only once all are True.
    held: list[Release] = field(default_factory=list)
    #: load: vLLM keeps the request's blocks until this task is reported (an async
    #: load: the request waits in WAITING_FOR_REMOTE_KVS, even when aborted).
    holds_blocks: bool = False
    #: a whole step's saves as one task (``submit_save_step``): its objects, and the
    #: requests it stands for (pending under each; ``reserved`` is all of theirs).
    step: StepObjects | None = None
    reqs: tuple[str, ...] = ()


@dataclass(eq=False, slots=True)
class StepObjects:
    """A whole step's objects of one direction as parallel lists, without an op
    object per chunk: built once per step by the connector, moved by one backend
    call (``TransferEngine.load_step`` / ``save_step``). On a small step the Python
    around the copy runs with cold caches (the previous step's copy evicted them),
    so what counts is how little of it there is per object."""

    keys: list[str]
    regions: list[list[Region]]
    #: vLLM block ids per object (negative: already on the device, never reported)
    blocks: list[list[int]]
    #: per request, in order: (request id, end index into the lists, bytes)
    spans: list[tuple[str, int, int]]

    @property
    def nbytes(self) -> int:
        return sum(s[2] for s in self.spans)

    @property
    def shares_objects(self) -> bool:
        """Two requests save the same object: the per-request path handles it
        (the second finds the first's put)."""
        return len(self.spans) > 1 and len(set(self.keys)) != len(self.keys)

    def only(self, keep: Sequence[bool]) -> tuple[StepObjects, int]:
        """The requests whose ``keep`` is true (one flag per span), and how many
        objects the others had."""
        idx: list[int] = []
        spans: list[tuple[str, int, int]] = []
        start = dropped = 0
        for (req_id, end, nb), ok in zip(self.spans, keep, strict=True):
            if ok:
                idx.extend(range(start, end))
                spans.append((req_id, len(idx), nb))
            else:
                dropped += end - start
            start = end
        part = StepObjects([self.keys[i] for i in idx], [self.regions[i] for i in idx],
                           [self.blocks[i] for i in idx], spans)
        return part, dropped


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


def _addr(buf: object) -> int:
    """Start address of a buffer the engine or a stager allocated."""
    if isinstance(buf, ctypes.Array):
        return ctypes.addressof(buf)
    data_ptr = getattr(buf, "data_ptr", None)  # a torch tensor (pinned staging buffer)
    return int(data_ptr()) if data_ptr is not None else 0


def batches(ops: Sequence[ChunkOp], max_bytes: int, max_blocks: int = 0) -> Iterable[list[ChunkOp]]:
    """Split ops into batches of at most max_bytes and max_blocks (at least one op each)."""
    if not max_bytes and not max_blocks:
        if ops:
            yield list(ops)
        return
    cur: list[ChunkOp] = []
    size = blocks = 0
    for op in ops:
        nb = len(op.block_ids)
        if cur and ((max_bytes and size + op.nbytes > max_bytes) or (max_blocks and blocks + nb > max_blocks)):
            yield cur
            cur, size, blocks = [], 0, 0
        cur.append(op)
        size += op.nbytes
        blocks += nb
    if cur:
        yield cur


class TransferEngine:
    def __init__(
        self,
        guard: BackendGuard,
        *,
        queue_size: int = 64,
        save_queue_bytes: int = SAVE_QUEUE_BYTES,
        max_inflight_bytes: int = 0,
        stagger_index: int = 0,
        stagger_size: int = 1,
        stagger_delay_s: float = 0.0,
        name: str = "ascendstore",
        stager: Stager | None = None,
        layer_batch_bytes: int = 0,
        layer_batch_blocks: int = 0,
        prefetch_layers: int = 0,
        direct_async_loads: bool = False,
    ) -> None:
        self.guard = guard
        self.stager = stager
        caps = guard.capabilities
        self._registers = bool(caps.needs_registration or caps.zero_copy)
        #: Where loads land when the backend may write after its deadline and there
        #: is no device stager: host memory here (host KV); the connector puts one
        #: on the device instead for device KV that the backend reads (``use_landing``).
        self.landing: Stager | None = None if guard.direct else HostBounce(PIPELINE_BYTES, self.register_buffer)
        #: Async loads (``holds_blocks``) skip the landing buffer and its
        #: copy: their gets write vLLM's blocks, and one that overran holds its
        #: request unreported until it has ended (a hung client: up to its own
        #: 30-60 s, instead of the deadline, before the request recomputes).
        self.direct_async_loads = direct_async_loads
        #: saves of computed chunks ask no exists first: the store's put turns away what it holds.
        self.dedups_puts = bool(caps.dedups_puts)
        #: a step's save is one ``put_absent`` (the backend skips what it holds), not an exists and a put.
        self.puts_absent = guard.has_put_absent
        # One staging buffer per direction; sync loads share the load one.
        self._stage_locks = {"load": threading.Lock(), "save": threading.Lock()}
        self.metrics = guard.metrics
        #: requests whose lookup-to-load misses were logged (one line each; bounded)
        self._miss_logged: OrderedDict[str, None] = OrderedDict()
        self._miss_lock = threading.Lock()
        self.timeout_s = guard.timeout_s
        self.max_inflight_bytes = max_inflight_bytes
        self.stagger_index = stagger_index
        self.stagger_size = stagger_size
        self.stagger_delay_s = stagger_delay_s
        self.layer_batch_bytes = layer_batch_bytes
        self.layer_batch_blocks = layer_batch_blocks
        #: layerwise: layers the loader may run ahead of the forward pass (0: no limit).
        self.prefetch_layers = prefetch_layers
        self._forward_layer = -1
        self._budget = _ByteBudget(max_inflight_bytes)
        # Loads: unbounded (at most a step's requests x layers, and the forward
        # pass never blocks on a full queue). Saves: admitted in slots and bytes.
        self._queues: dict[str, queue.Queue] = {k: queue.Queue() for k in ("load", "save")}
        self._save_slots_limit = queue_size
        self._save_bytes_limit = save_queue_bytes
        self._save_slots = 0
        self._save_bytes = 0
        self._lock = threading.Lock()
        self._layer_cv = threading.Condition(self._lock)
        self._pending: dict[str, dict[str, list[_Task]]] = {"load": defaultdict(list), "save": defaultdict(list)}
        self._loaded: dict[str, set[int]] = {}
        self._saved: set[str] = set()
        self._layer_tasks: dict[int, list[_Task]] = defaultdict(list)
        #: saves whose put overran: finished only once those calls have ended.
        self._held: list[_Task] = []
        #: buffers a late call may still use, kept alive until it ends.
        self._retired: list[tuple[object, Release]] = []
        #: landing/staging regions registered with the backend, by buffer id.
        self._registered: dict[int, Region] = {}
        #: first keys of recent load batches, in issue order (staggering is visible here).
        self.load_order: deque[list[str]] = deque(maxlen=64)
        #: keys of saves now in the pool, for KV events; drained by take_landed().
        self._landed_keys: list[str] = []
        #: note landed keys at all: False when nobody drains them (KV events off),
        #: which spares a step's save a lock and a list of its keys.
        self.keeps_landed = True
        self._stop = threading.Event()
        self._name = name
        #: which engine thread this is (the load thread's gets may be watched).
        self._role = threading.local()
        #: With a backend that runs calls on the caller's thread but may outlive them
        #: (``bounded_calls`` and ``detaches_calls``), the load thread's gets go
        #: watched: the backend may block this thread instead of handing the call to
        #: a worker of its own, and the watchdog gives up on it at the deadline.
        self._watch: CallWatch | None = None
        if guard.inline and not guard.direct:
            self._watch = CallWatch(self._abandon, min(WATCH_TICK_S, max(0.005, self.timeout_s / 20)), name)
        self._threads: list[threading.Thread] = []
        for k in ("load", "save"):
            self._start_thread(k)

    def _start_thread(self, kind: str) -> None:
        t = threading.Thread(target=self._run, args=(kind,), name=f"{self._name}-{kind}", daemon=True)
        with self._lock:
            # (load threads whose call was given up end once it returns: forget those)
            self._threads = [*(x for x in self._threads if x.is_alive()), t]
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
        holds_blocks: bool = False,
    ) -> None:
        """Queue a load for the load thread. ``holds_blocks``: vLLM keeps the
        request's blocks until it is reported (async loads), so a get that
        overran may be waited out instead of landing in a buffer (``direct_async_loads``)."""
        task = _Task("load", req_id, list(ops), layer=layer, after=after, deadline=deadline,
                     holds_blocks=holds_blocks and layer is None)
        if layer is not None:
            with self._lock:
                self._layer_tasks[layer].append(task)
        self._enqueue(task)

    def wait_layer(self, layer: int, timeout_s: float | None = None) -> set[int]:
        """Wait (bounded) for this step's loads of one layer; returns failed blocks."""
        with self._lock:
            tasks = self._layer_tasks.pop(layer, [])
            # The forward pass reached this layer: the loader may run further ahead.
            self._forward_layer = max(self._forward_layer, layer)
            self._layer_cv.notify_all()
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

    def new_step(self) -> None:
        """Layerwise: a new forward pass starts at layer 0."""
        with self._lock:
            self._forward_layer = -1

    def _wait_forward(self, task: _Task) -> None:
        """Layerwise prefetch bound: load layer i once the forward pass reached
        layer i - prefetch_layers (bounded by the task's deadline)."""
        if not self.prefetch_layers or task.layer is None:
            return
        with self._lock:
            while task.layer - self._forward_layer > self.prefetch_layers and not task.cancelled:
                left = self._time_left(task)
                if left <= 0 or not self._layer_cv.wait(left):
                    return

    # -- saves ------------------------------------------------------------------------
    def admit_save(self, tasks: int, nbytes: int) -> bool:
        """Reserve room for a step's saves of one request (all its layers at once,
        so a chunk is never stored with some layers dropped). False: skip them."""
        with self._lock:
            busy = self._save_slots > 0
            if busy and (self._save_slots + tasks > self._save_slots_limit
                         or (self._save_bytes_limit and self._save_bytes + nbytes > self._save_bytes_limit)):
                return False
            self._save_slots += tasks
            self._save_bytes += nbytes
            return True

    def submit_save(
        self,
        req_id: str,
        ops: Sequence[ChunkOp],
        *,
        layer: int | None = None,
        before: Hook | None = None,
        skip_existing: bool = True,
        shared_exists: SharedExists | None = None,
        admitted: bool = False,
        inline: bool = False,
        computed: bool = False,
    ) -> bool:
        """Queue a save; False if there was no room (the save is dropped, a future miss).

        ``admitted``: room was reserved with ``admit_save`` (layerwise: once for all layers).
        ``inline``: run it now on the calling thread (a small in-process copy costs
        less than waking a transfer thread on a CPU whose cores spin in OpenMP).
        ``computed``: no object is a device prefix hit's, re-saved in case the pool
        lost it; a store that turns duplicate puts away is then asked no exists."""
        nbytes = sum(op.nbytes for op in ops)
        if not admitted and not self.admit_save(1, nbytes):
            self.metrics.add(save_dropped_queue_full=len(ops))
            return False
        # A save that cannot start within the timeout is dropped: its blocks go
        # back to vLLM promptly instead of waiting behind a slow store.
        # A store that turns duplicate puts away itself (``dedups_puts``) is asked no
        # exists before objects just computed: its put is the dedup, one round trip
        # fewer. Still asked: before a device prefix hit's re-save (the pool holds
        # those usually, and save_skipped_existing counts them right), and by
        # layerwise saves (a chunk stored with a layer missing is removed whole,
        # which needs to know which layers this task itself wrote).
        if computed and self.dedups_puts and shared_exists is None:
            skip_existing = False
        task = _Task("save", req_id, list(ops), layer=layer, before=before, skip_existing=skip_existing,
                     shared_exists=shared_exists, deadline=time.monotonic() + self.timeout_s, reserved=nbytes)
        if inline:
            with self._lock:
                self._pending["save"][req_id].append(task)
            self._execute(task)
            return True
        self._enqueue(task)
        return True

    # -- a whole step in one call ----------------------------------------------------
    @property
    def fused(self) -> bool:
        """A step's sync loads (and inline saves) may go as one backend call
        (``load_step``, ``save_step``): the backend runs on this thread and is done
        with the memory when it returns (``guard.direct``), KV is host memory the
        backend reads (no stager), and neither an in-flight byte cap nor a stagger
        delay asks for batches or waits."""
        return (self.guard.direct and self.stager is None and not self.max_inflight_bytes
                and not (self.stagger_delay_s and self.stagger_index))

    def load_step(self, step: StepObjects, deadline: float) -> set[int]:
        """The sync loads of a step as one backend call (requires ``fused``), the
        same outcome as one ``load_now`` per request: each request's reads
        staggered, one deadline, failed blocks returned (all requests together),
        misses logged per request, corrupt objects dropped."""
        keys, regions, blocks = step.keys, step.regions, step.blocks
        if self.stagger_size > 1:
            order: list[int] = []
            start = 0
            for _, end, _ in step.spans:
                part = stagger(range(start, end), self.stagger_index, self.stagger_size)
                if part:
                    self.load_order.append([keys[i] for i in part])
                order += part
                start = end
            keys, regions, blocks = [keys[i] for i in order], [regions[i] for i in order], [blocks[i] for i in order]
        else:
            start = 0
            for _, end, _ in step.spans:
                if end > start:
                    self.load_order.append(keys[start:end])
                start = end
        n = len(keys)
        if not n:
            return set()
        left = min(self.timeout_s, deadline - time.monotonic())
        if left > 0:
            t0 = time.perf_counter()
            statuses = self.guard.get(keys, regions, left)
            dt = time.perf_counter() - t0
        else:  # the step's time is spent: fail fast (recompute)
            statuses, dt = [Status.TIMEOUT] * n, 0.0
        if statuses.count(Status.OK) == n:  # the usual case: no pass per object
            if dt:
                self.metrics.add(load_ops=n, load_bytes=step.nbytes, load_time_s=dt)
            return set()
        failed: set[int] = set()
        good = good_bytes = 0
        corrupt: list[str] = []
        start = 0
        for req_id, end, _ in step.spans:
            gone = []
            for i in range(start, end):
                st = statuses[i]
                if st is Status.OK:
                    good += 1
                    good_bytes += sum(r.length for r in regions[i])
                    continue
                failed.update(b for b in blocks[i] if b >= 0)
                if st is Status.NOT_FOUND:
                    gone.append(keys[i])
                elif st is Status.CORRUPT:
                    corrupt.append(keys[i])
            if gone:
                self._log_lookup_miss(req_id, gone)
            start = end
        if dt:
            self.metrics.add(load_ops=good, load_bytes=good_bytes, load_time_s=dt)
        self.metrics.add(load_failures=n - good)
        if corrupt:
            self._drop_corrupt(corrupt)
        return failed

    def save_step(self, step: StepObjects) -> bool:
        """A step's saves run now on this thread as one exists and one put, or one
        ``put_absent`` where the backend has it (requires ``fused``), the same
        outcome as one inline ``submit_save`` per request: each request admitted
        against the save queue on its own (one not admitted is dropped), objects
        already pooled skipped, landed keys noted. False (nothing done): two
        requests save the same object in this step, which the per-request path
        handles (the second finds the first's put)."""
        if step.shares_objects:
            return False
        # One inline save is admitted, runs and gives its room back before the
        # next: each request needs room beside the queued (async) saves only.
        with self._lock:
            slots, queued = self._save_slots, self._save_bytes
        admitted = [not slots or (slots + 1 <= self._save_slots_limit
                                  and not (self._save_bytes_limit and queued + nb > self._save_bytes_limit))
                    for _, _, nb in step.spans]
        kept = step
        if not all(admitted):
            kept, dropped = step.only(admitted)
            self.metrics.add(save_dropped_queue_full=dropped)
        try:
            if kept.keys:
                self._save_flat(kept.keys, kept.regions, kept.nbytes)
        finally:
            with self._lock:
                self._saved.update(req_id for req_id, _, _ in kept.spans)
        return True

    def submit_save_step(self, step: StepObjects, before: Hook | None = None) -> bool:
        """A step's saves as one task on the save thread (requires ``fused``), the
        same outcome as one ``submit_save`` per request: each request admitted on
        its own (one without room is dropped), pending under its own id until the
        task ends, objects already pooled skipped; one exists and one put (or one
        ``put_absent``). False (nothing queued): two requests save the same object
        in this step (see ``save_step``)."""
        if not step.spans:
            return True
        if step.shares_objects:
            return False
        admitted = [self.admit_save(1, nb) for _, _, nb in step.spans]
        if not all(admitted):
            step, dropped = step.only(admitted)
            self.metrics.add(save_dropped_queue_full=dropped)
            if not step.spans:
                return True
        reqs = tuple(s[0] for s in step.spans)
        task = _Task("save", reqs[0], [], before=before, deadline=time.monotonic() + self.timeout_s,
                     reserved=step.nbytes, step=step, reqs=reqs)
        with self._lock:
            for r in reqs:
                self._pending["save"][r].append(task)
        q = self._queues["save"]
        q.put(task)
        self.metrics.peak(queue_depth_max=q.qsize())
        return True

    def _save_flat(self, keys: list[str], regions: list[list[Region]], nbytes: int | None) -> None:
        """``nbytes``: of all the objects, if known (saves a pass over the regions)."""
        if self.puts_absent:
            return self._save_absent(keys, regions, nbytes)
        exists = self.guard.exists(keys)
        if Status.OK in exists:
            nbytes = None
            present = [k for k, s in zip(keys, exists, strict=True) if s is Status.OK]
            self.metrics.add(save_skipped_existing=len(present))
            self._note_landed(present)
            idx = [i for i, s in enumerate(exists) if s is not Status.OK]
            keys, regions = [keys[i] for i in idx], [regions[i] for i in idx]
            if not keys:
                return
        t0 = time.perf_counter()
        statuses = self.guard.put(keys, regions)
        dt = time.perf_counter() - t0
        n = len(keys)
        if statuses.count(Status.OK) == n:
            if nbytes is None:
                nbytes = sum(r.length for rs in regions for r in rs)
            self.metrics.add(save_ops=n, save_bytes=nbytes, save_time_s=dt)
            self._note_landed(keys)
            return
        good = [i for i, s in enumerate(statuses) if s is Status.OK]
        no_space = statuses.count(Status.NO_SPACE)
        self.metrics.add(save_ops=len(good), save_bytes=sum(r.length for i in good for r in regions[i]),
                         save_time_s=dt, save_failures=n - len(good) - no_space, save_no_space=no_space)
        if good:
            self._note_landed(keys[i] for i in good)

    def _save_absent(self, keys: list[str], regions: list[list[Region]], nbytes: int | None) -> None:
        """``_save_flat`` as one call: the backend's ``put_absent`` skips what it
        holds itself (the local pool, under the lock it takes anyway). The same
        outcome as an exists then a put of the rest, and the same counters. It
        saves the exists' call, which a step pays cold, right after its copy
        evicted the caches (docs/benchmarking.md)."""
        if not keys:
            return
        present: list[int] = []
        t0 = time.perf_counter()
        statuses = self.guard.put_absent(keys, regions, present)
        dt = time.perf_counter() - t0
        n = len(keys)
        if not present and statuses.count(Status.OK) == n:  # the usual case: all stored, none held
            if nbytes is None:
                nbytes = sum(r.length for rs in regions for r in rs)
            self.metrics.add(save_ops=n, save_bytes=nbytes, save_time_s=dt)
            self._note_landed(keys)
            return
        # (an index of a key that did not end OK is not trusted as held)
        held = {i for i in present if statuses[i] is Status.OK} if present else set()
        if held:
            self.metrics.add(save_skipped_existing=len(held))
            self._note_landed(keys[i] for i in sorted(held))
        good = [i for i, s in enumerate(statuses) if s is Status.OK and i not in held]
        no_space = statuses.count(Status.NO_SPACE)
        self.metrics.add(save_ops=len(good), save_bytes=sum(r.length for i in good for r in regions[i]),
                         save_time_s=dt, save_failures=n - len(held) - len(good) - no_space, save_no_space=no_space)
        if good:
            self._note_landed(keys[i] for i in good)

    def take_landed(self) -> list[str]:
        """Keys of saves that are in the pool since the last call: put OK, or
        found there already and skipped (for BlockStored events)."""
        with self._lock:
            keys, self._landed_keys = self._landed_keys, []
        return keys

    def _note_landed(self, keys: Iterable[str]) -> None:
        if not self.keeps_landed:
            return
        with self._lock:
            self._landed_keys.extend(keys)
            if len(self._landed_keys) > 1 << 16:
                # Nobody drains them (events off): keep memory bounded.
                del self._landed_keys[: 1 << 15]

    # -- bookkeeping ------------------------------------------------------------------
    def _task_timeout(self, tasks: Sequence[_Task]) -> float:
        # Each batch call is bounded by timeout_s; allow for every batch queued ahead.
        return self.timeout_s * (2 + sum(1 + (len(t.step.keys) if t.step else len(t.ops)) // 64 for t in tasks)
                                 ) + self.stagger_delay_s

    def _enqueue(self, task: _Task) -> None:
        with self._lock:
            self._pending[task.kind][task.req_id].append(task)
        q = self._queues[task.kind]
        q.put(task)
        self.metrics.peak(queue_depth_max=q.qsize())

    def _finish(self, task: _Task) -> None:
        with self._lock:
            for req_id in task.reqs or (task.req_id,):
                lst = self._pending[task.kind].get(req_id, [])
                if task in lst:
                    lst.remove(task)
                if task.kind == "load":
                    self._loaded.setdefault(req_id, set()).update(task.failed)
                    if not lst:
                        self._pending["load"].pop(req_id, None)
                else:
                    self._save_slots -= 1
                    if not lst:
                        self._pending["save"].pop(req_id, None)
                        self._saved.add(req_id)
            if task.kind == "save":
                self._save_bytes -= task.reserved
        task.done.set()

    def _end(self, task: _Task) -> None:
        """A task is over for vLLM only when no call may still use its blocks: a
        put reading them, or a direct async load's get writing them."""
        if task.held and not all(r() for r in task.held):
            if task.kind == "save":
                self.metrics.add(save_held_late=1)
                log.warning("a put of %s overran its deadline; its blocks stay held until it ends", task.req_id)
            else:
                self.metrics.add(load_held_late=1)
                log.warning("a get for %s overran its deadline; the request's blocks stay held (and the load "
                            "unreported) until it ends", task.req_id)
            with self._lock:
                self._held.append(task)
            return
        self._finish(task)

    def _reap(self) -> None:
        """Finish held saves and free retired buffers whose late calls have ended."""
        _prune_linger()
        if not self._held and not self._retired:
            return
        with self._lock:
            done = [t for t in self._held if all(r() for r in t.held)]
            self._held = [t for t in self._held if t not in done]
            freed = [b for b, r in self._retired if r()]
            self._retired = [(b, r) for b, r in self._retired if not r()]
        for b in freed:
            region = self._registered.pop(_addr(b), None)
            if region is not None:
                self.guard.unregister([region])
        for t in done:
            log.info("late %s of %s ended; its blocks go back to vLLM", "put" if t.kind == "save" else "get",
                     t.req_id)
            self._finish(t)

    def use_landing(self, make: Callable[[Callable[[Region], None]], Stager]) -> None:
        """Loads land in ``make(register_buffer)`` instead of host memory (device KV
        that the backend reads directly); nothing changes where they need no landing."""
        if self.landing is not None:
            self.landing = make(self.register_buffer)

    def register_buffer(self, region: Region) -> None:
        """Landing and staging buffers the engine allocates are registered like
        vLLM's KV when the backend reads or writes registered memory (RDMA)."""
        if self._registers:
            self.guard.register([region])
            self._registered[region.addr] = region

    def _retire(self, stager: Stager, direction: str, release: Release) -> None:
        old, region = stager.detach(direction)
        with self._lock:
            self._retired.append((old, release))
        self.metrics.add(load_buffers_retired=1)
        if region is not None:
            self.register_buffer(region)

    def _landing_full(self) -> bool:
        self._reap()
        with self._lock:
            return len(self._retired) >= MAX_RETIRED_BUFFERS

    def _stuck_full(self) -> bool:
        """As many direct async loads wait out a late get as buffers may be retired."""
        self._reap()
        with self._lock:
            return sum(t.kind == "load" for t in self._held) >= MAX_RETIRED_BUFFERS

    def pending(self, kind: str, req_id: str) -> bool:
        self._reap()
        with self._lock:
            return bool(self._pending[kind].get(req_id))

    def take_results(self) -> TransferResult:
        """Requests whose loads all finished (with failed blocks) and whose saves all finished."""
        self._reap()
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
                if not self._wait_done(t, deadline):
                    return False
        return True

    def _wait_done(self, task: _Task, deadline: float) -> bool:
        while not task.done.wait(max(0.0, min(deadline - time.monotonic(), WATCH_TICK_S))):
            if time.monotonic() >= deadline:
                return False
            # A held task ends when its late call has: nobody else may be reaping.
            self._reap()
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
        # Nothing waits on the save thread call by call (a late put holds its blocks
        # anyway; saves queued behind it that cannot start in time are dropped): a
        # backend may run puts there past their deadline and skip a hand-off.
        with blocking_caller() if kind == "save" else nullcontext():
            self._serve(kind)

    def _serve(self, kind: str) -> None:
        q = self._queues[kind]
        self._role.load_thread = kind == "load"
        while not self._stop.is_set():
            try:
                task = q.get(timeout=0.1)
            except queue.Empty:
                continue
            if task is None:
                break
            try:
                self._execute(task)
            except _Abandoned:
                # The watchdog failed the task and started another load thread; a
                # task it held for this call may be reported now.
                self._reap()
                return
            except Exception:
                log.exception("%s task for %s failed", kind, task.req_id)
                if kind == "load":
                    task.failed.update(b for op in task.ops for b in op.block_ids)
                    self._end(task)
                else:
                    self._end(task)

    def _execute(self, task: _Task) -> None:
        if task.cancelled:
            if task.kind == "load":
                task.failed.update(b for op in task.ops for b in op.block_ids)
            self._finish(task)
            return
        if task.kind == "load":
            self._do_load(task)
            self._end(task)
        else:
            self._do_save(task)
            self._end(task)

    def _time_left(self, task: _Task) -> float:
        """Seconds the task's next backend call may take: the timeout, capped by the task's deadline."""
        if task.deadline is None:
            return self.timeout_s
        return min(self.timeout_s, task.deadline - time.monotonic())

    def _load_stager(self) -> Stager | None:
        """Where gets land: vLLM's blocks (None), the device stager, or the bounce buffer."""
        return self.stager or self.landing

    def _batch_limit(self, task: _Task, pipelined: bool, stager: Stager | None) -> tuple[int, int]:
        limits = [x for x in (self.max_inflight_bytes, stager.capacity if stager else 0,
                              PIPELINE_BYTES if pipelined else 0) if x]
        if task.layer is not None and self.layer_batch_bytes:
            limits.append(self.layer_batch_bytes)
        return (min(limits) if limits else 0), (self.layer_batch_blocks if task.layer is not None else 0)

    def _do_load(self, task: _Task) -> None:
        self._wait_forward(task)
        ops = stagger(task.ops, self.stagger_index, self.stagger_size)
        if ops:
            self.load_order.append([op.key for op in ops])
        if self.stagger_delay_s and self.stagger_index:
            time.sleep(max(0.0, min(self.stagger_delay_s * self.stagger_index, self._time_left(task))))
        stager = self._load_stager()
        # Straight into vLLM's blocks with a backend that never outlives its calls,
        # or for an async load (its blocks stay vLLM's loan until it is reported)
        # when told so; overlapped on a guard thread unless the backend runs
        # inline (a hand-off costs more than the overlap gains for an in-process copy).
        held_direct = stager is not None and stager is self.landing and self._holds_direct(task)
        if held_direct:
            stager = None
        pipelined = stager is None and not self.guard.inline
        pending: tuple[list[ChunkOp], int, PendingCall, float] | None = None
        max_bytes, max_blocks = self._batch_limit(task, pipelined, stager)
        for batch in batches(ops, max_bytes, max_blocks):
            # Build this batch's regions while the previous batch is being copied.
            regions = [op.regions if op.build is None else op.materialize() for op in batch]
            if pending is not None:
                self._collect_load(task, *pending)
                pending = None
            nbytes = sum(op.nbytes for op in batch)
            left = self._time_left(task)
            if task.cancelled or left <= 0 or not self._budget.acquire(nbytes, left):
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
                if held_direct:  # into vLLM's blocks, waited out if it overruns
                    statuses = self._held_get(task, batch, regions)
                elif stager is None:  # inline into vLLM's blocks (a direct, bounded backend)
                    statuses = self.guard.get([op.key for op in batch], regions, max(0.0, self._time_left(task)))
                else:
                    statuses = self._staged_get(task, batch, stager)
            finally:
                self._budget.release(nbytes)
            self._load_done(task, batch, statuses, time.perf_counter() - t0, nbytes)
        if pending is not None:
            self._collect_load(task, *pending)

    def _holds_direct(self, task: _Task) -> bool:
        return self.direct_async_loads and task.holds_blocks and self._on_load_thread()

    def _on_load_thread(self) -> bool:
        return getattr(self._role, "load_thread", False)

    def _held_get(self, task: _Task, batch: list[ChunkOp], regions: list[list[Region]]) -> list[Status]:
        """An async load's get straight into vLLM's blocks. If it overruns (the
        watchdog gives up on it, or the backend detached it), the load fails and
        the task stays unreported, so vLLM keeps the blocks, until the call ends."""
        if self._stuck_full():
            return [Status.TIMEOUT] * len(batch)  # every spare thread is stuck in a get: recompute
        left = max(0.0, self._time_left(task))
        watch = (self._watch.watching(time.monotonic() + left + GRACE_S, (task, batch, None, None))
                 if self._watch is not None else nullcontext())
        with watch as watched:
            call = self.guard.submit_get([op.key for op in batch], regions, left)
            statuses = self.guard.result(call)
        if watched is not None and watched.abandoned:
            watched.settled.wait()
            raise _Abandoned  # the watchdog failed the task and holds it until this returned
        release = self.guard.hold_for(call, statuses)
        if release is not None:
            task.held.append(release)
        return statuses

    def _stage_lock(self, task: _Task) -> threading.Lock | None:
        """The load stager's lock, held; None when the task's time ran out first."""
        while True:
            lock = self._stage_locks["load"]
            if not lock.acquire(timeout=max(0.0, self._time_left(task))):
                return None
            if lock is self._stage_locks["load"]:
                return lock
            # Replaced while we waited: its holder's call was abandoned, and the
            # buffer it guarded is retired (``_abandon``). Queue on the new one.
            lock.release()

    def _staged_get(self, task: _Task, batch: list[ChunkOp], stager: Stager) -> list[Status]:
        """Get into connector-owned memory, then copy what arrived in time."""
        timeout = [Status.TIMEOUT] * len(batch)
        if self._landing_full():
            return timeout  # every spare buffer is held by a stuck call: recompute
        lock = self._stage_lock(task)
        if lock is None:
            return timeout
        watched: WatchedCall | None = None
        try:
            # Again under the lock: while we waited, the holder's call may have been
            # given up and its buffer retired (the bound counted before is stale).
            left = self._time_left(task)
            if left <= 0 or self._landing_full():
                return timeout
            keys = [op.key for op in batch]
            try:
                regions = stager.stage_in(batch)
            except Exception:  # e.g. no device memory left for a fresh landing buffer
                log.exception("no landing buffer for a load of %d object(s) for %s; they are recomputed",
                              len(batch), task.req_id)
                return [Status.UNAVAILABLE] * len(batch)
            watch = (self._watch.watching(time.monotonic() + left + GRACE_S, (task, batch, stager, lock))
                     if self._watch is not None and self._on_load_thread() else nullcontext())
            with watch as watched:
                call = self.guard.submit_get(keys, regions, left)
                statuses = self.guard.result(call)
            if watched is not None and watched.abandoned:
                # Too late: the watchdog failed the task and retired this buffer.
                # Touch neither.
                raise _Abandoned
            release = self.guard.hold_for(call, statuses)
            # Objects that arrived whole are safe to copy even if another key's
            # native call goes on writing its own part of the buffer.
            stager.commit_in(batch, [st is Status.OK for st in statuses])
            if release is not None:
                self._retire(stager, "load", release)
            return statuses
        finally:
            if watched is not None and watched.abandoned:
                # ``_abandon`` let go of this lock for us once the buffer was swapped
                # (so waiters did not wait out this call); wait until it has.
                watched.settled.wait()
            else:
                lock.release()

    def _abandon(self, watched: WatchedCall) -> None:
        """The watchdog gave up on a load thread's get (it overran its deadline):
        the request's blocks fail (recompute), the landing buffer the call still
        holds is retired until the call returns, and a new load thread takes the
        queue. The stuck thread, when its call returns, only ends."""
        task, batch, stager, old = watched.payload
        n = len(batch)
        log.warning("a get of %d object(s) for %s ran past its deadline on the load thread; failing the load "
                    "(recompute) and starting another load thread", n, task.req_id)
        self.metrics.add(timeouts=n, load_failures=n, loads_abandoned=1)
        self.guard.observe("get", [Status.TIMEOUT] * n)
        backend = self.guard.backend
        if stager is None:
            # Straight into vLLM's blocks (``_held_get``): the request stays
            # unreported, so vLLM keeps them, until the call has ended.
            task.held.append(lambda: watched.returned and backend.quiescent())
            self._fail_given_up(task, batch)
            return
        # Swap the buffer under a fresh lock held meanwhile: a waiter on the old
        # lock sees it replaced and queues here, never on the retired buffer.
        fresh = threading.Lock()
        fresh.acquire()
        try:
            self._stage_locks["load"] = fresh
            self._retire(stager, "load", lambda: watched.returned and backend.quiescent())
        finally:
            fresh.release()
            # The stuck thread holds the old lock until its call returns, maybe for
            # the client's own 30-60 s; its waiters (a sync load on vLLM's forward
            # thread) must not wait that out. A ``Lock`` may be released by any
            # thread; the stuck thread, seeing itself abandoned, leaves it alone.
            old.release()
            self._fail_given_up(task, batch)

    def _fail_given_up(self, task: _Task, batch: list[ChunkOp]) -> None:
        """The whole load fails (recompute); it ends now, or once its late call has
        (held); another load thread takes the queue."""
        task.failed.update(b for op in task.ops for b in op.block_ids)
        try:
            if task.after is not None:
                task.after(batch, [Status.TIMEOUT] * len(batch))
        finally:
            self._end(task)
            if not self._stop.is_set():
                self._start_thread("load")

    def _collect_load(self, task: _Task, batch: list[ChunkOp], nbytes: int, call: PendingCall, t0: float) -> None:
        try:
            statuses = self.guard.result(call)
        finally:
            self._budget.release(nbytes)
        self._load_done(task, batch, statuses, time.perf_counter() - t0, nbytes)

    def _load_done(self, task: _Task, batch: list[ChunkOp], statuses: list[Status], dt: float,
                   nbytes: int = 0) -> None:
        if statuses.count(Status.OK) == len(batch):  # the usual case, without a pass per op
            if dt:
                self.metrics.add(load_ops=len(batch), load_bytes=nbytes or sum(op.nbytes for op in batch),
                                 load_time_s=dt)
        else:
            good = [op for op, s in zip(batch, statuses, strict=True) if s is Status.OK]
            if dt:
                self.metrics.add(load_ops=len(good), load_bytes=sum(op.nbytes for op in good), load_time_s=dt)
            bad = [op for op, s in zip(batch, statuses, strict=True) if s is not Status.OK]
            self.metrics.add(load_failures=len(bad))
            gone = [op.key for op, s in zip(batch, statuses, strict=True) if s is Status.NOT_FOUND]
            if gone:
                self._log_lookup_miss(task.req_id, gone)
            for op in bad:
                task.failed.update(op.block_ids)
            corrupt = [op.key for op, s in zip(batch, statuses, strict=True) if s is Status.CORRUPT]
            if corrupt:
                self._drop_corrupt(corrupt)
        if task.after is not None:
            task.after(batch, statuses)

    def _log_lookup_miss(self, req_id: str, keys: list[str]) -> None:
        """One line per request (not per batch or layer): chunks the lookup counted
        were gone at load (counted in ``lookup_load_misses`` by the guard's observer)."""
        with self._miss_lock:
            if req_id in self._miss_logged:
                return
            self._miss_logged[req_id] = None
            while len(self._miss_logged) > 1024:
                self._miss_logged.popitem(last=False)
        log.warning("request %s: %d pool object(s) counted by the lookup were gone at load (evicted or removed "
                    "since); recomputing their blocks. First: %s", req_id, len(keys), keys[0])

    def _drop_corrupt(self, keys: list[str]) -> None:
        """A damaged object would fail every later load, and saves skip keys that
        exist: remove it so the next save of that chunk writes it afresh."""
        self.metrics.add(load_corrupt=len(keys))
        log.warning("pool returned %d corrupt object(s), removing them (recomputed): %s",
                    len(keys), ", ".join(keys[:4]) + (" ..." if len(keys) > 4 else ""))
        # Off the load path: a synchronous step must not wait for the repair.
        self.guard.submit_remove(keys)

    def _late(self, task: _Task) -> bool:
        if task.deadline is not None and time.monotonic() > task.deadline:
            return True
        return False

    def _do_save(self, task: _Task) -> None:
        if task.before is not None:
            task.before()
        if task.step is not None:
            if self._late(task):
                self.metrics.add(save_dropped_late=len(task.step.keys))
            else:
                self._save_flat(task.step.keys, task.step.regions, task.step.nbytes)
            return
        ops = task.ops
        # Per-op outcomes matter only to layerwise saves sharing one exists (a chunk
        # is stored whole or dropped); plain saves skip that bookkeeping.
        track = task.shared_exists is not None and task.layer is not None
        landed: dict[int, bool] | None = {} if track else None  # id(op) -> in the pool after this task
        stored: set[int] | None = set() if track else None  # id(op) put by this task
        try:
            self._save_ops(task, ops, landed, stored)
        finally:
            if track:
                assert task.shared_exists is not None and landed is not None and stored is not None
                drop = task.shared_exists.settle(task.req_id, ops, [landed.get(id(op), False) for op in ops],
                                                 [id(op) in stored for op in ops])
                if drop and self.dedups_puts:
                    # A put such a store turned away answered OK like one that stored:
                    # some of these may be another engine's whole chunk, which a reader
                    # may be reading (Mooncake's forced removal would tear that read).
                    # Left to eviction: a lookup never counts a chunk missing a layer.
                    self.metrics.add(save_partial_left=len(drop))
                elif drop:
                    self.metrics.add(save_partial_removed=len(drop))
                    self.guard.submit_remove(drop)

    def _save_ops(self, task: _Task, ops: list[ChunkOp], landed: dict[int, bool] | None,
                  stored: set[int] | None) -> None:
        if self._late(task):
            # Waited in the queue past the timeout: give the blocks back now.
            self.metrics.add(save_dropped_late=len(ops))
            return
        if task.skip_existing and ops:
            if task.shared_exists is not None:
                present = task.shared_exists.present(self.guard)
                keep = [op for op in ops if op.key not in present] if present else ops
            else:
                exists = self.guard.exists([op.key for op in ops])
                if Status.OK not in exists:  # the usual case: nothing of this save is pooled yet
                    keep = ops
                else:
                    keep = [op for op, s in zip(ops, exists, strict=True) if s is not Status.OK]
            if len(keep) != len(ops):
                self.metrics.add(save_skipped_existing=len(ops) - len(keep))
                kept = {id(op) for op in keep}
                existing = [op for op in ops if id(op) not in kept]
                if landed is not None:
                    landed.update((id(op), True) for op in existing)
                self._note_landed(op.key for op in existing)
            ops = keep
        stager = self.stager
        pipelined = stager is None and not self.guard.inline
        pending: tuple[list[ChunkOp], int, PendingCall, float, list[str]] | None = None
        max_bytes, max_blocks = self._batch_limit(task, pipelined, stager)
        for batch in batches(ops, max_bytes, max_blocks):
            regions = [op.regions if op.build is None else op.materialize() for op in batch]
            if pending is not None:
                self._collect_save(task, *pending, landed, stored)
                pending = None
            nbytes = sum(op.nbytes for op in batch)
            if not self._budget.acquire(nbytes, self.timeout_s):
                self.metrics.add(save_failures=len(batch))
                continue
            t0 = time.perf_counter()
            keys = [op.key for op in batch]
            if pipelined or stager is None:
                pending = (batch, nbytes, self.guard.submit_put(keys, regions), t0, keys)
                if not pipelined:  # an inline backend: the put already ran on this thread
                    self._collect_save(task, *pending, landed, stored)
                    pending = None
                continue
            try:
                with self._stage_locks["save"]:
                    call = self.guard.submit_put(keys, stager.stage_out(batch))  # type: ignore[union-attr]
                    statuses = self.guard.result(call)
                    release = self.guard.hold_for(call, statuses)
                    if release is not None:
                        # The late put reads the staging buffer, not vLLM's blocks.
                        self._retire(stager, "save", release)  # type: ignore[arg-type]
            finally:
                self._budget.release(nbytes)
            self._save_done(batch, nbytes, keys, statuses, time.perf_counter() - t0, landed, stored)
        if pending is not None:
            self._collect_save(task, *pending, landed, stored)

    def _collect_save(self, task: _Task, batch: list[ChunkOp], nbytes: int, call: PendingCall, t0: float,
                      keys: list[str], landed: dict[int, bool] | None, stored: set[int] | None) -> None:
        try:
            statuses = self.guard.result(call)
            release = self.guard.hold_for(call, statuses)
            if release is not None:
                # The put may still be reading vLLM's blocks: they stay held.
                task.held.append(release)
        finally:
            self._budget.release(nbytes)
        self._save_done(batch, nbytes, keys, statuses, time.perf_counter() - t0, landed, stored)

    def _save_done(self, batch: list[ChunkOp], nbytes: int, keys: list[str], statuses: list[Status], dt: float,
                   landed: dict[int, bool] | None, stored: set[int] | None) -> None:
        if statuses.count(Status.OK) == len(batch):  # the usual case, without a pass per op
            good, good_bytes, no_space = batch, nbytes, 0
            good_keys: Iterable[str] = keys
        else:
            good = [op for op, s in zip(batch, statuses, strict=True) if s is Status.OK]
            good_bytes = sum(op.nbytes for op in good)
            no_space = statuses.count(Status.NO_SPACE)
            good_keys = (op.key for op in good)
        if landed is not None and stored is not None:
            for op in good:
                landed[id(op)] = True
                stored.add(id(op))
        self.metrics.add(
            save_ops=len(good),
            save_bytes=good_bytes,
            save_time_s=dt,
            save_failures=len(batch) - len(good) - no_space,
            save_no_space=no_space,
        )
        if good:
            self._note_landed(good_keys)

    def shutdown(self, timeout_s: float = 5.0, keepalive: object = None) -> None:
        """Finish queued saves (bounded), then stop the threads.

        ``keepalive`` (e.g. vLLM's KV tensors) outlives this engine while a late
        put may still read it; retired buffers likewise."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            reqs = list(self._pending["save"])
        self.wait("save", reqs, timeout_s)
        self._stop.set()
        if self._watch is not None:
            self._watch.close()
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._reap()
        with self._lock:
            lingering = list(self._retired)
            releases = [r for t in self._held for r in t.held]
            self._retired, self._held = [], []
        if releases:
            lingering.append((keepalive, lambda: all(r() for r in releases)))
        if lingering:
            log.warning("%d backend call(s) still running at shutdown; their memory is kept until they end",
                        len(lingering))
            with _LINGER_LOCK:
                _LINGER.extend(lingering)
