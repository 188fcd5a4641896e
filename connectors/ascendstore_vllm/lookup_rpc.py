"""Lookup over IPC when the backend's client lives only in the workers.

Worker rank 0 serves REP on a per-instance ipc:// path; the scheduler asks with
REQ. Both ends time out: the client answers "no hit" and rebuilds its socket
(a REQ socket is unusable after a lost reply); the server never blocks on send.

With pins on (``pin_lease_ms``, a backend declaring ``pins``) worker 0 holds the
pins of what its lookups counted, per request; the scheduler tells it when to
let go (``release``). A lost release costs nothing but the lease.
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
                msg = msgspec.msgpack.decode(self._sock.recv())
                self._sock.send(msgspec.msgpack.encode(self._answer(msg)))
            except zmq.ZMQError as exc:
                log.warning("lookup server: %s", exc)
            except Exception:
                log.exception("lookup server failed a request")
                try:
                    self._sock.send(msgspec.msgpack.encode(-1))
                except zmq.ZMQError:
                    pass

    def _answer(self, msg: list | dict) -> object:
        pins = getattr(self.lookup, "pins", None)
        if isinstance(msg, dict):  # {"release": [req ids], "keep": [[req id, chunks], ...]}
            if pins is not None:
                for req_id, chunks in msg.get("keep", ()):
                    pins.keep(req_id, int(chunks))
                pins.release(list(msg.get("release", ())))
                pins.expire()
            return 0
        if len(msg) == 4:  # [tenant, hashes, start, request id]: pin what is counted
            tenant, hashes, start, req_id = msg
            return [self.lookup.prefix_hits(tenant, hashes, start, req_id), pins is not None]
        tenant, hashes, start = msg
        return self.lookup.prefix_hits(tenant, hashes, start)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._sock.close(0)
        pins = getattr(self.lookup, "pins", None)
        if pins is not None:
            pins.close()  # before the backend client closes (the caller's order)
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

    def prefix_hits(self, tenant: str, chunk_hashes: list[str], start: int, req_id: str | None = None) -> int:
        """Absolute chunk count present; ``start`` on timeout or error (a miss).
        With ``req_id``, worker 0 pins what it counted (when its backend pins)."""
        hits, _ = self.prefix_hits_pinned(tenant, chunk_hashes, start, req_id)
        return hits

    def prefix_hits_pinned(
        self, tenant: str, chunk_hashes: list[str], start: int, req_id: str | None = None
    ) -> tuple[int, bool]:
        """(absolute chunk count present, whether worker 0 pinned them for ``req_id``)."""
        msg = [tenant, chunk_hashes, start] if req_id is None else [tenant, chunk_hashes, start, req_id]
        reply = self._ask(msg)
        if reply is None:
            return start, False
        hits, pinned = reply if isinstance(reply, list) else (reply, False)
        return (start, False) if hits < 0 else (int(hits), bool(pinned))

    def release(self, req_ids: list[str], keep: list[tuple[str, int]] | None = None) -> None:
        """Worker 0 unpins what these requests held (and trims ``keep`` holdings to their loads)."""
        if req_ids or keep:
            self._ask({"release": list(req_ids), "keep": [list(k) for k in keep or ()]})

    def _ask(self, msg: object) -> object | None:
        with self._lock:
            try:
                sock = self._socket()
                sock.send(msgspec.msgpack.encode(msg))
                return msgspec.msgpack.decode(sock.recv())
            except zmq.ZMQError as exc:
                log.warning("lookup RPC to %s failed (%s); treating as a miss", self.path, exc)
                if self._sock is not None:
                    self._sock.close(0)
                    self._sock = None
                return None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
