"""Lookup latency as prompts grow from 4k to 128k tokens, against the raw exists.

The scheduler asks "how much of this prompt is in the pool?" once per waiting
request per step. Three parts, every configuration of a row interleaved round by
round (bench/harness.py), a warm-up round outside the timing, each sample the
median of ``--calls`` calls, ratios per round:

1. ``PoolLookup.prefix_hits`` for prompts of 4k..128k tokens, scenarios ``hit``
   (all present), ``half`` (first half present), ``miss`` (none), against the
   baseline: the raw backend's batched ``exists`` of the same keys, prebuilt.
   Paths: ``scan`` (the backend's native prefix scan, hex hashes), ``scan/bytes``
   (raw hashes, as the scheduler passes them), ``exists`` (the generic path:
   key strings + one batched exists + first miss in Python). This part runs in
   ``--procs`` fresh processes one after the other (so does part 2) and each
   figure is the median over processes. Every round is also probed for the
   host's level (a pure-Python loop timed before and after it): on a shared VM
   the core alternates, within tens of milliseconds, between a fast level and
   one where Python runs 1.6-1.9x slower and the raw exists ~1.3x, so a ratio
   over all rounds moves with the share of slow rounds. Each ratio is also
   reported per level (``ratio_by_level``: rounds of either level pooled over
   the processes, mixed rounds left out), and ``harness.py agree`` compares
   those (see docs/benchmarking.md).
2. The connector's whole ``get_num_new_matched_tokens`` for a real vLLM
   ``Request`` of 128k tokens (16-token blocks, 128-token chunks: the hash chain
   of 8192 blocks), through vLLM's scheduler-side connector, against the raw
   exists of the prompt's 1024 keys; a request's first lookup (scan + pin), and
   the backend's native pinning scan inside it timed alone (``first_native``),
   so what the Python around that call costs on a host shows beside it.
3. Linear scan vs galloping search under eviction holes (``--holes``): a
   prompt whose chunks are all stored, then a fraction removed at random; per
   hole rate: probes, time, how often galloping overcounts the run and by how
   many chunks (those loads fail and are recomputed).
4. A crowded pool (``--crowd N``, local backend): the longest prompt's chunks
   (128k tokens: 1024) stored in random order among N other objects, as in a
   pool many prompts share, so its entries and buckets lie scattered over
   tables larger than the caches; the scan (``prefix_hits``) and the raw
   exists of its keys, each called warm (back to back) and cold (after writing
   ``--evict-mib`` of other memory, which evicts them from the caches: a
   scheduler step between two lookups does much the same), and the backend's
   native scan inside the lookup timed alone (``native``, warm and cold), so
   what the Python around it costs, warm and cold, shows beside it; all six
   interleaved round by round. Parts 1 and 2 store only the prompt's chunks,
   one after the other: their entries sit side by side, which flatters a
   lookup. Like parts 1 and 2 this part runs in each of the ``--procs``
   processes, and each figure is the median over processes: where the tables
   land in memory differs from one process to the next. Its rounds are probed
   for the host's level and split by it too (``ratio_by_level``).

    .venv/bin/python bench/bench_lookup.py [--json out.json] [--quick]
    .venv/bin/python bench/bench_lookup.py --layers 32     # layerwise keys: 32 objects per chunk
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import uuid
from collections.abc import Callable

import numpy as np
from harness import (
    LEVEL_CUT,
    LEVEL_HI,
    LEVEL_LO,
    Stat,
    across_processes,
    clock_ns,
    env_info,
    env_line,
    interleave,
    per_call_us,
    ratios,
    split_by_level,
    stat,
)
from rich.console import Console
from rich.table import Table

from ascendstore.contract import BackendContext, Region, Status
from ascendstore.engine import BackendGuard, KeyBuilder, PoolLookup
from ascendstore.keys import RankPart, tenant_id
from ascendstore.registry import create_backend

PROMPTS = [4096, 16384, 65536, 131072]


def chunk_hashes(n: int, salt: str) -> list[bytes]:
    # Chained like vLLM's: each hash covers its prefix. Content does not matter here.
    out, h = [], hashlib.sha256(salt.encode()).digest()
    for i in range(n):
        h = hashlib.sha256(h + i.to_bytes(8, "little")).digest()
        out.append(h)
    return out


def _fmt(s: dict | Stat, digits: int = 0) -> str:
    if isinstance(s, dict):
        s = Stat(s["median"], s["min"], s["max"], s["n"])
    return s.fmt(digits)


def _rounds(lv: dict) -> str:
    n = lv["rounds"]
    return f"{n['fast']}/{n['slow']}/{n['mixed']}"


def _level_fmt(lv: dict, level: str, figure: str) -> str:
    return _fmt(lv[level][figure], 2) if level in lv else "-"


def _put_all(backend, keys: list[str], region) -> None:  # type: ignore[no-untyped-def]
    for i in range(0, len(keys), 512):
        batch = keys[i : i + 512]
        st = backend.put(batch, [region] * len(batch), 5.0)
        if any(s is not Status.OK for s in st):
            raise SystemExit(f"setup put failed: {next(s for s in st if s is not Status.OK).name}")


def part_prompts(args, backend, guard, keys: KeyBuilder, region) -> list[dict]:  # type: ignore[no-untyped-def]
    tenant = tenant_id(f"bench-{uuid.uuid4().hex}")
    scan = PoolLookup(guard, keys, 5.0)
    generic = PoolLookup(guard, keys, 5.0)
    generic._scan = None  # the path of backends without a native scan
    prompts = [p for p in PROMPTS if p <= args.max_tokens]
    allh = chunk_hashes(prompts[-1] // args.block_size, tenant)
    _put_all(backend, keys.lookup_keys_flat(tenant, [h.hex() for h in allh])[0], region)
    rows = []
    for tokens in prompts:
        n = tokens // args.block_size
        for scenario in ("hit", "half", "miss"):
            if scenario == "hit":
                t, hs = tenant, allh[:n]
            elif scenario == "miss":
                t, hs = tenant_id(f"miss-{tokens}"), allh[:n]
            else:  # the first half present, the rest unknown
                t, hs = tenant, allh[: n // 2] + chunk_hashes(n - n // 2, f"other-{tokens}")
            hexes = [h.hex() for h in hs]
            qkeys = keys.lookup_keys_flat(t, hexes)[0]
            expect = {"hit": n, "half": n // 2, "miss": 0}[scenario]
            for lk, q in ((scan, hexes), (scan, hs), (generic, hexes)):
                got = lk.prefix_hits(t, q)
                assert got == expect, f"{scenario}: prefix_hits={got}, expected {expect}"
            cases: dict[str, Callable[[], float]] = {
                "raw": lambda qk=qkeys: per_call_us(lambda: backend.exists(qk, 5.0), args.calls),
                "scan": lambda t=t, q=hexes: per_call_us(lambda: scan.prefix_hits(t, q), args.calls),
                "scan/bytes": lambda t=t, q=hs: per_call_us(lambda: scan.prefix_hits(t, q), args.calls),
                "exists": lambda t=t, q=hexes: per_call_us(lambda: generic.prefix_hits(t, q), args.calls),
            }
            s = interleave(cases, args.rounds, level=True)
            rows.append(
                {
                    "tokens": tokens,
                    "chunks": n,
                    "keys": len(qkeys),
                    "scenario": scenario,
                    "us": {k: stat(v).as_dict() for k, v in s.items()},
                    "ratio": {k: ratios(s[k], s["raw"]).as_dict() for k in ("scan", "scan/bytes", "exists")},
                    "per_round": _per_round(s, {k: (k, "raw") for k in ("scan", "scan/bytes", "exists")}),
                }
            )
    backend.remove_prefix(f"as1@{tenant}@", 10.0)
    return rows


def part_crowded(args, keys: KeyBuilder, region) -> dict:  # type: ignore[no-untyped-def]
    """The longest prompt's chunks among ``args.crowd`` other objects, warm and cold (part 4)."""
    tokens = max(p for p in PROMPTS if p <= args.max_tokens)
    chunks = tokens // args.block_size
    tenant = tenant_id(f"crowd-{uuid.uuid4().hex}")
    hs = chunk_hashes(chunks, tenant)
    qkeys = keys.lookup_keys_flat(tenant, [h.hex() for h in hs])[0]
    page = 4096  # one 4 KiB page per 64-byte object
    ctx = BackendContext(role="scheduler", instance_id=f"bench-crowd-{uuid.uuid4().hex[:8]}", timeout_s=5.0)
    # (a pool of its own: the parent's stays open while children run this)
    backend = create_backend("local", {"name": f"bench-crowd-{uuid.uuid4().hex[:8]}", "page_size": page,
                                       "capacity": (args.crowd + len(qkeys) + 1024) * page}, ctx)
    guard = BackendGuard(backend, timeout_s=5.0)  # (closing it removes the pool)
    try:
        others = [f"crowd-{i}-{uuid.uuid4().hex}" for i in range(args.crowd)]
        order = qkeys + others
        random.Random(0).shuffle(order)  # the prompt's entries scattered among the others'
        _put_all(backend, order, region)
        del order, others
        scan = PoolLookup(guard, keys, 5.0)
        assert scan.prefix_hits(tenant, hs) == chunks
        evict = np.zeros(args.evict_mib << 20, dtype=np.uint8)

        def timed(fn: Callable[[], object], cold: bool) -> float:
            out = []
            for _ in range(args.calls):
                if cold:
                    evict[::64] += 1  # a write to every line: theirs leave the caches
                t0 = clock_ns()
                fn()
                out.append((clock_ns() - t0) / 1e3)
            return statistics.median(out)

        def raw() -> object:
            return backend.exists(qkeys, 5.0)

        def lookup() -> object:
            return scan.prefix_hits(tenant, hs)

        native_scan, prefixes = scan._scan, scan._tenant_prefixes(tenant)
        assert native_scan is not None

        def native() -> object:  # the lookup's one backend call, with its arguments
            return native_scan(prefixes, hs, 5.0, gallop=False)

        cases: dict[str, Callable[[], float]] = {
            "raw": lambda: timed(raw, False), "scan": lambda: timed(lookup, False),
            "raw cold": lambda: timed(raw, True), "scan cold": lambda: timed(lookup, True),
            "native": lambda: timed(native, False), "native cold": lambda: timed(native, True),
        }
        # Rounds probed for the host's level, as parts 1 and 2: a run spent at the slow
        # level read the warm ratio 0.89 against 0.76 at the fast one (Zen 5, 2026-12-07).
        s = interleave(cases, args.rounds, level=True)
        figures = {"ratio": ("scan", "raw"), "ratio_cold": ("scan cold", "raw cold"),
                   "ratio_native": ("native", "raw"), "ratio_native_cold": ("native cold", "raw cold")}
        return {
            "tokens": tokens, "keys": len(qkeys), "crowd": args.crowd, "evict_mib": args.evict_mib,
            "us": {k: stat(v).as_dict() for k, v in s.items()},
            **{name: ratios(s[num], s[den]).as_dict() for name, (num, den) in figures.items()},
            "per_round": _per_round(s, figures),
        }
    finally:
        guard.close()


def _per_round(s: dict[str, list[float]], figures: dict[str, tuple[str, str]]) -> dict[str, list[float]]:
    """Each round's ratios (figure: (numerator case, baseline case)) and host-level probes."""
    out = {f: [a / b for a, b in zip(s[num], s[den], strict=True)] for f, (num, den) in figures.items()}
    return {**out, LEVEL_LO: s[LEVEL_LO], LEVEL_HI: s[LEVEL_HI]}


def _by_level(results: list[dict]) -> dict:
    """The per-round ratios of one row from every process, split by host level."""
    figures = [k for k in results[0]["per_round"] if k not in (LEVEL_LO, LEVEL_HI)]
    return split_by_level([r["per_round"] for r in results], figures)


def _across(runs: list[dict], fixed: tuple[str, ...]) -> dict:
    """One result from several processes: ``fixed`` fields from the first; every
    ``{"median": ...}`` figure under "us"/"ratio*" as the median over processes
    (min..max across them), keeping every process's median and the median spread
    within a process."""
    first = runs[0]
    out = {k: first[k] for k in fixed}
    for section in [k for k in first if k == "us" or k.startswith("ratio")]:
        if "median" in first[section]:  # a single figure
            out[section] = across_processes([r[section] for r in runs])
        else:
            out[section] = {name: across_processes([r[section][name] for r in runs]) for name in first[section]}
    return out


def _in_processes(args) -> tuple[list[dict], dict | None, dict | None]:
    """The prompt rows, the scheduler part and the crowded pool in ``args.procs`` fresh
    interpreters."""
    argv = list(sys.argv[1:])
    if "--json" in argv:  # the children print to stdout
        i = argv.index("--json")
        del argv[i : i + 2]
    argv = [a for a in argv if not a.startswith("--json=")]
    runs = []
    for _ in range(args.procs):
        out = subprocess.run([sys.executable, __file__, *argv, "--child"], capture_output=True, text=True,
                             check=False)
        if out.returncode:
            raise SystemExit(f"bench_lookup child failed ({out.returncode}):\n{out.stderr}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for i in range(len(runs[0]["rows"])):
        row = _across([r["rows"][i] for r in runs], ("tokens", "chunks", "keys", "scenario"))
        row["ratio_by_level"] = _by_level([r["rows"][i] for r in runs])
        rows.append(row)
    sched = None
    if runs[0]["scheduler"] is not None:
        sched = _across([r["scheduler"] for r in runs], ("tokens", "blocks", "keys", "pins"))
        sched["ratio_by_level"] = _by_level([r["scheduler"] for r in runs])
    crowded = None
    if runs[0]["crowded"] is not None:
        crowded = _across([r["crowded"] for r in runs], ("tokens", "keys", "crowd", "evict_mib"))
        crowded["ratio_by_level"] = _by_level([r["crowded"] for r in runs])
    return rows, sched, crowded


def part_scheduler(args) -> dict:  # type: ignore[no-untyped-def]
    """get_num_new_matched_tokens of a real 128k-token vLLM Request."""
    from ascendstore_vllm.testing import EngineHarness, EngineSpec
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    tokens = min(131072, args.max_tokens)
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # the tiny local model says 4096 positions
    extra = {
        "backend": "local",
        "backend_config": {"name": "bench-" + uuid.uuid4().hex[:8], "capacity": "64MiB", "page_size": "4KiB"},
        "chunk_size": 128,
    }
    spec = EngineSpec(extra_config=extra, num_layers=1, num_heads=1, num_kv_heads=1, head_size=8, block_size=16,
                      num_blocks=tokens // 16 + 64, max_model_len=tokens + 256, max_num_batched_tokens=8192)
    eng = EngineHarness(spec, check_reads=False)
    try:
        conn = eng.connector
        sched = conn.scheduler
        rng = random.Random(0)
        req = Request("bench", [rng.randrange(3, 30000) for _ in range(tokens)], SamplingParams(max_tokens=1),
                      None, block_hasher=eng.block_hasher)
        bpc = sched.ctx.blocks_per_chunk
        hexes = [bytes(h).hex() for h in req.block_hashes[bpc - 1 :: bpc]]
        tenant = sched.ctx.tenant(req.cache_salt)
        flat = sched.ctx.key_builder().lookup_keys_flat(tenant, hexes)[0]
        backend = sched._guard.backend
        payload = np.zeros(64, dtype=np.uint8)
        _put_all(backend, flat, [Region(payload.ctypes.data, 64)])
        got, _ = conn.get_num_new_matched_tokens(req, 0)
        assert got == tokens - 1, got  # every chunk hit; vLLM computes the last token
        pins = sched._lookup.pins

        def first_lookup() -> float:
            # A request's first lookup, which also pins what it counts (pins are on by
            # default): its earlier holding, and the chunk hashes the scheduler keeps
            # while a request waits, are let go first, untimed.
            out = []
            for _ in range(args.calls):
                if pins is not None:
                    pins.release(req.request_id)
                sched._chunk_hashes.pop(req.request_id, None)
                t0 = clock_ns()
                conn.get_num_new_matched_tokens(req, 0)
                out.append((clock_ns() - t0) / 1e3)
            return statistics.median(out)

        lookup = sched._lookup
        scan, raw_hashes = lookup._scan, req.block_hashes[bpc - 1 :: bpc]
        prefixes = lookup._tenant_prefixes(tenant)
        lease = {"lease_s": pins.lease_s} if pins is not None else {}

        def first_native() -> float:
            # The native call inside a first lookup alone: the backend's pinning scan of
            # the same raw chunk hashes, its pins let go untimed after each. What the first
            # lookup costs beyond it is the Python around it (connector, ledger, metrics),
            # which runs at the host's Python speed, with the caches the scan left.
            out = []
            for _ in range(args.calls):
                if pins is not None:
                    pins.release(req.request_id)
                t0 = clock_ns()
                scan(prefixes, raw_hashes, 5.0, gallop=False, **lease)
                out.append((clock_ns() - t0) / 1e3)
                if lease:
                    lookup._unpin_chunks(tenant, raw_hashes)
            return statistics.median(out)

        cases = {
            "raw": lambda: per_call_us(lambda: backend.exists(flat, 5.0), args.calls),
            # later lookups of a waiting request: its pinned run held whole, only what follows it probed
            "matched_tokens": lambda: per_call_us(lambda: conn.get_num_new_matched_tokens(req, 0), args.calls),
            "first_lookup": first_lookup,
        }
        if scan is not None:
            cases["first_native"] = first_native
        s = interleave(cases, args.rounds, level=True)
        if pins is not None:
            pins.release(req.request_id)
        figures = {"ratio": ("matched_tokens", "raw"), "ratio_first": ("first_lookup", "raw")}
        if scan is not None:
            figures["ratio_first_native"] = ("first_native", "raw")
        return {
            "tokens": tokens,
            "blocks": len(req.block_hashes),
            "keys": len(flat),
            "pins": pins is not None,
            "us": {k: stat(v).as_dict() for k, v in s.items()},
            **{name: ratios(s[num], s[den]).as_dict() for name, (num, den) in figures.items()},
            "per_round": _per_round(s, figures),
        }
    finally:
        eng.close()


def part_holes(args, backend, guard, keys: KeyBuilder, region) -> list[dict]:  # type: ignore[no-untyped-def]
    """Linear scan vs galloping search when eviction left holes in a stored prefix."""
    n = min(131072, args.max_tokens) // args.block_size
    linear = PoolLookup(guard, keys, 5.0, probe="linear")
    gallop = PoolLookup(guard, keys, 5.0, probe="gallop")
    rows = []
    rng = random.Random(1)
    for rate in args.holes:
        trials = []
        for trial in range(args.hole_trials):
            tenant = tenant_id(f"holes-{rate}-{trial}-{uuid.uuid4().hex[:6]}")
            hs = chunk_hashes(n, tenant)
            hexes = [h.hex() for h in hs]
            flat = keys.lookup_keys_flat(tenant, hexes)[0]
            _put_all(backend, flat, region)
            holes = [i for i in range(n) if rng.random() < rate]
            width = len(flat) // n
            backend.remove([k for i in holes for k in flat[i * width : (i + 1) * width]], 5.0)
            exact = linear.prefix_hits(tenant, hs)
            assert exact == (holes[0] if holes else n)
            m0 = guard.metrics.totals()["lookup_keys"]
            lin = linear.prefix_hits(tenant, hs)
            m1 = guard.metrics.totals()["lookup_keys"]
            gal = gallop.prefix_hits(tenant, hs)
            m2 = guard.metrics.totals()["lookup_keys"]
            s = interleave(
                {
                    "linear": lambda t=tenant, q=hs: per_call_us(lambda: linear.prefix_hits(t, q), args.calls),
                    "gallop": lambda t=tenant, q=hs: per_call_us(lambda: gallop.prefix_hits(t, q), args.calls),
                },
                max(3, args.rounds // 2),
            )
            trials.append(
                {
                    "exact": exact,
                    "gallop": gal,
                    "linear_probes": (m1 - m0) / width,
                    "gallop_probes": (m2 - m1) / width,
                    "linear_us": stat(s["linear"]).median,
                    "gallop_us": stat(s["gallop"]).median,
                }
            )
            assert lin == exact
            backend.remove_prefix(f"as1@{tenant}@", 10.0)
        over = [t for t in trials if t["gallop"] > t["exact"]]
        rows.append(
            {
                "hole_rate": rate,
                "trials": len(trials),
                "exact_chunks": stat(t["exact"] for t in trials).as_dict(),
                "linear_probes": stat(t["linear_probes"] for t in trials).as_dict(),
                "gallop_probes": stat(t["gallop_probes"] for t in trials).as_dict(),
                "linear_us": stat(t["linear_us"] for t in trials).as_dict(),
                "gallop_us": stat(t["gallop_us"] for t in trials).as_dict(),
                "gallop_overcounts": len(over),
                "overcount_chunks": stat([t["gallop"] - t["exact"] for t in over] or [0]).as_dict(),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="local")
    ap.add_argument("--backend-config", default="{}", help="backend options as JSON")
    ap.add_argument("--block-size", type=int, default=128, help="tokens per pool chunk (vllm-ascend: 128)")
    ap.add_argument("--layers", type=int, default=0, help="layerwise: objects per chunk (0: one object per chunk)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    ap.add_argument("--calls", type=int, default=15, help="calls per sample (its median)")
    ap.add_argument("--max-tokens", type=int, default=PROMPTS[-1])
    ap.add_argument("--holes", type=float, nargs="*", default=[0.0, 0.001, 0.01, 0.05])
    ap.add_argument("--hole-trials", type=int, default=8)
    ap.add_argument("--crowd", type=int, default=200_000,
                    help="part 4: other objects beside the longest prompt's chunks (local backend; 0: skip the part)")
    ap.add_argument("--evict-mib", type=int, default=64, help="part 4: memory written before each cold call")
    ap.add_argument("--procs", type=int, default=0, help="fresh processes for parts 1, 2 and 4 (0: 9, --quick: 1)")
    ap.add_argument("--quick", action="store_true", help="fewer rounds and calls")
    ap.add_argument("--json", help="also write the results as JSON here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.calls, args.hole_trials = 3, 7, 4
    args.procs = args.procs or (1 if args.quick else 9)

    env0 = env_info()
    ctx = BackendContext(role="scheduler", instance_id=f"bench-lookup-{uuid.uuid4().hex[:8]}", timeout_s=5.0)
    cfg = json.loads(args.backend_config)
    if args.backend == "local":
        # (a pool name of its own, as every bench's: never the default name an engine's pool may have)
        cfg = {"name": f"bench-lookup-{uuid.uuid4().hex[:8]}", "capacity": "64MiB", "page_size": "4KiB", **cfg}
    backend = create_backend(args.backend, cfg, ctx)
    guard = BackendGuard(backend, timeout_s=5.0)
    keys = KeyBuilder(fingerprint="0" * 16, rank=RankPart(), layerwise=args.layers > 0, num_layers=max(1, args.layers))
    payload = np.zeros(64, dtype=np.uint8)
    region = [Region(payload.ctypes.data, payload.nbytes)]
    native = hasattr(backend, "prefix_run")
    with_sched = args.backend == "local" and not args.layers
    crowded = None
    try:
        if args.child or args.procs <= 1:
            rows = part_prompts(args, backend, guard, keys, region)
        else:
            rows, sched, crowded = _in_processes(args)
        holes = part_holes(args, backend, guard, keys, region) if native and not args.child else []
    finally:
        guard.close()
    if args.child or args.procs <= 1:
        # (a crowded pool's figures follow where its tables landed in memory, which
        # changes from one process to the next: one process's 7 rounds moved 10–24%
        # between two runs on a Zen 3 host, so, like parts 1 and 2, a median over processes)
        if args.crowd > 0 and args.backend == "local":
            crowded = part_crowded(args, keys, region)
        sched = part_scheduler(args) if with_sched else None
    if args.child:
        print(json.dumps({"rows": rows, "scheduler": sched, "crowded": crowded}))
        return
    for r in [*rows, *([sched] if sched else []), *([crowded] if crowded else [])]:
        if "per_round" in r:  # one process: its own rounds, split by level as the processes' are
            r["ratio_by_level"] = _by_level([r])
            del r["per_round"]
    out = {"rows": rows, "scheduler": sched, "holes": holes, "crowded": crowded, "env_before": env0,
           "env_after": env_info(),
           "rounds": args.rounds, "calls": args.calls}

    con = Console(width=max(170, Console().width))
    table = Table(
        title=f"lookup vs raw exists ({args.backend}, {args.block_size}-token chunks"
        + (f", {args.layers} layers" if args.layers else "")
        + f"; us, median (min..max) over {args.procs} processes x {args.rounds} interleaved rounds; ratio per round)"
    )
    for col in ("tokens", "keys", "scenario", "raw exists us", "scan us", "scan ÷ raw", "scan/bytes ÷ raw",
                "exists path us", "exists path ÷ raw"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['tokens']:,}", str(r["keys"]), r["scenario"], _fmt(r["us"]["raw"]), _fmt(r["us"]["scan"]),
                      _fmt(r["ratio"]["scan"], 2), _fmt(r["ratio"]["scan/bytes"], 2), _fmt(r["us"]["exists"]),
                      _fmt(r["ratio"]["exists"], 2))
    con.print(table)
    levels = Table(title="the same ratios per host level (rounds probed by a pure-Python loop before and after: "
                   f"fast within {LEVEL_CUT}x of the run's fast level, slow beyond it; rounds fast/slow/mixed)")
    for col in ("tokens", "scenario", "rounds f/s/m", "scan ÷ raw fast", "slow", "scan/bytes ÷ raw fast", "slow",
                "exists path ÷ raw fast", "slow"):
        levels.add_column(col, justify="right")
    for r in rows:
        lv = r["ratio_by_level"]
        levels.add_row(f"{r['tokens']:,}", r["scenario"], _rounds(lv),
                       *(_level_fmt(lv, level, k) for k in ("scan", "scan/bytes", "exists") for level in ("fast", "slow")))
    con.print(levels)
    if sched:
        con.print(
            f"get_num_new_matched_tokens, {sched['tokens']:,}-token vLLM Request ({sched['blocks']} block hashes, "
            f"{sched['keys']} keys), pins {'on' if sched['pins'] else 'off'}: raw exists of its keys "
            f"{_fmt(sched['us']['raw'])} us; a waiting request's lookup {_fmt(sched['us']['matched_tokens'])} us, "
            f"ratio {_fmt(sched['ratio'], 2)} (goal <= 1.2); its first lookup (scan + pin) "
            f"{_fmt(sched['us']['first_lookup'])} us, ratio {_fmt(sched['ratio_first'], 2)}"
        )
        if "ratio_first_native" in sched:
            con.print(f"  of which the backend's native pinning scan {_fmt(sched['us']['first_native'])} us, "
                      f"ratio {_fmt(sched['ratio_first_native'], 2)}: the rest is the Python around it")
        lv = sched["ratio_by_level"]
        con.print(f"  per host level (rounds f/s/m {_rounds(lv)}): a waiting request's lookup ÷ raw fast "
                  f"{_level_fmt(lv, 'fast', 'ratio')}, slow {_level_fmt(lv, 'slow', 'ratio')}; its first lookup ÷ raw "
                  f"fast {_level_fmt(lv, 'fast', 'ratio_first')}, slow {_level_fmt(lv, 'slow', 'ratio_first')}")
    if holes:
        t = Table(title="linear scan vs galloping search, prompt stored then a fraction of chunks removed at random")
        for col in ("hole rate", "trials", "true run (chunks)", "linear probes", "gallop probes", "linear us",
                    "gallop us", "gallop overcounts", "overcount (chunks)"):
            t.add_column(col, justify="right")
        for h in holes:
            t.add_row(f"{h['hole_rate']:.3f}", str(h["trials"]), _fmt(h["exact_chunks"]), _fmt(h["linear_probes"]),
                      _fmt(h["gallop_probes"]), _fmt(h["linear_us"]), _fmt(h["gallop_us"]),
                      f"{h['gallop_overcounts']}/{h['trials']}", _fmt(h["overcount_chunks"]))
        con.print(t)
    if crowded:
        us = crowded["us"]
        con.print(
            f"a crowded pool: the {crowded['tokens']:,}-token prompt's {crowded['keys']} keys among {crowded['crowd']:,} "
            f"other objects; warm: raw exists {_fmt(us['raw'])} us, lookup {_fmt(us['scan'])} us, ratio "
            f"{_fmt(crowded['ratio'], 2)}; cold (after writing {crowded['evict_mib']} MiB): raw exists "
            f"{_fmt(us['raw cold'])} us, lookup {_fmt(us['scan cold'])} us, ratio {_fmt(crowded['ratio_cold'], 2)}"
        )
        con.print(
            f"  of which the backend's native scan: warm {_fmt(us['native'])} us, ratio "
            f"{_fmt(crowded['ratio_native'], 2)}; cold {_fmt(us['native cold'])} us, ratio "
            f"{_fmt(crowded['ratio_native_cold'], 2)}: the rest is the Python around it"
        )
        lv = crowded["ratio_by_level"]
        con.print(f"  per host level (rounds f/s/m {_rounds(lv)}): lookup ÷ raw warm fast {_level_fmt(lv, 'fast', 'ratio')}, "
                  f"slow {_level_fmt(lv, 'slow', 'ratio')}; cold fast {_level_fmt(lv, 'fast', 'ratio_cold')}, "
                  f"slow {_level_fmt(lv, 'slow', 'ratio_cold')}")
    con.print(env_line(env0, out["env_after"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
