"""Device KV (cuda, npu, ...) through torch's device-generic APIs.

No device type is hard-coded: streams and events come from
``torch.get_device_module(device)``, which torch_npu fills for ``npu`` as
torch does for ``cuda``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ascendstore.contract import Region


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


class HostStaging:
    """Bounded pinned host buffers between device KV and a backend that cannot
    read device memory (an ``ascendstore.engine.Stager``).

    One buffer per direction of ``capacity`` bytes; the engine cuts batches to
    fit. Device regions are byte ranges of vLLM's KV allocation (all layers are
    views into one buffer), copied with the device's own side stream."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], capacity: int) -> None:
        first = next(iter(kv_caches.values()))
        self.device = first.device
        self._mod = torch.get_device_module(self.device)
        self.stream = self._mod.Stream(self.device) if self.device.type != "cpu" else None
        # Flat byte views of every distinct backing allocation: addr -> (base, flat).
        self._storages: list[tuple[int, int, torch.Tensor]] = []
        seen = set()
        for t in kv_caches.values():
            st = t.untyped_storage()
            if st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            flat = torch.empty(0, dtype=torch.uint8, device=self.device).set_(st)
            self._storages.append((st.data_ptr(), st.nbytes(), flat))
        self.device_views = kv_caches
        self._mirror: dict[str, torch.Tensor] | None = None
        self.capacity = capacity
        self.save_buf = _pinned(capacity)
        self.load_buf = _pinned(capacity)

    # -- whole-cache mirror (the GR user store's interface) ----------------------------
    @property
    def host_views(self) -> dict[str, torch.Tensor]:
        """Pinned host copies of every KV view (allocated on first use)."""
        if self._mirror is None:
            self._mirror = {}
            for name, t in self.device_views.items():
                h = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
                try:
                    h = h.pin_memory()
                except RuntimeError:
                    pass
                self._mirror[name] = h
        return self._mirror

    def _layers(self, layer: int | None) -> list[str]:
        names = list(self.device_views)
        return names if layer is None else [names[layer]]

    def to_host(self, block_ids: Sequence[int], layer: int | None = None) -> None:
        """Copy blocks of the device views into host_views."""
        if not block_ids:
            return
        idx = torch.tensor(sorted(set(block_ids)), dtype=torch.long)
        for name in self._layers(layer):
            self.host_views[name][idx] = self.device_views[name][idx.to(self.device)].to("cpu")
        DeviceSync(self.device).synchronize()

    def to_device(self, block_ids: Sequence[int], layer: int | None = None) -> None:
        """Copy blocks of host_views into the device views."""
        if not block_ids:
            return
        idx = torch.tensor(sorted(set(block_ids)), dtype=torch.long)
        idx_dev = idx.to(self.device)
        for name in self._layers(layer):
            self.device_views[name].index_copy_(0, idx_dev, self.host_views[name][idx].to(self.device))
        DeviceSync(self.device).synchronize()

    def host_regions(self) -> list[Region]:
        return [Region(b.data_ptr(), b.numel()) for b in (self.save_buf, self.load_buf)]

    def _device_slice(self, r: Region) -> torch.Tensor | None:
        for base, size, flat in self._storages:
            if base <= r.addr and r.addr + r.length <= base + size:
                return flat[r.addr - base : r.addr - base + r.length]
        return None  # e.g. the host scratch block: nothing to copy

    def _host_layout(self, buf: torch.Tensor, ops: Sequence) -> list[list[Region]]:
        out, pos = [], 0
        for op in ops:
            out.append([Region(buf.data_ptr() + pos, op.nbytes)])
            pos += op.nbytes
        if pos > buf.numel():
            # One object larger than the buffer (the engine cuts batches to capacity,
            # never below one object): grow rather than fail the transfer.
            grown = _pinned(pos)
            if buf is self.save_buf:
                self.save_buf = grown
            else:
                self.load_buf = grown
            return self._host_layout(grown, ops)
        return out

    def _copies(self, ops: Sequence, buf: torch.Tensor, to_host: bool, ok: Sequence[bool] | None = None) -> None:
        ctx = self._mod.stream(self.stream) if self.stream is not None else _null()
        with ctx:
            pos = 0
            for i, op in enumerate(ops):
                for r in op.regions:
                    dev = self._device_slice(r)
                    if dev is not None and (ok is None or ok[i]):
                        host = buf[pos : pos + r.length]
                        if to_host:
                            host.copy_(dev, non_blocking=True)
                        else:
                            dev.copy_(host, non_blocking=True)
                    pos += r.length
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
            old, self.load_buf = self.load_buf, _pinned(self.capacity)
            new = self.load_buf
        else:
            old, self.save_buf = self.save_buf, _pinned(self.capacity)
            new = self.save_buf
        return old, Region(new.data_ptr(), new.numel())


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
