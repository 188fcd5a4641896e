"""A test-only backend: one file per key in a directory, written by atomic rename.

Visible across processes (engine A and engine B run in different processes),
so the connector's end-to-end tests do not depend on the embedded ``local``
backend. Registered under ``ascendstore.backends`` as ``testdir`` through the
dist-info folder beside this file (tests put this folder on sys.path).

Fault injection for the failure tests (all off by default):
  * ``fail_get_every``: a get of a key whose digest % N == 0 reports UNAVAILABLE;
  * ``hang_ops`` / ``hang_s``: those operations sleep hang_s, ignoring timeouts;
  * ``hang_after_puts``: hang only once this many objects have been put;
  * ``put_delay_s``: every put sleeps first (keeps saves in flight);
  * ``jitter_s``: every exists/put/get sleeps a random 0..jitter_s first (interleavings).

A small LRU pool with a removal record, for the KV-event tests (off by default):
  * ``capacity_objects``: at most this many objects; a put beyond it evicts the
    least recently used (put or read) object first;
  * ``removal_record``: declare the optional capability ``removal_events`` and
    keep a record of every eviction and removal, read with
    ``removed_since(cursor, limit)`` (the interface the local pool implements);
    ``record_size`` bounds it (oldest dropped: readers see them as lost).
Both are shared by every process using the same root (a lock file serialises them).
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import hashlib
import os
import random
import tempfile
import time
from collections.abc import Sequence
from contextlib import contextmanager

from ascendstore.contract import (
    Backend,
    BackendContext,
    BackendOptions,
    BackendSetupError,
    Capabilities,
    Health,
    Region,
    Status,
)


class DirPoolOptions(BackendOptions):
    root: str
    fail_get_every: int = 0
    hang_ops: list[str] = []
    hang_s: float = 0.0
    put_delay_s: float = 0.0
    jitter_s: float = 0.0
    scheduler_client: bool = True
    capacity_objects: int = 0
    removal_record: bool = False
    record_size: int = 0
    #: the tier name removal events carry (this pool stands in for a DRAM tier).
    tier: str = "dram"


@dataclasses.dataclass(frozen=True)
class _RecordCaps(Capabilities):
    #: optional capability (declared here whether or not the contract knows it yet).
    removal_events: bool = True


@dataclasses.dataclass(frozen=True)
class RemovalEvent:
    key: str
    tier: str
    reason: str  # "evicted" | "removed"


_LOCK, _RECORD, _SEQ = ".lock", ".removals", ".removal-seq"


class DirPoolBackend(Backend):
    Options = DirPoolOptions

    def __init__(self, options: DirPoolOptions, ctx: BackendContext) -> None:
        self.opts = options
        self.ctx = ctx
        self.root = options.root
        self.closed = False

    @classmethod
    def create(cls, options: BackendOptions, ctx: BackendContext) -> DirPoolBackend:
        assert isinstance(options, DirPoolOptions)
        try:
            os.makedirs(options.root, exist_ok=True)
        except OSError as exc:
            raise BackendSetupError(f"testdir: cannot create root {options.root!r}: {exc}") from exc
        if not options.scheduler_client and ctx.role == "scheduler":
            raise BackendSetupError("testdir: no scheduler-side client in this configuration")
        return cls(options, ctx)

    @property
    def capabilities(self) -> Capabilities:
        cls = _RecordCaps if self.opts.removal_record else Capabilities
        return cls(shared_across_processes=True, persistent=not self.opts.capacity_objects, overwrite_on_put=False,
                   scheduler_client=self.opts.scheduler_client, listing=True,
                   evicts=bool(self.opts.capacity_objects))

    # -- LRU capacity and the removal record ---------------------------------------------
    @contextmanager
    def _locked(self):
        fd = os.open(os.path.join(self.root, _LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _objects(self) -> list[str]:
        return [n for n in os.listdir(self.root) if not n.startswith(".")]

    def _record(self, keys: list[str], reason: str) -> None:
        """Append removals to the record (caller holds the lock)."""
        if not self.opts.removal_record or not keys:
            return
        seq_path = os.path.join(self.root, _SEQ)
        try:
            with open(seq_path) as f:
                seq = int(f.read() or 0)
        except FileNotFoundError:
            seq = 0
        rec_path = os.path.join(self.root, _RECORD)
        lines = []
        if self.opts.record_size and os.path.exists(rec_path):
            with open(rec_path) as f:
                lines = f.read().splitlines()
        for k in keys:
            seq += 1
            lines.append(f"{seq}\t{k}\t{self.opts.tier}\t{reason}")
        if self.opts.record_size:
            lines = lines[-self.opts.record_size :]
            with open(rec_path, "w") as f:
                f.write("".join(line + "\n" for line in lines))
        else:
            with open(rec_path, "a") as f:
                f.write("".join(line + "\n" for line in lines[-len(keys) :]))
        with open(seq_path, "w") as f:
            f.write(str(seq))

    def removed_since(self, cursor: int, limit: int) -> tuple[int, list[RemovalEvent], int]:
        """(new cursor, removals after ``cursor`` (at most ``limit``), events lost).
        ``cursor`` -1: start from now."""
        if not self.opts.removal_record:
            raise NotImplementedError("removal_record is off")
        with self._locked():
            try:
                with open(os.path.join(self.root, _SEQ)) as f:
                    last = int(f.read() or 0)
            except FileNotFoundError:
                last = 0
            if cursor < 0:
                return last, [], 0
            try:
                with open(os.path.join(self.root, _RECORD)) as f:
                    lines = f.read().splitlines()
            except FileNotFoundError:
                lines = []
        rows = [line.split("\t") for line in lines]
        first = int(rows[0][0]) if rows else last + 1
        lost = max(0, first - cursor - 1)
        out = [RemovalEvent(k, tier, reason) for seq, k, tier, reason in rows if int(seq) > cursor][:limit]
        new = cursor + lost + len(out)
        return new, out, lost

    def _make_room(self, incoming: int) -> None:
        """Evict least recently used objects so ``incoming`` more fit (lock held)."""
        cap = self.opts.capacity_objects
        names = self._objects()
        over = len(names) + incoming - cap
        if over <= 0:
            return
        aged = sorted(names, key=lambda n: (os.stat(os.path.join(self.root, n)).st_mtime_ns, n))
        gone = []
        for n in aged[:over]:
            try:
                os.unlink(os.path.join(self.root, n))
                gone.append(n.replace("%2F", "/"))
            except FileNotFoundError:
                pass
        self._record(gone, "evicted")

    def _touch(self, path: str) -> None:
        if self.opts.capacity_objects:
            try:
                os.utime(path)
            except FileNotFoundError:
                pass

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key.replace("/", "%2F"))

    def _maybe_hang(self, op: str) -> None:
        if self.opts.jitter_s:
            time.sleep(random.uniform(0, self.opts.jitter_s))
        if op in self.opts.hang_ops and self.opts.hang_s:
            time.sleep(self.opts.hang_s)

    def exists(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        if self.closed:
            return [Status.UNAVAILABLE] * len(keys)
        self._maybe_hang("exists")
        return [Status.OK if os.path.exists(self._path(k)) else Status.NOT_FOUND for k in keys]

    def put(self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float) -> list[Status]:
        if self.closed:
            return [Status.UNAVAILABLE] * len(keys)
        self._maybe_hang("put")
        if self.opts.put_delay_s:
            time.sleep(self.opts.put_delay_s)
        out = []
        for key, regs in zip(keys, regions, strict=True):
            path = self._path(key)
            if os.path.exists(path):
                self._touch(path)
                out.append(Status.OK)
                continue
            data = b"".join(ctypes.string_at(r.addr, r.length) for r in regs)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            if self.opts.capacity_objects:
                with self._locked():
                    if not os.path.exists(path):
                        self._make_room(1)
                    os.replace(tmp, path)
            else:
                os.replace(tmp, path)
            out.append(Status.OK)
        return out

    def _fails(self, key: str) -> bool:
        n = self.opts.fail_get_every
        return bool(n) and int(hashlib.sha256(key.encode()).hexdigest(), 16) % n == 0

    def get(self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float) -> list[Status]:
        if self.closed:
            return [Status.UNAVAILABLE] * len(keys)
        self._maybe_hang("get")
        out = []
        for key, regs in zip(keys, regions, strict=True):
            if self._fails(key):
                out.append(Status.UNAVAILABLE)
                continue
            try:
                with open(self._path(key), "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                out.append(Status.NOT_FOUND)
                continue
            if len(data) != sum(r.length for r in regs):
                out.append(Status.INVALID)
                continue
            self._touch(self._path(key))
            pos = 0
            for r in regs:
                ctypes.memmove(r.addr, data[pos : pos + r.length], r.length)
                pos += r.length
            out.append(Status.OK)
        return out

    def remove(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        out = []
        with self._locked():
            for k in keys:
                try:
                    os.unlink(self._path(k))
                    out.append(Status.OK)
                except FileNotFoundError:
                    out.append(Status.NOT_FOUND)
            self._record([k for k, st in zip(keys, out, strict=True) if st is Status.OK], "removed")
        return out

    def list_keys(self, prefix: str = "", limit: int = 1000):
        n = 0
        for name in sorted(os.listdir(self.root)):
            if name.startswith(prefix) and not name.startswith("."):
                yield name
                n += 1
                if n >= limit:
                    return

    def health(self, timeout_s: float) -> Health:
        return Health(Status.OK if os.path.isdir(self.root) else Status.UNAVAILABLE)

    def close(self) -> None:
        self.closed = True
