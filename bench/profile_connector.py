"""Where a connector step's time goes beyond the raw client's (bench_connector's rows).

One engine as in ``bench_connector.py`` (8 layers x 8 KV heads x 128, fp16,
16-token blocks, local pool), one step of ``--objects`` chunk objects, thread
CPU time, medians of ``--steps`` steps:

1. the connector step with the real pool, split into the backend call (the
   worker's backend wrapped) and the rest, beside the raw client's call;
2. the same step with a backend whose calls return at once (pure connector
   Python), hot and with every cache flushed first (a read of ``--flush-mib``:
   what each step's copy does to the next one), beside the raw call's
   Python-side cost the same way; and the cold cost of its pieces.

    .venv/bin/python bench/profile_connector.py [--objects 64] [--steps 40]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import typer
from ascendstore_vllm.metadata import AscendStoreMetadata, ChunkRef, LoadSpec, SaveSpec
from ascendstore_vllm.testing import EngineHarness, EngineSpec
from bench_connector import _backend_config, torch_rand_like
from harness import env_info

from ascendstore.contract import BackendContext, Status
from ascendstore.registry import create_backend

app = typer.Typer(add_completion=False)


def _med(fn: Callable[[], object], steps: int, before: Callable[[], object] | None = None) -> float:
    ts = []
    for _ in range(steps):
        if before is not None:
            before()
        t0 = time.thread_time()
        fn()
        ts.append(time.thread_time() - t0)
    return statistics.median(ts) * 1e6


@app.command()
def main(objects: int = 64, steps: int = 40, flush_mib: int = 96) -> None:
    torch.set_num_threads(1)
    extra = {**_backend_config("local", (objects // 2 + 64) * 3 // 2), "chunk_size": 16}
    spec = EngineSpec(extra_config=extra, num_layers=8, num_heads=8, num_kv_heads=8, head_size=128,
                      # vLLM refuses an engine whose cache cannot hold one max_model_len request (64 blocks)
                      block_size=16, num_blocks=max(objects, 1024 // 16) + 8, max_model_len=1024)
    eng = EngineHarness(spec, check_reads=False)
    try:
        w = eng.workers[0].connector.worker
        for t in eng.workers[0].kv_caches.values():
            t.copy_(torch_rand_like(t))
        chunks = [ChunkRef(i, f"{i:064x}", [1 + i]) for i in range(objects)]
        raw = create_backend("local", extra["backend_config"], BackendContext(role="tool"))
        ops = w._ops(SaveSpec("bench", "-", chunks), None)
        keys, regions = [op.key for op in ops], [op.materialize() for op in ops]

        def conn_put() -> None:
            w.bind(AscendStoreMetadata(saves=[SaveSpec("bench", "-", chunks)]))
            w.wait_for_save()
            assert w.engine.wait("save", ["bench"], 60)

        def conn_get() -> None:
            w.bind(AscendStoreMetadata(loads=[LoadSpec("bench", "-", chunks)]))
            w.start_load_kv(None)
            assert not w.take_load_errors()

        def clear() -> None:
            raw.remove(keys, 30.0)

        raw.put(keys, regions, 30.0)
        be = w.guard.backend
        native: dict[str, float] = {}
        real = {op: getattr(be, op) for op in ("put", "get", "exists")}
        for op, fn in real.items():
            def timed(*a, _fn=fn, _op=op):  # type: ignore[no-untyped-def]
                t0 = time.thread_time()
                try:
                    return _fn(*a)
                finally:
                    native[_op] = time.thread_time() - t0
            setattr(be, op, timed)

        def split(fn: Callable[[], None], op: str, before: Callable[[], None] | None = None) -> tuple[float, float]:
            tot, nat = [], []
            for _ in range(steps):
                if before is not None:
                    before()
                t0 = time.thread_time()
                fn()
                tot.append(time.thread_time() - t0)
                nat.append(native[op])
            return statistics.median(tot) * 1e6, statistics.median(nat) * 1e6

        print(f"{objects} x 512 KiB per step; thread CPU us, medians of {steps}; load {env_info()['loadavg']}")
        for _ in range(2):
            rp, rg = _med(lambda: raw.put(keys, regions, 30.0), steps, clear), _med(lambda: raw.get(keys, regions, 30.0), steps)
            (cp, np_), (cg, ng) = split(conn_put, "put", clear), split(conn_get, "get")
            print(f"  raw put {rp:6.0f}  connector put {cp:6.0f} (its pool call {np_:6.0f}, rest {cp - np_:4.0f}) | "
                  f"raw get {rg:6.0f}  connector get {cg:6.0f} (its pool call {ng:6.0f}, rest {cg - ng:4.0f})")
        for op in real:  # no-op backend: only the connector's own work is left
            setattr(be, op, (lambda k, *a: [Status.NOT_FOUND] * len(k)) if op == "exists"
                    else (lambda k, *a: [Status.OK] * len(k)))
        junk = np.ones(flush_mib << 20, np.uint8)

        def flush() -> None:
            junk.sum()

        def noop_raw() -> None:
            be.get(keys, regions, 30.0)

        for _ in range(2):
            print(f"  no-op backend, hot:  connector get {_med(conn_get, steps):5.0f}  put {_med(conn_put, steps):5.0f}"
                  f" | cold: connector get {_med(conn_get, steps, flush):5.0f}  put {_med(conn_put, steps, flush):5.0f}"
                  f"  raw call {_med(noop_raw, steps, flush):4.0f}")
        spec_l = LoadSpec("bench", "-", chunks)
        pieces = {
            "build ops": lambda: w._ops(spec_l, None),
            "one guarded call": lambda: w.guard.get(keys, regions, 5.0),
            "load_now (ops + engine)": lambda: w.engine.load_now("bench", w._ops(spec_l, None),
                                                                 deadline=time.monotonic() + 5),
            "take_results": w.engine.take_results,
        }
        print("  cold pieces: " + ", ".join(f"{k} {_med(f, steps, flush):.0f}" for k, f in pieces.items()))
        raw.close()
    finally:
        eng.close()


if __name__ == "__main__":
    app()
