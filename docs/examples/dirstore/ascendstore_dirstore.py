"""DirStore: an example AscendStore backend keeping one file per object in a directory.

Each object is a file named after its key, holding the bytes and a CRC32. Files
are written aside and renamed into place, so a reader sees the old or the new
object, never half of one, whichever process wrote it.
"""

from __future__ import annotations

import base64
import ctypes
import errno
import itertools
import os
import shutil
import struct
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

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

MAX_KEY_BYTES = 191  # its base64 is 255 characters, the longest file name
MAX_OBJECT_BYTES = 16 << 20
CRC = struct.Struct("<I")


def _file_name(key: str) -> str:
    return base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def _key(file_name: str) -> str:
    return base64.urlsafe_b64decode(file_name + "=" * (-len(file_name) % 4)).decode()


class DirStore(Backend):
    class Options(BackendOptions):
        root: str  # the directory; every process given the same root shares the store
        capacity_bytes: int = 0  # 0: as much as the disk holds

    def __init__(self, options: Options) -> None:
        self.root, self.capacity = Path(options.root), options.capacity_bytes
        self.closed, self.slow_s = False, 0.0

    @classmethod
    def create(cls, options: Options, ctx: BackendContext) -> DirStore:
        try:
            (Path(options.root) / ".tmp").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BackendSetupError(f"dirstore: cannot use root {options.root!r}: {exc}") from exc
        return cls(options)

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            shared_across_processes=True,
            persistent=True,
            detects_corruption=True,
            listing=True,
            bounded_calls=True,  # every call runs in the caller's thread and ends with it
            max_key_bytes=MAX_KEY_BYTES,
            max_object_bytes=MAX_OBJECT_BYTES,
        )

    def _gate(self, timeout_s: float) -> Status | None:
        """The status of a call that cannot go ahead (closed, or slow past its timeout)."""
        if self.closed:
            return Status.UNAVAILABLE
        if self.slow_s:  # test hook: behave like a slow disk, but keep to the timeout
            time.sleep(max(0.0, min(self.slow_s, timeout_s)))
            if self.slow_s > timeout_s:
                return Status.TIMEOUT
        return None

    def _each(self, keys: Sequence[str], timeout_s: float, op: Callable[[Path, int], Status]) -> list[Status]:
        """Apply op to each key's file; one deadline for the whole batch."""
        if (early := self._gate(timeout_s)) is not None:
            return [early] * len(keys)
        deadline = time.monotonic() + timeout_s
        out = []
        for i, key in enumerate(keys):
            if time.monotonic() > deadline:
                out.append(Status.TIMEOUT)
            elif not 0 < len(key.encode()) <= MAX_KEY_BYTES:
                out.append(Status.INVALID)
            else:
                out.append(op(self.root / _file_name(key), i))
        return out

    def exists(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        return self._each(keys, timeout_s, lambda p, _: Status.OK if p.exists() else Status.NOT_FOUND)

    def put(self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float) -> list[Status]:
        def put_one(path: Path, i: int) -> Status:
            size = sum(r.length for r in regions[i])
            if size > MAX_OBJECT_BYTES:
                return Status.INVALID
            if self.capacity and self._used_bytes() + size + CRC.size > self.capacity:
                return Status.NO_SPACE
            data = b"".join(ctypes.string_at(r.addr, r.length) for r in regions[i])
            tmp = self.root / ".tmp" / uuid.uuid4().hex
            try:
                tmp.write_bytes(data + CRC.pack(zlib.crc32(data)))
                os.replace(tmp, path)  # atomic: the whole new object appears at once
            except OSError as exc:  # a full disk is NO_SPACE; a missing directory, an outage
                tmp.unlink(missing_ok=True)
                return Status.NO_SPACE if exc.errno == errno.ENOSPC else Status.UNAVAILABLE
            return Status.OK

        return self._each(keys, timeout_s, put_one)

    def get(self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float) -> list[Status]:
        def get_one(path: Path, i: int) -> Status:
            try:
                blob = path.read_bytes()
            except FileNotFoundError:
                return Status.NOT_FOUND
            except OSError:
                return Status.UNAVAILABLE
            data, crc = blob[: -CRC.size], blob[-CRC.size :]
            if len(crc) != CRC.size or CRC.unpack(crc)[0] != zlib.crc32(data):
                return Status.CORRUPT
            if sum(r.length for r in regions[i]) != len(data):
                return Status.INVALID
            pos = 0
            for r in regions[i]:  # scatter into the caller's regions
                ctypes.memmove(r.addr, data[pos : pos + r.length], r.length)
                pos += r.length
            return Status.OK

        return self._each(keys, timeout_s, get_one)

    def remove(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        def remove_one(path: Path, _: int) -> Status:
            try:
                path.unlink()
                return Status.OK
            except FileNotFoundError:
                return Status.NOT_FOUND

        return self._each(keys, timeout_s, remove_one)

    def remove_prefix(self, prefix: str, timeout_s: float) -> tuple[Status, int]:
        if (early := self._gate(timeout_s)) is not None:
            return early, 0
        if not prefix:  # would empty the whole store: never what a caller means
            return Status.INVALID, 0
        removed = 0
        for key in self._keys(prefix):  # plain str.startswith: no pattern language
            try:
                (self.root / _file_name(key)).unlink()
                removed += 1
            except FileNotFoundError:
                pass  # removed meanwhile by another process
            except OSError:
                return Status.UNAVAILABLE, removed
        return Status.OK, removed

    def _keys(self, prefix: str) -> list[str]:
        try:
            keys = [_key(e.name) for e in os.scandir(self.root) if e.is_file()]
        except OSError:
            return []
        return [k for k in keys if k.startswith(prefix)]

    def list_keys(self, prefix: str = "", limit: int = 1000) -> Iterator[str]:
        return iter(()) if self.closed else itertools.islice(self._keys(prefix), limit)

    def _used_bytes(self) -> int:
        try:
            return sum(e.stat().st_size for e in os.scandir(self.root) if e.is_file())
        except OSError:
            return 0

    def stats(self) -> dict[str, int]:
        stats = {"used_bytes": self._used_bytes()}
        if self.capacity:  # no limit: capacity_bytes left out
            stats["capacity_bytes"] = self.capacity
        return stats

    def health(self, timeout_s: float) -> Health:
        detail = {"root": str(self.root)}
        if (early := self._gate(timeout_s)) is not None:
            return Health(early, detail)
        if not (self.root / ".tmp").is_dir() or not os.access(self.root, os.W_OK):
            return Health(Status.UNAVAILABLE, {**detail, "reason": "root is gone or not writable"})
        return Health(Status.OK, detail)

    def close(self) -> None:
        self.closed = True

    # Fault injection for the conformance suite (BackendTestHooks).
    def test_hooks(self) -> DirStore:
        return self

    def delay(self, seconds: float) -> None:
        self.slow_s = seconds

    def break_store(self) -> None:
        shutil.rmtree(self.root)  # the disk is gone

    def corrupt(self, key: str) -> bool:
        path = self.root / _file_name(key)
        if not path.exists():
            return False
        blob = bytearray(path.read_bytes())
        blob[0] ^= 0xFF
        path.write_bytes(blob)
        return True
