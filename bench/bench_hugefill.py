"""A pool that is not prefaulted, with and without its 2 MiB pages made as it fills.

Three kinds of 1 GiB local pool on the host's /dev/shm (``lazy_huge_pages``,
docs/local-backend.md#huge-pages): ``lazy`` (the default: its creator's thread has the
kernel make 2 MiB pages just ahead of the fill), ``off`` (``lazy_huge_pages: false``:
4 KiB pages as puts touch them) and ``prefault`` (the whole arena made 2 MiB pages at
creation). Two parts:

1. Filling (``--procs`` fresh processes per kind, kinds alternating): create the
   pool, put ``--fill-mib`` of 64 KiB objects (batches of 32), wait until the
   thread has caught up, read every object once. Reported: creation and fill time,
   the wait, bytes of the segment in memory and in 2 MiB pages, and the page-table
   bytes the process gained (``VmPTE``): every process that maps a pool pays those.
2. Speed, one process with a pool of each kind, filled: put and get of 64 KiB and
   2 MiB objects, the kinds interleaved round by round (bench/harness.py); ratios
   lazy ÷ off and lazy ÷ prefault per round.

Only meaningful on a /dev/shm mounted huge=never (the usual mount; elsewhere the three
pools hold the same pages). Where free memory is fragmented a pool in 4 KiB pages gets
scattered ones and its copies slow down (docs/benchmarking.md); ``--compact-memory``
(root) compacts free memory before each process, for a steadier ``off``.

    .venv/bin/python bench/bench_hugefill.py [--quick] [--json]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import typer
from harness import COMPACT, compact_free_memory, env_info, env_line, interleave, placed, rate, ratios, stat
from rich.console import Console
from rich.table import Table

from ascendstore.contract import BackendContext, Region, Status
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions
from ascendstore.local.pages import tmpfs_huge

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BATCH = 32
KINDS = ("lazy", "off", "prefault")
app = typer.Typer(add_completion=False)


def _open(kind: str) -> LocalBackend:
    opts = LocalOptions(name=f"bench-hf-{uuid.uuid4().hex[:8]}", capacity=GiB, prefault=kind == "prefault",
                        lazy_huge_pages=kind == "lazy")
    return LocalBackend.create(opts, BackendContext())


def _vm_pte() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmPTE:"):
                return int(line.split()[1]) * KiB
    return 0


def _batches(prefix: str, size: int, total: int) -> list[list[str]]:
    n = total // size // BATCH * BATCH
    return [[f"{prefix}/{size}/{i + b}" for i in range(BATCH)] for b in range(0, n, BATCH)]


def fill_one(kind: str, fill_mib: int) -> dict:
    """Part 1 in this process: create, fill, wait for the thread, read all back."""
    size = 64 * KiB
    src = placed(BATCH * size, 0, 3)
    regions = [[Region(src.ctypes.data + j * size, size)] for j in range(BATCH)]
    pte0 = _vm_pte()
    t0 = time.perf_counter()
    be = _open(kind)
    t1 = time.perf_counter()
    try:
        batches = _batches("fill", size, fill_mib * MiB)
        for b in batches:
            assert be.put(b, regions, 5.0) == [Status.OK] * BATCH
        t2 = time.perf_counter()
        filler = be.huge_page_filler
        caught_up = filler.caught_up(120.0) if filler is not None else None
        t3 = time.perf_counter()
        sink = placed(BATCH * size, 0, 0)
        sregions = [[Region(sink.ctypes.data + j * size, size)] for j in range(BATCH)]
        for b in batches:
            assert be.get(b, sregions, 5.0) == [Status.OK] * BATCH
        assert bytes(sink[:size]) == bytes(src[:size])
        pages = be.dram_pages()
        return {
            "kind": kind,
            "create_s": t1 - t0,
            "fill_s": t2 - t1,
            "fill_gbps": len(batches) * BATCH * size / (t2 - t1) / 1e9,
            "catch_up_s": t3 - t2,
            "caught_up": caught_up,
            "stretches_made": filler.made if filler is not None else 0,
            "segment_bytes": be.stats()["shm_resident_bytes"],
            "resident_bytes": pages.resident_bytes,
            "huge_bytes": pages.huge_bytes,
            "page_table_bytes": _vm_pte() - pte0,
            "pages": pages.describe(),
        }
    finally:
        be.close()


def speed(rounds: int, min_s: float, fill_mib: int) -> dict:
    """Part 2: the three kinds in one process, interleaved round by round."""
    pools = {k: _open(k) for k in KINDS}
    try:
        out: dict = {}
        for size in (64 * KiB, 2 * MiB):
            src = placed(BATCH * size, 0, 5)
            sink = placed(BATCH * size, 0, 0)
            regs = [[Region(src.ctypes.data + j * size, size)] for j in range(BATCH)]
            sregs = [[Region(sink.ctypes.data + j * size, size)] for j in range(BATCH)]
            batches = _batches("speed", size, max(fill_mib * MiB // 2, BATCH * size))  # (a batch at least)
            for be in pools.values():
                for b in batches:
                    assert be.put(b, regs, 5.0) == [Status.OK] * BATCH
                if be.huge_page_filler is not None:
                    be.huge_page_filler.caught_up(120.0)
            turn: dict[str, int] = {}

            def case(kind: str, op: str, size: int = size, batches: list = batches, regs: list = regs,
                     sregs: list = sregs, turn: dict = turn):  # type: ignore[no-untyped-def]
                be = pools[kind]
                call, rr = (be.put, regs) if op == "put" else (be.get, sregs)
                name = f"{op} {kind}"

                def fn() -> int:
                    i = turn[name] = (turn.get(name, -1) + 1) % len(batches)
                    assert call(batches[i], rr, 5.0) == [Status.OK] * BATCH
                    return BATCH * size

                return lambda: rate(fn, min_s) / 1e9

            cases = {f"{op} {k}": case(k, op) for op in ("put", "get") for k in KINDS}
            s = interleave(cases, rounds)
            label = f"{size // KiB}KiB"
            out[label] = {"gbps": {k: stat(v).as_dict() for k, v in s.items()}, "ratio": {}}
            for op in ("put", "get"):
                for base in ("off", "prefault"):
                    out[label]["ratio"][f"{op} lazy / {base}"] = ratios(s[f"{op} lazy"], s[f"{op} {base}"]).as_dict()
        return out
    finally:
        for be in pools.values():
            be.close()


@app.command()
def main(
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of tables"),
    quick: bool = typer.Option(False, "--quick", help="one process per kind, a smaller fill, fewer rounds"),
    procs: int = typer.Option(0, help="fresh processes per kind for part 1 (0: 3, --quick: 1)"),
    rounds: int = typer.Option(0, help="interleaved rounds of part 2 (0: 7, --quick: 3)"),
    fill_mib: int = typer.Option(0, "--fill-mib", help="MiB put into each pool (0: 768, --quick: 128)"),
    compact_memory: bool = typer.Option(False, "--compact-memory", help=f"write {COMPACT} before each process"),
    child: str = typer.Option("", "--child", hidden=True, help="part 1 for one kind, as JSON"),
) -> None:
    procs = procs or (1 if quick else 3)
    rounds = rounds or (3 if quick else 7)
    fill_mib = fill_mib or (128 if quick else 768)
    if child:
        print(json.dumps(fill_one(child, fill_mib)))
        return
    if compact_memory and not os.access(COMPACT, os.W_OK):
        raise typer.BadParameter(f"--compact-memory writes {COMPACT}: run as root on a kernel with compaction")
    res: dict = {"shm_huge": tmpfs_huge("/dev/shm"), "procs": procs, "rounds": rounds, "fill_mib": fill_mib,
                 "env_before": env_info(), "fill": {k: [] for k in KINDS}}
    for p in range(procs):
        for kind in KINDS[p % 3:] + KINDS[: p % 3]:  # each kind goes first in turn
            if compact_memory:
                compact_free_memory()
            out = subprocess.run([sys.executable, __file__, "--child", kind, "--fill-mib", str(fill_mib)],
                                 capture_output=True, text=True, timeout=600, check=True)
            res["fill"][kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    res["speed"] = speed(rounds, 0.02 if quick else 0.04, fill_mib)
    res["env_after"] = env_info()
    if as_json:
        print(json.dumps(res, indent=2))
        return
    con = Console(width=160)
    t = Table(title=f"part 1: a 1 GiB pool filled with {fill_mib} MiB of 64 KiB objects (/dev/shm huge="
              f"{res['shm_huge']}), {procs} process(es) per kind: min..max")
    for col in ("pool", "create s", "fill GB/s", "catch-up s", "segment MiB", "in 2 MiB pages MiB",
                "page tables KiB"):
        t.add_column(col, justify="right", no_wrap=True)

    def span(rows: list[dict], key: str, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
        v = [r[key] / scale for r in rows]
        return fmt.format(min(v)) + (".." + fmt.format(max(v)) if len(v) > 1 else "")

    for kind, rows in res["fill"].items():
        t.add_row(kind, span(rows, "create_s"), span(rows, "fill_gbps"), span(rows, "catch_up_s"),
                  span(rows, "segment_bytes", MiB, "{:.0f}"), span(rows, "huge_bytes", MiB, "{:.0f}"),
                  span(rows, "page_table_bytes", KiB, "{:.0f}"))
    con.print(t)
    t = Table(title=f"part 2: GB/s median (min..max) over {rounds} interleaved rounds; ratios per round")
    for col in ("object", "op", "lazy", "off", "prefault", "lazy ÷ off", "lazy ÷ prefault"):
        t.add_column(col, justify="right", no_wrap=True)
    for label, r in res["speed"].items():
        for op in ("put", "get"):
            g, q = r["gbps"], r["ratio"]
            cell = [f"{g[f'{op} {k}']['median']:.2f} ({g[f'{op} {k}']['min']:.2f}..{g[f'{op} {k}']['max']:.2f})"
                    for k in KINDS]
            rq = [f"{q[f'{op} lazy / {b}']['median']:.3f} ({q[f'{op} lazy / {b}']['min']:.3f}.."
                  f"{q[f'{op} lazy / {b}']['max']:.3f})" for b in ("off", "prefault")]
            t.add_row(label, op, *cell, *rq)
    con.print(t)
    con.print(env_line(res["env_before"], res["env_after"]))


if __name__ == "__main__":
    app()
