"""STAND-IN for ``memcache_hybrid`` — not MemCache.

MemCache's data path needs an Ascend driver and CANN; without them nothing can
be stored (see ``preflight``). This module reproduces the part of the
``memcache_hybrid`` 1.3.0 Python API that the adapter drives, with the same
method names, argument order, defaults and return codes, so the adapter's
translation (copy directions, layers, batches, leases, error codes) runs
unchanged against it. Data lives in one SQLite file, so every process of one
host that opens the same file sees the same objects (``shared_across_processes``
holds; across nodes it does not).

Where each behaviour comes from (the tags are used in comments below):

* [measured] seen on memcache-hybrid 1.3.0 here (meta service on loopback,
  pure client and failed-init client).
* [source] read in Ascend/memcache ``pymmc.cpp`` / ``mmc_types.h`` or its
  Python tests (batch limits, duplicate put -> 0, GVA write/read flow).
* [stand-in] our choice where the real behaviour could not be observed here;
  the docs list these.

It copies with ``ctypes.memmove``: regions must be host memory of this process,
whatever copy direction is named (the direction is still validated and logged
in ``calls``, so tests can check what the adapter asked for).
"""

from __future__ import annotations

import ctypes
import os
import re
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ascendstore_memcache.codes import MAX_BATCH_KEYS, MAX_KEY_BYTES, MAX_LAYERS, MEDIA_DRAM, Mmc

# Copy directions, as memfabric_hybrid.bm.BmCopyType [source, measured].
L2G, G2L, G2H, H2G, AUTO = 0, 1, 2, 3, 9
_WRITE_DIRS = (L2G, H2G)
_READ_DIRS = (G2L, G2H)

#: GVAs the stand-in hands out: base + (object id << 32) + offset. Far from any
#: real pointer so a GVA passed where a buffer is expected fails loudly.
GVA_BASE = 0x2000_0000_0000_0000
_OFFSET_BITS = 32
DEFAULT_LEASE_MS = 10_000  # MetaConfig.lease_ttl_ms default [measured]
_WRITING, _READABLE = 0, 1
_UNINIT_SERVICE_ID = 4294967295  # get_local_service_id() before init [measured]


class ReplicateConfig:
    """Same fields and defaults as ``_pymmc.ReplicateConfig`` [measured]."""

    def __init__(self) -> None:
        self.replicaNum = 1
        self.preferredLocalServiceIDs: list[int] = []


class KeyInfo:
    """Same accessors as ``_pymmc.KeyInfo``; a missing key reads size 0 and
    empty lists [measured]."""

    def __init__(self, size: int = 0, gvas: Sequence[int] = (), locs: Sequence[int] = ()) -> None:
        self._size = size
        self._gvas = list(gvas)
        self._locs = list(locs)

    def size(self) -> int:
        return self._size

    def gva_list(self) -> list[int]:
        return list(self._gvas)

    def loc_list(self) -> list[int]:
        return list(self._locs)

    def type_list(self) -> list[int]:
        return [MEDIA_DRAM] * len(self._gvas)

    def __str__(self) -> str:  # format of the real __str__ [measured]
        locs = ",".join(map(str, self._locs))
        gvas = ",".join(map(str, self._gvas))
        types = ",".join(map(str, self.type_list()))
        return f"loc:{locs} type:{types} gva:{gvas} blobNum:{len(self._gvas)}, size:{self._size}"

    __repr__ = __str__


_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)b?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_mmc_size(text: str) -> int:
    """Sizes as mmc-local.conf writes them: 134217728, 2048KB/2048K, 200MB, 2.5GB, 1TB."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"bad MemCache size {text!r}")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _aligned_dram(size: int, protocol: str) -> int:
    # [source: shipped mmc-local.conf] aligned up to 2 MB (host_*) or 1 GB (device_*)
    step = (1 << 30) if protocol.startswith("device_") else (2 << 20)
    return -(-size // step) * step


def _read_local_conf(path: str | None) -> dict[str, str]:
    if not path or not Path(path).is_file():
        return {}
    values = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, _, v = line.partition("=")
            values[k.strip()] = v.strip()
    return values


class StandinModule:
    """Plays the ``memcache_hybrid`` module: ``DistributedObjectStore()``,
    ``ReplicateConfig``, ``KeyInfo`` and the copy directions, bound to one
    store file."""

    ReplicateConfig = ReplicateConfig
    KeyInfo = KeyInfo
    L2G, G2L, G2H, H2G, AUTO = L2G, G2L, G2H, H2G, AUTO
    __name__ = "ascendstore_memcache.standin"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path).expanduser()
        if p.suffix not in {".sqlite", ".db"}:
            p = p / "standin.sqlite"
        p.parent.mkdir(parents=True, exist_ok=True)
        self.path = p

    def DistributedObjectStore(self) -> StandinObjectStore:  # named like the real class
        return StandinObjectStore(self.path)


class StandinObjectStore:
    """``DistributedObjectStore`` over the stand-in file. Thread-safe; one
    SQLite connection per thread; every mutation is one IMMEDIATE transaction."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self._client_id: int | None = None
        self._init_bm = False
        self._leases: dict[str, float] = {}  # key -> expiry (this client's read leases)
        self._allocated: set[str] = set()  # keys this client allocated and not yet finished
        self._delay_s = 0.0
        self._meta_down = False  # test hook break_meta: the meta service is gone
        #: (method, direction) of the latest data calls, for tests of the adapter
        self.calls: deque[tuple[str, int]] = deque(maxlen=256)

    # -- plumbing ---------------------------------------------------------------
    def _db(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self._path, timeout=30.0, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=OFF")
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    def _tx(self) -> _Tx:
        return _Tx(self._db())

    def _slow(self) -> None:
        if self._delay_s > 0:
            time.sleep(self._delay_s)

    @property
    def _ready(self) -> bool:
        return self._client_id is not None

    def set_delay(self, seconds: float) -> None:
        """Test hook: every later data call takes ``seconds`` longer."""
        self._delay_s = max(0.0, float(seconds))

    def break_meta(self) -> None:
        """Test hook: the meta service died. Every later call of this client fails
        as the real one does: LINK_NOT_FOUND at once [measured for batch_is_exist;
        stand-in for the others: GVA 0 from batch_alloc, no key infos]."""
        self._meta_down = True

    def corrupt(self, key: str) -> bool:
        """Test hook: flip the first byte of ``key``'s stored value."""
        with self._tx() as db:
            row = db.execute("SELECT data FROM objects WHERE key=? AND state=?", (key, _READABLE)).fetchone()
            if row is None or not row[0]:
                return False
            data = bytearray(row[0])
            data[0] ^= 0xFF
            db.execute("UPDATE objects SET data=? WHERE key=?", (bytes(data), key))
        return True

    # -- lifecycle ----------------------------------------------------------------
    def setup(self, config: Any) -> int:
        return Mmc.OK

    def init(self, device_id: int, init_bm: bool = True) -> int:
        conf = _read_local_conf(os.environ.get("MMC_LOCAL_CONFIG_PATH"))
        protocol = conf.get("ock.mmc.local_service.protocol", "host_rdma")
        dram = _aligned_dram(parse_mmc_size(conf.get("ock.mmc.local_service.dram.size", "1GB")), protocol)
        with self._tx() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS objects (key TEXT PRIMARY KEY, oid INTEGER UNIQUE, "
                "size INTEGER, state INTEGER, data BLOB, last_used REAL, lease_until REAL DEFAULT 0)"
            )
            db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v INTEGER)")
            db.execute("INSERT OR IGNORE INTO meta VALUES ('next_oid', 1), ('next_client', 0), ('capacity', 0)")
            cid = db.execute("SELECT v FROM meta WHERE k='next_client'").fetchone()[0]
            db.execute("UPDATE meta SET v=v+1 WHERE k='next_client'")
            if init_bm:
                # [stand-in] the pool's capacity is the first memory-contributing
                # client's dram_size; real MemCache sums every local service's.
                db.execute("UPDATE meta SET v=? WHERE k='capacity' AND v=0", (dram,))
        self._client_id = int(cid)
        self._init_bm = bool(init_bm)
        return Mmc.OK

    def close(self) -> int:
        if self._ready and self._leases:
            self.batch_remove_lease(list(self._leases))
        self._client_id = None
        with self._conns_lock:
            for conn in self._conns:
                try:
                    conn.close()
                except sqlite3.Error:
                    pass
            self._conns.clear()
        self._local = threading.local()
        return Mmc.OK

    def get_local_service_id(self) -> int:
        return _UNINIT_SERVICE_ID if self._client_id is None else self._client_id

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        if self._ready and not self._init_bm:
            # [measured] the real client segfaults here; never let that pass silently.
            raise RuntimeError("stand-in: register_buffer on a pure client (init_bm=False) crashes MemCache")
        return Mmc.OK if self._ready else Mmc.CLIENT_NOT_INIT

    def unregister_buffer(self, buffer_ptr: int, size: int) -> int:
        return self.register_buffer(buffer_ptr, size)

    # -- existence / info -----------------------------------------------------------
    def is_exist(self, key: str) -> int:
        return self.batch_is_exist([key])[0] if key else Mmc.INVALID_PARAM

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        if not self._ready:
            return [Mmc.CLIENT_NOT_INIT] * len(keys)  # [measured]
        if self._meta_down:
            return [Mmc.LINK_NOT_FOUND] * len(keys)  # [measured]
        if not keys:
            return []  # [measured]
        self._slow()
        out = []
        now = time.time()
        with self._tx() as db:
            for key in keys:
                if not key or len(key.encode()) > MAX_KEY_BYTES:
                    out.append(Mmc.INVALID_PARAM)  # per key [measured]
                    continue
                hit = db.execute(
                    "UPDATE objects SET last_used=? WHERE key=? AND state=?", (now, key, _READABLE)
                ).rowcount
                out.append(1 if hit else 0)
        return out

    def get_key_info(self, key: str, flag: int = 1) -> KeyInfo:
        infos = self.batch_get_key_info([key], flag)
        return infos[0] if infos else KeyInfo()

    def batch_get_key_info(self, keys: Sequence[str], flag: int = 1) -> list[KeyInfo]:
        if not self._ready or not keys or self._meta_down:
            return []  # [measured] (uninitialised client)
        self._slow()
        out = []
        db = self._db()
        for key in keys:
            row = db.execute("SELECT oid, size FROM objects WHERE key=? AND state=?", (key, _READABLE)).fetchone()
            out.append(KeyInfo(row[1], [_gva(row[0])], [0]) if row else KeyInfo())
        return out

    # -- layers API -------------------------------------------------------------------
    def batch_put_from_layers(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        direct: int = H2G,
        replicateConfig: ReplicateConfig | None = None,
    ) -> list[int]:
        bad = self._check_batch(keys, buffer_ptrs, sizes, int(direct), _WRITE_DIRS)
        if bad is not None:
            return bad
        self.calls.append(("batch_put_from_layers", int(direct)))
        self._slow()
        out = []
        for key, ptrs, lens in zip(keys, buffer_ptrs, sizes, strict=True):
            if not self._init_bm:
                out.append(Mmc.ERROR)  # [stand-in] a pure client cannot move data
                continue
            data = b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, lens, strict=True))
            with self._tx() as db:
                if db.execute("SELECT 1 FROM objects WHERE key=?", (key,)).fetchone():
                    out.append(Mmc.OK)  # duplicate put is skipped and reported 0 [source]
                    continue
                if not _make_room(db, len(data)):
                    out.append(Mmc.ERROR)  # allocation failure is -1 [measured]
                    continue
                oid = _next_oid(db)
                db.execute(
                    "INSERT INTO objects (key, oid, size, state, data, last_used) VALUES (?,?,?,?,?,?)",
                    (key, oid, len(data), _READABLE, data, time.time()),
                )
            out.append(Mmc.OK)
        return out

    def batch_get_into_layers(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        direct: int = G2H,
    ) -> list[int]:
        bad = self._check_batch(keys, buffer_ptrs, sizes, int(direct), _READ_DIRS)
        if bad is not None:
            return bad
        self.calls.append(("batch_get_into_layers", int(direct)))
        self._slow()
        out = []
        db = self._db()
        for key, ptrs, lens in zip(keys, buffer_ptrs, sizes, strict=True):
            row = db.execute("SELECT data FROM objects WHERE key=? AND state=?", (key, _READABLE)).fetchone()
            if row is None:
                out.append(Mmc.OBJECT_NOT_EXISTS)  # [measured]
                continue
            if not self._init_bm:
                out.append(Mmc.ERROR)  # [stand-in]
                continue
            data = row[0] or b""
            if sum(lens) != len(data):
                out.append(Mmc.INVALID_PARAM)  # [stand-in] regions must cover the object exactly
                continue
            _scatter(data, ptrs, lens)
            db.execute("UPDATE objects SET last_used=? WHERE key=?", (time.time(), key))
            out.append(Mmc.OK)
        return out

    def _check_batch(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        direct: int,
        allowed: tuple[int, int],
    ) -> list[int] | None:
        """The pybind layer's checks: any failure fails the whole batch [source, measured]."""
        n = len(keys)
        if not self._ready:
            return []  # the real layer asserts on the missing client and returns [] [measured]
        if self._meta_down:
            return [Mmc.LINK_NOT_FOUND] * n  # [stand-in]
        bad = [Mmc.INVALID_PARAM] * n
        if direct not in allowed or len(ptrs) != n or len(sizes) != n:
            return bad
        if n == 0:
            return []
        if n > MAX_BATCH_KEYS:
            return bad
        for key, p, s in zip(keys, ptrs, sizes, strict=True):
            if not key or len(key.encode()) > MAX_KEY_BYTES:
                return bad
            if not p or len(p) > MAX_LAYERS or len(p) != len(s):
                return bad
        return None

    # -- removal ----------------------------------------------------------------------
    def remove(self, key: str) -> int:
        return self.remove_batch([key])[0] if key else Mmc.INVALID_PARAM

    def remove_batch(self, keys: Sequence[str]) -> list[int]:
        if not self._ready:
            return [Mmc.CLIENT_NOT_INIT] * len(keys)  # [measured]
        if self._meta_down:
            return [Mmc.LINK_NOT_FOUND] * len(keys)  # [stand-in]
        self._slow()
        out = []
        now = time.time()
        with self._tx() as db:
            for key in keys:
                row = db.execute("SELECT lease_until FROM objects WHERE key=?", (key,)).fetchone()
                if row is None:
                    out.append(Mmc.UNMATCHED_KEY)  # [measured]
                elif row[0] and row[0] > now:
                    out.append(Mmc.LEASE_NOT_EXPIRED)  # [stand-in] a reader holds it
                else:
                    db.execute("DELETE FROM objects WHERE key=?", (key,))
                    out.append(Mmc.OK)
        return out

    def remove_all(self) -> int:
        if not self._ready:
            return Mmc.CLIENT_NOT_INIT
        with self._tx() as db:
            db.execute("DELETE FROM objects")
        return Mmc.OK

    # -- GVA flow: writers batch_alloc -> batch_copy(L2G) -> batch_write_finish;
    #    readers batch_get_key_info -> batch_add_lease -> batch_copy(G2L) -> batch_remove_lease [source]
    def batch_alloc(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        media: int = MEDIA_DRAM,
        leaseTtlMs: int = 0,
    ) -> list[int]:
        if not self._ready or len(keys) != len(sizes) or self._meta_down:
            return [0] * len(keys)  # failure is GVA 0 [measured]
        self._slow()
        out = []
        with self._tx() as db:
            for key, size in zip(keys, sizes, strict=True):
                if (
                    not key
                    or len(key.encode()) > MAX_KEY_BYTES
                    or size <= 0
                    or size >= 1 << _OFFSET_BITS
                    or db.execute("SELECT 1 FROM objects WHERE key=?", (key,)).fetchone()
                    or not _make_room(db, size)
                ):
                    out.append(0)  # [stand-in] existing key or no room
                    continue
                oid = _next_oid(db)
                db.execute(
                    "INSERT INTO objects (key, oid, size, state, data, last_used) VALUES (?,?,?,?,zeroblob(?),?)",
                    (key, oid, size, _WRITING, size, time.time()),
                )
                self._allocated.add(key)
                out.append(_gva(oid))
        return out

    def batch_copy(
        self,
        gva_ptrs: Sequence[int],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        direct: int = G2L,
        flag: int = 0,
    ) -> int:
        if not self._ready:
            return Mmc.CLIENT_NOT_INIT  # [measured]
        if not (len(gva_ptrs) == len(buffer_ptrs) == len(sizes)):
            return Mmc.INVALID_PARAM
        return self._copy([(g, [b], [s]) for g, b, s in zip(gva_ptrs, buffer_ptrs, sizes, strict=True)], int(direct))

    def batch_copy_layers(
        self,
        gva_ptrs: Sequence[int],
        buffer_ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        direct: int = G2L,
        flag: int = 0,
    ) -> int:
        if not self._ready:
            return Mmc.CLIENT_NOT_INIT
        if len(gva_ptrs) != len(buffer_ptrs) or len(gva_ptrs) != len(sizes):
            return Mmc.INVALID_PARAM
        if any(len(b) != len(s) for b, s in zip(buffer_ptrs, sizes, strict=True)):
            return Mmc.INVALID_PARAM  # "batch_copy_layers input size mismatch at index" [source]
        return self._copy(list(zip(gva_ptrs, buffer_ptrs, sizes, strict=True)), int(direct))

    def _copy(self, spans: list[tuple[int, Sequence[int], Sequence[int]]], direct: int) -> int:
        if direct not in _WRITE_DIRS + _READ_DIRS:
            return Mmc.INVALID_PARAM
        if self._meta_down:
            return Mmc.LINK_NOT_FOUND  # [stand-in]
        self.calls.append(("batch_copy", direct))
        if any(gva < GVA_BASE for gva, _, _ in spans):
            return Mmc.INVALID_PARAM  # GVA 0 [measured]
        if not self._init_bm:
            return Mmc.ERROR  # [stand-in]
        self._slow()
        writing = direct in _WRITE_DIRS
        now = time.time()
        with self._tx() as db:
            for gva, ptrs, lens in spans:
                oid, offset = (gva - GVA_BASE) >> _OFFSET_BITS, (gva - GVA_BASE) & ((1 << _OFFSET_BITS) - 1)
                row = db.execute("SELECT key, size, state, data FROM objects WHERE oid=?", (oid,)).fetchone()
                if row is None:
                    return Mmc.UNMATCHED_KEY  # [stand-in] the object is gone
                key, size, state, data = row
                total = sum(lens)
                if offset + total > size:
                    return Mmc.INVALID_PARAM  # [stand-in] outside the allocation
                if writing:
                    if state != _WRITING or key not in self._allocated:
                        return Mmc.WRITE_READABLE_BLOB  # [source] vllm-ascend notes -3108/-3107 here
                    chunk = b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, lens, strict=True))
                    buf = bytearray(data)
                    buf[offset : offset + total] = chunk
                    db.execute("UPDATE objects SET data=? WHERE oid=?", (bytes(buf), oid))
                else:
                    if state != _READABLE or self._leases.get(key, 0) <= now:
                        return Mmc.LEASE_EXPIRED  # "batch copy read lease expired" [source]
                    _scatter(data[offset : offset + total], ptrs, lens)
        return Mmc.OK

    def batch_write_finish(self, keys: Sequence[str], res: Sequence[int]) -> list[int]:
        if not self._ready or len(keys) != len(res):
            return [Mmc.INVALID_PARAM] * len(keys)  # [measured] (uninitialised client)
        out = []
        with self._tx() as db:
            for key, r in zip(keys, res, strict=True):
                if key not in self._allocated:
                    out.append(Mmc.INVALID_PARAM)  # key this client did not allocate [measured]
                    continue
                self._allocated.discard(key)
                if r == 0:
                    db.execute(
                        "UPDATE objects SET state=?, last_used=? WHERE key=?", (_READABLE, time.time(), key)
                    )
                else:
                    db.execute("DELETE FROM objects WHERE key=? AND state=?", (key, _WRITING))
                out.append(Mmc.OK)
        return out

    def batch_add_lease(self, keys: Sequence[str], leaseTtlMs: int = 0) -> list[int]:
        if not self._ready:
            return [Mmc.INVALID_PARAM] * len(keys)  # [measured]
        ttl = (leaseTtlMs or DEFAULT_LEASE_MS) / 1000.0
        out = []
        with self._tx() as db:
            for key in keys:
                until = time.time() + ttl
                hit = db.execute(
                    "UPDATE objects SET lease_until=MAX(lease_until, ?) WHERE key=? AND state=?", (until, key, _READABLE)
                ).rowcount
                if hit:
                    self._leases[key] = until
                    out.append(Mmc.OK)
                else:
                    out.append(Mmc.UNMATCHED_KEY)  # [measured]
        return out

    def batch_remove_lease(self, keys: Sequence[str]) -> int:
        if not self._ready:
            return Mmc.CLIENT_NOT_INIT  # [measured]
        now = time.time()
        result = Mmc.OK
        with self._tx() as db:
            for key in keys:
                until = self._leases.pop(key, None)
                if until is None or until <= now:
                    result = Mmc.LEASE_EXPIRED  # no lease held [measured]
                    continue
                # [stand-in] one lease expiry per object; releasing ends it for everyone
                db.execute("UPDATE objects SET lease_until=0 WHERE key=?", (key,))
        return result

    def stats(self) -> dict[str, int]:
        db = self._db()
        count, used = db.execute("SELECT COUNT(*), COALESCE(SUM(size),0) FROM objects").fetchone()
        cap = db.execute("SELECT v FROM meta WHERE k='capacity'").fetchone()[0]
        return {"objects": count, "used_bytes": used, "capacity_bytes": cap}


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error) on one connection."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")


def _gva(oid: int) -> int:
    return GVA_BASE + (oid << _OFFSET_BITS)


def _next_oid(db: sqlite3.Connection) -> int:
    oid = db.execute("SELECT v FROM meta WHERE k='next_oid'").fetchone()[0]
    db.execute("UPDATE meta SET v=v+1 WHERE k='next_oid'")
    return int(oid)


def _make_room(db: sqlite3.Connection, size: int) -> bool:
    """Evict least recently used readable, unleased objects until ``size`` fits.

    [stand-in] Real MemCache evicts from 90% to 80% of the pool on a periodic
    check and on allocation; here it is synchronous, down to what is needed.
    """
    cap = db.execute("SELECT v FROM meta WHERE k='capacity'").fetchone()[0]
    if size > cap:
        return False
    used = db.execute("SELECT COALESCE(SUM(size),0) FROM objects").fetchone()[0]
    if used + size <= cap:
        return True
    now = time.time()
    victims = db.execute(
        "SELECT key, size FROM objects WHERE state=? AND lease_until<=? ORDER BY last_used", (_READABLE, now)
    ).fetchall()
    for key, vsize in victims:
        db.execute("DELETE FROM objects WHERE key=?", (key,))
        used -= vsize
        if used + size <= cap:
            return True
    return False


def _scatter(data: bytes, ptrs: Sequence[int], lens: Sequence[int]) -> None:
    pos = 0
    for p, n in zip(ptrs, lens, strict=True):
        ctypes.memmove(p, data[pos : pos + n], n)
        pos += n
