"""Connector-path throughput and scheduler overhead, against baselines in the same run.

1. put/get GB/s through the connector's worker (AscendStoreWorker: plan -> chunk
   regions from vLLM's KV views -> guarded transfer threads) divided by the raw
   backend client's GB/s moving the same objects between the same regions.
   Goal: >= 0.9. Each row's figure is the median over 5 fresh processes of each
   process's median over interleaved rounds (a process's connector put runs at a
   level of its own on this VM). With the local pool the rows run on one CPU
   (``--pin-cpu``, the process's first by default: the connector's save and load
   threads inherit it), so that the connector's copy on its save thread and the raw
   call on the bench's thread find the source in the same caches: left to the
   scheduler, the save thread on another vCPU than the thread that last read the KV
   made 64 KiB-block puts read 0.70-0.94 of the raw call over processes, against
   0.92-0.99 on one CPU (2026-12-04, AMD EPYC; ``--pin-cpu -1`` runs them unpinned).
   ``--backend mooncake`` starts a real ``mooncake_master`` on loopback (re-running
   itself in a private network namespace, as root) and compares against the worker's own client's zero-copy
   batch calls; it adds the connector's get as an async load makes it (on the
   load thread) beside the sync load's (vLLM's forward thread), the async get
   into vLLM's blocks (``direct_async_loads``), and the put with the exists the
   engine asked before it until Mooncake declared ``dedups_puts``; it skips part 2.
   With the local pool, ``put exists first`` is the step's save as an exists and
   a put, as before the pool's ``put_absent`` did the dedup inside the put.
   ``--segment remote`` (with ``BENCH_CLOCK=wall``) puts the objects in another
   client's segment (a lender process; the worker's client lends none), so every
   transfer crosses a TCP socket on loopback, as from another node's memory.
2. The connector's scheduler-side time per step (its calls in schedule() and
   in the update_from_output() after it) divided by vLLM's schedule() time,
   with 256 running requests (real Scheduler; connector calls timed by
   wrapping them; CPU time of the scheduler's thread, since the harness runs the
   worker's save thread in the same process). Each engine instance gives one
   ratio (sums over its steady steps); the figure is the median over 32 fresh
   instances, whose levels differ by a few percent, spread over 16 fresh
   processes, whose levels differ by up to a quarter on one host and a half on
   another (one process's median did not reproduce in the next run). Goal: <= 0.10.

    .venv/bin/python bench/bench_connector.py [--backend local|mooncake] [--quick] [--json] [--pin-cpu N]
    BENCH_CLOCK=wall .venv/bin/python bench/bench_connector.py --backend mooncake --segment remote
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from ascendstore_vllm.metadata import AscendStoreMetadata, ChunkRef, LoadSpec, SaveSpec
from ascendstore_vllm.testing import EngineHarness, EngineSpec
from harness import (
    CLOCK_NAME,
    Stat,
    across_processes,
    env_info,
    env_line,
    gbps_sampler,
    interleave,
    ratios,
    stat,
    thread_clock,
)
from mooncake_master import ensure_private_netns, start_lender, start_master
from rich.console import Console
from rich.table import Table

from ascendstore.contract import BackendContext, Status
from ascendstore.registry import create_backend

app = typer.Typer(add_completion=False)
#: the master's address for the Mooncake rows (main() starts it; fresh processes inherit it).
MASTER_ENV = "_BENCH_CONNECTOR_MOONCAKE_MASTER"
#: "remote": the worker's client lends no segment; its objects sit in a lender process's.
SEGMENT_ENV = "_BENCH_CONNECTOR_MOONCAKE_SEGMENT"
#: what the lender lends: the largest row's step (256 MiB) twice over, and room to spare
LENDER_BYTES = 1 << 30


def _backend_config(backend: str, capacity_mib: int) -> dict[str, Any]:
    if backend == "local":
        # prefault: the pool's pages are touched once at creation, as in a server that has
        # run a while; else the first rounds of a process pay first-touch faults in the put
        # (rounds of 0.55-0.77 seen) that neither side of a later round does.
        return {"backend": "local", "backend_config": {"name": "bench-" + uuid.uuid4().hex[:8],
                                                       "capacity": f"{capacity_mib}MiB", "page_size": "64KiB",
                                                       "prefault": True}}
    if backend == "mooncake":
        # main() started the master (loopback, private namespace); fresh processes inherit this.
        remote = os.environ.get(SEGMENT_ENV) == "remote"
        return {"backend": "mooncake", "backend_config": {
            "master_server_address": os.environ[MASTER_ENV], "local_hostname": "127.0.0.1",
            "global_segment_size": 0 if remote else capacity_mib << 20, "local_buffer_size": 16 << 20,
            "exists_cache_ttl_s": 0}}
    return {"backend": backend}


class _RawMooncake:
    """The worker's own Mooncake client called straight (zero-copy batch calls on
    the same connection and segment the connector uses), its argument lists built
    once, as the local side's key and region lists are."""

    def __init__(self, backend: Any, keys: list[str], regions: list[list[Any]]) -> None:
        self._store = backend._store
        self._cfg = backend._replicate
        self._keys = keys
        self._ptrs = [[r.addr for r in rs] for rs in regions]
        self._sizes = [[r.length for r in rs] for rs in regions]
        self._totals = [sum(s) for s in self._sizes]

    def put(self) -> None:
        rc = self._store.batch_put_from_multi_buffers(self._keys, self._ptrs, self._sizes, self._cfg)
        assert list(rc) == [0] * len(self._keys), rc

    def get(self) -> None:
        rc = self._store.batch_get_into_multi_buffers(self._keys, self._ptrs, self._sizes, False)
        assert list(rc) == self._totals, rc

    def remove(self) -> None:
        self._store.batch_remove(self._keys, True)


def delivered(meta: AscendStoreMetadata) -> AscendStoreMetadata:
    """A step's metadata as a worker gets it before its loads: vLLM's multiprocess
    executor pickles the scheduler output into a message queue and the worker
    unpickles it just before the step (in one process the scheduler builds it
    moments before). Either way every object is new, made after the previous
    step's copy evicted the caches, not an object the worker last read steps ago."""
    return pickle.loads(pickle.dumps(meta))


def transfer_ratio(backend: str, num_chunks: int, rounds: int, blocks_per_chunk: int = 1,
                   block_size: int = 16) -> dict[str, float]:
    # 8 layers x 8 KV heads x block_size tokens x (128+128) fp16: 64 KiB per layer-block at
    # 16 tokens (vLLM's GPU default), 512 KiB at 128 (vllm-ascend's usual block size).
    nblocks = num_chunks * blocks_per_chunk
    mib = nblocks * block_size // 32 + 64
    extra = {**_backend_config(backend, mib * 3 // 2), "chunk_size": block_size * blocks_per_chunk}
    spec = EngineSpec(extra_config=extra, num_layers=8, num_heads=8, num_kv_heads=8, head_size=128,
                      block_size=block_size, num_blocks=nblocks + 8, max_model_len=1024)
    eng = EngineHarness(spec, check_reads=False)
    try:
        w = eng.workers[0].connector.worker
        for t in eng.workers[0].kv_caches.values():
            t.copy_(torch_rand_like(t))
        tenant = "-"
        bpc = blocks_per_chunk
        chunks = [ChunkRef(i, f"{i:064x}", list(range(1 + i * bpc, 1 + (i + 1) * bpc))) for i in range(num_chunks)]
        cfg = spec.extra_config
        ops = w._ops(SaveSpec("bench", tenant, chunks), None)
        nbytes = sum(op.nbytes for op in ops)
        keys = [op.key for op in ops]
        regions = [op.materialize() for op in ops]  # the very regions the connector moves
        if backend == "mooncake":
            native = _RawMooncake(w.guard.backend, keys, regions)
            raw = None
            clear, raw_put, raw_get = native.remove, native.put, native.get
        else:
            raw = create_backend(cfg["backend"], cfg.get("backend_config"), BackendContext(role="tool"))

            def clear() -> None:
                raw.remove(keys, 30.0)

            def raw_put() -> None:
                assert raw.put(keys, regions, 30.0) == [Status.OK] * len(keys)

            def raw_get() -> None:
                assert raw.get(keys, regions, 30.0) == [Status.OK] * len(keys)

        def timed(fn: Callable[[], None], before: Callable[[], None] | None = None) -> Callable[[], float]:
            return gbps_sampler(fn, nbytes, before)  # (each call moves every object once)

        # The step's metadata is the scheduler's work, as the raw client's key and
        # region lists are prebuilt: made before the timing. A load reads it as vLLM
        # hands it over (``delivered``): fresh objects, made after the previous
        # step's copy. A save reads it after the forward pass, which evicts the
        # caches: there the chunk refs are the same objects every step, read cold.
        step: list[AscendStoreMetadata] = []

        dedups, absent = w.engine.dedups_puts, w.engine.puts_absent

        def prep_put(exists_first: bool = False) -> None:
            clear()
            # (a store whose put turns duplicates away, Mooncake, is asked no exists first,
            # and the local pool's put_absent skips what it holds itself, unless the case
            # says so: the same worker, the engine's flags switched per case)
            w.engine.dedups_puts = dedups and not exists_first
            w.engine.puts_absent = absent and not exists_first
            # (chunks the step computed: no device prefix hit's re-save)
            step[:] = [AscendStoreMetadata(saves=[SaveSpec("bench", tenant, chunks, computed=True)])]

        def stored() -> None:
            # Each get reads objects a put has just stored (a put's streaming stores
            # leave the pool's pages out of the cache, as a load in service finds
            # them). Else a get right after another get read them from the cache:
            # 13.5 against 8.6 GB/s for a 32 MiB step on a host whose L3 held it,
            # so the figure followed the order of the cases, not the code.
            clear()
            raw_put()

        def prep_get() -> None:
            stored()
            step[:] = [delivered(AscendStoreMetadata(loads=[LoadSpec("bench", tenant, chunks)]))]

        def conn_put() -> None:
            w.bind(step[0])
            w.wait_for_save()
            assert w.engine.wait("save", ["bench"], 60)

        def conn_get() -> None:
            w.bind(step[0])
            w.start_load_kv(None)
            assert not w.take_load_errors()

        def prep_get_async(direct: bool = False) -> None:
            stored()
            w.engine.direct_async_loads = direct  # the same worker, its option switched per case
            step[:] = [delivered(AscendStoreMetadata(loads=[LoadSpec("bench", tenant, chunks, is_async=True)]))]

        def conn_get_async() -> None:
            # The load thread's way (load_async): submitted here, waited for, collected
            # as get_finished does.
            w.bind(step[0])
            w.start_load_kv(None)
            assert w.engine.wait("load", ["bench"], 60)
            _, recv = w.get_finished(set())
            assert recv == {"bench"} and not w.take_load_errors()

        # Every put case clears the keys first (outside the timing), and stores the
        # same bytes under the same keys, so any get finds them whatever ran before.
        cases = {"raw put": timed(raw_put, clear), "conn put": timed(conn_put, prep_put),
                 "raw get": timed(raw_get, stored), "conn get": timed(conn_get, prep_get)}
        compared = ["put", "get"]  # (``ops`` above is the step's chunk objects)
        if backend == "mooncake":
            # Mooncake's gets run on a worker thread from vLLM's forward thread (sync
            # loads, the default) but on the load thread itself for async loads.
            cases["conn get async"] = timed(conn_get_async, prep_get_async)
            compared.append("get async")
            # direct_async_loads: the async get into vLLM's blocks, no landing buffer.
            cases["conn get async direct"] = timed(conn_get_async, lambda: prep_get_async(True))
            compared.append("get async direct")
        if dedups or absent:
            # The save's exists before its put: as before Mooncake declared dedups_puts, and
            # before the local pool's step saves became one put_absent.
            cases["conn put exists first"] = timed(conn_put, lambda: prep_put(True))
            compared.append("put exists first")
        raw_put()
        s = interleave(cases, rounds)
        clear()
        if raw is not None:
            raw.close()
        # the CPUs the engine's transfer threads could run on (--pin-cpu reaches them)
        cpus = sorted({c for t in w.engine._threads if t.is_alive() and t.native_id
                       for c in os.sched_getaffinity(t.native_id)})
        return {"gbps": {k: stat(v).as_dict() for k, v in s.items()},
                "ratio": {op: ratios(s[f"conn {op}"], s[f"raw {op.split()[0]}"]).as_dict() for op in compared},
                "engine_thread_cpus": cpus,
                "object_bytes": nbytes / num_chunks, "objects": num_chunks, "blocks_per_chunk": bpc,
                "block_size": block_size}
    finally:
        eng.close()


def torch_rand_like(t):
    import torch

    return torch.randn(t.shape, dtype=torch.float32).to(t.dtype)


def _scheduler_run(backend: str, num_requests: int, steps: int) -> tuple[int, list[tuple[float, float]]]:
    """One engine instance: (running requests, [(schedule() s, connector s)] per steady step);
    a step's connector s are its scheduler-side calls in schedule() and after it."""
    spec = EngineSpec(extra_config=_backend_config(backend, 256), num_blocks=num_requests * 9 + 16,
                      max_num_seqs=num_requests, max_num_batched_tokens=num_requests * 128 + 256,
                      max_model_len=512, num_layers=1, num_heads=1, num_kv_heads=1, head_size=8)
    eng = EngineHarness(spec, check_reads=False)
    try:
        conn = eng.connector
        spent = [0.0]
        for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                     "request_finished", "update_connector_output", "take_events", "get_kv_connector_stats"):
            fn = getattr(conn, name)

            def timed(*a, _fn=fn, **k):
                t0 = thread_clock()
                try:
                    return _fn(*a, **k)
                finally:
                    spent[0] += thread_clock() - t0

            setattr(conn, name, timed)
        for i in range(num_requests):
            eng.add_request(f"r{i}", [(i * 131 + j * 7) % 997 + 3 for j in range(100)], max_tokens=steps + 50)
        sched = eng.scheduler
        orig = sched.schedule
        per_step: list[tuple[float, float]] = []

        def after_last_schedule() -> None:
            # A step's connector time is its calls in schedule() and in the
            # update_from_output() after it (update_connector_output, request_finished,
            # take_events, get_kv_connector_stats): those are the scheduler side too.
            if per_step:
                s, c = per_step[-1]
                per_step[-1] = (s, c + spent[0])
            spent[0] = 0.0

        def schedule():
            after_last_schedule()
            t0 = thread_clock()
            out = orig()
            per_step.append((thread_clock() - t0, spent[0]))
            spent[0] = 0.0
            return out

        sched.schedule = schedule
        for _ in range(steps):
            eng.step()
        after_last_schedule()
        return len(sched.running), per_step[3:]  # after every prompt is in (decode steady state)
    finally:
        eng.close()


_IN_PROCESS = (
    "import json, sys; sys.path.insert(0, {here!r}); import torch; torch.set_num_threads(1); "
    "import bench_connector as b; print('OUT', json.dumps({expr}))"
)


def _in_fresh_process(expr: str) -> Any:
    """The JSON value of ``expr`` (over this module as ``b``), evaluated in a fresh interpreter."""
    code = _IN_PROCESS.format(here=str(Path(__file__).resolve().parent), expr=expr)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads([ln for ln in out.splitlines() if ln.startswith("OUT ")][-1][4:])


def _runs_in_processes(backend: str, num_requests: int, steps: int, engines: int, procs: int
                       ) -> list[tuple[int, list[tuple[float, float]]]]:
    """``engines`` instances spread over ``procs`` fresh processes, one after the other."""
    runs: list[tuple[int, list[tuple[float, float]]]] = []
    for i in range(procs):
        k = engines // procs + (i < engines % procs)
        got = _in_fresh_process(f"[b._scheduler_run({backend!r}, {num_requests}, {steps}) for _ in range({k})]")
        runs += [(n, [(a, c) for a, c in steps_]) for n, steps_ in got]
    return runs


def scheduler_ratio(backend: str, num_requests: int, steps: int, engines: int, procs: int = 1) -> dict[str, Any]:
    """Connector time over schedule() time: one ratio per fresh engine instance, the median of those.

    ``steps`` should cover whole chunk periods after the 3 warm-up steps (every running
    request reaches a chunk boundary once per period, so steps differ by phase).
    ``procs`` > 1 spreads the instances over that many fresh processes."""
    if procs > 1:
        runs = _runs_in_processes(backend, num_requests, steps, engines, procs)
    else:
        runs = [_scheduler_run(backend, num_requests, steps) for _ in range(engines)]
    steady = [s for _, run in runs for s in run]
    per_engine = [sum(c for _, c in run) / sum(s for s, _ in run) for _, run in runs]
    sched_t = statistics.median(s for s, _ in steady)
    conn_t = statistics.median(c for _, c in steady)
    return {"running": runs[-1][0], "engines": engines, "processes": procs, "steps": steps,
            "clock": "thread " + CLOCK_NAME,
            "schedule_ms": sched_t * 1e3, "connector_ms": conn_t * 1e3,
            "ratio": stat(per_engine).as_dict(),
            "per_step": stat(c / s for s, c in steady).as_dict()}


def _transfer_rows(backend: str, n: int, rounds: int, pin_cpu: int | None = None) -> list[dict]:
    """The four transfer shapes, in this process; with ``pin_cpu``, on that CPU only (the
    calling thread, and so the engine threads it starts; its own mask restored after)."""
    mask = os.sched_getaffinity(0)
    if pin_cpu is not None:
        os.sched_setaffinity(0, {pin_cpu})
    try:
        # 192 x 512 KiB, 48 x 2 MiB, a small step of 64 x 512 KiB, and 64 x 4 MiB (128-token blocks)
        rows = [transfer_ratio(backend, n, rounds, 1), transfer_ratio(backend, n // 4, rounds, 4),
                transfer_ratio(backend, 64, rounds, 1), transfer_ratio(backend, 64, rounds, 1, block_size=128)]
    finally:
        os.sched_setaffinity(0, mask)
    for r in rows:
        r["pin_cpu"] = pin_cpu
    return rows


def transfers_across(backend: str, n: int, rounds: int, procs: int, pin_cpu: int | None = None) -> list[dict]:
    """The transfer rows measured in ``procs`` fresh processes, one after the other: every
    figure the median of the process medians (min..max across processes), with each
    process's median. A process's connector put runs at a level of its own (the save
    thread's placement on this VM: 16 against 23 GB/s beside a raw put steady at 23 in
    one process, within +-10% in the next), which more rounds in one process cannot
    average out."""
    if procs <= 1:
        return _transfer_rows(backend, n, rounds, pin_cpu)
    runs = [_in_fresh_process(f"b._transfer_rows({backend!r}, {n}, {rounds}, {pin_cpu!r})") for _ in range(procs)]
    rows = []
    for i, first in enumerate(runs[0]):
        row = {k: v for k, v in first.items() if k not in ("gbps", "ratio")}  # (pin_cpu among them)
        row["gbps"] = {case: across_processes([r[i]["gbps"][case] for r in runs]) for case in first["gbps"]}
        row["ratio"] = {op: across_processes([r[i]["ratio"][op] for r in runs]) for op in first["ratio"]}
        row["processes"] = procs
        rows.append(row)
    return rows


def _fmt(d: dict, digits: int = 2) -> str:
    return Stat(d["median"], d["min"], d["max"], d["n"]).fmt(digits)


@app.command()
def main(backend: str = "local", quick: bool = False, as_json: bool = typer.Option(False, "--json"),
         rounds: int = typer.Option(0, help="interleaved rounds per process (0: 7, --quick: 3)"),
         procs: int = typer.Option(0, help="fresh processes for the transfer rows (0: 5, --quick: 1)"),
         segment: str = typer.Option("own", help="mooncake: whose segment holds the objects, the worker's "
                                     "client's own or another client's (remote: read across a socket)"),
         pin_cpu: int = typer.Option(None, "--pin-cpu", help="run the transfer rows on this CPU only (local: the "
                                     "process's first CPU by default; -1: unpinned; mooncake: unpinned by default, "
                                     "its client's threads would share the CPU)")) -> None:
    import torch

    if segment not in ("own", "remote"):
        raise typer.BadParameter(f"{segment!r}: use own or remote", param_hint="--segment")
    if segment == "remote" and (backend != "mooncake" or CLOCK_NAME != "wall"):
        # The lender's half of every transfer runs in its process: not this one's CPU time.
        raise typer.BadParameter("remote is for --backend mooncake, timed by the wall clock (BENCH_CLOCK=wall)",
                                 param_hint="--segment")

    allowed = os.sched_getaffinity(0)
    if pin_cpu is None:
        pin_cpu = min(allowed) if backend == "local" else -1
    if pin_cpu != -1 and pin_cpu not in allowed:
        raise typer.BadParameter(f"CPU {pin_cpu} is not one this process may run on ({sorted(allowed)}); "
                                 "-1 leaves the rows unpinned", param_hint="--pin-cpu")
    pin = None if pin_cpu == -1 else pin_cpu
    torch.set_num_threads(1)  # no OpenMP workers spinning on the CPU clock between torch ops
    n = 64 if quick else 192
    rounds = rounds or (3 if quick else 7)
    procs = procs or (1 if quick else 5)
    master = lender = None
    if backend == "mooncake":
        ensure_private_netns()
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        master, os.environ[MASTER_ENV] = start_master()
        os.environ[SEGMENT_ENV] = segment
    env0 = env_info()
    try:
        if segment == "remote":
            lender = start_lender(os.environ[MASTER_ENV], LENDER_BYTES)
        transfers = transfers_across(backend, n, rounds, procs, pin)
        # 3 warm-up steps + two 16-step chunk periods per engine; 32 engines in 16 processes (3 in
        # this one with --quick): per-engine levels differ by up to 2x on this VM (~30 us of work
        # per step), and per-process ones by up to a quarter (Zen 3) or a half (Zen 5, where 24
        # engines in 8 processes put two runs' medians 14% apart, 32 in 16 put them 8% apart), so
        # many processes. Local pool only: a lookup through another backend is that backend's
        # exists (bench_lookup.py).
        s = scheduler_ratio(backend, 256, 35, 3 if quick else 32, 1 if quick else 16) if backend == "local" else None
    finally:
        if lender is not None:
            lender.kill()
            lender.wait()
        if master is not None:
            master.kill()
            master.wait()
    out = {"transfer": transfers, "scheduler": s, "rounds": rounds, "processes": procs, "pin_cpu": pin,
           "env_before": env0,
           "env_after": env_info(), "segment": segment if backend == "mooncake" else None, "clock": CLOCK_NAME}
    if as_json:
        print(json.dumps(out, indent=2))
        return
    c = Console(width=160)
    over = (f"the median of {procs} fresh processes' medians (min..max across them), {rounds} interleaved rounds "
            "each" if procs > 1 else f"median (min..max) over {rounds} interleaved rounds")
    where = f" (objects in {'another client' if segment == 'remote' else 'its own'}'s segment)" \
        if backend == "mooncake" else ""
    on = f"on CPU {pin}" if pin is not None else "unpinned"
    tab = Table(title=f"connector path vs raw {backend} client{where}, same objects and regions, {on}; GB/s and "
                f"ratio (per round, {CLOCK_NAME} clock): {over}")
    for col in ("op", "objects", "connector GB/s", "raw GB/s", "ratio (goal >= 0.9)"):
        tab.add_column(col)
    for t in transfers:
        for op in t["ratio"]:
            shape = f"{t['objects']} x {t['object_bytes'] / 1024:.0f} KiB ({t['blocks_per_chunk']} x {t['block_size']}-token blk)"
            tab.add_row(op, shape, _fmt(t["gbps"][f"conn {op}"]), _fmt(t["gbps"][f"raw {op.split()[0]}"]),
                        _fmt(t["ratio"][op]))
    c.print(tab)
    if s is None:
        c.print(env_line(env0, out["env_after"]))
        return
    tab = Table(title=f"scheduler side, {s['running']} running requests, {s['engines']} engine instances in "
                f"{s['processes']} process(es), "
                f"CPU time of the scheduler's thread")
    for col in ("schedule() ms", "connector ms", "connector / schedule() per engine (goal <= 0.10)", "per step"):
        tab.add_column(col)
    tab.add_row(f"{s['schedule_ms']:.3f}", f"{s['connector_ms']:.3f}", _fmt(s["ratio"], 3), _fmt(s["per_step"], 3))
    c.print(tab)
    c.print(env_line(env0, out["env_after"]))


if __name__ == "__main__":
    app()
