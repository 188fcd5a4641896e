"""Lookup latency as prompts grow from 4k to 128k tokens.

The scheduler asks "how much of this prompt is in the pool?" once per request,
with one batched existence query (``PoolLookup.prefix_hits``). This benchmark
times that call for prompts of 4k..128k tokens against the baseline measured in
the same run: the raw backend's batched ``exists`` for the same keys (no key
building, no deadline guard). It prints percentiles and the ratio lookup/raw.

Scenarios: ``hit`` (every chunk present: the whole prompt is queried and
found), ``miss`` (nothing present), ``half`` (the first half present).

    .venv/bin/python bench/bench_lookup.py                 # local backend
    .venv/bin/python bench/bench_lookup.py --layers 32     # layerwise keys: 32 objects per chunk
    .venv/bin/python bench/bench_lookup.py --backend mooncake --backend-config '{...}'
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
import uuid

import numpy as np
from rich.console import Console
from rich.table import Table

from ascendstore.contract import BackendContext, Region, Status
from ascendstore.engine import BackendGuard, KeyBuilder, PoolLookup
from ascendstore.keys import RankPart, tenant_id
from ascendstore.registry import create_backend

PROMPTS = [4096, 8192, 16384, 32768, 65536, 131072]


def chunk_hashes(n: int, salt: str) -> list[str]:
    # Chained like vLLM's: each hash covers its prefix. Content does not matter here.
    out, h = [], hashlib.sha256(salt.encode()).digest()
    for i in range(n):
        h = hashlib.sha256(h + i.to_bytes(8, "little")).digest()
        out.append(h.hex())
    return out


def timed(fn, repeat: int) -> list[float]:  # type: ignore[no-untyped-def]
    fn()  # warm up
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="local")
    ap.add_argument("--backend-config", default="{}", help="backend options as JSON")
    ap.add_argument("--block-size", type=int, default=128, help="tokens per pool chunk (vllm-ascend: 128)")
    ap.add_argument(
        "--layers", type=int, default=0, help="layerwise: objects per chunk (0: one object per chunk)"
    )
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=PROMPTS[-1])
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args()

    ctx = BackendContext(role="scheduler", instance_id=f"bench-lookup-{uuid.uuid4().hex[:8]}", timeout_s=5.0)
    backend = create_backend(args.backend, json.loads(args.backend_config), ctx)
    guard = BackendGuard(backend, timeout_s=5.0)
    keys = KeyBuilder(
        fingerprint="0" * 16, rank=RankPart(), layerwise=args.layers > 0, num_layers=max(1, args.layers)
    )
    lookup = PoolLookup(guard, keys, timeout_s=5.0)
    tenant = tenant_id(f"bench-{uuid.uuid4().hex}")
    payload = np.zeros(64, dtype=np.uint8)
    region = [Region(payload.ctypes.data, payload.nbytes)]

    prompts = [p for p in PROMPTS if p <= args.max_tokens]
    all_hashes = chunk_hashes(prompts[-1] // args.block_size, tenant)
    stored = 0
    rows = []
    try:
        for tokens in prompts:
            n = tokens // args.block_size
            hashes = all_hashes[:n]
            key_lists = [keys.lookup_keys(tenant, h) for h in hashes]
            flat = [k for ks in key_lists for k in ks]
            # Store what the "hit" scenario needs (grows with the prompt).
            want = [k for ks in key_lists[stored:] for k in ks]
            for i in range(0, len(want), 256):
                batch = want[i : i + 256]
                st = backend.put(batch, [region] * len(batch), 5.0)
                if any(s is not Status.OK for s in st):
                    raise SystemExit(
                        f"setup put failed: {Status(next(s for s in st if s is not Status.OK)).name}"
                    )
            stored = n
            missing_tenant = tenant_id(f"miss-{tokens}")
            for scenario in ("hit", "half", "miss"):
                if scenario == "hit":
                    t, hs = tenant, hashes
                elif scenario == "miss":
                    t, hs = missing_tenant, hashes
                else:  # the first half present, the rest unknown
                    t, hs = tenant, hashes[: n // 2] + chunk_hashes(n - n // 2, f"other-{tokens}")
                qkeys = [k for h in hs for k in keys.lookup_keys(t, h)]
                raw = timed(lambda qk=qkeys: backend.exists(qk, 5.0), args.repeat)
                got = lookup.prefix_hits(t, hs)
                expect = {"hit": n, "half": n // 2, "miss": 0}[scenario]
                assert got == expect, f"{scenario}: prefix_hits={got}, expected {expect}"
                look = timed(lambda t=t, hs=hs: lookup.prefix_hits(t, hs), args.repeat)
                build = timed(lambda t=t, hs=hs: keys.lookup_keys_flat(t, hs), args.repeat)
                rows.append(
                    dict(
                        tokens=tokens,
                        chunks=n,
                        keys=len(flat),
                        scenario=scenario,
                        raw_p50_us=pct(raw, 50),
                        raw_p99_us=pct(raw, 99),
                        lookup_p50_us=pct(look, 50),
                        lookup_p99_us=pct(look, 99),
                        keybuild_p50_us=pct(build, 50),
                        ratio=statistics.median(look) / max(1e-9, statistics.median(raw)),
                    )
                )
    finally:
        backend.remove_prefix(f"as1@{tenant}@", 10.0) if backend.capabilities.remove_by_prefix else None
        guard.close()

    table = Table(
        title=f"lookup latency vs prompt length ({args.backend}, {args.block_size}-token chunks"
        + (f", {args.layers} layers" if args.layers else "")
        + ")"
    )
    for col in (
        "prompt tokens",
        "chunks",
        "keys",
        "scenario",
        "raw exists p50/p99 us",
        "lookup p50/p99 us",
        "lookup / raw",
        "lookup ns/key",
        "of which key building",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['tokens']:,}",
            str(r["chunks"]),
            str(r["keys"]),
            r["scenario"],
            f"{r['raw_p50_us']:.0f} / {r['raw_p99_us']:.0f}",
            f"{r['lookup_p50_us']:.0f} / {r['lookup_p99_us']:.0f}",
            f"{r['ratio']:.2f}x",
            f"{1e3 * r['lookup_p50_us'] / max(1, r['keys']):.0f}",
            f"{100 * r['keybuild_p50_us'] / max(1e-9, r['lookup_p50_us']):.0f}%",
        )
    Console(width=max(160, Console().width)).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
