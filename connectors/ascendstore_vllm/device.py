"""Device KV (cuda, npu, ...) through torch's device-generic APIs.

No device type is hard-coded: streams and events come from
``torch.get_device_module(device)``, which torch_npu fills for ``npu`` as
torch does for ``cuda``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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


class HostStaging:
    """Pinned host copies of the KV views, for backends that cannot read device memory.

    Blocks are copied device->host before a put and host->device after a get,
    in one batched index copy per layer on a side stream."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], budget_bytes: int) -> None:
        self.device_views = kv_caches
        first = next(iter(kv_caches.values()))
        self.device = first.device
        self._mod = torch.get_device_module(self.device)
        self.stream = self._mod.Stream(self.device)
        pin = torch.cuda.is_available() or self.device.type != "cuda"
        self.host_views: dict[str, torch.Tensor] = {
            name: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=pin)
            for name, t in kv_caches.items()
        }
        self.budget_bytes = budget_bytes

    def _layers(self, layer: int | None) -> list[str]:
        names = list(self.device_views)
        return names if layer is None else [names[layer]]

    def to_host(self, block_ids: Sequence[int], layer: int | None = None) -> None:
        if not block_ids:
            return
        idx = torch.tensor(sorted(set(block_ids)), dtype=torch.long)
        idx_dev = idx.to(self.device)
        with self._mod.stream(self.stream):
            for name in self._layers(layer):
                self.host_views[name][idx] = self.device_views[name][idx_dev].to("cpu", non_blocking=False)
        self.stream.synchronize()

    def to_device(self, block_ids: Sequence[int], layer: int | None = None) -> None:
        if not block_ids:
            return
        idx = torch.tensor(sorted(set(block_ids)), dtype=torch.long)
        idx_dev = idx.to(self.device)
        with self._mod.stream(self.stream):
            for name in self._layers(layer):
                src = self.host_views[name][idx].to(self.device, non_blocking=True)
                self.device_views[name].index_copy_(0, idx_dev, src)
        self.stream.synchronize()
