"""The local pool side by side with LMCache 0.5.6's storage layer, in one process.

Run by ``make bench-peers`` in its own environment (.venv-peers: LMCache 0.5.6
installed with --no-deps plus its runtime imports, CPU torch, the project's
core). Same source and destination tensors for both, configurations
interleaved round by round (bench/harness.py), CPU time:

- DRAM put of a batch of 32 objects: LMCache ``StorageManager.batched_allocate``
  + a torch copy into each object + ``batched_put`` (LocalCPUBackend) against
  our ``LocalBackend.put`` (copy into the shared-memory pool included); the keys
  of the batch are removed before each put, outside the timing, on both sides
  (LMCache ignores a put of a key it holds);
- DRAM get: ``batched_get`` + a torch copy out of each object + releasing it,
  against our ``get``;
- baseline for both: one C memcpy per object (``_shmpool.copy_regions``);
- lookup: ``StorageManager.batched_contains`` of 512 keys (prefix hits) against
  our ``exists`` of 512 keys and our native prefix scan (``prefix_run``);
- disk tier (``bench_disk``): LMCache ``LocalDiskBackend`` against our disk
  tier, wall time, both to the page cache (see there).

    LMCACHE_DISABLE_BANNER=1 LMCACHE_TRACK_USAGE=false .venv-peers/bin/python bench/bench_peers.py [--json]
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Callable

os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch
import typer
from harness import Stat, clock, env_info, env_line, interleave, per_call_us, ratios, stat
from rich.console import Console
from rich.table import Table

from ascendstore.contract import BackendContext, Region, Status
from ascendstore.local import _shmpool
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions

KiB, MiB = 1 << 10, 1 << 20
BATCH = 32
app = typer.Typer(add_completion=False)


def _lmcache(cpu_bytes: int, obj_bytes: int, disk: str | None = None, disk_bytes: int = 0):  # type: ignore[no-untyped-def]
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=256, local_cpu=True, max_local_cpu_size=cpu_bytes / 2**30, local_disk=disk,
        max_local_disk_size=disk_bytes / 2**30,
    )
    half = obj_bytes // 4  # bfloat16 KV_2LTD [2, 1, half, 1]: obj_bytes bytes
    meta = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=(1, 2, half, 1, 1))
    sm = StorageManager(config=cfg, metadata=meta, event_manager=EventManager())

    def key(s: str):  # type: ignore[no-untyped-def]
        return CacheEngineKey(model_name="bench", world_size=1, worker_id=0,
                              chunk_hash=int(hashlib.sha256(s.encode()).hexdigest(), 16), dtype=torch.bfloat16)

    return sm, key, torch.Size([2, 1, half, 1])


def _open_pool(capacity: int) -> LocalBackend:
    opts = LocalOptions(name=f"peers-{uuid.uuid4().hex[:8]}", capacity=capacity, page_size=64 * KiB, prefault=True)
    return LocalBackend.create(opts, BackendContext())


def bench_dram(size: int, working_set: int, rounds: int, min_s: float) -> dict:
    n_batches = max(2, working_set // (BATCH * size))
    sm, mkkey, shape = _lmcache(working_set * 2 + 64 * MiB, size)
    pool = _open_pool(working_set * 2 + 64 * MiB)
    try:
        src = [torch.randint(-100, 100, tuple(shape)).to(torch.bfloat16) for _ in range(BATCH)]
        dst = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(BATCH)]
        names = [[f"{size}/{b}/{j}" for j in range(BATCH)] for b in range(n_batches)]
        lkeys = [[mkkey(n) for n in batch] for batch in names]
        sregions = [[Region(t.data_ptr(), size)] for t in src]
        dregions = [[Region(t.data_ptr(), size)] for t in dst]
        mirror = torch.ones(n_batches * BATCH * size, dtype=torch.uint8)  # touched: no page faults timed
        maddr = [[mirror.data_ptr() + (b * BATCH + j) * size for j in range(BATCH)] for b in range(n_batches)]
        sa, da = [t.data_ptr() for t in src], [t.data_ptr() for t in dst]
        turn: dict[str, int] = {}

        def nxt(name: str) -> int:
            b = turn[name] = (turn.get(name, -1) + 1) % n_batches
            return b

        def lm_put_once(b: int) -> None:
            objs = sm.batched_allocate(shape, torch.bfloat16, BATCH)
            assert objs is not None and len(objs) == BATCH
            for o, s in zip(objs, src, strict=True):
                o.tensor.copy_(s)
            sm.batched_put(lkeys[b], objs)

        def lm_get_once(b: int) -> None:
            objs = sm.batched_get(lkeys[b])
            for o, d in zip(objs, dst, strict=True):
                assert o is not None
                d.copy_(o.tensor)
                o.ref_count_down()

        def timed_puts(remove: Callable[[int], None], put: Callable[[int], None], name: str) -> Callable[[], float]:
            def sample() -> float:  # GB/s of puts only: each batch's keys removed first, untimed
                done = spent = 0.0
                while spent < min_s:
                    b = nxt(name)
                    remove(b)
                    t0 = clock()
                    put(b)
                    spent += clock() - t0
                    done += BATCH * size
                return done / spent / 1e9

            return sample

        def timed(fn: Callable[[int], None], name: str) -> Callable[[], float]:
            def sample() -> float:
                done, t0 = 0, clock()
                while clock() - t0 < min_s:
                    fn(nxt(name))
                    done += BATCH * size
                return done / (clock() - t0) / 1e9

            return sample

        def ours_put(b: int) -> None:
            assert pool.put(names[b], sregions, 5.0) == [Status.OK] * BATCH

        def ours_get(b: int) -> None:
            assert pool.get(names[b], dregions, 5.0) == [Status.OK] * BATCH

        for b in range(n_batches):  # everything stored once; first touch is not measured
            lm_put_once(b)
            ours_put(b)
        cases = {
            "put lmcache": timed_puts(lambda b: sm.batched_remove(lkeys[b]), lm_put_once, "lp"),
            "put ours": timed_puts(lambda b: pool.remove(names[b], 5.0), ours_put, "op"),
            "put memcpy": timed(lambda b: _shmpool.copy_regions(maddr[b], sa, size), "mp"),
            "get lmcache": timed(lm_get_once, "lg"),
            "get ours": timed(ours_get, "og"),
            "get memcpy": timed(lambda b: _shmpool.copy_regions(da, maddr[b], size), "mg"),
        }
        s = interleave(cases, rounds)
        # both hand back the bytes they were given
        for fn in (lm_get_once, ours_get):
            for d in dst:
                d.zero_()
            fn(0)
            assert all(torch.equal(d, t) for d, t in zip(dst, src, strict=True))
        out: dict = {"gbps": {k: stat(v).as_dict() for k, v in s.items()}, "ratio": {}}
        for op in ("put", "get"):
            out["ratio"][f"{op} ours / lmcache"] = ratios(s[f"{op} ours"], s[f"{op} lmcache"]).as_dict()
            out["ratio"][f"{op} ours / memcpy"] = ratios(s[f"{op} ours"], s[f"{op} memcpy"]).as_dict()
            out["ratio"][f"{op} lmcache / memcpy"] = ratios(s[f"{op} lmcache"], s[f"{op} memcpy"]).as_dict()
        return out
    finally:
        pool.destroy()
        sm.close()


def bench_disk(size: int, n_objs: int, rounds: int) -> dict:
    """Disk tiers, wall time (the cost is I/O waits), each side to the page cache
    (neither fsyncs: LMCache's LocalDiskBackend writes one file per chunk with a
    plain write(); our tier pwritev()s spilled objects into segment files).

    - put: LMCache ``LocalDiskBackend.batched_submit_put_task`` (its write-through
      path: asynchronous, on its disk worker threads) timed until every key's
      completion callback ran, i.e. until its bytes are written; ours: ``put``
      into a DRAM tier of one batch, so every put spills as many objects to
      disk before returning;
    - get of objects on disk: LMCache ``batched_get_blocking`` (concurrent reads
      into objects from its CPU allocator) + a torch copy out + release; ours:
      ``get`` (read from disk into the caller's memory, then promoted to DRAM;
      the promotion evicts the previous batch's promoted objects, which go back
      to the disk copies they were read from without a write).
    """
    import tempfile
    import threading
    import time

    with tempfile.TemporaryDirectory(prefix="peers-disk-", dir=os.environ.get("BENCH_DISK_DIR")) as d:
        # LMCache stages every write in its CPU allocator until the disk worker has
        # written it: room for a whole round, so its puts never wait on allocation.
        sm, mkkey, shape = _lmcache(2 * n_objs * size + 64 * MiB, size, disk=os.path.join(d, "lmcache") + "/",
                                    disk_bytes=4 * n_objs * size)
        disk = sm.storage_backends["LocalDiskBackend"]
        cpu = sm.storage_backends["LocalCPUBackend"]
        opts = LocalOptions(name=f"peers-{uuid.uuid4().hex[:8]}", capacity=BATCH * size, page_size=64 * KiB,
                            prefault=True, disk_path=os.path.join(d, "ours"), disk_capacity=4 * n_objs * size)
        pool = LocalBackend.create(opts, BackendContext())
        try:
            src = [torch.randint(-100, 100, tuple(shape)).to(torch.bfloat16) for _ in range(BATCH)]
            dst = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(BATCH)]
            sregions = [[Region(t.data_ptr(), size)] for t in src]
            dregions = [[Region(t.data_ptr(), size)] for t in dst]
            n = n_objs // BATCH * BATCH
            rnd = iter(range(10**9))
            state: dict[str, list] = {}

            def lm_put() -> float:
                names = [f"d/{next(rnd)}" for _ in range(n)]
                keys = [mkkey(x) for x in names]
                left = [n]
                done = threading.Event()
                lock = threading.Lock()

                def landed(_key) -> None:  # type: ignore[no-untyped-def]
                    with lock:
                        left[0] -= 1
                        if not left[0]:
                            done.set()

                t0 = time.perf_counter()
                for i in range(0, n, BATCH):
                    objs = cpu.batched_allocate(shape, torch.bfloat16, BATCH)
                    assert objs is not None and len(objs) == BATCH
                    for o, t in zip(objs, src, strict=True):
                        o.tensor.copy_(t)
                    disk.batched_submit_put_task(keys[i : i + BATCH], objs, on_complete_callback=landed)
                    for o in objs:
                        o.ref_count_down()  # the disk task holds its own reference until written
                assert done.wait(120), "LMCache disk writes did not finish"
                dt = time.perf_counter() - t0
                state["lm"] = keys
                return n * size / dt / 1e9

            def ours_put() -> float:
                names = [f"d/{next(rnd)}" for _ in range(n)]
                t0 = time.perf_counter()
                for i in range(0, n, BATCH):
                    assert pool.put(names[i : i + BATCH], sregions, 5.0) == [Status.OK] * BATCH
                dt = time.perf_counter() - t0
                state["ours"] = names
                return n * size / dt / 1e9

            def lm_get() -> float:
                keys = state["lm"]
                t0 = time.perf_counter()
                for i in range(0, n // 2, BATCH):  # the older half: certainly on disk on both sides
                    objs = disk.batched_get_blocking(keys[i : i + BATCH])
                    for o, t in zip(objs, dst, strict=True):
                        assert o is not None
                        t.copy_(o.tensor)
                        o.ref_count_down()
                return (n // 2) * size / (time.perf_counter() - t0) / 1e9

            def ours_get() -> float:
                names = state["ours"]
                t0 = time.perf_counter()
                for i in range(0, n // 2, BATCH):
                    assert pool.get(names[i : i + BATCH], dregions, 5.0) == [Status.OK] * BATCH
                return (n // 2) * size / (time.perf_counter() - t0) / 1e9

            # A round: both puts, then both gets of what that round wrote (puts must precede gets).
            s = interleave({"put lmcache": lm_put, "put ours": ours_put}, 1, warmup=0)
            gets = interleave({"get lmcache": lm_get, "get ours": ours_get}, 1, warmup=0)
            for _ in range(rounds - 1):
                for k, v in interleave({"put lmcache": lm_put, "put ours": ours_put}, 1, warmup=0).items():
                    s[k] += v
                for k, v in interleave({"get lmcache": lm_get, "get ours": ours_get}, 1, warmup=0).items():
                    gets[k] += v
            s.update(gets)
            # both read back the bytes they were given
            for d_ in dst:
                d_.zero_()
            lm_get()
            assert all(torch.equal(a, b) for a, b in zip(dst, src, strict=True))
            for d_ in dst:
                d_.zero_()
            ours_get()
            assert all(torch.equal(a, b) for a, b in zip(dst, src, strict=True))
            st = pool.stats()
            return {"gbps": {k: stat(v).as_dict() for k, v in s.items()},
                    "ratio": {f"{op} ours / lmcache": ratios(s[f"{op} ours"], s[f"{op} lmcache"]).as_dict()
                              for op in ("put", "get")},
                    "objects_per_round": n, "spills": st["spills"], "clean_spills": st["clean_spills"],
                    "disk_hits": st["disk_hits"]}
        finally:
            pool.destroy()
            sm.close()


def bench_lookup(n: int, rounds: int, calls: int) -> dict:
    sm, mkkey, shape = _lmcache(256 * MiB, 4 * KiB)
    pool = _open_pool(256 * MiB)
    try:
        hexes = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(n)]
        lkeys = [mkkey(h) for h in hexes]
        names = ["bench@" + h for h in hexes]
        buf = torch.zeros(4 * KiB, dtype=torch.uint8)
        for i in range(0, n, BATCH):
            objs = sm.batched_allocate(shape, torch.bfloat16, len(lkeys[i : i + BATCH]))
            sm.batched_put(lkeys[i : i + BATCH], objs)
            assert pool.put(names[i : i + BATCH], [[Region(buf.data_ptr(), 4 * KiB)]] * len(names[i : i + BATCH]),
                            5.0) == [Status.OK] * len(names[i : i + BATCH])
        assert sm.batched_contains(lkeys)[0] == n
        assert pool.prefix_run(["bench@"], hexes, 5.0)[1] == n
        s = interleave(
            {
                "lmcache batched_contains": lambda: per_call_us(lambda: sm.batched_contains(lkeys), calls),
                "ours exists": lambda: per_call_us(lambda: pool.exists(names, 5.0), calls),
                "ours prefix_run": lambda: per_call_us(lambda: pool.prefix_run(["bench@"], hexes, 5.0), calls),
            },
            rounds,
        )
        return {
            "us": {k: stat(v).as_dict() for k, v in s.items()},
            "ratio": {
                "lmcache / ours exists": ratios(s["lmcache batched_contains"], s["ours exists"]).as_dict(),
                "lmcache / ours prefix_run": ratios(s["lmcache batched_contains"], s["ours prefix_run"]).as_dict(),
            },
        }
    finally:
        pool.destroy()
        sm.close()


def _fmt(d: dict, digits: int = 2) -> str:
    return Stat(d["median"], d["min"], d["max"], d["n"]).fmt(digits)


@app.command()
def main(
    as_json: bool = typer.Option(False, "--json"),
    rounds: int = typer.Option(7, help="interleaved rounds"),
    quick: bool = typer.Option(False, "--quick"),
) -> None:
    torch.set_num_threads(1)  # one copying thread each side (and CPU time counts all threads anyway)
    if quick:
        rounds = 3
    min_s = 0.03 if quick else 0.06
    env0 = env_info()
    res: dict = {"rounds": rounds, "batch": BATCH, "env_before": env0}
    res["dram_64KiB"] = bench_dram(64 * KiB, 64 * MiB, rounds, min_s)
    res["dram_2048KiB"] = bench_dram(2 * MiB, 256 * MiB, rounds, min_s)
    res["lookup_512"] = bench_lookup(512, rounds, 20 if quick else 50)
    res["disk_256KiB"] = bench_disk(256 * KiB, 256 if quick else 512, 2 if quick else 3)
    res["env_after"] = env_info()
    if as_json:
        print(json.dumps(res, indent=2))
        return
    con = Console(width=200)
    t = Table(title=f"local pool vs LMCache 0.5.6 StorageManager + LocalCPUBackend, batches of {BATCH}, same tensors; "
              f"GB/s median (min..max) ±half-spread over {rounds} interleaved rounds; ratios per round")
    for col in ("object", "op", "ours GB/s", "LMCache GB/s", "memcpy GB/s", "ours ÷ LMCache", "ours ÷ memcpy",
                "LMCache ÷ memcpy"):
        t.add_column(col, justify="right", no_wrap=True)
    for size in ("64KiB", "2048KiB"):
        r = res[f"dram_{size}"]
        for op in ("put", "get"):
            g, q = r["gbps"], r["ratio"]
            t.add_row(size, op, _fmt(g[f"{op} ours"]), _fmt(g[f"{op} lmcache"]), _fmt(g[f"{op} memcpy"]),
                      _fmt(q[f"{op} ours / lmcache"]), _fmt(q[f"{op} ours / memcpy"]), _fmt(q[f"{op} lmcache / memcpy"]))
    con.print(t)
    lk = res["lookup_512"]
    con.print(
        f"512 keys: LMCache batched_contains {_fmt(lk['us']['lmcache batched_contains'], 1)} us, our exists "
        f"{_fmt(lk['us']['ours exists'], 1)} us, our prefix_run {_fmt(lk['us']['ours prefix_run'], 1)} us; "
        f"LMCache ÷ ours: {_fmt(lk['ratio']['lmcache / ours exists'])} (exists), "
        f"{_fmt(lk['ratio']['lmcache / ours prefix_run'])} (prefix_run)"
    )
    dk = res["disk_256KiB"]
    con.print(
        f"disk tier, 256 KiB objects, {dk['objects_per_round']} per round, wall time, to the page cache (no fsync "
        f"either side): put ours {_fmt(dk['gbps']['put ours'])} GB/s vs LMCache {_fmt(dk['gbps']['put lmcache'])} "
        f"(ours ÷ LMCache {_fmt(dk['ratio']['put ours / lmcache'])}); get of on-disk objects ours "
        f"{_fmt(dk['gbps']['get ours'])} vs LMCache {_fmt(dk['gbps']['get lmcache'])} "
        f"(ours ÷ LMCache {_fmt(dk['ratio']['get ours / lmcache'])})"
    )
    con.print(env_line(env0, res["env_after"]))


if __name__ == "__main__":
    app()
