"""Bounded host staging for GR user objects on a device the backend cannot read.

The chunk pool moves device KV through ``HostStaging``'s two pinned buffers of
``staging_buffer_bytes`` each; GR does the same with a pair of its own (the
chunk pool's buffers are in use by its transfer threads at any time). One user
object is staged at a time: its device blocks are copied into the buffer, the
backend reads or writes the buffer, and a load is copied back to the device
only when the backend returned it whole. Host memory is therefore bounded by
the two buffers, whatever the size of the KV cache. A user history larger than
a buffer goes through a temporary buffer of its size, released after the
transfer (logged once: raise ``staging_buffer_bytes`` or use ``use_layerwise``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import torch

from ascendstore.contract import Region, Status
from ascendstore.gr.store import BlockSpan
from ascendstore_vllm.device import HostStaging

log = logging.getLogger(__name__)

LayerBlocks = Sequence[Sequence[BlockSpan | None]]


def _runs(span: BlockSpan) -> list[Region]:
    return [span] if isinstance(span, Region) else list(span)


#: landing buffers a call still running may use; past this, transfers fail fast.
MAX_LENT = 4


class GRStaging:
    def __init__(self, kv_caches: dict[str, torch.Tensor], capacity: int,
                 late_calls: Callable[[], bool] | None = None) -> None:
        self.host = HostStaging(kv_caches, capacity)
        self.capacity = capacity
        self._locks = {"save": threading.Lock(), "load": threading.Lock()}
        self._warned = False
        #: with a backend whose calls may outlive their deadline: True while some call
        #: may still be running. Each transfer then gets a buffer of its own, kept
        #: until no call is late, so a late get never lands in vLLM's blocks or in a
        #: buffer reused by the next transfer, and a late put never reads one.
        self._late_calls = late_calls
        self._lent: list[torch.Tensor] = []

    def host_regions(self) -> list[Region]:
        """The staging buffers (to register with backends that need it)."""
        return self.host.host_regions()

    def _layout(self, layer_blocks: LayerBlocks, buf: torch.Tensor) -> tuple[list[list[BlockSpan | None]], list[Region]]:
        """Host spans of the same shape as ``layer_blocks`` at consecutive bytes of
        ``buf``, and the device regions in that order."""
        base, pos = buf.data_ptr(), 0
        out: list[list[BlockSpan | None]] = []
        flat: list[Region] = []
        for layer in layer_blocks:
            row: list[BlockSpan | None] = []
            for span in layer:
                if span is None:
                    row.append(None)
                    continue
                runs = []
                for r in _runs(span):
                    runs.append(Region(base + pos, r.length))
                    flat.append(r)
                    pos += r.length
                row.append(runs)
            out.append(row)
        return out, flat

    def _own_buffer(self, nbytes: int) -> torch.Tensor | None:
        """A fresh buffer for one transfer (None: all spares held by stuck calls)."""
        assert self._late_calls is not None
        if not self._late_calls():
            self._lent.clear()
        if len(self._lent) >= MAX_LENT:
            return None
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self._lent.append(buf)
        return buf

    def _buffer(self, which: str, nbytes: int) -> torch.Tensor | None:
        if self._late_calls is not None:
            return self._own_buffer(nbytes)
        buf = self.host.save_buf if which == "save" else self.host.load_buf
        if nbytes <= buf.numel():
            return buf
        if not self._warned:
            self._warned = True
            log.warning(
                "GR user object of %d bytes exceeds staging_buffer_bytes (%d): staged through a temporary "
                "host buffer (raise staging_buffer_bytes, or use_layerwise for per-layer objects)",
                nbytes, buf.numel(),
            )
        return torch.empty(nbytes, dtype=torch.uint8)

    @staticmethod
    def _nbytes(layer_blocks: LayerBlocks) -> int:
        return sum(r.length for layer in layer_blocks for span in layer if span is not None for r in _runs(span))

    def save(self, layer_blocks: LayerBlocks, write: Callable[[LayerBlocks], Status]) -> Status:
        """Stage the device blocks out, then ``write`` the host copy."""
        with self._locks["save"]:
            buf = self._buffer("save", self._nbytes(layer_blocks))
            if buf is None:
                return Status.TIMEOUT
            spans, flat = self._layout(layer_blocks, buf)
            self.host.copy_regions(flat, buf, to_host=True)
            return write(spans)

    def load(self, layer_blocks: LayerBlocks, read: Callable[[LayerBlocks], Status]) -> Status:
        """``read`` into the host buffer, then copy to the device blocks if it succeeded."""
        with self._locks["load"]:
            buf = self._buffer("load", self._nbytes(layer_blocks))
            if buf is None:
                return Status.TIMEOUT
            spans, flat = self._layout(layer_blocks, buf)
            st = read(spans)
            if st is Status.OK:
                self.host.copy_regions(flat, buf, to_host=False)
            return st
