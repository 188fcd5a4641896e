"""Device KV to and from the pool on a real device, byte for byte, then timed.

Every other check of device KV runs with CPU tensors standing in for device
memory. This one is for the day a CUDA or NPU device is at hand, and needs no
vLLM (the lent GPU machines have none): the KV is per-layer tensors
``[2, blocks, block_bytes]`` (K and V apart) on the device, and a chunk object
is one run of blocks in each layer's K and V (2 x layers regions), as the
connector's worker builds it. It checks, exiting 1 if any check fails:

1. **host staging** (a backend that cannot read device memory: the ``local``
   pool, Mooncake over TCP): ``HostStaging.stage_out`` puts each object's bytes
   in the pinned buffer; they go into a ``local`` pool, the blocks are wiped,
   and a get into ``stage_in``'s buffer with ``commit_in`` brings them back:
   the device KV must equal what it was, byte for byte (without the pool's C
   extension built, the buffer's bytes go straight back instead);
2. **device landing** (a backend that reads device memory but may outlive a
   call: Mooncake over rdma/ascend, MemCache's device pool): the landing buffer
   is on the KV's device and ``commit_in`` copies the objects marked ok, and
   only those, into the blocks;
3. **GR user objects through device buffers** (GR with such a backend): an
   object of a host header and device KV blocks goes through ``GRStaging`` over
   ``DeviceBuffers``; the buffer the backend is handed (on the device) holds the
   header and the blocks, and a get brings back the objects that arrived, and
   only those, header included.

Then it times, interleaved round by round on the wall clock: the staged save
and load against one copy of the same bytes between the device and pinned host
memory, and the landing's commit against one device-to-device copy.

    python bench/bench_device.py [--device cuda|npu|cpu] [--quick] [--json]

(On a machine without the project installed: ``PYTHONPATH=.:connectors``.)
"""

from __future__ import annotations

import json
import os
import sys
import uuid

os.environ.setdefault("BENCH_CLOCK", "wall")  # device copies end on the device, not in this thread's CPU time

import numpy as np
import torch
import typer
from ascendstore_vllm.device import GATHER_BYTES, DeviceBuffers, DeviceLanding, HostStaging
from ascendstore_vllm.gr.staging import GRStaging
from harness import Stat, env_info, gbps_sampler, interleave, ratios, stat
from rich.console import Console
from rich.table import Table

from ascendstore.contract import BackendContext, Region, Status

app = typer.Typer(add_completion=False)


class _Object:
    """A chunk object as the engine hands it to a stager: its regions and size."""

    def __init__(self, regions: list[Region]) -> None:
        self.regions = regions
        self.nbytes = sum(r.length for r in regions)


def _kv(device: torch.device, layers: int, blocks: int, block_bytes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {f"layer{i}": torch.randint(0, 256, (2, blocks, block_bytes), dtype=torch.uint8, generator=g).to(device)
            for i in range(layers)}


def _objects(kv: dict[str, torch.Tensor], first: int, count: int, run: int) -> list[_Object]:
    """``count`` objects of ``run`` consecutive blocks each, from block ``first`` on."""
    out = []
    for j in range(count):
        b = first + j * run
        regions = []
        for t in kv.values():
            for kv_half in (0, 1):
                blk = t[kv_half, b]
                regions.append(Region(blk.data_ptr(), blk.numel() * run))
        out.append(_Object(regions))
    return out


def _device_bytes(kv: dict[str, torch.Tensor], objs: list[_Object]) -> torch.Tensor:
    """The objects' bytes in order, read from the device by torch indexing (not by address)."""
    parts = []
    index = {t.data_ptr(): t for t in kv.values()}
    for o in objs:
        for r in o.regions:
            for base, t in index.items():
                if base <= r.addr < base + t.numel():
                    off = r.addr - base
                    parts.append(t.reshape(-1)[off : off + r.length].cpu())
                    break
    return torch.cat(parts)


def _pool_round_trip(staging: HostStaging, objs: list[_Object], kv: dict[str, torch.Tensor]) -> str:
    """Put the staged bytes into a local pool and get them back through stage_in; '' or why skipped."""
    try:
        from ascendstore.local.backend import LocalBackend
        from ascendstore.local.options import LocalOptions
    except ImportError as exc:  # the C extension is not built on this machine
        return f"local pool not importable ({exc}); the buffer's bytes went back directly"
    total = sum(o.nbytes for o in objs)
    pool = LocalBackend.create(LocalOptions(name=f"bench-device-{uuid.uuid4().hex[:8]}", capacity=2 * total + (64 << 20)),
                               BackendContext())
    try:
        keys = [f"obj{i}" for i in range(len(objs))]
        out = staging.stage_out(objs)
        assert pool.put(keys, out, 10.0) == [Status.OK] * len(objs), "put failed"
        for t in kv.values():
            t.zero_()
        into = staging.stage_in(objs)
        assert pool.get(keys, into, 10.0) == [Status.OK] * len(objs), "get failed"
        return ""
    finally:
        pool.destroy()


def check(device: torch.device, layers: int, blocks: int, block_bytes: int, run: int) -> dict:
    results: dict[str, object] = {}
    for batched in (True, False):
        kv = _kv(device, layers, blocks, block_bytes)
        objs = _objects(kv, 1, (blocks - 1) // run, run)
        mode = "batched" if batched else "per region"
        results.update({f"{k} ({mode})": v for k, v in _check_stagers(device, kv, objs, batched).items()})
    results.update(gr_check(device, kv, objs))
    return results


def _check_stagers(device: torch.device, kv: dict[str, torch.Tensor], objs: list[_Object], batched: bool) -> dict:
    want = _device_bytes(kv, objs)
    results: dict[str, object] = {}
    staging = HostStaging(kv, sum(o.nbytes for o in objs), batched=batched)
    staging.stage_out(objs)
    results["staged save: buffer == device KV"] = bool(torch.equal(staging.save_buf[: want.numel()].cpu(), want))
    skipped = _pool_round_trip(staging, objs, kv)
    if skipped:
        for t in kv.values():
            t.zero_()
        staging.load_buf[: want.numel()].copy_(staging.save_buf[: want.numel()])
    staging.commit_in(objs, [True] * len(objs))
    results["staged load: device KV == before"] = bool(torch.equal(_device_bytes(kv, objs), want))
    if skipped:
        results["note"] = skipped

    landing = DeviceLanding(kv, sum(o.nbytes for o in objs), batched=batched)
    assert landing.load_buf is not None
    # (the KV's device, index included: torch.device("cuda") != torch.device("cuda:0"))
    results["landing buffer on the KV's device"] = landing.load_buf.device == next(iter(kv.values())).device
    landing.stage_in(objs)
    fresh = torch.randint(0, 256, (want.numel(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    landing.load_buf[: fresh.numel()].copy_(fresh.to(device))
    ok = [i % 3 != 1 for i in range(len(objs))]
    landing.commit_in(objs, ok)
    expect, pos = [], 0
    for o, good in zip(objs, ok, strict=True):
        expect.append(fresh[pos : pos + o.nbytes] if good else want[pos : pos + o.nbytes])
        pos += o.nbytes
    results["landing: ok objects copied, the others untouched"] = bool(torch.equal(_device_bytes(kv, objs),
                                                                              torch.cat(expect)))
    return results


def gr_check(device: torch.device, kv: dict[str, torch.Tensor], objs: list[_Object]) -> dict:
    """User objects (a 64-byte host header, then device blocks) through device buffers and back."""
    headers = [np.random.default_rng(10 + i).integers(0, 256, 64, dtype=np.uint8) for i in range(len(objs))]
    objects = [[Region(h.ctypes.data, h.nbytes), *o.regions] for h, o in zip(headers, objs, strict=True)]
    want = [np.concatenate([h, _device_bytes(kv, [o]).numpy()]) for h, o in zip(headers, objs, strict=True)]
    staging = GRStaging(DeviceBuffers(kv, sum(len(w) for w in want)))
    stored: list[np.ndarray] = []
    handed: list[torch.device] = []

    def put(staged: list[list[Region]], buf: torch.Tensor):
        handed.append(buf.device)
        base = buf.data_ptr()
        stored[:] = [buf[rs[0].addr - base : rs[0].addr - base + rs[0].length].cpu().numpy().copy() for rs in staged]
        return [Status.OK] * len(staged), None

    staging.transfer("put", objects, put)
    results: dict[str, object] = {
        "GR: the backend is handed device memory only": len(handed) == 1 and handed[0].type == device.type,
        "GR put: buffer == header + device KV": all(np.array_equal(a, b) for a, b in zip(stored, want, strict=True)),
    }
    for t in kv.values():
        t.zero_()
    for h in headers:
        h[:] = 0
    ok = [i % 3 != 1 for i in range(len(objs))]

    def get(staged: list[list[Region]], buf: torch.Tensor):
        base = buf.data_ptr()
        for rs, data in zip(staged, stored, strict=True):
            buf[rs[0].addr - base : rs[0].addr - base + rs[0].length].copy_(torch.from_numpy(data).to(device))
        return [Status.OK if good else Status.NOT_FOUND for good in ok], None

    staging.transfer("get", objects, get)
    back = [np.concatenate([h, _device_bytes(kv, [o]).numpy()]) for h, o in zip(headers, objs, strict=True)]
    results["GR get: arrived objects back whole, the others untouched"] = all(
        np.array_equal(b, w if good else np.zeros_like(w)) for b, w, good in zip(back, want, ok, strict=True))
    return results


def timings(device: torch.device, layers: int, blocks: int, block_bytes: int, run: int, rounds: int,
            gather_bytes: int) -> dict:
    kv = _kv(device, layers, blocks, block_bytes)
    objs = _objects(kv, 1, (blocks - 1) // run, run)
    nbytes = sum(o.nbytes for o in objs)
    staging = HostStaging(kv, nbytes, batched=True, gather_bytes=gather_bytes)
    landing = DeviceLanding(kv, nbytes, batched=True)
    per_region = HostStaging(kv, nbytes, batched=False)
    landing_pr = DeviceLanding(kv, nbytes, batched=False)
    for st in (staging, landing, per_region, landing_pr):
        st.stage_in(objs)
    ok = [True] * len(objs)
    dev_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = staging.save_buf[:nbytes]
    mod = torch.get_device_module(device)

    def one(dst: torch.Tensor, src: torch.Tensor):
        def go() -> None:
            dst.copy_(src, non_blocking=True)
            if device.type != "cpu":
                mod.synchronize(device)
        return go

    cases = {
        "save: one copy": gbps_sampler(one(host, dev_src), nbytes),
        "save: staged": gbps_sampler(lambda: staging.stage_out(objs), nbytes),
        "save: staged per region": gbps_sampler(lambda: per_region.stage_out(objs), nbytes),
        "load: one copy": gbps_sampler(one(dev_src, host), nbytes),
        "load: staged": gbps_sampler(lambda: staging.commit_in(objs, ok), nbytes),
        "load: staged per region": gbps_sampler(lambda: per_region.commit_in(objs, ok), nbytes),
        "landing: one copy": gbps_sampler(one(dev_dst, dev_src), nbytes),
        "landing: commit": gbps_sampler(lambda: landing.commit_in(objs, ok), nbytes),
        "landing: commit per region": gbps_sampler(lambda: landing_pr.commit_in(objs, ok), nbytes),
    }
    samples = interleave(cases, rounds)
    pairs = {
        "staged save / one copy": ("save: staged", "save: one copy"),
        "staged load / one copy": ("load: staged", "load: one copy"),
        "landing commit / one copy": ("landing: commit", "landing: one copy"),
        "per-region save / one copy": ("save: staged per region", "save: one copy"),
        "per-region load / one copy": ("load: staged per region", "load: one copy"),
        "per-region commit / one copy": ("landing: commit per region", "landing: one copy"),
    }
    return {
        "objects": len(objs), "regions": sum(len(o.regions) for o in objs), "bytes": nbytes,
        "gather_bytes": gather_bytes,
        "gbps": {k: stat(v).as_dict() for k, v in samples.items()},
        "ratio": {k: ratios(samples[a], samples[b]).as_dict() for k, (a, b) in pairs.items()},
    }


def _default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    npu = getattr(torch, "npu", None)  # torch_npu, when imported, fills torch.npu
    return "npu" if npu is not None and npu.is_available() else "cpu"


@app.command()
def main(
    device: str = typer.Option("", help="cuda, npu or cpu (default: the accelerator if there is one)"),
    quick: bool = typer.Option(False, help="a small KV cache and 3 rounds"),
    rounds: int = typer.Option(7, help="interleaved rounds per shape"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of tables"),
    gather_mib: int = typer.Option(GATHER_BYTES >> 20, min=1, help="the batched stager's gather buffer, MiB"),
) -> None:
    dev = torch.device(device or _default_device())
    if dev.type != "cpu":
        torch.empty(1, device=dev)  # fails here, clearly, if the device is not usable
    # (layers, blocks, block bytes, blocks per object): a 32-layer model's 16-token
    # blocks of 8 KV heads x 128 fp16 (32 KiB per layer's K or V), objects of one
    # block and of 16; fewer layers and blocks with --quick.
    shapes = [(4, 34, 4096, 1), (4, 34, 4096, 8)] if quick else [(32, 257, 32768, 1), (32, 257, 32768, 16)]
    rounds = 3 if quick else rounds
    out: dict = {"device": str(dev), "env": env_info(), "checks": {}, "shapes": []}
    for layers, blocks, bb, run in shapes:
        name = f"{layers} layers x {run} block(s) of {bb >> 10} KiB"
        out["checks"][name] = check(dev, layers, blocks, bb, run)
        out["shapes"].append({"shape": name, **timings(dev, layers, blocks, bb, run, rounds, gather_mib << 20)})
    failed = [f"{s}: {k}" for s, c in out["checks"].items() for k, v in c.items() if v is False]
    out["failed"] = failed
    if as_json:
        print(json.dumps(out))
    else:
        con = Console()
        for s, c in out["checks"].items():
            for k, v in c.items():
                con.print(f"{s}: {k}: {v}", highlight=False)
        t = Table(title=f"device KV on {dev}: GB/s median (min..max) over {rounds} interleaved rounds, wall clock")
        cols = ("staged save / one copy", "staged load / one copy", "landing commit / one copy",
                "per-region save / one copy", "per-region load / one copy", "per-region commit / one copy")
        for col in ("shape", "objects x regions", *cols):
            t.add_column(col)
        for row in out["shapes"]:
            r = row["ratio"]
            t.add_row(row["shape"], f"{row['objects']} x {row['regions'] // row['objects']}",
                      *(Stat(**{f: r[k][f] for f in ("median", "min", "max", "n")}).fmt() for k in cols))
        con.print(t)
    if failed:
        print("FAILED: " + "; ".join(failed), file=sys.stderr)
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
