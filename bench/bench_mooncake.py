"""The Mooncake backend against the raw Mooncake client, measured in the same run.

Starts its own ``mooncake_master`` on 127.0.0.1 and one client, then times
batched zero-copy puts and gets of the same objects two ways, alternating rounds
on the same connection: through ``MooncakeBackend`` (contract translation, bounded
native threads, status mapping) and straight through the client's
``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``. The ratio is
the cost of our layer. Puts are made as the engine's save thread makes them
(``blocking_caller()``: nothing waits on that thread, so the backend runs them
on it), gets as the engine's load thread makes them
(``watched_caller()``: the engine's watchdog bounds them, so the backend runs
them on the calling thread); the "thread" column hands every native call to a
worker thread, as gets from vLLM's forward thread (synchronous loads) are. Every put writes fresh keys (a duplicate put is a no-op in
Mooncake and would flatter both sides); the keys are removed outside the timing.

Each call carries ``--batch`` objects (32 by default, the unit the figures in
docs/benchmarking.md use); ``--batch 512`` times 32 MiB calls of 64 KiB objects, a
call the size a synchronous load of a long prompt makes (the engine sends a request's
objects in calls of up to 64 MiB), where the hand-off is a small share of the call.
2 MiB objects are timed only while a call stays within 64 MiB.

Mooncake clients listen on all interfaces, so the script re-runs itself in a
private network namespace (``unshare -n``, needs root) unless it is in one.

``--pin-cpu N`` pins the calling thread, and so the guard's worker threads it starts,
to one CPU, the client's own threads left on the process's CPUs: the hand-off's two
wake-ups then stay on one CPU instead of waking an idle one.

The bench's buffers (put sources, get destinations) start on a page, as vLLM's KV
tensors do (64-byte aligned); ``--user-offset N`` moves them N bytes past one. Until
2026-12-05 they were numpy's, 16 bytes past a page, where glibc's ``memcpy`` into
them runs slowly on AMD Zen 4: the raw get slower, our layer's share smaller.

Lookups (``--lookup-chunks``, 1024 by default: a 128k-token prompt in 128-token
chunks): the scheduler's question "how much of this prompt is pooled?" asked six
ways of a prompt whose chunks are all stored, against the raw client's
``batch_is_exist`` of the prompt's keys, prebuilt: the backend's ``exists`` of those
keys with the exists cache off (``exists``) and with every answer fresh in it
(``exists/cached``); ``PoolLookup.prefix_hits`` given the chunks' raw hashes as
vLLM's scheduler has them (``lookup``: keys built, one ``exists``, the first miss);
a new request's first lookup with pins on (``lookup/pinned``: a request id each
time, the exists cache off, its pins let go of outside the timing); the same with the
backend's options as shipped (``lookup/pinned/cache``: the exists cache on at its
default TTL, holding 32768 other keys; the prompt's own keys dropped from it outside
the timing, as a new prompt's are not in it); and, as shipped, a waiting request's
next lookup (``lookup/waiting``: vLLM asks again each step; the request holds its
pinned run). Interleaved round by round like the transfers; ratios per round.

    .venv/bin/python bench/bench_mooncake.py [--rounds 5] [--batch 32] [--pin-cpu N] [--user-offset N] [--json]
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import typer
from harness import Stat, env_info, env_line, interleave, placed, ratios, stat
from mooncake_master import ensure_private_netns, start_master
from rich.console import Console
from rich.table import Table

from ascendstore.contract import BackendContext, Region, Status, blocking_caller, watched_caller
from ascendstore.registry import create_backend

KiB, MiB = 1 << 10, 1 << 20
BATCH = 32  # objects per call (--batch); a synchronous load's call carries up to 64 MiB
BATCHES = 15  # timed calls per sample (their median)
LOOKUP_CALLS = 9  # timed lookups per sample (their median)
OTHER_KEYS = 32768  # other prompts' keys in the shipped backend's exists cache
#: the deadline the connector gives a call by default (timeout_ms 5000)
TIMEOUT_S = 5.0
app = typer.Typer(add_completion=False)


def _measure(size: int, rounds: int, address: str, batch: int = BATCH, pin_cpu: int | None = None,
             user_offset: int = 0) -> dict:
    backend = create_backend(
        "mooncake",
        {"master_server_address": address, "local_hostname": "127.0.0.1", "global_segment_size": 4 * batch * size
         + 64 * MiB, "local_buffer_size": 16 * MiB, "exists_cache_ttl_s": 0},
        BackendContext(role="worker"),
    )
    raw = backend._store  # the same connected client, called directly
    cfg = backend._replicate
    # The caller's buffers where vLLM's KV would be (on a page; --user-offset moves them)
    src = placed(batch * size, user_offset)
    src[:] = np.random.default_rng(size).integers(0, 256, batch * size, dtype=np.uint8)
    dst = placed(batch * size, user_offset)
    regions = [[Region(src.ctypes.data + i * size, size)] for i in range(batch)]
    dregions = [[Region(dst.ctypes.data + i * size, size)] for i in range(batch)]
    ptrs = [[r[0].addr] for r in regions]
    dptrs = [[r[0].addr] for r in dregions]
    sizes = [[size]] * batch
    total = batch * size
    counter = iter(range(10**9))

    def fresh() -> list[str]:
        n = next(counter)
        return [f"bench/{size}/{n}/{i}" for i in range(batch)]

    guard = backend._guard
    inline_allowed = guard.allow_inline
    mask = os.sched_getaffinity(0)
    if pin_cpu is not None:
        # After the client's set-up (its own threads keep the process's mask), before
        # the guard's first worker: the guard starts workers from the calling thread
        # on demand, and a new thread inherits its creator's mask.
        assert not guard._threads, "a guard worker started before the pin"
        os.sched_setaffinity(0, {pin_cpu})

    def put_ours() -> float:
        keys = fresh()
        with blocking_caller():  # as the engine's save thread calls it
            t0 = time.perf_counter()
            st = backend.put(keys, regions, TIMEOUT_S)
            dt = time.perf_counter() - t0
        assert st == [Status.OK] * batch, st
        raw.batch_remove(keys, True)
        return dt

    def threaded(fn: Callable[[], float]) -> Callable[[], float]:
        # The same call with every native call handed to a worker thread (no inline calls).
        def run() -> float:
            guard.allow_inline = False
            try:
                return fn()
            finally:
                guard.allow_inline = inline_allowed

        return run

    def put_raw() -> float:
        keys = fresh()
        t0 = time.perf_counter()
        rc = raw.batch_put_from_multi_buffers(keys, ptrs, sizes, cfg)
        dt = time.perf_counter() - t0
        assert list(rc) == [0] * batch, rc
        raw.batch_remove(keys, True)
        return dt

    stored = fresh()
    assert backend.put(stored, regions, 10.0) == [Status.OK] * batch

    def get_ours() -> float:
        with watched_caller():  # as the engine's load thread calls it
            t0 = time.perf_counter()
            st = backend.get(stored, dregions, TIMEOUT_S)
            dt = time.perf_counter() - t0
        assert st == [Status.OK] * batch, st
        return dt

    def get_raw() -> float:
        t0 = time.perf_counter()
        rc = raw.batch_get_into_multi_buffers(stored, dptrs, sizes, False)
        dt = time.perf_counter() - t0
        assert list(rc) == [size] * batch, rc
        return dt

    # One sample: GB/s from the median of BATCHES timed batches; the six cases interleave.
    fns = {"put_raw": put_raw, "put_ours": put_ours, "put_thread": threaded(put_ours),
           "get_raw": get_raw, "get_ours": get_ours, "get_thread": threaded(get_ours)}
    cases = {k: (lambda f=f: total / statistics.median(f() for _ in range(BATCHES)) / 1e9) for k, f in fns.items()}
    calls0 = guard.inline_calls
    s = interleave(cases, rounds, warmup=2)
    assert np.array_equal(dst, src)  # what we timed was real data movement
    inline_calls = guard.inline_calls - calls0
    worker_masks = [sorted(os.sched_getaffinity(t.native_id)) for t in guard._threads if t.native_id]
    os.sched_setaffinity(0, mask)
    backend.close()
    return {"gbps": {k: stat(v).as_dict() for k, v in s.items()},
            "ratio": {op: ratios(s[f"{op}_ours"], s[f"{op}_raw"]).as_dict() for op in ("put", "get")},
            "ratio_thread": {op: ratios(s[f"{op}_thread"], s[f"{op}_raw"]).as_dict() for op in ("put", "get")},
            "inline_puts": inline_allowed, "inline_calls": inline_calls,
            "pin_cpu": pin_cpu, "worker_cpus": worker_masks, "user_offset": user_offset,
            "buffer_page_offsets": [src.ctypes.data % 4096, dst.ctypes.data % 4096]}


def _measure_lookup(chunks: int, rounds: int, address: str) -> dict:
    """A prompt of ``chunks`` stored chunks looked up three ways against the raw
    client's batch_is_exist of its keys (the module doc)."""
    from ascendstore.engine import BackendGuard, KeyBuilder, PoolLookup
    from ascendstore.keys import RankPart, tenant_id

    conf = {"master_server_address": address, "local_hostname": "127.0.0.1", "global_segment_size": 64 * MiB,
            "local_buffer_size": 16 * MiB}
    # (a worker's client: it lends the segment the prompt's objects are put in)
    fresh = create_backend("mooncake", {**conf, "exists_cache_ttl_s": 0}, BackendContext(role="worker"))
    # (a ttl far beyond the run: every answer stays fresh; the first call fills the cache)
    cached = create_backend("mooncake", {**conf, "exists_cache_ttl_s": 3600}, BackendContext(role="scheduler"))
    # (a scheduler's client as shipped: the exists cache at its default ttl)
    shipped = create_backend("mooncake", conf, BackendContext(role="scheduler"))
    guard = BackendGuard(fresh, timeout_s=TIMEOUT_S)  # (the engine's: closing it closes ``fresh``)
    shipped_guard = BackendGuard(shipped, timeout_s=TIMEOUT_S)
    try:
        raw = fresh._store
        tenant = tenant_id("bench-lookup")
        hashes = [hashlib.sha256(f"{tenant}/{i}".encode()).digest() for i in range(chunks)]
        kb = KeyBuilder("bench-fp", RankPart(0))
        keys, _ = kb.lookup_keys_flat(tenant, [h.hex() for h in hashes])
        src = placed(64)
        for i in range(0, len(keys), 256):
            part = keys[i:i + 256]
            assert fresh.put(part, [[Region(src.ctypes.data, 64)]] * len(part), 10.0) == [Status.OK] * len(part)
        lookup = PoolLookup(guard, kb, TIMEOUT_S)
        assert lookup.prefix_hits(tenant, hashes) == chunks
        # (a lease far beyond the run; each timed lookup is a new request's first)
        pinning = PoolLookup(guard, kb, TIMEOUT_S, pin_lease_s=60.0)
        shipped_pinning = PoolLookup(shipped_guard, kb, TIMEOUT_S, pin_lease_s=60.0)
        assert pinning.pins is not None and shipped_pinning.pins is not None
        assert shipped.options.exists_cache_ttl_s > 0
        requests = iter(range(10**9))
        assert cached.exists(keys, TIMEOUT_S) == [Status.OK] * len(keys)
        # A scheduler's exists cache holds other prompts' keys too (up to 65536): the pin's
        # answers go into a dict of 32768 (inserting into an empty one is cheaper).
        others = [hashlib.sha256(f"other/{i}".encode()).digest() for i in range(OTHER_KEYS)]
        shipped._exists_cache.update(dict.fromkeys(kb.lookup_keys_flat(tenant, others)[0], time.monotonic()))

        def timed(fn: Callable[[], object]) -> Callable[[], float]:
            def run() -> float:
                out = []
                for _ in range(LOOKUP_CALLS):
                    t0 = time.perf_counter()
                    fn()
                    out.append(time.perf_counter() - t0)
                return statistics.median(out) * 1e6
            return run

        def first_pinned(pool_lookup: PoolLookup, forget: Callable[[], None] | None = None) -> Callable[[], float]:
            pins = pool_lookup.pins
            assert pins is not None

            def run() -> float:
                out = []
                for _ in range(LOOKUP_CALLS):
                    req = f"req-{next(requests)}"
                    if forget is not None:
                        forget()  # (untimed: a new prompt's keys are not cached)
                    t0 = time.perf_counter()
                    hits = pool_lookup.prefix_hits(tenant, hashes, req_id=req)
                    out.append(time.perf_counter() - t0)
                    assert hits == chunks and pins.holding(req)
                    pins.release(req)  # (outside the timing: the request's load ended)
                return statistics.median(out) * 1e6
            return run

        def waiting(pool_lookup: PoolLookup) -> Callable[[], float]:
            # One request looked up again and again, as vLLM asks each step while it
            # waits; pinned once before the timing (its lease far beyond the run).
            pins = pool_lookup.pins
            assert pins is not None
            req = f"req-{next(requests)}"
            assert pool_lookup.prefix_hits(tenant, hashes, req_id=req) == chunks

            def run() -> float:
                out = []
                for _ in range(LOOKUP_CALLS):
                    t0 = time.perf_counter()
                    hits = pool_lookup.prefix_hits(tenant, hashes, req_id=req)
                    out.append(time.perf_counter() - t0)
                    assert hits == chunks and pins.holding(req)
                return statistics.median(out) * 1e6
            return run

        cases = {
            "raw": timed(lambda: raw.batch_is_exist(keys)),
            "exists": timed(lambda: fresh.exists(keys, TIMEOUT_S)),
            "exists/cached": timed(lambda: cached.exists(keys, TIMEOUT_S)),
            "lookup": timed(lambda: lookup.prefix_hits(tenant, hashes)),
            "lookup/pinned": first_pinned(pinning),
            "lookup/pinned/cache": first_pinned(shipped_pinning, lambda: shipped._forget(keys)),
            "lookup/waiting": waiting(PoolLookup(shipped_guard, kb, TIMEOUT_S, pin_lease_s=60.0)),
        }
        s = interleave(cases, rounds, warmup=1)
        raw.batch_remove(keys, True)
    finally:
        guard.close()
        shipped_guard.close()
        cached.close()
    return {"chunks": chunks, "keys": len(keys), "us": {k: stat(v).as_dict() for k, v in s.items()},
            "ratio": {k: ratios(s[k], s["raw"]).as_dict() for k in ("exists", "exists/cached", "lookup",
                                                                         "lookup/pinned", "lookup/pinned/cache",
                                                                         "lookup/waiting")}}


def _fmt(d: dict, digits: int = 2) -> str:
    return Stat(d["median"], d["min"], d["max"], d["n"]).fmt(digits)


@app.command()
def main(
    rounds: int = typer.Option(11, min=1, max=50, help="interleaved rounds per size"),
    batch: int = typer.Option(BATCH, min=1, max=1024, help="objects per call (512 x 64 KiB: a synchronous load's "
                               "step-sized call, where the hand-off is a small share)"),
    pin_cpu: int | None = typer.Option(None, "--pin-cpu", min=0, help="pin the calling thread, and with it the "
                                       "guard's workers, to this CPU (the client's own threads keep the process's "
                                       "CPUs): shows what a hand-off's wake-ups cost when they cross CPUs"),
    user_offset: int = typer.Option(0, "--user-offset", help="the caller's buffers start this many bytes past a "
                                    "page (0: as vLLM's KV; 16: where numpy puts a large array)"),
    lookup_chunks: int = typer.Option(1024, "--lookup-chunks", min=0, max=1 << 16,
                                      help="chunks of the prompt the lookup part asks about (0: no lookup part)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    if not 0 <= user_offset < 4096:
        raise typer.BadParameter(f"--user-offset must be in 0..4095, not {user_offset}", param_hint="--user-offset")
    if pin_cpu is not None and pin_cpu not in os.sched_getaffinity(0):
        raise typer.BadParameter(f"CPU {pin_cpu} is not among this process's CPUs "
                                 f"{sorted(os.sched_getaffinity(0))}", param_hint="--pin-cpu")
    ensure_private_netns()
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    env0 = env_info()
    master, address = start_master()
    try:
        # (2 MiB objects only up to 64 MiB per call, as the engine batches them)
        sizes = [64 * KiB] + ([2 * MiB] if batch * 2 * MiB <= 64 * MiB else [])
        results = {size: _measure(size, rounds, address, batch, pin_cpu, user_offset) for size in sizes}
        lookup = _measure_lookup(lookup_chunks, rounds, address) if lookup_chunks else None
    finally:
        master.kill()
        master.wait()
    if as_json:
        print(json.dumps({"sizes": {str(k): v for k, v in results.items()}, "lookup": lookup, "rounds": rounds,
                          "batch": batch,
                          "pin_cpu": pin_cpu, "user_offset": user_offset,
                          "env_before": env0, "env_after": env_info()}, indent=2))
        return
    table = Table(title=f"MooncakeBackend vs raw Mooncake client (batch {batch}, single process, deadline "
                  f"{TIMEOUT_S:g} s); GB/s median \\[min..max] ±half-spread over {rounds} interleaved rounds; "
                  "ratios per round; gets as the engine's load thread makes them (watched); 'thread': every "
                  "native call handed to a worker thread (gets from vLLM's forward thread)")
    for col in ("object", "op", "raw GB/s", "ours GB/s", "ours ÷ raw", "thread ÷ raw", "inline calls"):
        table.add_column(col, justify="right")
    for size, r in results.items():
        g = r["gbps"]
        for op in ("put", "get"):
            table.add_row(
                f"{size // KiB} KiB" if size < MiB else f"{size // MiB} MiB", op,
                _fmt(g[f"{op}_raw"]), _fmt(g[f"{op}_ours"]), _fmt(r["ratio"][op]), _fmt(r["ratio_thread"][op]),
                str(r["inline_calls"]) if op == "put" else "(puts + gets)",
            )
    con = Console(width=160)
    con.print(table)
    if lookup is not None:
        us, r = lookup["us"], lookup["ratio"]
        con.print(f"lookup of a prompt of {lookup['chunks']} stored chunks ({lookup['keys']} keys), us median "
                  f"\\[min..max] over {rounds} interleaved rounds: raw batch_is_exist {_fmt(us['raw'], 0)}; ours ÷ raw: "
                  f"exists {_fmt(r['exists'])}, exists all cached {_fmt(r['exists/cached'])}, "
                  f"PoolLookup from raw hashes {_fmt(r['lookup'])}, a request's first lookup with pins on "
                  f"{_fmt(r['lookup/pinned'])}, and with the exists cache on as shipped "
                  f"{_fmt(r['lookup/pinned/cache'])}; a waiting request's next lookup as shipped "
                  f"{_fmt(r['lookup/waiting'], 3)}")
    con.print(env_line(env0, env_info()))


if __name__ == "__main__":
    app()
