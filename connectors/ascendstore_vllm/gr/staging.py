"""GR user objects through connector-owned buffers (``UserStore.staging``).

A user object is a header (host memory the store writes and checks) followed by
KV blocks (vLLM's, on the device). Handed to the backend as they are, those
regions would be wrong in three deployments: a backend that cannot read device
memory (the KV), a backend that reads only device memory or only registered
memory (MemCache's device pool, Mooncake over rdma: the host header, record and
scratch block), and a backend whose calls may outlive their deadline (vLLM's
blocks, once given back). Here every region of a put is copied into one buffer
of the kind the backend reads (pinned host or the KV's device, registered where
the backend needs it) and the backend sees only that buffer; a get lands there
and its objects are copied out only when they arrived whole and in time.

Memory is bounded by one buffer per direction of ``staging_buffer_bytes``,
whatever the size of the KV cache. An object larger than that goes through a
buffer of its size, released after the transfer (logged once: raise
``staging_buffer_bytes`` or use ``use_layerwise``). A buffer whose call overran
is retired until that call ends (registration included) and the next transfer
gets a fresh one; with ``MAX_RETIRED`` retired, transfers fail fast (a
recompute) rather than allocate without bound.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence

import torch

from ascendstore.contract import Region, Status
from ascendstore.gr.store import StagedCall
from ascendstore_vllm.device import HostBuffers

log = logging.getLogger(__name__)

#: buffers calls still running may use; past this, transfers fail fast.
MAX_RETIRED = 4

Running = Callable[[], bool]


def _host_view(r: Region) -> torch.Tensor:
    """Host memory at ``r`` (a header, a record, the scratch block) as a byte tensor."""
    return torch.frombuffer((ctypes.c_ubyte * r.length).from_address(r.addr), dtype=torch.uint8)


class GRStaging:
    """An ``ascendstore.gr.store.ObjectStaging`` over ``buffers`` (``HostStaging``
    or ``DeviceBuffers``: the kind of memory, the KV's views, the side stream;
    ``HostBuffers`` where there is no KV).

    ``register``/``unregister`` (the backend's, when it needs registration) are
    called for every buffer handed to it and when one is let go."""

    def __init__(self, buffers: HostBuffers, register: Callable[[list[Region]], Status] | None = None,
                 unregister: Callable[[list[Region]], Status] | None = None) -> None:
        self.buffers = buffers
        self.capacity = buffers.capacity
        self._register, self._unregister = register, unregister
        self._bufs: dict[str, torch.Tensor | None] = {"put": buffers.save_buf, "get": buffers.load_buf}
        for buf in self._bufs.values():
            assert buf is not None
            self._registered(buf)
        self._locks = {"put": threading.Lock(), "get": threading.Lock()}
        self._lock = threading.Lock()
        self._retired: list[tuple[torch.Tensor, Running]] = []
        self._warned = False

    # -- buffers ----------------------------------------------------------------------
    def _registered(self, buf: torch.Tensor) -> torch.Tensor:
        if self._register is not None:
            st = self._register([Region(buf.data_ptr(), buf.numel())])
            if st is not Status.OK:
                log.warning("GR staging register() returned %s; transfers may fail and be recomputed",
                            Status(st).name)
        return buf

    def _let_go(self, buf: torch.Tensor) -> None:
        if self._unregister is not None:
            self._unregister([Region(buf.data_ptr(), buf.numel())])

    def _reap(self) -> int:
        """Let go of retired buffers whose calls have ended; returns how many are left."""
        with self._lock:
            ended, kept = [], []
            for b, running in self._retired:
                (ended if running() else kept).append((b, running))
            self._retired = kept
            left = len(kept)
        for b, _ in ended:
            self._let_go(b)
        return left

    def retired(self) -> int:
        """Buffers still lent to calls that overran."""
        return self._reap()

    def _take(self, op: str, nbytes: int) -> tuple[torch.Tensor, bool] | None:
        """(buffer, temporary) for one transfer; None: none may be had now."""
        if self._reap() >= MAX_RETIRED:
            return None
        try:
            buf = self._bufs[op]
            if buf is None:  # the last one was retired under a late call
                buf = self._bufs[op] = self._registered(self.buffers.alloc(self.capacity))
            if nbytes <= buf.numel():
                return buf, False
            if not self._warned:
                self._warned = True
                log.warning(
                    "GR objects of %d bytes exceed the %d-byte staging buffer: staged through a temporary "
                    "buffer (on workers: raise staging_buffer_bytes, or use_layerwise for per-layer objects)",
                    nbytes, buf.numel(),
                )
            return self._registered(self.buffers.alloc(nbytes)), True
        except RuntimeError:  # no room (e.g. on the device): this transfer fails, vLLM recomputes
            log.warning("GR staging: no buffer for a %d-byte user object; recomputing", nbytes, exc_info=True)
            return None

    # -- copies -----------------------------------------------------------------------
    def _views(self, regions: Sequence[Region]) -> tuple[list[torch.Tensor], list[bool]]:
        """The regions' views (empty ones left out), and which of them are device KV."""
        view = self.buffers.device_view
        out, is_kv = [], []
        for r in regions:
            if r.length:
                v = view(r)
                is_kv.append(v is not None)
                out.append(_host_view(r) if v is None else v)
        return out, is_kv

    def _copy(self, objects: Sequence[Sequence[Region]], buf: torch.Tensor, to_buf: bool) -> None:
        theirs, is_kv = self._views([r for rs in objects for r in rs])
        if not theirs:
            return
        mine = buf[: sum(v.numel() for v in theirs)].split([v.numel() for v in theirs])
        # Headers and records (host memory) one copy each; the KV's views batched.
        pairs = list(zip(mine, theirs, is_kv, strict=True))
        other_mine = [m for m, _, k in pairs if not k]
        if other_mine:
            other_theirs = [t for _, t, k in pairs if not k]
            if to_buf:
                self.buffers.copy_all(other_mine, other_theirs)
            else:
                self.buffers.copy_all(other_theirs, other_mine)
        kv_mine = [m for m, _, k in pairs if k]
        if kv_mine:
            self.buffers.copy_kv([t for _, t, k in pairs if k], kv_mine, to_kv=not to_buf)

    # -- the transfer -----------------------------------------------------------------
    def transfer(self, op: str, regions: list[list[Region]], call: StagedCall
                 ) -> tuple[list[Status], Running | None]:
        sizes = [sum(r.length for r in rs) for rs in regions]
        with self._locks[op]:
            got = self._take(op, sum(sizes))
            if got is None:
                return [Status.TIMEOUT] * len(regions), None
            buf, temporary = got
            base, staged, pos = buf.data_ptr(), [], 0
            for n in sizes:
                staged.append([Region(base + pos, n)])
                pos += n
            if op == "put":
                self._copy(regions, buf, to_buf=True)
            statuses, running = call(staged, buf)
            if running is not None:
                # The call goes on with the buffer: retire it until it ends.
                with self._lock:
                    self._retired.append((buf, running))
                if not temporary:
                    self._bufs[op] = None
                return statuses, running
            if op == "get":
                pos = 0
                for rs, n, st in zip(regions, sizes, statuses, strict=True):
                    if st is Status.OK:
                        self._copy([rs], buf[pos:], to_buf=False)
                    pos += n
            if temporary:
                self._let_go(buf)
            return statuses, None

