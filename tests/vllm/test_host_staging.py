"""HostStaging's copies between device KV and its host buffers, and
DeviceLanding's from its device buffer into the KV, byte for byte.

CPU tensors stand in for device memory (the copies are device-generic torch).
The expected bytes are computed independently, from the regions' addresses,
over allocations of several kinds: one per layer, two layers viewing one
allocation, and memory outside the KV (the worker's scratch block), which a
copy must skip while keeping its place in the buffer.

Each runs region by region (the CPU's default) and batched (a device's default:
gathered through a device buffer, scattered by one fused copy), the latter also
with a gather buffer of a few regions, so that batches go in pieces and some
regions are larger than the buffer."""

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


#: how a stager is built (and the module's thresholds for loads): region by region;
#: batched, loads scattered by row indices or by one fused copy; batched in pieces
MODES = {
    "per region": ({"batched": False}, {}),
    "batched, rows": ({"batched": True}, {"MIN_REGIONS_PER_ALLOCATION": 0}),
    "batched, fused": ({"batched": True}, {"MIN_ROW_BYTES": 1 << 40}),
    # (rows: a gather buffer of a few regions, and larger than any; fused: smaller than some)
    "batched in pieces, rows": ({"batched": True, "gather_bytes": 4096}, {"MIN_REGIONS_PER_ALLOCATION": 0}),
    "batched in pieces, fused": ({"batched": True, "gather_bytes": 700}, {"MIN_ROW_BYTES": 1 << 40}),
}


def _stager(monkeypatch, mode: str, kv: dict[str, torch.Tensor]) -> HostStaging:
    kwargs, limits = MODES[mode]
    for name, value in limits.items():
        monkeypatch.setattr(device, name, value)
    return HostStaging(kv, 1 << 20, **kwargs)


def _objects(kv: dict[str, torch.Tensor], scratch: torch.Tensor, rng: random.Random,
             distinct: bool = False) -> list[_Op]:
    """Objects of 1-6 regions: a block run of a layer's K or V (the end of an
    allocation included), now and then the scratch block. ``distinct``: no two
    runs share a block (as in vLLM's loads); else they overlap now and then."""
    ops = []
    tensors = list(kv.values())
    taken: set[int] = set()
    for _ in range(40):
        regions = []
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.1:
                regions.append(Region(scratch.data_ptr() + 256 * rng.randrange(8), 256))
                continue
            t = rng.choice(tensors)
            half, first = rng.randrange(2), rng.randrange(12)
            n = rng.randint(1, 12 - first)
            if distinct:
                blocks = {t[half, b].data_ptr() for b in range(first, first + n)}
                if blocks & taken:
                    continue
                taken |= blocks
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


def _check_saved(staging: HostStaging, kv: dict[str, torch.Tensor], ops: list[_Op]) -> int:
    """The save buffer holds each region's bytes in order; returns the bytes laid out."""
    buf, pos = staging.save_buf.numpy(), 0
    for op in ops:
        for r in op.regions:
            want = _bytes_at(kv, r)
            if want is not None:  # scratch: its place in the buffer kept, nothing copied
                assert buf[pos : pos + r.length].tobytes() == want
            pos += r.length
    return pos


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("distinct", [False, True], ids=["overlapping", "distinct"])
@pytest.mark.parametrize("cache", ["cache", "small cache"])
def test_staged_copies_move_each_region_s_bytes_and_skip_what_is_not_device_kv(monkeypatch, cache, distinct, mode):
    if cache == "small cache":  # the view cache cleared every few regions
        monkeypatch.setattr(device, "VIEW_CACHE_ENTRIES", 5)
    kv, scratch = _kv()
    staging = _stager(monkeypatch, mode, kv)
    rng = random.Random(cache)
    for _ in range(3):
        ops = _objects(kv, scratch, rng, distinct)
        regions = staging.stage_out(ops)
        assert [r[0].length for r in regions] == [op.nbytes for op in ops]
        pos = _check_saved(staging, kv, ops)
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


@pytest.mark.parametrize("mode", ["per region", "batched, rows", "batched, fused"])
@pytest.mark.parametrize("distinct", [False, True], ids=["overlapping", "distinct"])
def test_device_landing_copies_what_arrived_into_the_kv_and_skips_what_is_not_device_kv(monkeypatch, distinct, mode):
    kv, scratch = _kv()
    allocated: list[Region] = []
    kwargs, limits = MODES[mode]
    for name, value in limits.items():
        monkeypatch.setattr(device, name, value)
    landing = DeviceLanding(kv, 1 << 16, allocated.append, **kwargs)
    # At start-up (where no room for it is a clear error), on the KV's device, registered.
    assert landing.load_buf is not None and landing.load_buf.device == next(iter(kv.values())).device
    assert allocated == [Region(landing.load_buf.data_ptr(), landing.load_buf.numel())]
    rng = random.Random(3)
    for _ in range(3):
        ops = _objects(kv, scratch, rng, distinct)
        _check_loads(landing, kv, scratch, ops, rng, sum(op.nbytes for op in ops))
    with pytest.raises(NotImplementedError):
        landing.stage_out(ops)


@pytest.mark.parametrize("scatter", ["rows", "fused"])
@pytest.mark.parametrize("distinct", [False, True], ids=["overlapping", "distinct"])
@pytest.mark.parametrize("stager", ["staging", "landing"])
def test_a_scatter_in_any_order_never_reorders_overlapping_loads(monkeypatch, distinct, stager, scatter):
    """A batched scatter writes its regions in no set order (on a device, in
    parallel); where loads overlap, a later object's bytes must still win. The
    planted scatters write in reverse, so a batch with overlaps that one of them
    took would be seen."""
    calls = []

    def reversed_copy(dst, src):
        calls.append(len(dst))
        for d, s in reversed(list(zip(dst, src, strict=True))):
            d.copy_(s)

    real_index_copy = torch.Tensor.index_copy_

    def reversed_index_copy(self, dim, index, source):
        calls.append(len(index))
        for i in reversed(range(len(index))):
            real_index_copy(self, dim, index[i : i + 1], source[i : i + 1])
        return self

    monkeypatch.setattr(torch, "_foreach_copy_", reversed_copy)
    monkeypatch.setattr(torch.Tensor, "index_copy_", reversed_index_copy)
    mode = f"batched, {scatter}"
    for name, value in MODES[mode][1].items():
        monkeypatch.setattr(device, name, value)
    kv, scratch = _kv()
    st = HostStaging(kv, 1 << 20, batched=True) if stager == "staging" else DeviceLanding(kv, 1 << 16, batched=True)
    rng = random.Random(11)
    for _ in range(3):
        ops = _objects(kv, scratch, rng, distinct)
        _check_loads(st, kv, scratch, ops, rng, sum(op.nbytes for op in ops))
    assert bool(calls) == distinct  # distinct loads took the scatter; overlapping ones went in order


@pytest.mark.parametrize("stager", ["staging", "landing"])
def test_loads_keep_each_region_s_place_when_a_skipped_region_leaves_it_at_an_odd_offset(monkeypatch, stager):
    """A region that is not device KV (the scratch block) keeps its place in the
    buffer whatever its size, so the KV regions after it may start at any offset:
    rows must divide those places too where the buffer is the source."""
    monkeypatch.setattr(device, "MIN_REGIONS_PER_ALLOCATION", 0)
    kv, scratch = _kv()
    tensors = list(kv.values())
    regions = [Region(t[h, b].data_ptr(), 256) for t in tensors for h in (0, 1) for b in (1, 4, 9)]
    ops = [_Op([Region(scratch.data_ptr(), 100), *regions[:12]]), _Op(regions[12:])]
    for op in ops:
        op.nbytes = sum(r.length for r in op.regions)
    st = HostStaging(kv, 1 << 20, batched=True) if stager == "staging" else DeviceLanding(kv, 1 << 16, batched=True)
    _check_loads(st, kv, scratch, ops, random.Random(2), sum(op.nbytes for op in ops))


def test_batched_saves_cross_in_one_copy_per_run_of_the_buffer(monkeypatch):
    """Saved regions are gathered on the device and cross to the host buffer in one
    copy per run of adjacent slices (a region that is not device KV breaks the run)."""
    kv, scratch = _kv()
    staging = HostStaging(kv, 1 << 20, batched=True)
    tensors = list(kv.values())
    regions = [Region(t[h, b].data_ptr(), 256) for t in tensors for h in (0, 1) for b in (0, 5, 11)]
    ops = [_Op(regions[:10]), _Op([Region(scratch.data_ptr(), 256), *regions[10:]])]
    for op in ops:
        op.nbytes = sum(r.length for r in op.regions)
    crossings = []
    real_copy = torch.Tensor.copy_

    def copy(self, src, non_blocking=False):
        if self.data_ptr() >= staging.save_buf.data_ptr() and self.data_ptr() < staging.save_buf.data_ptr() + staging.save_buf.numel():
            crossings.append(self.numel())
        return real_copy(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy)
    staging.stage_out(ops)
    monkeypatch.setattr(torch.Tensor, "copy_", real_copy)
    assert crossings == [10 * 256, (len(regions) - 10) * 256]  # the scratch block splits the buffer in two runs
    _check_saved(staging, kv, ops)


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


@pytest.mark.parametrize("gather_kib", [64, 4])
def test_loads_scatter_by_rows_only_where_a_piece_holds_many_regions_per_allocation(monkeypatch, gather_kib):
    """The default thresholds: 280 one-block regions over two allocations go by
    rows through a 64 KiB gather buffer (140 per allocation per piece), and as one
    fused copy per piece through a 4 KiB one (8 per allocation per piece)."""
    used = []
    real_index_copy, real_fused = torch.Tensor.index_copy_, torch._foreach_copy_
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda self, *a: used.append("rows") or real_index_copy(self, *a))
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: used.append("fused") or real_fused(d, s))
    g = torch.Generator().manual_seed(4)
    kv = {f"l{i}": torch.randint(0, 256, (2, 80, 256), dtype=torch.uint8, generator=g) for i in range(2)}
    ops = [_Op([Region(t[h, b].data_ptr(), 256) for t in kv.values() for h in (0, 1)]) for b in range(1, 71)]
    for op in ops:
        op.nbytes = 1024
    st = HostStaging(kv, 1 << 20, batched=True, gather_bytes=gather_kib << 10)
    _check_loads(st, kv, torch.zeros(256, dtype=torch.uint8), ops, random.Random(1), 70 * 1024)
    assert set(used) == ({"rows"} if gather_kib == 64 else {"fused"})


def test_the_gather_buffer_is_no_larger_than_a_host_buffer_and_without_room_copies_go_one_by_one(monkeypatch, caplog):
    kv, scratch = _kv()
    assert [g.numel() for g in HostStaging(kv, 4096, batched=True)._gathers.values()] == [4096, 4096]
    assert [g.numel() for g in HostStaging(kv, 1 << 30, batched=True, gather_bytes=8192)._gathers.values()] == [8192] * 2
    real_empty = torch.empty

    def empty(*args, **kwargs):  # the device has no room left for the gather buffer
        if kwargs.get("device") is not None and args and args[0] == 1 << 16:
            raise torch.OutOfMemoryError("out of memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with caplog.at_level("WARNING"):
        st = HostStaging(kv, 1 << 20, batched=True, gather_bytes=1 << 16)
    monkeypatch.setattr(torch, "empty", real_empty)
    assert st._gathers == {True: None, False: None} and "no room on cpu for a 0.0625 MiB gather buffer" in caplog.text
    rng = random.Random(8)
    ops = _objects(kv, scratch, rng, distinct=True)
    regions = st.stage_out(ops)
    assert [r[0].length for r in regions] == [op.nbytes for op in ops]
    _check_loads(st, kv, scratch, ops, rng, _check_saved(st, kv, ops))


@pytest.mark.parametrize("mode", ["batched, rows", "batched, fused", "batched in pieces, rows"])
def test_a_save_and_a_load_at_once_never_see_each_other_s_bytes(monkeypatch, mode):
    """The engine saves on one thread while it loads on another (async loads, layerwise):
    each direction has buffers of its own, the gather buffer included, so neither
    moves the other's bytes. Copies here are in the calling thread, and release
    the GIL while they run."""
    import threading

    kv, scratch = _kv()
    st = _stager(monkeypatch, mode, kv)
    tensors = list(kv.values())
    # Saves read layer 0-1's blocks; loads write layer 2's and the shared allocation's.
    save_ops = [_Op([Region(t[h, b].data_ptr(), 256) for t in tensors[:2] for h in (0, 1)]) for b in range(12)]
    load_ops = [_Op([Region(t[h, b].data_ptr(), 256) for t in tensors[2:] for h in (0, 1)]) for b in range(12)]
    for op in save_ops + load_ops:
        op.nbytes = sum(r.length for r in op.regions)
    want = [_bytes_at(kv, r) for op in save_ops for r in op.regions]
    n_load = sum(op.nbytes for op in load_ops)
    fill = torch.randint(0, 256, (n_load,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    errors: list[str] = []

    def saves():
        for _ in range(300):
            st.stage_out(save_ops)
            got = st.save_buf[: 256 * len(want)].numpy().tobytes()
            if got != b"".join(want):
                errors.append("a save's buffer held other bytes")
                return

    def loads():
        for _ in range(300):
            st.stage_in(load_ops)
            st.load_buf[:n_load].copy_(fill)
            st.commit_in(load_ops, [True] * len(load_ops))
            got = b"".join(_bytes_at(kv, r) for op in load_ops for r in op.regions)
            if got != fill.numpy().tobytes():
                errors.append("a load wrote other bytes")
                return

    threads = [threading.Thread(target=saves), threading.Thread(target=loads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
