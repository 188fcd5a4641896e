"""The MemCache adapter's own cost on a lookup-sized ``exists``, measured in one run.

MemCache's data path needs an Ascend driver, so this runs the adapter against the
STAND-IN (``ascendstore_memcache.standin``) with its ``batch_is_exist`` replaced by
a constant answer ("every key present"): what is timed is our layer (key checks,
batches of at most 512 keys, the bounded hand-off of each native call, decoding),
not MemCache and not the stand-in's SQLite. Two cases, interleaved round by round:

* ``native``: the same native calls the adapter makes (the keys in slices of 512),
  each through the adapter's own call executor, with the arguments prebuilt;
* ``exists``: ``MemcacheBackend.exists`` of the keys.

The ratio ``exists ÷ native`` is what our layer adds to the hand-offs; on real
hardware the native call itself (a meta-service round trip) makes the ratio smaller.
A lookup of a 128k-token prompt asks about 1024 keys per rank (``--keys``).

    .venv/bin/python bench/bench_memcache.py [--keys 1024] [--rounds 15] [--json]
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import typer
from harness import Stat, env_info, env_line, interleave, ratios, stat
from rich.console import Console

from ascendstore.contract import BackendContext, Status
from ascendstore.registry import create_backend

CALLS = 9  # timed calls per sample (their median)
TIMEOUT_S = 5.0
app = typer.Typer(add_completion=False)


def _measure(keys: int, rounds: int) -> dict:
    from ascendstore_memcache.calls import Deadline
    from ascendstore_memcache.codes import MAX_BATCH_KEYS

    with tempfile.TemporaryDirectory(prefix="bench-memcache-") as tmp:
        cfg = {"driver": "standin", "standin_path": str(Path(tmp) / "store"), "conf_dir": str(Path(tmp) / "conf"),
               "protocol": "host_tcp", "dram_size": "64MiB"}
        backend = create_backend("memcache", cfg, BackendContext(role="scheduler", instance_id="bench"))
        try:
            # (a key as the connector makes one: model fingerprint, tenant, chunk hash, rank)
            names = [f"fp@tenant@{i:064x}@0" for i in range(keys)]
            store = backend._store  # type: ignore[attr-defined]
            store.batch_is_exist = lambda ks: [1] * len(ks)  # the constant answer (module doc)
            run = backend._calls.run  # type: ignore[attr-defined]
            batches = [names[s:s + MAX_BATCH_KEYS] for s in range(0, keys, MAX_BATCH_KEYS)]

            def timed(fn):
                def sample() -> float:
                    out = []
                    for _ in range(CALLS):
                        t0 = time.perf_counter()
                        fn()
                        out.append(time.perf_counter() - t0)
                    return statistics.median(out) * 1e6
                return sample

            def native() -> None:
                deadline = Deadline(TIMEOUT_S)
                for b in batches:
                    run(deadline, store.batch_is_exist, b)

            assert backend.exists(names, TIMEOUT_S) == [Status.OK] * keys
            s = interleave({"native": timed(native), "exists": timed(lambda: backend.exists(names, TIMEOUT_S))},
                           rounds, warmup=1)
        finally:
            backend.close()
    return {"keys": keys, "native_calls": len(batches), "us": {k: stat(v).as_dict() for k, v in s.items()},
            "ratio": {"exists": ratios(s["exists"], s["native"]).as_dict()},
            "added_us": stat(a - b for a, b in zip(s["exists"], s["native"], strict=True)).as_dict()}


@app.command()
def main(
    keys: int = typer.Option(1024, min=1, max=1 << 16, help="keys asked about (1024: a 128k-token prompt, one rank)"),
    rounds: int = typer.Option(15, min=1, max=100, help="interleaved rounds"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a line"),
) -> None:
    env0 = env_info()
    r = _measure(keys, rounds)
    if as_json:
        print(json.dumps({**r, "rounds": rounds, "env_before": env0, "env_after": env_info()}, indent=2))
        return
    f = lambda d, digits=2: Stat(d["median"], d["min"], d["max"], d["n"]).fmt(digits)  # noqa: E731
    con = Console(width=160)
    calls = f"{r['native_calls']} native call{'s' if r['native_calls'] != 1 else ''}"
    con.print(f"MemCache adapter exists of {keys} keys ({calls}, answered by a constant "
              f"stand-in), us median \\[min..max] over {rounds} interleaved rounds: native calls alone "
              f"{f(r['us']['native'], 0)}, exists {f(r['us']['exists'], 0)}; exists ÷ native "
              f"{f(r['ratio']['exists'])}; our layer adds {f(r['added_us'], 0)} us")
    con.print(env_line(env0, env_info()))


if __name__ == "__main__":
    app()
