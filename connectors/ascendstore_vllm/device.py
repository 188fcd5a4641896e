"""Device KV (cuda, npu, ...) through torch's device-generic APIs.

No device type is hard-coded: streams and events come from
``torch.get_device_module(device)``, which torch_npu fills for ``npu`` as
torch does for ``cuda``.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ascendstore.contract import Region

log = logging.getLogger(__name__)

#: device views of regions kept (cleared when full): a few hundred bytes each, ~6 MB at most
VIEW_CACHE_ENTRIES = 1 << 14

#: device memory a stager gathers regions into before one copy to its host buffer (and
#: scatters from after one copy back), in pieces of this size, one per direction. On an
#: H200 with 32 KiB regions (16-token blocks of a 32-layer model) one copy per region
#: moved 3-7 GB/s, batched 14-35, one copy of the same bytes 55 (docs/benchmarking.md).
GATHER_BYTES = 64 << 20

#: loads scatter by row indices (two kernels per KV allocation, no view per region)
#: where rows are at least this large and a piece of the gather buffer holds at least
#: this many regions per allocation; else one fused copy of per-region views (on an
#: H200: 32 KiB regions, ~2,000 per piece, load at 0.36-0.41 of one copy by rows and
#: 0.26-0.36 fused; 512 KiB regions, 128 per piece, 0.50-0.53 by rows, 0.87-0.88 fused)
MIN_ROW_BYTES = 256
MIN_REGIONS_PER_ALLOCATION = 32


class _NoEvent:
    def synchronize(self) -> None:
        return


class DeviceSync:
    """Records an event on the device's current stream (what the model wrote)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cpu = device.type == "cpu"
        self._mod = None if self.is_cpu else torch.get_device_module(device)

    def record(self):
        if self._mod is None:
            return _NoEvent()
        event = self._mod.Event()
        event.record(self._mod.current_stream(self.device))
        return event

    def synchronize(self) -> None:
        if self._mod is not None:
            self._mod.synchronize(self.device)


def _pinned(nbytes: int) -> torch.Tensor:
    try:  # pins for the current accelerator (cuda, npu, ...) when there is one
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:
        return torch.empty(nbytes, dtype=torch.uint8)


class HostBuffers:
    """Pinned host buffers, one per direction of ``capacity`` bytes, handed to a
    backend instead of the caller's memory; the base of the stagers below
    (alone: GR's record reads on the scheduler, where there is no KV)."""

    device = torch.device("cpu")
    stream = None

    def __init__(self, capacity: int, buffers: bool = True) -> None:
        self.capacity = capacity
        if buffers:
            self.save_buf = self.alloc(capacity)
            self.load_buf = self.alloc(capacity)

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A buffer of this kind (here pinned host memory)."""
        return _pinned(nbytes)

    def device_view(self, r: Region) -> torch.Tensor | None:
        """``r`` as a byte view of the device KV (None: not in it)."""
        return None

    def copy_all(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        """``dst[i] <- src[i]``; returns when the copies are done."""
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)

    def copy_kv(self, kv: Sequence[torch.Tensor], mine: Sequence[torch.Tensor], to_kv: bool,
                disjoint: bool | None = None) -> None:
        """Between views of the KV and views of this stager's own memory (its buffers),
        ``kv[i] <-> mine[i]``; ``disjoint``: whether no two KV views overlap, when the
        caller knows (None: look). Returns when the copies are done."""
        if to_kv:
            self.copy_all(kv, mine)
        else:
            self.copy_all(mine, kv)


class HostStaging(HostBuffers):
    """Bounded pinned host buffers between device KV and a backend that cannot
    read device memory (an ``ascendstore.engine.Stager``).

    One buffer per direction of ``capacity`` bytes; the engine cuts batches to
    fit. Device regions are byte ranges of vLLM's KV allocation (all layers are
    views into one buffer), copied with the device's own side stream."""

    #: whether copies between the device and host memory go through a gather buffer
    GATHERS = True

    def __init__(self, kv_caches: dict[str, torch.Tensor], capacity: int, buffers: bool = True,
                 batched: bool | None = None, gather_bytes: int = GATHER_BYTES) -> None:
        first = next(iter(kv_caches.values()))
        self.device = first.device
        self._mod = torch.get_device_module(self.device)
        self.stream = self._mod.Stream(self.device) if self.device.type != "cpu" else None
        # Flat byte views of every distinct backing allocation, by address: (base, size, flat).
        self._storages: list[tuple[int, int, torch.Tensor]] = []
        seen = set()
        for t in kv_caches.values():
            st = t.untyped_storage()
            if st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            flat = torch.empty(0, dtype=torch.uint8, device=self.device).set_(st)
            self._storages.append((st.data_ptr(), st.nbytes(), flat))
        self._storages.sort(key=lambda s: s[0])
        self._bases = [base for base, _, _ in self._storages]
        self._bases_np = np.array(self._bases, dtype=np.int64)
        self._ends_np = np.array([base + size for base, size, _ in self._storages], dtype=np.int64)
        self._row_views: dict[tuple[int, int], torch.Tensor] = {}  # (storage, row bytes) -> rows
        #: device views of regions already seen: vLLM reuses a bounded set of blocks (and
        #: the worker a bounded set of region lists), so a region's view is built once,
        #: not searched for and sliced on every copy (a few µs each, per region).
        self._views: dict[tuple[int, int], torch.Tensor | None] = {}
        self.device_views = kv_caches
        # Batched copies: on a device each copy is a launch (a few µs of host time), and
        # a chunk of a 32-layer model is 64 regions per block, so per-region copies move
        # small regions at a tenth of the link's speed. In a batch, saves are gathered on
        # the device into one buffer that crosses to the host in one copy per contiguous
        # run; loads cross in, then scatter by row indices (or one fused copy of views);
        # a device buffer's commits scatter likewise. On the CPU a region's copy is a
        # memcpy and the gather a second pass, so per-region copies stay the default there.
        self.batched = self.device.type != "cpu" if batched is None else batched
        self._fused = hasattr(torch, "_foreach_copy_")
        #: gather buffers by direction (True: loads): a save and a load may run at once
        #: (the save thread beside async or layerwise loads), as with the host buffers
        self._gathers: dict[bool, torch.Tensor | None] = {True: None, False: None}
        super().__init__(capacity, buffers)
        if self.batched and self.GATHERS and min(gather_bytes, capacity) > 0:
            # No larger than a host buffer: the engine cuts batches to that.
            for to_kv in (False, True):
                self._gathers[to_kv] = self._alloc_gather(min(gather_bytes, capacity))

    def _alloc_gather(self, nbytes: int) -> torch.Tensor | None:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except RuntimeError as exc:  # torch.OutOfMemoryError is one
            # Slower, not wrong: copies go region by region.
            log.warning("AscendStore: no room on %s for a %g MiB gather buffer (%s); device KV is copied to "
                        "and from host memory region by region, which is slower for small blocks",
                        self.device, nbytes / (1 << 20), exc)
            return None

    def host_regions(self) -> list[Region]:
        return [Region(b.data_ptr(), b.numel()) for b in (self.save_buf, self.load_buf)]

    def device_view(self, r: Region) -> torch.Tensor | None:
        key = (r.addr, r.length)
        try:
            return self._views[key]
        except KeyError:
            pass
        view = None  # e.g. the host scratch block: nothing to copy
        i = bisect.bisect_right(self._bases, r.addr) - 1
        if i >= 0:
            base, size, flat = self._storages[i]
            if r.addr + r.length <= base + size:
                view = flat[r.addr - base : r.addr - base + r.length]
        if len(self._views) >= VIEW_CACHE_ENTRIES:
            self._views.clear()
        self._views[key] = view
        return view

    def _host_layout(self, buf: torch.Tensor, ops: Sequence) -> list[list[Region]]:
        out, pos = [], 0
        for op in ops:
            out.append([Region(buf.data_ptr() + pos, op.nbytes)])
            pos += op.nbytes
        if pos > buf.numel():
            # One object larger than the buffer (the engine cuts batches to capacity,
            # never below one object): grow rather than fail the transfer.
            grown = self.alloc(pos)
            if buf is self.save_buf:
                self.save_buf = grown
            else:
                self.load_buf = grown
            return self._host_layout(grown, ops)
        return out

    def _copies(self, ops: Sequence, buf: torch.Tensor, to_host: bool, ok: Sequence[bool] | None = None) -> None:
        # Python per region is what this costs beside the bytes (a 32-layer model with K
        # and V apart has 64 regions per chunk): cached device views, and either every
        # host view from one split of the buffer (one copy call per region) or, batched,
        # the regions' places in the buffer as plain numbers.
        view = self.device_view
        if self.batched and not to_host and self._load_by_rows(ops, buf, ok):
            return
        if self.batched:
            devs: list[torch.Tensor] = []
            offs: list[int] = []
            lens: list[int] = []
            copied: list[Region] = []
            pos = 0
            for i, op in enumerate(ops):
                skip = ok is not None and not ok[i]
                for r in op.regions:
                    d = None if skip else view(r)
                    if d is not None:  # None: not device KV (the scratch block); its place is kept
                        devs.append(d)
                        offs.append(pos)
                        lens.append(r.length)
                        copied.append(r)
                    pos += r.length
            if devs:
                # Loads may not reorder overlapping regions (a later object's bytes win).
                disjoint = True if to_host else _disjoint(copied)
                with self._on_stream():
                    self._batched(devs, buf, offs, lens, not to_host, disjoint)
                self._wait()
            return
        all_devs: list[torch.Tensor | None] = []
        lengths: list[int] = []
        for i, op in enumerate(ops):
            skip = ok is not None and not ok[i]
            for r in op.regions:
                lengths.append(r.length)
                all_devs.append(None if skip else view(r))
        if not lengths:
            return
        hosts = buf[: sum(lengths)].split(lengths)
        dev_side = [d for d in all_devs if d is not None]
        host_side = [h for d, h in zip(all_devs, hosts, strict=True) if d is not None]
        if to_host:
            self.copy_all(host_side, dev_side)
        elif dev_side:
            self.copy_all(dev_side, host_side)

    def copy_all(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        """``dst[i] <- src[i]`` on the side stream, one copy each; returns when the copies are done."""
        if not dst:
            return
        with self._on_stream():
            for d, s in zip(dst, src, strict=True):
                d.copy_(s, non_blocking=True)
        self._wait()

    def copy_kv(self, kv: Sequence[torch.Tensor], mine: Sequence[torch.Tensor], to_kv: bool,
                disjoint: bool | None = None) -> None:
        base = mine[0].untyped_storage() if mine else None
        if (not self.batched or len(kv) < 2
                or any(m.untyped_storage().data_ptr() != base.data_ptr() for m in mine)):  # type: ignore[union-attr]
            super().copy_kv(kv, mine, to_kv, disjoint)
            return
        # Slices of one buffer (a GR staging buffer): their places in it as numbers.
        buf = torch.empty(0, dtype=torch.uint8, device=mine[0].device).set_(base)
        if to_kv and disjoint is None:
            disjoint = _disjoint([Region(v.data_ptr(), v.numel()) for v in kv])
        with self._on_stream():
            self._batched(kv, buf, [m.storage_offset() for m in mine], [m.numel() for m in mine], to_kv,
                          bool(disjoint) or not to_kv)
        self._wait()

    def _on_stream(self):
        return self._mod.stream(self.stream) if self.stream is not None else _null()

    def _wait(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    # -- batched copies (issued on the side stream, in its order) -----------------------
    def _batched(self, devs: list[torch.Tensor], buf: torch.Tensor, offs: list[int], lens: list[int],
                 to_kv: bool, disjoint: bool) -> None:
        """``devs[i]`` (KV views) <-> ``buf[offs[i] : offs[i] + lens[i]]``; ``disjoint``:
        no two of ``devs`` overlap (only loads need it)."""
        if not self.GATHERS:  # the buffer is on the device too: one fused copy
            mine = _views(buf, offs, lens, 0, len(devs))
            if to_kv:
                self._fused_copy(devs, mine, disjoint)
            else:
                self._fused_copy(mine, devs, True)
            return
        gather = self._gathers[to_kv]
        if gather is None:  # no room for it on the device: one copy per region
            for d, h in zip(devs, _views(buf, offs, lens, 0, len(devs)), strict=True):
                (d.copy_(h, non_blocking=True) if to_kv else h.copy_(d, non_blocking=True))
            return
        # A piece at a time: while the device copies one piece, this thread lays out the
        # next (the gather buffer's reuse is ordered by the stream).
        cap, n, i = gather.numel(), len(devs), 0
        while i < n:
            j, size = i, 0
            while j < n and (j == i or size + lens[j] <= cap):
                size += lens[j]
                j += 1
            if size > cap:  # one region larger than the buffer: its own copy is as good
                h = buf[offs[i] : offs[i] + lens[i]]
                (devs[i].copy_(h, non_blocking=True) if to_kv else h.copy_(devs[i], non_blocking=True))
                i = j
                continue
            runs = _runs(offs, lens, i, j)
            if to_kv:
                for at, start, nbytes in runs:
                    gather[at : at + nbytes].copy_(buf[start : start + nbytes], non_blocking=True)
                self._fused_copy(devs[i:j], gather[:size].split(lens[i:j]), disjoint)
            else:
                torch.cat(devs[i:j], out=gather[:size])
                for at, start, nbytes in runs:
                    buf[start : start + nbytes].copy_(gather[at : at + nbytes], non_blocking=True)
            i = j

    def _load_by_rows(self, ops: Sequence, buf: torch.Tensor, ok: Sequence[bool] | None) -> bool:
        """A load as rows: the regions' addresses and places as arrays (no view, no
        Python per region beyond reading two numbers), the KV's allocations and the
        source seen as rows of the largest size that divides every offset and
        length, and per allocation one gather of rows from the source and one
        scatter into it: two kernels, whatever the region count. False: not worth
        it or not possible here (see ``MIN_ROW_BYTES``; overlapping regions, which
        a scatter may write in any order); nothing was copied."""
        counts = [len(op.regions) for op in ops]
        regions = [r for op in ops for r in op.regions]
        n = len(regions)
        if n == 0:
            return True
        addr = np.fromiter((r.addr for r in regions), dtype=np.int64, count=n)
        lens = np.fromiter((r.length for r in regions), dtype=np.int64, count=n)
        pos = np.cumsum(lens) - lens  # each region's place in the buffer
        k = np.searchsorted(self._bases_np, addr, side="right") - 1
        kc = np.maximum(k, 0)
        keep = (k >= 0) & (addr + lens <= self._ends_np[kc]) & (lens > 0)  # in the KV (not the scratch block)
        if ok is not None:
            keep &= np.repeat(np.asarray(ok, dtype=bool), counts)
        addr, lens, pos, k = addr[keep], lens[keep], pos[keep], k[keep]
        m = len(addr)
        if m == 0:
            return True
        gather = self._gathers[True] if self.GATHERS else None
        if self.GATHERS and gather is None:
            return False
        # The fixed cost is per allocation and per piece of the gather buffer: count the
        # regions a piece holds (a batch of a few large regions per allocation goes
        # faster as one fused copy of views; measured on an H200, docs/benchmarking.md).
        per_piece = m if gather is None else m * min(1.0, gather.numel() / float(lens.sum()))
        if per_piece < MIN_REGIONS_PER_ALLOCATION * len(np.unique(k)):
            return False
        order = np.argsort(addr, kind="stable")
        if np.any((addr + lens)[order[:-1]] > addr[order[1:]]):
            return False  # overlapping: in order, region by region
        dst = addr - self._bases_np[k]
        # Rows must divide the KV offsets and lengths; and the source offsets where the
        # source is the buffer itself (a landing buffer on the device).
        parts = (dst, lens) if self.GATHERS else (dst, lens, pos)
        row = math.gcd(int(np.gcd.reduce(np.concatenate(parts))), 1 << 16)  # <= 64 KiB: enough rows to spread
        if row < MIN_ROW_BYTES or (gather is not None and int(lens.max()) > gather.numel()):
            return False
        with self._on_stream():
            if not self.GATHERS:
                self._scatter_rows(k, dst, lens, pos, buf, row)
            else:
                # Pieces of the gather buffer: host runs in, then one scatter per piece.
                cap = gather.numel()
                ends = np.cumsum(lens)
                i = 0
                while i < m:
                    base = int(ends[i] - lens[i])
                    j = int(np.searchsorted(ends, base + cap, side="right"))
                    packed = ends[i:j] - lens[i:j] - base  # places in the gather buffer
                    breaks = np.flatnonzero(pos[i + 1 : j] != pos[i : j - 1] + lens[i : j - 1]) + 1
                    starts = np.concatenate(([0], breaks))
                    stops = np.concatenate((breaks, [j - i]))
                    for a, z in zip(starts.tolist(), stops.tolist(), strict=True):
                        at, first = int(packed[a]), int(pos[i + a])
                        nbytes = int(packed[z - 1] + lens[i + z - 1]) - at
                        gather[at : at + nbytes].copy_(buf[first : first + nbytes], non_blocking=True)
                    self._scatter_rows(k[i:j], dst[i:j], lens[i:j], packed, gather, row)
                    i = j
        self._wait()
        return True

    def _scatter_rows(self, k: np.ndarray, dst: np.ndarray, lens: np.ndarray, at: np.ndarray,
                      src: torch.Tensor, row: int) -> None:
        """Allocation ``k[i]`` at ``dst[i]`` <- ``src`` at ``at[i]``, ``lens[i]`` bytes, as rows."""
        counts = lens // row
        total = int(counts.sum())
        within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        dst_rows = np.repeat(dst // row, counts) + within
        src_rows = np.repeat(at // row, counts) + within
        storage = np.repeat(k, counts)
        order = np.argsort(storage, kind="stable")
        storage, dst_rows, src_rows = storage[order], dst_rows[order], src_rows[order]
        cuts = (np.flatnonzero(np.diff(storage)) + 1).tolist()
        idx = torch.from_numpy(np.concatenate((dst_rows, src_rows))).to(self.device)
        src_rows_t = _rows(src, row)
        for lo, hi in zip([0, *cuts], [*cuts, total], strict=True):
            key = (int(storage[lo]), row)
            rows = self._row_views.get(key)
            if rows is None:
                rows = self._row_views[key] = _rows(self._storages[key[0]][2], row)
            rows.index_copy_(0, idx[lo:hi], src_rows_t.index_select(0, idx[total + lo : total + hi]))

    def _fused_copy(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], disjoint: bool) -> None:
        """Within one device: one fused copy, unless destinations overlap (then in order)."""
        if self._fused and disjoint:
            try:
                torch._foreach_copy_(list(dst), list(src))
                return
            except (RuntimeError, NotImplementedError) as exc:  # a device without a fused copy
                log.warning("AscendStore: no fused copy on %s (%s); copying region by region", self.device, exc)
                self._fused = False
        for d, s in zip(dst, src, strict=True):
            d.copy_(s, non_blocking=True)

    def stage_out(self, ops: Sequence) -> list[list[Region]]:
        regions = self._host_layout(self.save_buf, ops)
        self._copies(ops, self.save_buf, to_host=True)
        return regions

    def stage_in(self, ops: Sequence) -> list[list[Region]]:
        return self._host_layout(self.load_buf, ops)

    def commit_in(self, ops: Sequence, ok: Sequence[bool]) -> None:
        if any(ok):
            self._copies(ops, self.load_buf, to_host=False, ok=ok)

    def detach(self, direction: str) -> tuple[object, Region | None]:
        """A call that overran still uses one buffer: give it to the engine to keep
        alive until the call ends, and carry on with a fresh pinned one."""
        if direction == "load":
            old, self.load_buf = self.load_buf, self.alloc(self.capacity)
            new = self.load_buf
        else:
            old, self.save_buf = self.save_buf, self.alloc(self.capacity)
            new = self.save_buf
        return old, Region(new.data_ptr(), new.numel())


class DeviceBuffers(HostStaging):
    """``HostStaging``'s buffers on the KV's own device: for a backend that reads
    and writes device memory but must not be handed vLLM's blocks (its calls may
    outlive their deadline), or must see one kind of memory only.

    Not host memory as a fallback: such a backend copies by the kind of memory it
    was set up for (MemCache's G2L), so a pinned host buffer there is a wrong
    copy, not a slower one. No room for a buffer is a clear error instead."""

    GATHERS = False  # its buffers are on the device: copies are device to device

    def alloc(self, nbytes: int) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except RuntimeError as exc:  # torch.OutOfMemoryError is one
            raise RuntimeError(
                f"AscendStore: no room on {self.device} for a {nbytes >> 20} MiB transfer buffer (a backend call "
                f"may outlive its deadline, so it never gets vLLM's blocks); leave that much device memory free "
                f"beside the KV cache, e.g. a lower gpu_memory_utilization ({exc})"
            ) from exc


class DeviceLanding(DeviceBuffers):
    """Where loads land for device KV and a backend that reads device memory
    (Mooncake over rdma/ascend, MemCache's device pool) but whose calls may
    outlive their deadline: a connector-owned buffer on the KV's own device, so
    a get that overran writes there and never into blocks vLLM has taken back,
    and what arrived in time goes on into the blocks as device-to-device copies
    (an ``ascendstore.engine.Stager`` for loads only; puts read the blocks).

    The core's host landing buffer would not do: its copy out is a host memmove,
    and device addresses are not host memory. The buffer is allocated at
    start-up, where no room for it is a clear error, and registered with the
    backend through ``on_alloc``; after an overrun the next load allocates a
    fresh one."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], capacity: int,
                 on_alloc: Callable[[Region], None] | None = None, batched: bool | None = None) -> None:
        super().__init__(kv_caches, capacity, buffers=False, batched=batched)
        self._on_alloc = on_alloc
        self.save_buf = None
        self.load_buf: torch.Tensor | None = self.alloc(capacity)

    def alloc(self, nbytes: int) -> torch.Tensor:
        buf = super().alloc(nbytes)
        if self._on_alloc is not None:
            self._on_alloc(Region(buf.data_ptr(), buf.numel()))
        return buf

    def stage_out(self, ops: Sequence) -> list[list[Region]]:
        raise NotImplementedError("puts read vLLM's blocks directly")

    def stage_in(self, ops: Sequence) -> list[list[Region]]:
        if self.load_buf is None:
            self.load_buf = self.alloc(max(self.capacity, sum(op.nbytes for op in ops)))
        return self._host_layout(self.load_buf, ops)

    def detach(self, direction: str) -> tuple[object, Region | None]:
        """A get that overran still writes the buffer: hand it over; the next load allocates (and registers) anew."""
        old, self.load_buf = self.load_buf, None
        return old, None


def _runs(offs: list[int], lens: list[int], i: int, j: int) -> list[tuple[int, int, int]]:
    """Regions ``i:j`` as maximal runs of adjacent places in the buffer: (offset among
    the regions' bytes, offset in the buffer, bytes). A staging buffer's regions are
    one run, or a few where a region that is not device KV leaves a gap."""
    out: list[tuple[int, int, int]] = []
    at = 0
    start, end = offs[i], offs[i]
    for k in range(i, j):
        if offs[k] != end:
            out.append((at, start, end - start))
            at += end - start
            start = end = offs[k]
        end += lens[k]
    out.append((at, start, end - start))
    return out


def _rows(flat: torch.Tensor, row: int) -> torch.Tensor:
    """A byte tensor as rows of ``row`` bytes (as 8-byte words where they fit: a
    copy kernel moves an element per thread step)."""
    usable = flat[: flat.numel() // row * row]
    if row % 8 == 0 and flat.data_ptr() % 8 == 0:
        return usable.view(torch.int64).view(-1, row // 8)
    return usable.view(-1, row)


def _views(buf: torch.Tensor, offs: list[int], lens: list[int], i: int, j: int) -> list[torch.Tensor]:
    """Views of ``buf`` at regions ``i:j``'s places: one split per run."""
    out: list[torch.Tensor] = []
    k = i
    for _, start, nbytes in _runs(offs, lens, i, j):
        m = k
        while m < j and offs[m] < start + nbytes:
            m += 1
        out.extend(buf[start : start + nbytes].split(lens[k:m]))
        k = m
    return out


def _disjoint(regions: Sequence[Region]) -> bool:
    """Whether no two regions overlap (a fused copy writes them in no set order)."""
    if len(regions) < 2:
        return True
    addr = np.fromiter((r.addr for r in regions), dtype=np.int64, count=len(regions))
    end = addr + np.fromiter((r.length for r in regions), dtype=np.int64, count=len(regions))
    order = np.argsort(addr, kind="stable")
    return not bool(np.any(end[order[:-1]] > addr[order[1:]]))


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
