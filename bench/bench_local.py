"""Throughput of the embedded ``local`` pool against memcpy measured in the same run.

Every figure is GB/s of one batch call (``BATCH`` objects) repeated for
``min_s``; all configurations of an object size run interleaved round by round
(bench/harness.py), after a warm-up round that is not timed. Baselines are the
same kind of call as a pool put/get:

- ``memcpy``: one C call per batch (``_shmpool.copy_regions``) doing one memcpy
  per object, between the caller's buffer and a mirror of the pool's working
  set in ordinary (anonymous) memory;
- ``memcpy/obj``: the same binding called once per object (what a caller
  without a batched API pays);
- ``memcpy shm``: the bulk call into a mirror in /dev/shm, the kind of memory
  the pool lives in (shared memory gets no transparent huge pages on this host
  unless shmem_enabled allows it, anonymous memory does);
- ``stream``: the bulk call into the anonymous mirror with the pool's own copy
  routine (streaming stores for a put batch of 1 MiB or more, a get batch of
  half the last-level cache or more): what the pool costs beyond its copy.

Ratios are taken per round (pool and baseline of the same round, so of the same
process), summarised per process as the median of its rounds.

**Where the buffers sit.** The caller's buffers (put sources, get destinations)
start ``--user-offset`` bytes past a 4 KiB boundary (0 by default: vLLM's KV
tensors are 64-byte aligned, as torch allocates them), the mirrors on a page
boundary as the pool's objects are, so every baseline copies between addresses
aligned alike the pool's copy's. It matters: on AMD Zen 4, glibc's memcpy of 2 KiB-1
MiB ran 2.5-6x slower between addresses that differ mod 64 (numpy's buffers start at
16 mod 4096, which is what this bench used to time the pool's gets against).

**Several fresh processes per run.** Writes into /dev/shm (the pool's puts, the
``memcpy shm`` baseline) run at a level that is steady within a process (its
rounds within ±1-2%) but shifts from one process to the next (a 64 KiB pool put
at 24-30 GB/s over eight processes), a property of the memory a process maps,
not of timing noise; more rounds in one process cannot average it out. So the
DRAM part runs in ``--procs`` fresh processes one after the other (each
interleaving all configurations round by round), and every figure reported is
the median over the processes of each process's median, with the min..max and
spread *across processes*; ``within_spread`` is the median of the processes'
own round-to-round spreads. ``exists`` and the disk tier run once, in the
parent. Bounded: about 80 s (``--quick``: about 12 s).

**Where a process's pages come from.** Which 4 KiB pages a fresh /dev/shm mapping
gets (a pool's segment, the ``memcpy shm`` mirror) depends on how fragmented the
host's free memory is at that moment, and on the KVM guest measured a copy ran up
to 2x faster on pages that share their 2 MiB physical frames with their neighbours
than on scattered ones (docs/benchmarking.md). Every process records that share for
each mapping it copies to or from (``layout``, from /proc/self/pagemap: root only),
so ``harness.py agree`` shows when two runs disagree because their memory was laid
out differently; ``--compact-memory`` (root) has the kernel compact free memory
before each process, which makes the layouts, and so the runs, agree far more often
(``make bench`` and ``make bench-agree`` pass it where they can).

With ``--hugetlbfs DIR`` every process also measures a third pool, checksum off,
whose DRAM tier is on that hugetlbfs mount (``off, huge pages``), interleaved with
the rest: the same copies from 2 MiB pages instead of /dev/shm's 4 KiB ones.

With ``--shm-huge MODE`` (root) the DRAM processes run in a private mount namespace
whose /dev/shm is a tmpfs mounted ``huge=MODE``: with ``advise`` the pools (which ask
for huge pages) get transparent huge pages, the ``memcpy shm`` mirror (which does not)
keeps small ones. The host's /dev/shm is not touched; ``shm_huge`` in the output says
which /dev/shm the figures come from.

    .venv/bin/python bench/bench_local.py [--json] [--quick] [--procs N] [--rounds N] [--hugetlbfs DIR]
        [--shm-huge advise|within_size|always|never] [--user-offset N] [--compact-memory]
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable

import numpy as np
import typer
from harness import (
    COMPACT,
    Stat,
    across_processes,
    compact_free_memory,
    env_info,
    env_line,
    interleave,
    placed,
    rate,
    ratios,
    stat,
)
from rich.console import Console
from rich.table import Table

from ascendstore.contract import BackendContext, Region, Status
from ascendstore.local import _shmpool
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions
from ascendstore.local.pages import frame_share, mapping_span, tmpfs_huge

KiB, MiB = 1 << 10, 1 << 20
BATCH = 32
#: tmpfs huge= modes (the kernel's)
SHM_HUGE = ("always", "within_size", "advise", "never")
app = typer.Typer(add_completion=False)


def _open(**kw) -> LocalBackend:
    opts = LocalOptions(name=f"bench-{uuid.uuid4().hex[:8]}", **kw)
    return LocalBackend.create(opts, BackendContext())


class _ShmMirror:
    """A /dev/shm mapping of ``size`` bytes (the pool's kind of memory), prefaulted."""

    def __init__(self, size: int) -> None:
        fd, path = tempfile.mkstemp(prefix="ascendstore-bench-", dir="/dev/shm")
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
            os.unlink(path)
        self.buf = np.frombuffer(self.mm, dtype=np.uint8)
        self.buf[:] = 1
        self.addr = self.buf.ctypes.data


#: the variant with checksum off and the pool's DRAM tier in a hugetlbfs mount's huge pages
HUGE = "off, huge pages"


def _checksums(hugetlbfs: str | None) -> tuple[str, ...]:
    """The pool variants measured: checksum off and on, and off with the DRAM tier on hugetlbfs."""
    return ("off", "on", HUGE) if hugetlbfs else ("off", "on")


def bench_dram(size: int, rounds: int, min_s: float, pool_bytes: int, page_size: int,
               hugetlbfs: str | None = None, user_offset: int = 0) -> dict:
    """put and get with checksum off and on (and off on hugetlbfs), against the memcpy baselines."""
    pools = {
        ck: _open(capacity=pool_bytes, page_size=page_size, checksum=ck == "on", prefault=True,
                  hugetlbfs=hugetlbfs if ck == HUGE else None)
        for ck in _checksums(hugetlbfs)
    }
    try:
        n_keys = (pool_bytes * 3 // 4) // size // BATCH * BATCH
        batches = [[f"bench/{size}/{i + b}" for i in range(BATCH)] for b in range(0, n_keys, BATCH)]
        user = placed(BATCH * size, user_offset, 0)
        user[:] = np.random.default_rng(0).integers(0, 255, BATCH * size, dtype=np.uint8)
        ua = [user.ctypes.data + j * size for j in range(BATCH)]
        regions = [[Region(a, size)] for a in ua]
        # Gets (pool and baselines) land in a buffer of their own: the put source
        # keeps what the pool holds, for the byte-exact check at the end (it used to
        # pass only when a put of batch 0 ran after the last memcpy get).
        sink = placed(BATCH * size, user_offset, 1)
        sa = [sink.ctypes.data + j * size for j in range(BATCH)]
        sregions = [[Region(a, size)] for a in sa]
        anon = placed(n_keys * size, 0, 1)  # baseline's stand-in for the pool (its objects start on pages too)
        shm = _ShmMirror(n_keys * size)
        mirrors = {"anon": anon.ctypes.data, "shm": shm.addr}
        maddr = {
            m: [[base + (b * BATCH + j) * size for j in range(BATCH)] for b in range(len(batches))]
            for m, base in mirrors.items()
        }
        nbytes = BATCH * size
        turn: dict[str, int] = {}

        def nxt(name: str) -> int:  # each case walks the working set on its own
            b = turn[name] = (turn.get(name, -1) + 1) % len(batches)
            return b

        def pool_op(op: str, ck: str) -> Callable[[], int]:
            be, name = pools[ck], f"{op}-{ck}"
            call = be.put if op == "put" else be.get
            regs = regions if op == "put" else sregions

            def fn() -> int:
                st = call(batches[nxt(name)], regs, 5.0)
                assert st == [Status.OK] * BATCH, st
                return nbytes

            return fn

        def memcpy(to_pool: bool, mirror: str, per_object: bool, stream: int = 0) -> Callable[[], int]:
            name = f"memcpy-{to_pool}-{mirror}-{per_object}-{stream}"
            cr = _shmpool.copy_regions

            def fn() -> int:
                ma = maddr[mirror][nxt(name)]
                dst, src = (ma, ua) if to_pool else (sa, ma)
                if per_object:
                    for d, s in zip(dst, src, strict=True):
                        cr((d,), (s,), size)
                else:
                    cr(dst, src, size, stream)
                return nbytes

            return fn

        for be in pools.values():  # every object stored once: first touch is not what we measure
            for b in batches:
                assert be.put(b, regions, 5.0) == [Status.OK] * BATCH
        cases: dict[str, Callable[[], int]] = {}
        for op, to_pool in (("put", True), ("get", False)):
            for ck in pools:
                cases[f"{op} checksum {ck}"] = pool_op(op, ck)
            cases[f"{op}: memcpy"] = memcpy(to_pool, "anon", False)
            cases[f"{op}: memcpy/obj"] = memcpy(to_pool, "anon", True)
            cases[f"{op}: memcpy shm"] = memcpy(to_pool, "shm", False)
            cases[f"{op}: stream"] = memcpy(to_pool, "anon", False, stream=1 if to_pool else 2)
        samples = interleave({k: (lambda f=f: rate(f, min_s) / 1e9) for k, f in cases.items()}, rounds)
        out: dict = {"gbps": {k: stat(v).as_dict() for k, v in samples.items()}, "ratio": {}}
        for op in ("put", "get"):
            for ck in pools:
                for base in ("memcpy", "memcpy/obj", "memcpy shm", "stream"):
                    r = ratios(samples[f"{op} checksum {ck}"], samples[f"{op}: {base}"])
                    out["ratio"][f"{op} checksum {ck} / {base}"] = r.as_dict()
        # byte-exact check of what was measured
        for be in pools.values():
            check = np.zeros_like(user)
            cregions = [[Region(check.ctypes.data + j * size, size)] for j in range(BATCH)]
            assert be.get(batches[0], cregions, 5.0) == [Status.OK] * BATCH
            assert np.array_equal(check, user)
        # which pages each pool's segment was in (prefaulted: all of it resident)
        pages = {ck: be.dram_pages() for ck, be in pools.items()}
        out["pages"] = {ck: p.kind for ck, p in pages.items()}
        mirrored = {"memcpy shm": (shm.addr, n_keys * size), "memcpy": (anon.ctypes.data, anon.nbytes)}
        out["layout"] = _layout({ck: p.path for ck, p in pages.items()}, mirrored)
        return out
    finally:
        for be in pools.values():
            be.destroy()


def _layout(segments: dict[str, str], mirrors: dict[str, tuple[int, int]]) -> dict:
    """How physically contiguous each mapping a figure copies to or from is
    (``frame_share``): each pool's segment (by path) and each baseline's mirror. A copy on
    4 KiB pages runs faster the more of them share a 2 MiB frame, and a fresh
    mapping gets whatever the host's free memory offers, so these say when two
    runs disagree because their memory was laid out differently. Empty when the
    frame numbers are hidden (not root)."""
    spans = {f"pool {ck}": mapping_span(path) for ck, path in segments.items()}
    shares = {name: frame_share(*span) for name, span in (spans | mirrors).items() if span is not None}
    return {name: stat([x]).as_dict() for name, x in shares.items() if x is not None}


def bench_exists(n: int, calls: int, rounds: int) -> dict:
    be = _open(capacity=64 * MiB, page_size=4 * KiB, checksum=False, max_keys=4 * n)
    try:
        buf = np.zeros(4096, dtype=np.uint8)
        keys = [f"model@1@0@{i:064x}@bfloat16" for i in range(n)]
        be.put(keys, [[Region(buf.ctypes.data, 4096)]] * n, 5.0)

        def one() -> float:
            ts = []
            for _ in range(calls):
                t0 = time.perf_counter_ns()
                be.exists(keys, 5.0)
                ts.append((time.perf_counter_ns() - t0) / 1e3)
            return float(np.median(ts))

        return stat(interleave({"exists": one}, rounds)["exists"]).as_dict()
    finally:
        be.destroy()


def bench_disk(size: int, total: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="ascendstore-bench-", dir=os.environ.get("BENCH_DISK_DIR")) as d:
        be = _open(capacity=16 * MiB, page_size=64 * KiB, checksum=True, disk_path=d, disk_capacity=total * 2)
        try:
            user = np.random.default_rng(1).integers(0, 255, BATCH * size, dtype=np.uint8)
            regions = [[Region(user.ctypes.data + j * size, size)] for j in range(BATCH)]
            n = total // size // BATCH * BATCH
            rnd = iter(range(10**6))
            keys: list[str] = []

            def put() -> float:
                keys[:] = [f"disk/{next(rnd)}/{i}" for i in range(n)]
                t0 = time.perf_counter()
                for i in range(0, n, BATCH):
                    assert all(s is Status.OK for s in be.put(keys[i : i + BATCH], regions, 5.0))
                return n * size / (time.perf_counter() - t0) / 1e9

            def get() -> float:
                # the oldest objects are on disk now: read them back (each hit is also promoted)
                t0 = time.perf_counter()
                got = 0
                for i in range(0, n // 2, BATCH):
                    got += sum(s is Status.OK for s in be.get(keys[i : i + BATCH], regions, 5.0))
                return got * size / (time.perf_counter() - t0) / 1e9

            res = interleave({"put": put, "get": get}, rounds, warmup=0)  # put must precede get
            stats = be.stats()
            return {
                "put_gbps": stat(res["put"]).as_dict(),
                "get_gbps": stat(res["get"]).as_dict(),
                "spills": stats["spills"],
                "clean_spills": stats["clean_spills"],  # promoted objects sent back to their copies
                "disk_hits": stats["disk_hits"],
            }
        finally:
            be.destroy()


def _s(d: dict, digits: int = 2) -> str:
    return Stat(d["median"], d["min"], d["max"], d["n"]).fmt(digits)


SIZES = ((64 * KiB, 128 * MiB), (2 * MiB, 256 * MiB))


def _dram_all(rounds: int, min_s: float, page_size: int, hugetlbfs: str | None, user_offset: int) -> dict:
    return {
        f"dram_{size // KiB}KiB": bench_dram(size, rounds, min_s, pool, page_size, hugetlbfs, user_offset)
        for size, pool in SIZES
    }


def _one_process(rounds: int, min_s: float, page_size: int, hugetlbfs: str | None, shm_huge: str | None,
                 user_offset: int) -> dict:
    """The DRAM part in a fresh interpreter (its own mappings: see the module doc);
    with ``shm_huge``, in a mount namespace of its own over a /dev/shm mounted huge=that."""
    cmd = [
        *(
            ("unshare", "-m", "sh", "-c",
             f'mount -t tmpfs -o huge={shm_huge},size=50% tmpfs /dev/shm && exec "$0" "$@"')
            if shm_huge else ()
        ),
        sys.executable,
        __file__,
        "--child",
        "--rounds",
        str(rounds),
        "--min-s",
        str(min_s),
        "--page-size",
        str(page_size),
        "--user-offset",
        str(user_offset),
        *(("--hugetlbfs", hugetlbfs) if hugetlbfs else ()),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"bench_local child failed ({out.returncode}):\n{out.stderr}")
    return json.loads(out.stdout)


def _across(runs: list[dict]) -> dict:
    """Each figure as the median over processes of the process medians (min..max across
    processes), keeping every process's median and the median within-process spread."""
    out: dict = {}
    for key, first in runs[0].items():
        out[key] = {}
        for section, figs in first.items():
            if section == "pages":  # words, not figures: every kind any process had
                out[key][section] = {n: sorted({r[key][section][n] for r in runs}) for n in figs}
                continue
            out[key][section] = {}
            for name in figs:
                # a layout share a process could not read (frame numbers hidden) is left out
                got = [r[key][section][name] for r in runs if name in r[key].get(section, {})]
                if len(got) == len(runs):
                    out[key][section][name] = across_processes(got)
    return out


@app.command()
def main(
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of a table"),
    quick: bool = typer.Option(False, "--quick", help="fewer processes, fewer and shorter rounds"),
    procs: int = typer.Option(0, help="fresh processes for the DRAM part (0: 9, --quick: 2)"),
    rounds: int = typer.Option(0, help="interleaved rounds per process (0: 5, --quick: 3)"),
    min_s: float = typer.Option(0.0, "--min-s", help="seconds per sample (0: 0.04, --quick: 0.03)"),
    page_size: int = typer.Option(64 * KiB, help="pool page size in bytes"),
    hugetlbfs: str = typer.Option("", help="also measure a pool whose DRAM tier is on this hugetlbfs mount "
                                  "(needs 256 MiB of huge pages reserved: vm.nr_hugepages)"),
    shm_huge: str = typer.Option("", help="run the DRAM part over a private /dev/shm mounted huge=this "
                                 f"({', '.join(SHM_HUGE)}; root); default: the host's /dev/shm"),
    compact_memory: bool = typer.Option(False, "--compact-memory", help="compact the host's free memory before "
                                        "each DRAM process, so its mappings' layout does not depend on how "
                                        f"fragmented it was ({COMPACT}; root)"),
    user_offset: int = typer.Option(0, "--user-offset", help="the caller's buffers start this many bytes past a "
                                    "4 KiB boundary (0: 64-byte aligned, as vLLM's KV tensors)"),
    child: bool = typer.Option(False, "--child", hidden=True, help="one process of the DRAM part, as JSON"),
) -> None:
    if not 0 <= user_offset < 4096:
        raise typer.BadParameter(f"--user-offset must be in 0..4095, not {user_offset}")
    if shm_huge and shm_huge not in SHM_HUGE:
        raise typer.BadParameter(f"--shm-huge must be one of {', '.join(SHM_HUGE)}, not {shm_huge!r}")
    if shm_huge and os.geteuid() != 0:
        raise typer.BadParameter("--shm-huge mounts a tmpfs in a private mount namespace: run as root")
    if compact_memory and not os.access(COMPACT, os.W_OK):
        raise typer.BadParameter(f"--compact-memory writes {COMPACT}: run as root on a kernel with compaction")
    rounds = rounds or (3 if quick else 5)
    procs = procs or (2 if quick else 9)
    min_s = min_s or (0.03 if quick else 0.04)
    huge = hugetlbfs or None
    if child:
        print(json.dumps(_dram_all(rounds, min_s, page_size, huge, user_offset)))
        return
    results: dict = {
        "batch": BATCH,
        "procs": procs,
        "rounds": rounds,
        "page_size": page_size,
        "hugetlbfs": huge,
        "user_offset": user_offset,
        # the huge= of the /dev/shm the pools lived in (the kernel's default: never)
        "shm_huge": shm_huge or tmpfs_huge("/dev/shm"),
        "compact_memory": compact_memory,
        "env_before": env_info(),
    }
    runs = []
    for _ in range(procs):
        if compact_memory:
            compact_free_memory(COMPACT)  # (the module's knob: tests point it elsewhere)
        runs.append(_one_process(rounds, min_s, page_size, huge, shm_huge or None, user_offset))
    results.update(_across(runs))
    results["exists_512_us"] = bench_exists(512, 20 if quick else 60, rounds)
    results["disk_64KiB"] = bench_disk(64 * KiB, 32 * MiB if quick else 64 * MiB, 2 if quick else 3)
    results["env_after"] = env_info()
    if as_json:
        print(json.dumps(results, indent=2))
        return
    con = Console(width=160)
    t = Table(
        title=f"local pool vs memcpy (/dev/shm huge={results['shm_huge']}, caller's buffers at {user_offset} "
        f"past a page), batches of {BATCH}, {procs} processes x "
        f"{rounds} interleaved rounds: "
        "median (min..max) ±half-spread across the process medians; ratio = pool / baseline of the same round"
    )
    for col in (
        "object",
        "op",
        "checksum",
        "pool GB/s",
        "÷ memcpy",
        "÷ memcpy/obj",
        "÷ memcpy shm",
        "÷ stream",
    ):
        t.add_column(col, justify="right", no_wrap=True)
    for name, r in results.items():
        if not name.startswith("dram_"):
            continue
        for op in ("put", "get"):
            for ck in _checksums(huge):
                rr = r["ratio"]
                t.add_row(
                    name.split("_")[1],
                    op,
                    ck,
                    _s(r["gbps"][f"{op} checksum {ck}"]),
                    *(
                        _s(rr[f"{op} checksum {ck} / {b}"])
                        for b in ("memcpy", "memcpy/obj", "memcpy shm", "stream")
                    ),
                )
        for op in ("put", "get"):
            g = r["gbps"]
            con.print(
                f"{name.split('_')[1]} {op} baselines GB/s: memcpy {_s(g[f'{op}: memcpy'])}, "
                f"memcpy/obj {_s(g[f'{op}: memcpy/obj'])}, memcpy shm {_s(g[f'{op}: memcpy shm'])}, "
                f"stream {_s(g[f'{op}: stream'])}"
            )
        if r.get("layout"):
            con.print(
                f"{name.split('_')[1]} layout (share of 4 KiB pages in their neighbour's 2 MiB frame): "
                + ", ".join(f"{m} {_s(v)}" for m, v in r["layout"].items())
            )
    con.print(t)
    within = [
        (f["within_spread"], f"{name.split('_')[1]} {fig}")
        for name, r in results.items()
        if name.startswith("dram_")
        for fig, f in {**r["gbps"], **r["ratio"]}.items()
    ]
    w, wname = max(within)
    con.print(
        f"within one process the rounds spread ±{100 * w / 2:.0f}% at most (median over processes; {wname})"
    )
    d = results["disk_64KiB"]
    con.print(f"exists of 512 keys: {_s(results['exists_512_us'], 1)} us")
    con.print(
        f"disk tier 64 KiB: put {_s(d['put_gbps'])} GB/s (every put spills an LRU object), "
        f"get {_s(d['get_gbps'])} GB/s (read from disk + promotion), spills {d['spills']}, disk hits {d['disk_hits']}"
    )
    con.print(env_line(results["env_before"], results["env_after"]))


if __name__ == "__main__":
    app()
