"""Lookup over IPC when the backend's client lives only in the workers.

Worker rank 0 serves REP on a per-instance ipc:// path; the scheduler asks with
REQ. Both ends time out: the client answers "no hit" and rebuilds its socket
(a REQ socket is unusable after a lost reply); the server never blocks on send.
"""

from __future__ import annotations

import logging
import os
import threading

import msgspec
import zmq

from ascendstore.engine import PoolLookup
from ascendstore.pd import ensure_lookup_path_free

log = logging.getLogger(__name__)


class LookupServer:
    def __init__(self, path: str, lookup: PoolLookup) -> None:
        self.path = path
        self.lookup = lookup
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, 1000)
        fs_path = path.removeprefix("ipc://")
        # A live instance on this host already answers here: refuse, never take its socket over.
        ensure_lookup_path_free(path)
        if os.path.exists(fs_path):
            # A stale socket file of a dead instance with the same identity.
            os.unlink(fs_path)
        self._sock.bind(path)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="ascendstore-lookup", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            try:
                tenant, hashes, start = msgspec.msgpack.decode(self._sock.recv())
                hits = self.lookup.prefix_hits(tenant, hashes, start)
                self._sock.send(msgspec.msgpack.encode(hits))
            except zmq.ZMQError as exc:
                log.warning("lookup server: %s", exc)
            except Exception:
                log.exception("lookup server failed a request")
                try:
                    self._sock.send(msgspec.msgpack.encode(-1))
                except zmq.ZMQError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._sock.close(0)
        try:
            os.unlink(self.path.removeprefix("ipc://"))
        except OSError:
            pass


class LookupClient:
    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self._ctx = zmq.Context.instance()
        self._lock = threading.Lock()
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            s.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            s.connect(self.path)
            self._sock = s
        return self._sock

    def prefix_hits(self, tenant: str, chunk_hashes: list[str], start: int) -> int:
        """Absolute chunk count present; ``start`` on timeout or error (a miss)."""
        with self._lock:
            try:
                sock = self._socket()
                sock.send(msgspec.msgpack.encode([tenant, chunk_hashes, start]))
                hits = msgspec.msgpack.decode(sock.recv())
            except zmq.ZMQError as exc:
                log.warning("lookup RPC to %s failed (%s); treating as a miss", self.path, exc)
                if self._sock is not None:
                    self._sock.close(0)
                    self._sock = None
                return start
        return start if hits < 0 else int(hits)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
