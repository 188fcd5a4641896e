"""Device KV (cuda, npu, ...) through torch's device-generic APIs.

No device type is hard-coded: streams and events come from
``torch.get_device_module(device)``, which torch_npu fills for ``npu`` as
torch does for ``cuda``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from ascendstore.contract import Region

#: device views of regions kept (cleared when full): a few hundred bytes each, ~6 MB at most
VIEW_CACHE_ENTRIES = 1 << 14


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


class HostStaging(HostBuffers):
    """Bounded pinned host buffers between device KV and a backend that cannot
    read device memory (an ``ascendstore.engine.Stager``).

    One buffer per direction of ``capacity`` bytes; the engine cuts batches to
    fit. Device regions are byte ranges of vLLM's KV allocation (all layers are
    views into one buffer), copied with the device's own side stream."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], capacity: int, buffers: bool = True) -> None:
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
        #: device views of regions already seen: vLLM reuses a bounded set of blocks (and
        #: the worker a bounded set of region lists), so a region's view is built once,
        #: not searched for and sliced on every copy (a few µs each, per region).
        self._views: dict[tuple[int, int], torch.Tensor | None] = {}
        self.device_views = kv_caches
        super().__init__(capacity, buffers)

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
        # and V apart has 64 regions per chunk): cached device views and every host view
        # from one split of the buffer leave one copy call per region.
        view = self.device_view
        devs: list[torch.Tensor | None] = []
        lengths: list[int] = []
        for i, op in enumerate(ops):
            skip = ok is not None and not ok[i]
            for r in op.regions:
                lengths.append(r.length)
                devs.append(None if skip else view(r))
        if not lengths:
            return
        hosts = buf[: sum(lengths)].split(lengths)
        dev_side = [d for d in devs if d is not None]
        host_side = [h for d, h in zip(devs, hosts, strict=True) if d is not None]
        if not dev_side:
            return
        if to_host:
            self.copy_all(host_side, dev_side)
        else:
            self.copy_all(dev_side, host_side)

    def copy_all(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        """``dst[i] <- src[i]`` on the side stream; returns when the copies are done."""
        ctx = self._mod.stream(self.stream) if self.stream is not None else _null()
        with ctx:
            for d, s in zip(dst, src, strict=True):
                d.copy_(s, non_blocking=True)
        if self.stream is not None:
            self.stream.synchronize()

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
                 on_alloc: Callable[[Region], None] | None = None) -> None:
        super().__init__(kv_caches, capacity, buffers=False)
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


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
