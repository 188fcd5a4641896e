"""The ``faulty`` backend: any backend, with faults injected (chaos tests only).

    backend: faulty
    backend_config:
      backend: local                      # the wrapped backend, by entry-point name
      backend_config: {name: p, checksum: true}
      seed: 7
      delay_s: {get: 0.3}                 # a slow store that honours timeouts
      hang_s: {put: 5}                    # a wedged client that ignores them
      late_garbage: false                 # a hung get scribbles over its regions when it wakes (answers TIMEOUT)
      detaches: false                     # hang like Mooncake: on the caller's thread only when it is watched
      registered_only: false              # refuse transfers touching memory never registered (RDMA)
      fail_rate: {get: 0.2}               # per key: report fail_status instead
      fail_status: UNAVAILABLE
      raise_rate: {exists: 0.01}          # per call: raise (a buggy client)
      corrupt_rate: 0.1                   # per stored object: damage it in the store
      flip_rate: 0.0                      # per loaded object: flip a byte after reading
      quota_bytes: 64MiB                  # puts beyond this report NO_SPACE (a full pool)
      down: false                         # every call UNAVAILABLE (an outage)
      health_status: OK                   # health() answers this whatever the truth (a lying check)
      control_file: /tmp/faults.json      # overrides re-read when the file changes

What is injected where, and why it is faithful:
  * ``delay_s`` sleeps before the wrapped call but never past the caller's
    ``timeout_s``; a delay at or over it answers TIMEOUT, as a slow store that
    keeps the contract would.
  * ``hang_s`` sleeps regardless of ``timeout_s``: the contract is broken and the
    core's guard must cut the call off. A hung put reads its regions only when
    it wakes (whatever they hold *then* is stored); with ``late_garbage`` a hung
    get, once awake, overwrites its regions with a wrong pattern (0xA5) after the
    real read. Both do the wrong thing late, so a test sees it if the engine
    gave the memory back too early. The scribbling get answers TIMEOUT for
    every key: a guard still waiting (a hang that ends within its grace) must
    never be told that garbage was loaded. An OK over wrong bytes is in-transit
    corruption, which no engine sees (that is ``flip_rate``); answering OK here
    made the interleaving tests report "wrong KV read" for a fault the engine
    cannot, and need not, survive.
  * ``detaches`` makes the wrapper a client with no per-call timeout behind a
    hand-off of its own, as the Mooncake backend is: it declares
    ``bounded_calls`` and ``detaches_calls``, so the engine calls it on its own
    threads and lands loads in buffers of its own. A call from a watched caller
    (``caller_is_watched()``: the engine's load thread) runs, hangs and scribbles
    right there, and only the engine's watchdog can give up on it; so does a put
    from a thread that may block (``caller_may_block()``: the engine's save
    thread), as Mooncake's ``inline_puts`` does; any other call
    runs on a thread of the wrapper and is answered TIMEOUT at ``timeout_s``
    while it goes on (``quiescent()`` False until it ends). Fixed at start-up.
  * ``registered_only`` declares ``needs_registration`` and refuses (INVALID,
    counted ``unregistered``) a put or get any of whose regions lies outside the
    memory registered through this client, as an RDMA transfer (Mooncake over
    rdma) fails on memory never registered. With ``device_memory`` it is also the
    CPU's stand-in for "device memory only" (MemCache's device pool copies by
    the kind of memory it was set up for): the connector registers vLLM's KV and
    every buffer it owns for the backend, so a region outside them is host
    memory handed to a backend that cannot address it.
  * ``corrupt_rate`` damages the object *in the wrapped store* through its own
    test hook, so the store's integrity checks (``detects_corruption``) are what
    is exercised; ``flip_rate`` damages the bytes after a successful read, which
    no store can see (in-transit corruption, a buggy client).
  * ``quota_bytes`` is a stand-in for a store that is full and does not evict:
    bytes counted are those put through this client.

Faults change at run time through :meth:`FaultyBackend.set_faults` (in-process;
:func:`live_backends` finds the instances the connector opened) or through
``control_file`` (any process). Counters of what was injected are in
``stats()["injected"]``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import random
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from ascendstore.config import Bool, ByteSize
from ascendstore.contract import (
    Backend,
    BackendContext,
    BackendOptions,
    BackendSetupError,
    BackendTestHooks,
    Capabilities,
    Health,
    Region,
    Status,
    caller_is_watched,
    caller_may_block,
)
from ascendstore.errors import ConfigError, format_validation_error

Op = Literal["exists", "put", "get", "remove"]
StatusName = Literal["NOT_FOUND", "NO_SPACE", "TIMEOUT", "UNAVAILABLE", "CORRUPT", "INVALID"]
Rate = float

_LIVE: weakref.WeakSet[FaultyBackend] = weakref.WeakSet()


def live_backends() -> list[FaultyBackend]:
    """Open ``faulty`` backends of this process (e.g. the ones a connector created)."""
    return [b for b in list(_LIVE) if not b.closed]


class FaultyOptions(BackendOptions):
    backend: str = Field("local", description="the wrapped backend (entry-point name)")
    backend_config: dict[str, Any] = Field(default_factory=dict, description="its options")
    seed: int = Field(0, description="seed of the fault draws (same seed, same faults)")
    delay_s: dict[Op, float] = Field(default_factory=dict, description="per op: delay, bounded by timeout_s")
    hang_s: dict[Op, float] = Field(default_factory=dict, description="per op: delay that ignores timeout_s")
    fail_rate: dict[Op, Rate] = Field(default_factory=dict, description="per op: share of keys that fail")
    fail_status: StatusName = Field("UNAVAILABLE", description="status of an injected key failure")
    raise_rate: dict[Op, Rate] = Field(default_factory=dict, description="per op: share of calls that raise")
    corrupt_rate: Rate = Field(0.0, ge=0, le=1, description="share of stored objects damaged in the store")
    flip_rate: Rate = Field(0.0, ge=0, le=1, description="share of loaded objects with a byte flipped after get")
    quota_bytes: ByteSize = Field(0, description="puts beyond this many bytes report NO_SPACE; 0: off")
    late_garbage: Bool = Field(
        False, description="a hung get writes a wrong pattern over its regions when it wakes (and answers TIMEOUT)"
    )
    detaches: Bool = Field(
        False, description="hang like a client behind a hand-off of its own (Mooncake): on the caller's thread only "
        "when the engine watches it, else on a thread of the wrapper, answering TIMEOUT at timeout_s"
    )
    device_memory: Bool = Field(
        False, description="declare that the wrapped backend reads and writes device memory (with CPU tensors taken "
        "for device KV, a stand-in for Mooncake over rdma/ascend or MemCache's device pool)"
    )
    registered_only: Bool = Field(
        False, description="declare needs_registration and refuse (INVALID) transfers that touch memory not "
        "registered through this client (Mooncake over rdma; with device_memory, a stand-in for device memory only)"
    )
    down: Bool = Field(False, description="every call reports UNAVAILABLE")
    health_status: Literal["OK", "UNAVAILABLE", "TIMEOUT"] | None = Field(
        None, description="health() reports this whatever the truth (a lying health check); None: the truth"
    )
    control_file: str | None = Field(None, description="JSON overrides of these faults, re-read on change")

    @field_validator("delay_s", "hang_s")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: s for k, s in v.items() if not s >= 0}
        if bad:
            raise ValueError(f"seconds must be >= 0, got {bad}")
        return v

    @field_validator("fail_rate", "raise_rate")
    @classmethod
    def _rates(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: r for k, r in v.items() if not 0 <= r <= 1}
        if bad:
            raise ValueError(f"rates must lie in [0, 1], got {bad}")
        return v


#: options that may change at run time (the wrapped backend may not).
_MUTABLE = frozenset(FaultyOptions.model_fields) - {
    "backend", "backend_config", "control_file", "detaches", "registered_only"}


class InjectedFault(RuntimeError):
    """Raised by the wrapper for ``raise_rate`` (a client bug, on purpose)."""


class FaultyBackend(Backend):
    Options = FaultyOptions
    #: a test tool: `ascendstore backends` marks it, the guide lists it as one.
    test_tool = True

    def __init__(self, inner: Backend, options: FaultyOptions, ctx: BackendContext) -> None:
        self.inner = inner
        self.options = options
        self.ctx = ctx
        self.closed = False
        self.injected: Counter[str] = Counter()
        self._rng = random.Random(options.seed * 1_000_003 + ctx.rank)
        self._lock = threading.Lock()
        self._quota_used = 0
        self._sizes: dict[str, int] = {}
        self._control_mtime: float | None = None
        self._control_checked = 0.0
        #: calls still running on the wrapper's threads after their caller was answered
        self._detached = 0
        #: calls asleep in a ``hang_s`` now (tests: "answered while the call still hung")
        self.hanging = 0
        #: memory registered through this client (``registered_only``): (start, end)
        self._registered: list[tuple[int, int]] = []
        hooks = inner.test_hooks()
        self._corrupt_hook = getattr(hooks, "corrupt", None) if hooks is not None else None
        if options.corrupt_rate and self._corrupt_hook is None:
            raise BackendSetupError(
                f"faulty: corrupt_rate needs the wrapped backend {options.backend!r} to offer the "
                "test hook corrupt(key); use flip_rate to damage bytes after reads instead"
            )
        _LIVE.add(self)

    @classmethod
    def create(cls, options: BackendOptions, ctx: BackendContext) -> FaultyBackend:
        assert isinstance(options, FaultyOptions)
        from ascendstore.registry import create_backend

        inner = create_backend(options.backend, options.backend_config, ctx)
        try:
            return cls(inner, options, ctx)
        except BaseException:
            inner.close()
            raise

    # -- run-time control --------------------------------------------------------------
    def set_faults(self, **changes: Any) -> None:
        """Change faults now (validated like the options), e.g. ``set_faults(down=True)``."""
        unknown = set(changes) - _MUTABLE
        if unknown:
            raise ConfigError(f"faulty: cannot change {sorted(unknown)} at run time; changeable: {sorted(_MUTABLE)}")
        try:
            new = FaultyOptions.model_validate({**self.options.model_dump(), **changes})
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, FaultyOptions, prefix="faulty")) from None
        with self._lock:
            self.options = new

    def clear_faults(self) -> None:
        self.set_faults(**{k: FaultyOptions.model_fields[k].get_default(call_default_factory=True)
                           for k in _MUTABLE if k != "seed"})

    def _poll_control(self) -> None:
        path = self.options.control_file
        if not path:
            return
        now = time.monotonic()
        if now - self._control_checked < 0.05:
            return
        self._control_checked = now
        try:
            mtime = os.stat(path).st_mtime_ns
        except OSError:
            return
        if mtime == self._control_mtime:
            return
        self._control_mtime = mtime
        try:
            with open(path, encoding="utf-8") as f:
                self.set_faults(**json.load(f))
        except (OSError, ValueError):
            # A half-written control file is read again at its next change.
            self._control_mtime = None

    def _draw(self, rate: float) -> bool:
        if rate <= 0:
            return False
        with self._lock:
            return self._rng.random() < rate

    # -- the wrapped calls ---------------------------------------------------------------
    def _enter(self, op: str, n: int, timeout_s: float) -> tuple[list[Status] | None, float]:
        """Apply call-level faults; returns (answer for every key, or None; time left)."""
        self._poll_control()
        o = self.options
        if self.closed or o.down:
            self.injected["down"] += n
            return [Status.UNAVAILABLE] * n, timeout_s
        hang = o.hang_s.get(op, 0.0)  # type: ignore[call-overload]
        if hang:
            self.injected["hang"] += 1
            with self._lock:
                self.hanging += 1
            try:
                time.sleep(hang)
            finally:
                with self._lock:
                    self.hanging -= 1
        delay = o.delay_s.get(op, 0.0)  # type: ignore[call-overload]
        if delay:
            self.injected["delay"] += 1
            if delay >= timeout_s:
                time.sleep(max(timeout_s, 0.0))
                return [Status.TIMEOUT] * n, 0.0
            time.sleep(delay)
            timeout_s -= delay
        if self._draw(o.raise_rate.get(op, 0.0)):  # type: ignore[call-overload]
            self.injected["raise"] += 1
            raise InjectedFault(f"faulty: injected exception in {op}()")
        return None, timeout_s

    def _split(self, op: str, n: int) -> list[bool]:
        rate = self.options.fail_rate.get(op, 0.0)  # type: ignore[call-overload]
        fails = [self._draw(rate) for _ in range(n)]
        if any(fails):
            self.injected["fail"] += sum(fails)
        return fails

    def _keyed(
        self, op: str, keys: Sequence[str], regions: Sequence[Sequence[Region]] | None, timeout_s: float,
        call: Callable[[list[str], float], list[Status]] | None = None,
    ) -> list[Status]:
        # As the Mooncake backend: a watched caller's calls, and puts of a thread that
        # may block (the engine's save thread), run right there; the rest hand off.
        if self.options.detaches and not (caller_is_watched() or (op == "put" and caller_may_block())):
            return self._handed_off(lambda: self._keyed_now(op, keys, regions, timeout_s, call), len(keys), timeout_s)
        return self._keyed_now(op, keys, regions, timeout_s, call)

    def _handed_off(self, fn: Callable[[], list[Status]], n: int, timeout_s: float) -> list[Status]:
        """Run a call on a thread of its own and answer TIMEOUT at ``timeout_s``
        while it goes on (``detaches``): the hand-off of a client without timeouts."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["out"] = fn()
            except BaseException as exc:  # re-raised on the caller's thread if it still waits
                box["err"] = exc
            finally:
                with self._lock:
                    self._detached -= 1
                done.set()

        with self._lock:
            self._detached += 1
        threading.Thread(target=run, name="faulty-call", daemon=True).start()
        if not done.wait(max(0.0, timeout_s)):
            self.injected["detached"] += 1
            return [Status.TIMEOUT] * n
        if "err" in box:
            raise box["err"]
        return box["out"]

    def _keyed_now(
        self, op: str, keys: Sequence[str], regions: Sequence[Sequence[Region]] | None, timeout_s: float,
        call: Callable[[list[str], float], list[Status]] | None = None,
    ) -> list[Status]:
        n = len(keys)
        # Decided when the call starts: faults may be switched off while it hangs.
        garbage = op == "get" and self.options.late_garbage and bool(self.options.hang_s.get("get", 0.0))
        early, left = self._enter(op, n, timeout_s)
        if early is not None:
            return early
        fails = self._split(op, n)
        out = [Status[self.options.fail_status] if f else Status.OK for f in fails]
        idx = [i for i, f in enumerate(fails) if not f]
        if regions is not None and self.options.registered_only:
            idx = self._registered_regions(regions, idx, out)
        if op == "put" and self.options.quota_bytes:
            idx = self._within_quota(keys, regions, idx, out)
        if not idx:
            return out
        sub_keys = [keys[i] for i in idx]
        fn = call or getattr(self.inner, op)
        if regions is None:
            got = fn(sub_keys, left)
        else:
            got = fn(sub_keys, [regions[i] for i in idx], left)
        for i, s in zip(idx, got, strict=True):
            out[i] = Status(s)
        if op == "put":
            self._after_put(keys, regions, idx, out)
        elif op == "get":
            self._after_get(regions, idx, out)
            if garbage:
                assert regions is not None
                self.injected["late_garbage"] += 1
                for i in idx:
                    for r in regions[i]:
                        ctypes.memset(r.addr, 0xA5, r.length)
                    # Its bytes are garbage: never OK, even to a guard still waiting.
                    if out[i] is Status.OK:
                        out[i] = Status.TIMEOUT
        elif op == "remove":
            self._forget([keys[i] for i in idx if out[i] is Status.OK])
        return out

    def _registered_regions(self, regions: Sequence[Sequence[Region]], idx: list[int], out: list[Status]) -> list[int]:
        with self._lock:
            spans = list(self._registered)
        keep = []
        for i in idx:
            # (registrations may overlap or nest: any one holding the whole region will do)
            if all(any(a <= r.addr and r.addr + r.length <= b for a, b in spans) for r in regions[i] if r.length):
                keep.append(i)
            else:
                out[i] = Status.INVALID
                self.injected["unregistered"] += 1
        return keep

    def _within_quota(
        self, keys: Sequence[str], regions: Sequence[Sequence[Region]] | None, idx: list[int], out: list[Status]
    ) -> list[int]:
        assert regions is not None
        keep = []
        with self._lock:
            used = self._quota_used
            for i in idx:
                size = sum(r.length for r in regions[i])
                if keys[i] not in self._sizes and used + size > self.options.quota_bytes:
                    out[i] = Status.NO_SPACE
                    self.injected["no_space"] += 1
                else:
                    used += 0 if keys[i] in self._sizes else size
                    keep.append(i)
        return keep

    def _after_put(
        self, keys: Sequence[str], regions: Sequence[Sequence[Region]] | None, idx: list[int], out: list[Status]
    ) -> None:
        assert regions is not None
        # Sizes are remembered only under a quota: the wrapped store evicts on its
        # own, so an unbounded record of every key would be this wrapper's leak.
        with self._lock:
            for i in idx if self.options.quota_bytes else ():
                if out[i] is Status.OK and keys[i] not in self._sizes:
                    size = sum(r.length for r in regions[i])
                    self._sizes[keys[i]] = size
                    self._quota_used += size
        if self.options.corrupt_rate and self._corrupt_hook is not None:
            for i in idx:
                if out[i] is Status.OK and self._draw(self.options.corrupt_rate):
                    if self._corrupt_hook(keys[i]):
                        self.injected["corrupt"] += 1

    def _after_get(self, regions: Sequence[Sequence[Region]] | None, idx: list[int], out: list[Status]) -> None:
        assert regions is not None
        if not self.options.flip_rate:
            return
        for i in idx:
            regs = [r for r in regions[i] if r.length]
            if out[i] is Status.OK and regs and self._draw(self.options.flip_rate):
                r = regs[0]
                byte = ctypes.c_ubyte.from_address(r.addr)
                byte.value ^= 0x5A
                self.injected["flip"] += 1

    def _forget(self, keys: Sequence[str]) -> None:
        with self._lock:
            for k in keys:
                self._quota_used -= self._sizes.pop(k, 0)

    # -- the contract -------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        # It may be told to hang at any time: never let the engine trust it with vLLM's blocks.
        caps = self.inner.capabilities
        if self.options.device_memory:
            caps = dataclasses.replace(caps, device_memory=True)
        if self.options.registered_only:
            caps = dataclasses.replace(caps, needs_registration=True)
        if self.options.detaches:
            # Bounded by its own hand-off, except for watched callers (the engine watches those).
            return dataclasses.replace(caps, bounded_calls=True, detaches_calls=True)
        return dataclasses.replace(caps, bounded_calls=False)

    def quiescent(self) -> bool:
        return self._detached == 0 and self.inner.quiescent()

    def register(self, regions: Sequence[Region]) -> Status:
        with self._lock:
            self._registered = [*self._registered, *((r.addr, r.addr + r.length) for r in regions)]
        return self.inner.register(regions)

    def unregister(self, regions: Sequence[Region]) -> Status:
        # As Mooncake's unregister_buffer: by start address.
        gone = {r.addr for r in regions}
        with self._lock:
            self._registered = [s for s in self._registered if s[0] not in gone]
        return self.inner.unregister(regions)

    def exists(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        return self._keyed("exists", keys, None, timeout_s)

    def put(self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float) -> list[Status]:
        return self._keyed("put", keys, regions, timeout_s)

    def get(self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float) -> list[Status]:
        return self._keyed("get", keys, regions, timeout_s)

    def remove(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        return self._keyed("remove", keys, None, timeout_s)

    def pin(self, keys: Sequence[str], lease_s: float, timeout_s: float) -> list[Status]:
        # An exists that also pins: the faults of "exists" apply (a failed key is not pinned).
        return self._keyed("exists", keys, None, timeout_s, call=lambda ks, t: self.inner.pin(ks, lease_s, t))

    def unpin(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        if self.closed:
            return [Status.UNAVAILABLE] * len(keys)
        return self.inner.unpin(keys, timeout_s)

    def remove_prefix(self, prefix: str, timeout_s: float) -> tuple[Status, int]:
        early, left = self._enter("remove", 1, timeout_s)
        if early is not None:
            return early[0], 0
        status, count = self.inner.remove_prefix(prefix, left)
        if status is Status.OK:
            self._forget([k for k in list(self._sizes) if k.startswith(prefix)])
        return status, count

    def list_keys(self, prefix: str = "", limit: int = 1000) -> Iterator[str]:
        return self.inner.list_keys(prefix, limit)

    def stats(self) -> Mapping[str, Any]:
        return {"injected": {k: v for k, v in self.injected.items() if v}, "quota_used_bytes": self._quota_used, "inner": dict(self.inner.stats())}

    def test_hooks(self) -> BackendTestHooks | None:
        return self.inner.test_hooks()

    def health(self, timeout_s: float) -> Health:
        self._poll_control()
        if self.options.health_status is not None:
            self.injected["health_lie"] += 1
            return Health(Status[self.options.health_status], {"faulty": "health_status"})
        if self.closed or self.options.down:
            return Health(Status.UNAVAILABLE, {"faulty": "down"})
        return self.inner.health(timeout_s)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.inner.close()
