"""Device KV through host staging: the copies between vLLM's blocks and the staging buffer.

A backend that cannot read device memory (the ``local`` pool, Mooncake over TCP)
gets device KV through ``HostStaging``: a save copies each chunk object's regions
(one per layer, or per layer and K/V, per run of consecutive blocks) into a pinned
host buffer before the put; a load copies the objects that arrived back out. This
times those copies with CPU tensors standing in for device memory (no device
here: the figure is the Python and dispatch around each region's copy, which a
device pays too, plus the bytes at host speed), against a baseline in the same
run, interleaved round by round:

- ``one copy``: one torch copy of the same number of bytes (the floor: the bytes
  once, no per-region work);
- ``per region``: the copies as ``HostStaging`` made them until 2026-12-03 (per
  region: find its allocation, slice it, slice the buffer, ``copy_``), kept here
  as the reference the change is measured against;
- ``staged``: ``HostStaging.stage_out`` (save) / ``commit_in`` (load) as the
  connector calls them, copying region by region as on the CPU (a device
  batches them: ``bench_device.py``).

The objects are the very chunk objects the connector's worker builds from a real
vLLM KV allocation (8 layers, 8 KV heads x 128, fp16): chunks of one 16-token
block, of 16 such blocks consecutive (a layer's run of blocks is one region) and
scattered (every other block: no two of a chunk's blocks adjacent, as after
churn), and of one 128-token block.

    .venv/bin/python bench/bench_staging.py [--rounds 9] [--json]
"""

from __future__ import annotations

import json
import uuid

import torch
import typer
from ascendstore_vllm.metadata import ChunkRef, SaveSpec
from ascendstore_vllm.testing import EngineHarness, EngineSpec
from ascendstore_vllm.worker import AscendStoreWorker
from harness import Stat, env_info, env_line, gbps_sampler, interleave, ratios, stat
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False)


def _per_region(staging, ops, buf: torch.Tensor, to_host: bool) -> None:
    """HostStaging's copies before 2026-12-03: a search, two slices and a copy per region."""
    pos = 0
    for op in ops:
        for r in op.regions:
            dev = None
            for base, size, flat in staging._storages:
                if base <= r.addr and r.addr + r.length <= base + size:
                    dev = flat[r.addr - base : r.addr - base + r.length]
                    break
            if dev is not None:
                host = buf[pos : pos + r.length]
                if to_host:
                    host.copy_(dev, non_blocking=True)
                else:
                    dev.copy_(host, non_blocking=True)
            pos += r.length


def _measure(block_size: int, bpc: int, chunks: int, stride: int, rounds: int) -> dict:
    nblocks = chunks * bpc * stride + 8
    cfg = {"backend": "local", "backend_config": {"name": f"stg-{uuid.uuid4().hex[:8]}", "capacity": "64MiB"},
           "chunk_size": block_size * bpc, "staging_buffer_bytes": "512MiB"}
    AscendStoreWorker.treat_kv_as_device = True
    try:
        eng = EngineHarness(EngineSpec(extra_config=cfg, num_layers=8, num_heads=8, num_kv_heads=8, head_size=128,
                                       block_size=block_size, num_blocks=nblocks, max_model_len=1024),
                            check_reads=False)
    finally:
        AscendStoreWorker.treat_kv_as_device = False
    try:
        w = eng.workers[0].connector.worker
        st = w.staging
        assert st is not None
        # The CPU's copies, one per region: the batched ones (a device's default, which the
        # worker also picks for CPU KV taken for device KV) are bench_device.py's, on a device.
        st.batched = False
        for t in eng.workers[0].kv_caches.values():
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
        refs = [ChunkRef(i, f"{i:064x}", [1 + (i * bpc + j) * stride for j in range(bpc)]) for i in range(chunks)]
        ops = w._ops(SaveSpec("bench", "-", refs), None)
        for op in ops:
            op.materialize()
        nbytes = sum(op.nbytes for op in ops)
        regions = sum(len(op.regions) for op in ops)
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        ok = [True] * len(ops)

        # Same bytes either way: the staged save equals the per-region one.
        st.stage_out(ops)
        first = st.save_buf[:nbytes].clone()
        st.save_buf[:nbytes].zero_()
        _per_region(st, ops, st.save_buf, True)
        assert torch.equal(first, st.save_buf[:nbytes])
        st.load_buf[:nbytes].copy_(first)

        cases = {  # GB/s, each sample the median of 3 calls
            "save one copy": gbps_sampler(lambda: dst.copy_(src), nbytes),
            "save staged": gbps_sampler(lambda: st.stage_out(ops), nbytes),
            "save per region": gbps_sampler(lambda: _per_region(st, ops, st.save_buf, True), nbytes),
            "load one copy": gbps_sampler(lambda: src.copy_(dst), nbytes),
            "load staged": gbps_sampler(lambda: st.commit_in(ops, ok), nbytes),
            "load per region": gbps_sampler(lambda: _per_region(st, ops, st.load_buf, False), nbytes),
        }
        s = interleave(cases, rounds)
        out: dict = {"gbps": {k: stat(v).as_dict() for k, v in s.items()}, "ratio": {}}
        for d in ("save", "load"):
            out["ratio"][f"{d} staged"] = ratios(s[f"{d} staged"], s[f"{d} one copy"]).as_dict()
            out["ratio"][f"{d} per region"] = ratios(s[f"{d} per region"], s[f"{d} one copy"]).as_dict()
            out["ratio"][f"{d} staged vs per region"] = ratios(s[f"{d} staged"], s[f"{d} per region"]).as_dict()
        out.update(block_size=block_size, blocks_per_chunk=bpc, objects=chunks, object_bytes=nbytes // chunks, regions=regions,
                   scattered=stride > 1)
        return out
    finally:
        eng.close()


def _fmt(d: dict, digits: int = 2) -> str:
    return Stat(d["median"], d["min"], d["max"], d["n"]).fmt(digits)


@app.command()
def main(rounds: int = typer.Option(9, min=1, max=50, help="interleaved rounds per shape"),
         as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table")) -> None:
    torch.set_num_threads(1)  # one copying thread (the clock is CPU time over all threads)
    env0 = env_info()
    rows = [_measure(16, 1, 192, 1, rounds), _measure(16, 16, 12, 1, rounds), _measure(16, 16, 12, 2, rounds),
            _measure(128, 1, 32, 1, rounds)]
    if as_json:
        print(json.dumps({"rows": rows, "rounds": rounds, "env_before": env0, "env_after": env_info()}, indent=2))
        return
    table = Table(title=f"Device KV through host staging, CPU tensors standing in for the device; GB/s ratios per "
                  f"round, median \\[min..max] ±half-spread over {rounds} interleaved rounds")
    for col in ("objects", "regions", "dir", "staged ÷ one copy", "per region ÷ one copy", "staged ÷ per region"):
        table.add_column(col, justify="right")
    for r in rows:
        shape = (f"{r['objects']} x {r['object_bytes'] // 1024} KiB ({r['blocks_per_chunk']} x {r['block_size']}-token blk"
                 f"{', scattered' if r['scattered'] else ''})")
        for d in ("save", "load"):
            q = r["ratio"]
            table.add_row(shape, str(r["regions"]), d, _fmt(q[f"{d} staged"]), _fmt(q[f"{d} per region"]),
                          _fmt(q[f"{d} staged vs per region"]))
    con = Console(width=160)
    con.print(table)
    con.print(env_line(env0, env_info()))


if __name__ == "__main__":
    app()
