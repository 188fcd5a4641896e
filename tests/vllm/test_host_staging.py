"""HostStaging's copies between device KV and its host buffers, and
DeviceLanding's from its device buffer into the KV, byte for byte.

CPU tensors stand in for device memory (the copies are device-generic torch).
The expected bytes are computed independently, from the regions' addresses,
over allocations of several kinds: one per layer, two layers viewing one
allocation, and memory outside the KV (the worker's scratch block), which a
copy must skip while keeping its place in the buffer."""

from __future__ import annotations

import random

import pytest
import torch
from ascendstore_vllm import device
from ascendstore_vllm.device import DeviceLanding, HostStaging

from ascendstore.contract import Region


class _Op:
    """One object's device regions, as the engine hands them to a stager."""

    def __init__(self, regions: list[Region]) -> None:
        self.regions = regions


def _kv() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    own = [torch.randint(0, 256, (2, 12, 256), dtype=torch.uint8, generator=g) for _ in range(3)]
    shared = torch.randint(0, 256, (2, 2, 12, 256), dtype=torch.uint8, generator=g)
    kv = {f"own{i}": t for i, t in enumerate(own)} | {"sharedA": shared[0], "sharedB": shared[1]}
    scratch = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    return kv, scratch


def _objects(kv: dict[str, torch.Tensor], scratch: torch.Tensor, rng: random.Random) -> list[_Op]:
    """Objects of 1-6 regions: a block run of a layer's K or V (the end of an
    allocation included), now and then the scratch block."""
    ops = []
    tensors = list(kv.values())
    for _ in range(40):
        regions = []
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.1:
                regions.append(Region(scratch.data_ptr() + 256 * rng.randrange(8), 256))
                continue
            t = rng.choice(tensors)
            half, first = rng.randrange(2), rng.randrange(12)
            n = rng.randint(1, 12 - first)
            regions.append(Region(t[half, first].data_ptr(), 256 * n))
        op = _Op(regions)
        op.nbytes = sum(r.length for r in regions)
        ops.append(op)
    return ops


def _bytes_at(kv: dict[str, torch.Tensor], r: Region) -> bytes | None:
    for t in kv.values():
        lo = t.data_ptr()
        if lo <= r.addr and r.addr + r.length <= lo + t.numel():
            return t.flatten()[r.addr - lo : r.addr - lo + r.length].numpy().tobytes()
    return None


@pytest.mark.parametrize("cache", ["cache", "small cache"])
def test_staged_copies_move_each_region_s_bytes_and_skip_what_is_not_device_kv(monkeypatch, cache):
    if cache == "small cache":  # the view cache cleared every few regions
        monkeypatch.setattr(device, "VIEW_CACHE_ENTRIES", 5)
    kv, scratch = _kv()
    staging = HostStaging(kv, 1 << 20)
    rng = random.Random(cache)
    for _ in range(3):
        ops = _objects(kv, scratch, rng)
        regions = staging.stage_out(ops)
        assert [r[0].length for r in regions] == [op.nbytes for op in ops]
        buf = staging.save_buf.numpy()
        pos = 0
        for op in ops:
            for r in op.regions:
                want = _bytes_at(kv, r)
                if want is not None:  # scratch: its place in the buffer kept, nothing copied
                    assert buf[pos : pos + r.length].tobytes() == want
                pos += r.length

        _check_loads(staging, kv, scratch, ops, rng, pos)


def _check_loads(staging: HostStaging, kv: dict[str, torch.Tensor], scratch: torch.Tensor, ops: list[_Op],
                 rng: random.Random, pos: int) -> None:
    """Distinct bytes into the load buffer; only objects marked ok reach the KV."""
    before = {k: t.clone() for k, t in kv.items()}
    scratch_before = scratch.clone()
    staging.stage_in(ops)
    fill = torch.randint(0, 256, (pos,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    staging.load_buf[:pos].copy_(fill)
    ok = [rng.random() < 0.5 for _ in ops]
    staging.commit_in(ops, ok)
    flat_expect = {k: t.flatten().clone() for k, t in before.items()}
    pos = 0
    for op, good in zip(ops, ok, strict=True):  # in order: a later object's bytes win
        for r in op.regions:
            if good:
                for k, t in kv.items():
                    lo = t.data_ptr()
                    if lo <= r.addr and r.addr + r.length <= lo + t.numel():
                        flat_expect[k][r.addr - lo : r.addr - lo + r.length] = fill[pos : pos + r.length]
            pos += r.length
    for k, t in kv.items():
        assert torch.equal(t.flatten(), flat_expect[k]), k
    assert torch.equal(scratch, scratch_before)  # never written: it is not device KV
    for k, t in kv.items():  # restore for the next round's saves
        t.copy_(before[k])


def test_device_landing_copies_what_arrived_into_the_kv_and_skips_what_is_not_device_kv():
    kv, scratch = _kv()
    allocated: list[Region] = []
    landing = DeviceLanding(kv, 1 << 16, allocated.append)
    # At start-up (where no room for it is a clear error), on the KV's device, registered.
    assert landing.load_buf is not None and landing.load_buf.device == next(iter(kv.values())).device
    assert allocated == [Region(landing.load_buf.data_ptr(), landing.load_buf.numel())]
    rng = random.Random(3)
    for _ in range(3):
        ops = _objects(kv, scratch, rng)
        _check_loads(landing, kv, scratch, ops, rng, sum(op.nbytes for op in ops))
    with pytest.raises(NotImplementedError):
        landing.stage_out(ops)


def test_device_landing_handed_over_after_an_overrun_is_never_written_again():
    kv, scratch = _kv()
    allocated: list[Region] = []
    landing = DeviceLanding(kv, 1 << 16, allocated.append)
    ops = _objects(kv, scratch, random.Random(5))[:4]
    landing.stage_in(ops)
    old, region = landing.detach("load")
    assert region is None and landing.load_buf is None  # the next load allocates (and registers) its own
    landed = landing.stage_in(ops)
    assert landing.load_buf.data_ptr() != old.data_ptr()
    assert landed[0][0].addr == landing.load_buf.data_ptr() and len(allocated) == 2
    kept = old.clone()
    landing.load_buf.fill_(1)
    landing.commit_in(ops, [True] * len(ops))
    assert torch.equal(old, kept), "the retired buffer was touched"


def test_device_landing_without_room_on_the_device_is_a_clear_error(monkeypatch):
    kv, _ = _kv()
    real_empty = torch.empty

    def empty(*args, **kwargs):
        if "device" in kwargs and args and args[0] > 0:
            raise torch.OutOfMemoryError("out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(RuntimeError, match=r"no room on cpu for a 2 MiB transfer buffer.*gpu_memory_util"):
        DeviceLanding(kv, 2 << 20)
