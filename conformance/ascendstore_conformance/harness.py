"""The test-side view of one backend client: memory regions, guarded calls,
byte-exact reads and per-test key names."""

from __future__ import annotations

import hashlib
import string
import struct
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from ascendstore.contract import Backend, Capabilities, Region, Status

#: bytes around every region; a backend writing outside its region damages them.
GUARD = 64
CANARY = 0xA5
#: fill of a receive area before a get, so "left untouched" can be checked.
UNTOUCHED = 0x5A
#: a call must return within its timeout_s; the suite fails it (instead of
#: hanging) once it overruns by this much.
OVERRUN_GRACE_S = 10.0
#: how far past its timeout_s a call may return (waking up from a sleep on a
#: busy machine); every call that takes a timeout_s is checked against it when
#: it returns, timed on the thread that makes the call.
TIMEOUT_MARGIN_S = 0.5
#: the calls that take a timeout_s (its last argument).
TIMED_CALLS = frozenset({"exists", "put", "get", "remove", "remove_prefix", "health"})


class Buffer:
    """Process memory with guard bytes on both sides of the usable span."""

    def __init__(self, size: int, offset: int = 0) -> None:
        self.size = size
        self.offset = offset
        self._mem = np.full(GUARD + offset + size + GUARD, CANARY, dtype=np.uint8)
        self._start = GUARD + offset
        self.view = self._mem[self._start : self._start + size]

    @property
    def base(self) -> Region:
        return Region(int(self._mem.ctypes.data), int(self._mem.nbytes))

    @property
    def region(self) -> Region:
        return Region(int(self._mem.ctypes.data) + self._start, self.size)

    def sub(self, start: int, length: int) -> Region:
        assert 0 <= start and start + length <= self.size
        return Region(self.region.addr + start, length)

    def write(self, data: bytes) -> None:
        assert len(data) == self.size
        self.view[:] = np.frombuffer(data, dtype=np.uint8)

    def fill(self, value: int) -> None:
        self.view[:] = value

    def read(self) -> bytes:
        return self.view.tobytes()

    def guards_intact(self) -> bool:
        head = self._mem[: self._start]
        tail = self._mem[self._start + self.size :]
        return bool((head == CANARY).all() and (tail == CANARY).all())


def pattern(tag: str, size: int) -> bytes:
    """Deterministic bytes that differ between tags at every offset."""
    if size == 0:
        return b""
    seed = hashlib.blake2b(tag.encode(), digest_size=64).digest()
    reps = -(-size // len(seed))
    return (seed * reps)[:size]


def versioned(writer: int, seq: int, size: int) -> bytes:
    """A value whose header names its writer and sequence and whose body is
    derived from them: a read mixing two versions fails ``check_versioned``."""
    head = struct.pack("<II", writer, seq)
    return head + pattern(f"v{writer}.{seq}", size - len(head))


def check_versioned(data: bytes) -> tuple[int, int] | None:
    writer, seq = struct.unpack_from("<II", data)
    return (writer, seq) if data == versioned(writer, seq, len(data)) else None


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class CallOverrun(AssertionError):
    pass


def check_bound(what: str, took: float, timeout_s: float, margin_s: float) -> None:
    """Fail a call that returned later than its timeout_s (plus the margin)."""
    if took > timeout_s + margin_s:
        raise CallOverrun(
            f"{what} returned {took:.3f} s after being called with timeout_s={timeout_s}: over its "
            f"timeout by {took - timeout_s:.3f} s (margin {margin_s} s); every call must return "
            "within its timeout_s, reporting TIMEOUT if the store is slow"
        )


def guarded(what: str, timeout_s: float, fn: Callable[[], Any]) -> Any:
    """Run a backend call on a helper thread so a hung backend fails the test
    instead of hanging the suite (the contract bounds every call in time)."""
    return guarded_timed(what, timeout_s, fn)[0]


def guarded_timed(what: str, timeout_s: float, fn: Callable[[], Any]) -> tuple[Any, float]:
    """``guarded``, and how long ``fn`` ran (timed on its own thread, so the
    hand-off between threads is not counted)."""
    box: dict[str, Any] = {}

    def target() -> None:
        start = time.monotonic()
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the caller
            box["error"] = exc
        finally:
            box["took"] = time.monotonic() - start

    t = threading.Thread(target=target, name=f"conformance-{what}", daemon=True)
    start = time.monotonic()
    t.start()
    t.join(timeout_s + OVERRUN_GRACE_S)
    if t.is_alive():
        raise CallOverrun(
            f"{what} did not return {time.monotonic() - start:.1f} s after being called with "
            f"timeout_s={timeout_s}; every backend call must return within its timeout"
        )
    if "error" in box:
        raise box["error"]
    return box["value"], box["took"]


class Harness:
    """One open client plus the memory and key names of one test."""

    def __init__(
        self, backend: Backend, timeout_s: float, name: str, margin_s: float = TIMEOUT_MARGIN_S
    ) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.margin_s = margin_s
        self.name = name
        self.caps: Capabilities = backend.capabilities
        # Keys of this test share a prefix so tests never see each other's
        # objects, even in a store that outlives the test (a cluster, a disk).
        sep = next((c for c in "/:-_." if c in self.caps.key_extra_chars), "")
        self.prefix = f"cf{uuid.uuid4().hex[:8]}{sep}"
        self._allowed = set(string.ascii_letters + string.digits + self.caps.key_extra_chars)
        self._buffers: list[Buffer] = []  # kept alive until close: a late write must land somewhere
        self._registered: list[Region] = []

    # -- keys and memory -------------------------------------------------
    def key(self, name: str) -> str:
        """The test's key for ``name``; characters the backend does not allow become "x"."""
        return self.prefix + "".join(c if c in self._allowed else "x" for c in name)

    def keys(self, *names: str) -> list[str]:
        return [self.key(n) for n in names]

    def buffer(self, size: int, offset: int = 0) -> Buffer:
        buf = Buffer(size, offset)
        self._buffers.append(buf)
        status = self.call("register", [buf.base])
        assert status is Status.OK, f"register() of a {buf.base.length}-byte buffer returned {status!r}"
        self._registered.append(buf.base)
        return buf

    def source(self, data: bytes, offset: int = 0) -> Buffer:
        buf = self.buffer(len(data), offset)
        buf.write(data)
        return buf

    # -- guarded calls ---------------------------------------------------
    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """``backend.method(*args)`` under the watchdog. For a call that takes a
        timeout_s (its last argument), also checks it returned within it."""
        fn = getattr(self.backend, method)
        t = self.timeout_s if timeout_s is None else timeout_s
        what = f"{self.name}.{method}()"
        result, took = guarded_timed(what, t, lambda: fn(*args))
        if method in TIMED_CALLS and args and isinstance(args[-1], int | float):
            check_bound(what, took, float(args[-1]), self.margin_s)
        return result

    def timed(self, method: str, *args: Any, timeout_s: float) -> tuple[Any, float]:
        """``backend.method(*args, timeout_s)`` and how long it took (bound checked)."""
        start = time.monotonic()
        result = self.call(method, *args, timeout_s, timeout_s=timeout_s)
        return result, time.monotonic() - start

    def statuses(
        self, method: str, keys: Sequence[str], *args: Any, timeout_s: float | None = None
    ) -> list[Status]:
        t = self.timeout_s if timeout_s is None else timeout_s
        result = self.call(method, keys, *args, t, timeout_s=t)
        assert isinstance(result, list) and len(result) == len(keys), (
            f"{method}() of {len(keys)} keys returned {result!r}; expected one status per key"
        )
        assert all(isinstance(s, Status) for s in result), f"{method}() returned non-Status values {result!r}"
        return result

    def exists(self, keys: Sequence[str], timeout_s: float | None = None) -> list[Status]:
        return self.statuses("exists", keys, timeout_s=timeout_s)

    def remove(self, keys: Sequence[str], timeout_s: float | None = None) -> list[Status]:
        return self.statuses("remove", keys, timeout_s=timeout_s)

    def put(self, items: dict[str, bytes], offset: int = 0, timeout_s: float | None = None) -> list[Status]:
        keys = list(items)
        regions = [[self.source(items[k], offset).region] for k in keys]
        return self.statuses("put", keys, regions, timeout_s=timeout_s)

    def put_ok(self, items: dict[str, bytes]) -> None:
        got = self.put(items)
        assert got == [Status.OK] * len(items), f"put of {len(items)} keys returned {got!r}"

    def get(
        self, keys: Sequence[str], sizes: Sequence[int], offset: int = 0, timeout_s: float | None = None
    ) -> tuple[list[Status], list[Buffer]]:
        bufs = [self.buffer(size, offset) for size in sizes]
        for b in bufs:
            b.fill(UNTOUCHED)
        statuses = self.statuses("get", keys, [[b.region] for b in bufs], timeout_s=timeout_s)
        for k, b in zip(keys, bufs, strict=True):
            assert b.guards_intact(), f"get({k!r}) wrote outside the {b.size}-byte region it was given"
        return statuses, bufs

    def get_bytes(self, key: str, size: int) -> tuple[Status, bytes | None]:
        (status,), (buf,) = self.get([key], [size])
        return status, (buf.read() if status is Status.OK else None)

    def assert_reads(self, expected: dict[str, bytes]) -> None:
        """Each key reads back byte-exact."""
        keys = list(expected)
        statuses, bufs = self.get(keys, [len(expected[k]) for k in keys])
        for k, s, b in zip(keys, statuses, bufs, strict=True):
            assert s is Status.OK, f"get({k!r}) returned {s!r}, expected OK"
            assert_same(b.read(), expected[k], k)

    def close(self) -> None:
        if self._registered:
            try:
                self.backend.unregister(self._registered)
            except Exception:  # closing anyway; unregister errors are not under test here
                pass
        try:
            self.backend.close()
        except Exception:
            pass


def assert_same(got: bytes, want: bytes, key: str) -> None:
    if got == want:
        return
    if len(got) != len(want):
        pytest.fail(f"{key!r}: read {len(got)} bytes, wrote {len(want)}")
    first = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    wrong = sum(1 for a, b in zip(got, want, strict=True) if a != b)
    pytest.fail(
        f"{key!r}: {wrong} of {len(want)} bytes differ from what was written, first at offset {first} "
        f"(read {got[first : first + 8].hex()}, wrote {want[first : first + 8].hex()})"
    )
