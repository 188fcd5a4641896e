"""A small directory-backed backend for the GR tests (one file per key).

Real files, real byte copies through ctypes, the contract's statuses and size
rule (a get into regions of the wrong total size is INVALID), plus a byte
capacity the quota tests need. The GR store tests run on it and on ``local``;
the tests at the bottom pin the behaviour the GR store relies on.
"""

from __future__ import annotations

import ctypes
import os
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from ascendstore.contract import (
    Backend,
    BackendContext,
    BackendOptions,
    Capabilities,
    Health,
    Region,
    Status,
)


class DirOptions(BackendOptions):
    path: str
    capacity_bytes: int = 0  # 0: unlimited; else puts that would exceed it are NO_SPACE


class DirBackend(Backend):
    Options = DirOptions

    def __init__(self, root: Path, capacity: int = 0) -> None:
        self.root = root
        self.capacity = capacity
        self.closed = False
        self.calls: list[str] = []
        root.mkdir(parents=True, exist_ok=True)

    @classmethod
    def create(cls, options: BackendOptions, ctx: BackendContext) -> DirBackend:
        assert isinstance(options, DirOptions)
        return cls(Path(options.path), options.capacity_bytes)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(shared_across_processes=True, persistent=True, listing=True)

    def _file(self, key: str) -> Path:
        return self.root / urllib.parse.quote(key, safe="")

    def used(self) -> int:
        return sum(p.stat().st_size for p in self.root.iterdir() if not p.name.startswith("."))

    def exists(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        self.calls.append("exists")
        return [Status.OK if self._file(k).exists() else Status.NOT_FOUND for k in keys]

    def put(self, keys, regions, timeout_s):
        self.calls.append("put")
        if self.closed:
            return [Status.UNAVAILABLE] * len(keys)
        out = []
        for key, regs in zip(keys, regions, strict=True):
            data = b"".join(ctypes.string_at(r.addr, r.length) for r in regs)
            f = self._file(key)
            old = f.stat().st_size if f.exists() else 0
            if self.capacity and self.used() - old + len(data) > self.capacity:
                out.append(Status.NO_SPACE)
                continue
            tmp = self.root / f".tmp.{os.getpid()}"
            tmp.write_bytes(data)
            tmp.replace(f)  # readers never see a torn object
            out.append(Status.OK)
        return out

    def get(self, keys, regions, timeout_s):
        self.calls.append("get")
        if self.closed:
            return [Status.UNAVAILABLE] * len(keys)
        out = []
        for key, regs in zip(keys, regions, strict=True):
            f = self._file(key)
            if not f.exists():
                out.append(Status.NOT_FOUND)
                continue
            data = f.read_bytes()
            if sum(r.length for r in regs) != len(data):
                out.append(Status.INVALID)
                continue
            off = 0
            for r in regs:
                ctypes.memmove(r.addr, data[off:off + r.length], r.length)
                off += r.length
            out.append(Status.OK)
        return out

    def remove(self, keys, timeout_s):
        self.calls.append("remove")
        out = []
        for k in keys:
            f = self._file(k)
            if f.exists():
                f.unlink()
                out.append(Status.OK)
            else:
                out.append(Status.NOT_FOUND)
        return out

    def remove_prefix(self, prefix: str, timeout_s: float) -> tuple[Status, int]:
        keys = list(self.list_keys(prefix, limit=1 << 30))
        self.remove(keys, timeout_s)
        return Status.OK, len(keys)

    def list_keys(self, prefix: str = "", limit: int = 1000) -> Iterator[str]:
        n = 0
        for p in sorted(self.root.iterdir()):
            if p.name.startswith("."):
                continue
            key = urllib.parse.unquote(p.name)
            if key.startswith(prefix) and n < limit:
                n += 1
                yield key

    def health(self, timeout_s: float) -> Health:
        return Health(Status.OK)

    def close(self) -> None:
        self.closed = True


def _region(a: np.ndarray) -> Region:
    return Region(a.ctypes.data, a.nbytes)


def test_roundtrip_and_size_rule(tmp_path):
    b = DirBackend(tmp_path)
    src = np.arange(64, dtype=np.uint8)
    assert b.put(["k"], [[_region(src[:10]), _region(src[10:])]], 1) == [Status.OK]
    dst = np.zeros(64, dtype=np.uint8)
    assert b.get(["k"], [[_region(dst)]], 1) == [Status.OK]
    assert (dst == src).all()
    assert b.get(["k"], [[_region(dst[:63])]], 1) == [Status.INVALID]
    assert b.get(["nope"], [[_region(dst)]], 1) == [Status.NOT_FOUND]


def test_prefix_remove_and_capacity(tmp_path):
    b = DirBackend(tmp_path, capacity=100)
    src = np.zeros(60, dtype=np.uint8)
    assert b.put(["u1@a", "u1@b"], [[_region(src)], [_region(src)]], 1) == [Status.OK, Status.NO_SPACE]
    assert b.remove_prefix("u1@", 1) == (Status.OK, 1)
    assert list(b.list_keys()) == []
