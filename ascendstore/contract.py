"""The backend contract: what a storage plugin implements.

Small on purpose. The core owns threads, batching, timeouts, retries, dedup,
staggering and metrics; a backend translates these calls to its library and
reports per-key results from a closed set of statuses. An *expected* failure
(missing key, full pool, unreachable service, timeout) is a status, never an
exception; exceptions are for bugs and for set-up errors (``BackendSetupError``).
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from ascendstore.local._shmpool import keys_fit as _keys_fit  # (the core's one C extension)


class Status(enum.IntEnum):
    """Per-key result of a backend call."""

    OK = 0
    NOT_FOUND = 1
    NO_SPACE = 2
    TIMEOUT = 3
    UNAVAILABLE = 4
    CORRUPT = 5
    INVALID = 6

    @property
    def is_miss(self) -> bool:
        """Statuses a reader treats as "not in the pool" (recompute instead)."""
        return self is not Status.OK


@dataclass(frozen=True, slots=True)
class Region:
    """A span of process memory: the unit the pool copies to and from."""

    addr: int
    length: int

    def __post_init__(self) -> None:
        if self.addr < 0 or self.length < 0:
            raise ValueError(f"bad region addr={self.addr} length={self.length}")


@dataclass(frozen=True)
class Capabilities:
    """What a backend promises. The engine and the conformance suite read these
    instead of special-casing backends by name."""

    #: put/get copy straight between registered memory and the store.
    zero_copy: bool = False
    #: puts of many small per-layer objects are efficient (layerwise mode).
    layerwise: bool = False
    #: an object put by one process is readable by another on the same node.
    shared_across_processes: bool = False
    #: ... and by a process on another node.
    shared_across_nodes: bool = False
    #: objects survive close() and reopen of every client.
    persistent: bool = False
    #: the store evicts by itself when full (else puts report NO_SPACE).
    evicts: bool = False
    #: a put of an existing key replaces the value (False: the first value stays).
    overwrite_on_put: bool = True
    #: a put of a key the store already holds is turned away before any byte
    #: moves and answers OK (so ``overwrite_on_put`` is False). The engine then
    #: leaves a save's dedup to the put instead of asking ``exists`` first: one
    #: round trip to the store fewer per save.
    dedups_puts: bool = False
    #: reads detect corrupted objects and report CORRUPT.
    detects_corruption: bool = False
    #: remove_prefix() is supported.
    remove_by_prefix: bool = True
    #: list_keys() is supported.
    listing: bool = False
    #: device (cuda/npu) memory can be passed as regions directly.
    device_memory: bool = False
    #: register() must be called for regions before put/get.
    needs_registration: bool = False
    #: a client may be opened in the scheduler process for lookups.
    scheduler_client: bool = True
    #: zero-length objects can be stored.
    empty_objects: bool = True
    #: longest key in bytes (UTF-8).
    max_key_bytes: int = 256
    #: largest object in bytes.
    max_object_bytes: int = 1 << 30
    #: characters allowed in keys besides ASCII letters and digits.
    key_extra_chars: str = "@._:-/=+"
    #: every call returns by itself within about ``timeout_s`` (plus the time to
    #: copy its bytes). The engine then calls it on its own threads without a
    #: watchdog and never abandons a call. False (the safe default): the engine's
    #: guard runs calls on spare threads and stops waiting at the deadline.
    bounded_calls: bool = False
    #: on a timeout the backend may return while its library call goes on with
    #: the call's regions (answer ``quiescent()`` False until it ends). The
    #: engine lets calls use vLLM's KV blocks directly only when ``bounded_calls``
    #: and not this; otherwise loads land in connector-owned buffers
    #: (docs/failure-semantics.md).
    detaches_calls: bool = False
    #: removed_since() reports objects leaving a tier (eviction, removal, tier moves).
    removal_events: bool = False
    #: pin()/unpin(): a lookup can keep what it counted from eviction for a short lease.
    pins: bool = False


class _Caller(threading.local):
    # Defaults on the class: a thread that never set them reads them without the
    # AttributeError a bare local's getattr(..., default) pays (~0.4 us a call,
    # and the Mooncake backend asks on every get and put).
    watched = False
    may_block = False


_caller = _Caller()


def caller_is_watched() -> bool:
    """True while the engine watches the calling thread's backend calls.

    The engine then stops waiting for a call at its deadline by itself: it fails
    what the call was for (vLLM recomputes those blocks), keeps the memory it
    lent the call out of use until the call returns, and carries on with another
    thread. So a backend whose client has no per-call timeout (``bounded_calls``
    and ``detaches_calls``: it hands calls to a worker of its own and stops
    waiting at ``timeout_s``) may run such a call on the calling thread instead
    and save the hand-off; an answer that comes after the deadline may be the
    truth about what was read, and the engine discards answers it stopped
    waiting for. Everywhere else (vLLM's forward thread, the scheduler, tools)
    this is False and ``timeout_s`` binds as the contract says.
    """
    return _caller.watched


class _Marked:
    """Sets one of the calling thread's marks for a ``with`` block, then restores it.

    A plain class rather than a generator: the engine enters one around each call it
    watches, and the exit runs on the cold caches a native call leaves, where a
    generator-based one cost 5-8 us more per call (Mooncake 32 x 64 KiB gets,
    2026-12-05: docs/benchmarking.md). One ``with`` block per instance: the
    functions below make a fresh one each time."""

    __slots__ = ("_mark", "_before")

    def __init__(self, mark: str) -> None:
        self._mark = mark
        self._before = False

    def __enter__(self) -> None:
        self._before = getattr(_caller, self._mark)
        setattr(_caller, self._mark, True)

    def __exit__(self, *exc: object) -> None:
        setattr(_caller, self._mark, self._before)


def watched_caller() -> AbstractContextManager[None]:
    """The engine's side of :func:`caller_is_watched` (and tests that play it)."""
    return _Marked("watched")


def caller_may_block() -> bool:
    """True on a thread of the engine that nothing waits on call by call: its save
    thread (and a watched thread, :func:`caller_is_watched`).

    A put there that runs past its deadline delays only the saves queued behind
    it, which the engine drops (giving their blocks back) once they cannot start
    in time; the memory the put was lent stays out of use until it returns, as
    after any call that overran. So a backend whose client has no per-call
    timeout may run the call on the calling thread and return when the client
    does, saving the hand-off. Everywhere else (vLLM's forward thread, where GR
    saves; the scheduler, which writes GR's records; tools) this is False and
    ``timeout_s`` binds: blocking there would stall the engine.
    """
    caller = _caller
    return caller.may_block or caller.watched


def blocking_caller() -> AbstractContextManager[None]:
    """The engine's side of :func:`caller_may_block` (and tests that play it)."""
    return _Marked("may_block")


def keys_fit(keys: Sequence[str], max_bytes: int) -> bool:
    """Every key a non-empty ASCII str of at most ``max_bytes`` (an ASCII key's
    length is its byte count): a batch a backend may send as it is. The usual
    batch, judged without a Python pass per key (a 128k prompt's lookup asks about
    1024); False only says some key needs a closer look."""
    return _keys_fit(keys, max_bytes)


@dataclass(frozen=True, slots=True)
class RemovalEvent:
    """An object left a tier of the pool (``Backend.removed_since``).

    ``tier`` is where it was: ``"cpu"`` (DRAM) or ``"disk"``. ``reason`` is
    ``"evicted"`` (to make room), ``"removed"`` (remove / remove_prefix),
    ``"spilled"`` (DRAM -> disk: ``moved_to="disk"``, the object is still in
    the pool), ``"promoted"`` (disk -> DRAM on a hit or a new put: ``moved_to=
    "cpu"``) or ``"lost"`` (dropped while recovering from a crashed process).
    ``moved_to`` is the tier that now stores it, None when it left the pool.
    A value replaced within one tier is no removal and has no record.
    """

    key: str
    tier: str
    reason: str
    moved_to: str | None = None
    #: position in the pool's record sequence (gap-free, increasing).
    seq: int = -1


@dataclass
class Health:
    status: Status
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status is Status.OK


@runtime_checkable
class BackendTestHooks(Protocol):
    """Optional fault injection for the conformance suite (never used in serving).

    A backend exposes it through ``Backend.test_hooks()``; the suite skips the
    tests that need a hook, naming the missing hook, when it is absent. A
    backend may implement only some hooks (leave the others out).
    """

    def delay(self, seconds: float) -> None:
        """Make every later call of this client that takes a ``timeout_s``
        (exists, put, get, remove, remove_prefix, health) take ``seconds`` as if
        the store were slow; 0 turns it off. Calls must still return within
        their ``timeout_s`` and report TIMEOUT (health: ``Health(TIMEOUT)``)."""

    def corrupt(self, key: str) -> bool:
        """Damage the stored bytes of ``key`` (False if absent)."""

    def break_store(self) -> None:
        """Break the store under this client as an outage would (its server
        gone, its memory or directory destroyed); not undone. Afterwards
        ``health()`` must not report OK, and no put or get reports OK."""

class BackendSetupError(RuntimeError):
    """The backend could not be created. The message says what to fix."""


class StoreNotFound(BackendSetupError):
    """Opened with ``BackendContext.existing_only`` where there is no store to open."""


@dataclass(frozen=True)
class BackendContext:
    """Where the backend is being opened; lets it pick device, ports, segments."""

    #: "scheduler" | "worker" | "tool"
    role: str = "tool"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    #: torch device type of the KV caches, e.g. "cpu", "cuda", "npu".
    device_type: str = "cpu"
    #: distinguishes vLLM instances on one host (used for IPC paths, segments).
    instance_id: str = "default"
    #: default per-call timeout the core will enforce.
    timeout_s: float = 5.0
    #: open the store only if it exists, as it was made: set by tools that inspect a pool
    #: (``ascendstore pool``, ``doctor``). A backend that keeps its store in the memory of the
    #: processes using it (``local``) raises StoreNotFound when there is none rather than
    #: make an empty one, and takes the options the store was made with; a client of a
    #: service connects as usual.
    existing_only: bool = False


class BackendOptions(BaseModel):
    """Base for a backend's own options (``backend_config`` in the extra config).

    Unknown keys are rejected; the config module turns pydantic errors into
    messages naming the key and the valid choices.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)


class Backend(ABC):
    """A storage plugin. Registered under the entry-point group
    ``ascendstore.backends``; the entry point names the class.

    Every method must return within ``timeout_s`` (the core also guards with its
    own deadline and reports TIMEOUT if a call overruns). Keys are ASCII text
    within ``capabilities.max_key_bytes``. For ``put`` the object's bytes are
    the concatenation of its regions; ``get`` scatters the object into the
    regions, whose total length must equal the object's size (else INVALID).
    A key over ``max_key_bytes`` or an object over ``max_object_bytes`` is
    INVALID (not NO_SPACE, which means "full for now").
    """

    #: pydantic model validating ``backend_config``.
    Options: ClassVar[type[BackendOptions]] = BackendOptions
    #: a tool for tests (fault injection), never for serving; `ascendstore backends` marks it.
    test_tool: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def create(cls, options: BackendOptions, ctx: BackendContext) -> Backend:
        """Open a client. Raises BackendSetupError with a clear message."""

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What this client promises (a property); the suite tests what it declares."""

    def register(self, regions: Sequence[Region]) -> Status:
        """Make regions usable for zero-copy transfers. Default: nothing to do."""
        return Status.OK

    def unregister(self, regions: Sequence[Region]) -> Status:
        """Undo register(). Default: nothing to do."""
        return Status.OK

    @abstractmethod
    def exists(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        """OK or NOT_FOUND per key (or an error status)."""

    @abstractmethod
    def put(
        self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float
    ) -> list[Status]:
        """Store each key's bytes, the concatenation of its regions: OK, NO_SPACE
        (full for now), INVALID (a key or size over the declared limits)."""

    @abstractmethod
    def get(
        self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float
    ) -> list[Status]:
        """Copy each object into its regions. A key reported NOT_FOUND because it
        is not stored, or INVALID, leaves its regions untouched; after CORRUPT,
        TIMEOUT or UNAVAILABLE they may hold any bytes (the caller discards
        them). Nothing is ever written outside the regions."""

    @abstractmethod
    def remove(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        """OK if removed, NOT_FOUND if absent."""

    def remove_prefix(self, prefix: str, timeout_s: float) -> tuple[Status, int]:
        """Remove every key starting with ``prefix`` (plain text, case-sensitive,
        matched at the start only); returns (status, count). An empty prefix is
        INVALID and removes nothing."""
        return Status.INVALID, 0

    def list_keys(self, prefix: str = "", limit: int = 1000) -> Iterator[str]:
        """At most ``limit`` keys starting with ``prefix`` (only when
        capabilities.listing); nothing after close()."""
        raise NotImplementedError

    def pin(self, keys: Sequence[str], lease_s: float, timeout_s: float) -> list[Status]:
        """``exists`` that also pins (only when ``capabilities.pins``): each key
        found (OK) is not evicted until ``lease_s`` seconds pass, ``unpin`` is
        called, or this process dies. Pinning again extends the lease."""
        raise NotImplementedError

    def unpin(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        """End this client's pins of the keys early (OK, or NOT_FOUND if absent)."""
        raise NotImplementedError

    def removed_since(self, cursor: int, limit: int = 4096) -> tuple[int, list[RemovalEvent], int]:
        """Objects that left a tier since ``cursor`` (only when
        ``capabilities.removal_events``): ``(next_cursor, events, lost)``, oldest
        first, at most ``limit``. ``cursor=-1`` starts from now (no events);
        pass the returned cursor to the next call. ``lost`` counts records
        overwritten before this reader came back for them (the record buffer
        is bounded); a reader that lost some should resynchronise its view."""
        raise NotImplementedError

    def stats(self) -> Mapping[str, Any]:
        """Backend-specific counters. By convention ``capacity_bytes`` (and
        ``disk_capacity_bytes`` for a second tier), ``used_bytes``, ``objects``:
        ints >= 0, a capacity > 0 and left out when the store has no limit.
        Answers after close() too (never raises)."""
        return {}

    def quiescent(self) -> bool:
        """True when no call of this client is still running in the background.

        A backend that gives up waiting on its own library (returns TIMEOUT while
        a native call goes on) answers False until that call has ended: the
        engine keeps the memory such a call was given (buffers, vLLM's blocks)
        out of use until then. Default: calls never outlive their return."""
        return True

    def test_hooks(self) -> BackendTestHooks | None:
        """Fault injection for the conformance suite; None when not offered."""
        return None

    @abstractmethod
    def health(self, timeout_s: float) -> Health:
        """OK only when the store can serve now; UNAVAILABLE after close() or
        when the store is broken; TIMEOUT when it does not answer in time."""

    @abstractmethod
    def close(self) -> None:
        """Release the client. Further calls return UNAVAILABLE, never crash."""
