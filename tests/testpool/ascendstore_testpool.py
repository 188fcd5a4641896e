"""A test-only backend: one file per key in a directory, written by atomic rename.

Visible across processes (engine A and engine B run in different processes),
so the connector's end-to-end tests do not depend on the embedded ``local``
backend. Registered under ``ascendstore.backends`` as ``testdir`` through the
dist-info folder beside this file (tests put this folder on sys.path).

Fault injection for the failure tests (all off by default):
  * ``fail_get_every``: a get of a key whose digest % N == 0 reports UNAVAILABLE;
  * ``hang_ops`` / ``hang_s``: those operations sleep hang_s, ignoring timeouts;
  * ``hang_after_puts``: hang only once this many objects have been put;
  * ``put_delay_s``: every put sleeps first (keeps saves in flight).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
import time
from collections.abc import Sequence

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
    scheduler_client: bool = True


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
        return Capabilities(shared_across_processes=True, persistent=True, overwrite_on_put=False,
                            scheduler_client=self.opts.scheduler_client, listing=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key.replace("/", "%2F"))

    def _maybe_hang(self, op: str) -> None:
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
                out.append(Status.OK)
                continue
            data = b"".join(ctypes.string_at(r.addr, r.length) for r in regs)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
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
            pos = 0
            for r in regs:
                ctypes.memmove(r.addr, data[pos : pos + r.length], r.length)
                pos += r.length
            out.append(Status.OK)
        return out

    def remove(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        out = []
        for k in keys:
            try:
                os.unlink(self._path(k))
                out.append(Status.OK)
            except FileNotFoundError:
                out.append(Status.NOT_FOUND)
        return out

    def list_keys(self, prefix: str = "", limit: int = 1000):
        n = 0
        for name in sorted(os.listdir(self.root)):
            if name.startswith(prefix) and not name.startswith(".tmp-"):
                yield name
                n += 1
                if n >= limit:
                    return

    def health(self, timeout_s: float) -> Health:
        return Health(Status.OK if os.path.isdir(self.root) else Status.UNAVAILABLE)

    def close(self) -> None:
        self.closed = True
