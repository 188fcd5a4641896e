"""The lookup-pin ledger's own cost for one request, on a backend without a native scan.

With pins on (the default), a request's first lookup on Mooncake pins every key of its
prompt, and the ledger (``ascendstore.engine.pins.LookupPins``) records the run it holds;
when the request's load ends the ledger lets go of the keys no other request holds. Both
run on vLLM's scheduler thread. This measures the ledger alone (the backend's ``pin`` and
``unpin`` are stubs answering at once), for a 128k-token prompt's 1024 keys by default,
beside ``--others`` waiting requests holding prompts of their own (and, in the ``shared``
cases, the first ``--shared`` chunks of this one: a system prompt). The others' holdings
begin at chunk 0, or with ``--spread`` at chunks spread over the prompt's length (each
request's lookup begins past what it has on the device: holdings found by their start
are then found one start at a time). Cases, interleaved round by round:

* ``keys``: building the request's keys from its chunk hashes
  (``KeyBuilder.lookup_keys_flat``), work every lookup does anyway: the baseline;
* ``record`` / ``release``: the ledger records the lookup's keys placed in the prompt
  (as ``PoolLookup`` gives them), then lets go of them;
* ``record counted`` / ``release counted``: the same keys given with no place in a
  prompt, which the ledger counts one by one, in a ledger whose other holdings are
  counted too (how it held every key before 2026-12-07);
* ``record run`` / ``release run``: the pool's native scan pinned the chunks (the
  ``local`` pool's way): the ledger records their chunk hashes, then lets go of them
  (``unpin_run`` a stub), beside the others' runs;
* the same with ``shared`` appended, another request holding the prompt's first
  ``--shared`` chunks.

Ratios are each case ÷ ``keys`` of the same round.

    .venv/bin/python bench/bench_pins.py [--keys 1024] [--others 32] [--spread] [--shared 128] [--rounds 15] [--json]
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable

import typer
from harness import Stat, env_info, env_line, interleave, ratios, stat
from rich.console import Console

from ascendstore.contract import Status
from ascendstore.engine.pins import LookupPins
from ascendstore.engine.plan import KeyBuilder, RankPart

CALLS = 9  # timed calls per sample (their median)
TENANT = "bench"
app = typer.Typer(add_completion=False)


class _Stub:
    """A backend client's pins, answering at once: only the ledger is timed."""

    class capabilities:  # (read as guard.capabilities.pins)
        pins = True

    def pin(self, keys, lease_s, timeout_s=None):  # type: ignore[no-untyped-def]
        return [Status.OK] * len(keys)

    def unpin(self, keys, timeout_s=None):  # type: ignore[no-untyped-def]
        return [Status.OK] * len(keys)


def _chain(seed: str, n: int) -> list[bytes]:
    """``n`` chained chunk hashes (raw bytes, as vLLM's scheduler has them)."""
    out, h = [], seed.encode()
    for _ in range(n):
        h = hashlib.sha256(h).digest()
        out.append(h)
    return out


def _measure(keys: int, others: int, shared: int, rounds: int, spread: bool = False) -> dict:
    kb = KeyBuilder("bench-fp", RankPart())
    # (one ledger per way of holding keys: a ledger holding both kinds pays to check
    # one against the other, which PoolLookup never asks of it)
    ledgers = {True: LookupPins(_Stub(), 60.0, 5.0), False: LookupPins(_Stub(), 60.0, 5.0)}  # type: ignore[arg-type]
    by_run = LookupPins(_Stub(), 60.0, 5.0, unpin_run=lambda tenant, hashes: None)  # type: ignore[arg-type]
    hashes = _chain("prompt", keys)
    run = (TENANT, 0, hashes[0], hashes[-1], keys)
    ok = [Status.OK] * keys
    for i in range(others):  # waiting requests with prompts of their own
        start = i * keys // others if spread else 0
        h = _chain(f"other-{i}", keys)[start:]
        flat, _ = kb.lookup_keys_flat(TENANT, h)
        for placed, pins in ledgers.items():
            pins.pinned(f"other-{i}", flat, 1, ok[: len(h)], len(h), (TENANT, start, h[0], h[-1], len(h)),
                        (TENANT, start) if placed else None)
        by_run.took(f"other-{i}", TENANT, h, (TENANT, start, h[0], h[-1], len(h)))

    def timed(fn: Callable[[], object], before: Callable[[], object]) -> Callable[[], float]:
        def sample() -> float:
            out = []
            for _ in range(CALLS):
                before()
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            return statistics.median(out) * 1e6
        return sample

    built: list[list[str]] = [[]]

    def record(placed: bool) -> Callable[[], object]:
        pins, at = ledgers[placed], (TENANT, 0) if placed else None

        def fn() -> None:
            pins.pinned("req", built[0], 1, ok, keys, run, at)
        return fn

    def fresh_keys(placed: bool) -> Callable[[], object]:
        def fn() -> None:  # (what a lookup hands the ledger: a new list of its own)
            ledgers[placed].release("req")
            built[0] = kb.lookup_keys_flat(TENANT, hashes)[0]
        return fn

    def held(placed: bool) -> Callable[[], object]:
        def fn() -> None:
            fresh_keys(placed)()
            record(placed)()
        return fn

    def release(placed: bool) -> Callable[[], object]:
        return lambda: ledgers[placed].release("req")

    def took() -> None:  # (a copy of the hashes: what the scheduler hands a first lookup)
        by_run.took("req", TENANT, list(hashes), run)

    def shared_case(case: Callable[[], float], placed: bool | None) -> Callable[[], float]:
        pins = ledgers[placed] if placed is not None else by_run
        system = (TENANT, 0, hashes[0], hashes[shared - 1], shared)

        def sample() -> float:
            if placed is None:
                pins.took("system", TENANT, hashes[:shared], system)
            else:
                flat, _ = kb.lookup_keys_flat(TENANT, hashes[:shared])
                pins.pinned("system", flat, 1, ok[:shared], shared, system, (TENANT, 0) if placed else None)
            try:
                return case()
            finally:
                pins.release("system")
        return sample

    cases: dict[str, Callable[[], float]] = {
        "keys": timed(lambda: kb.lookup_keys_flat(TENANT, hashes), lambda: None),
        "record": timed(record(True), fresh_keys(True)),
        "release": timed(release(True), held(True)),
        "record counted": timed(record(False), fresh_keys(False)),
        "release counted": timed(release(False), held(False)),
        "record run": timed(took, lambda: by_run.release("req")),
        "release run": timed(lambda: by_run.release("req"), took),
    }
    if shared:
        for name in list(cases)[1:]:
            placed = None if name.endswith(" run") else "counted" not in name
            cases[f"{name} shared"] = shared_case(cases[name], placed)
    s = interleave(cases, rounds, warmup=1)
    for pins in (*ledgers.values(), by_run):
        pins.close()
    return {"keys": keys, "others": others, "spread": spread, "shared": shared,
            "us": {k: stat(v).as_dict() for k, v in s.items()},
            "ratio": {k: ratios(v, s["keys"]).as_dict() for k, v in s.items() if k != "keys"}}


@app.command()
def main(
    keys: int = typer.Option(1024, min=1, max=1 << 16, help="the request's keys (1024: a 128k-token prompt, one rank)"),
    others: int = typer.Option(32, min=0, max=4096, help="other waiting requests' holdings in the ledger"),
    spread: bool = typer.Option(False, "--spread", help="the others' holdings begin at chunks spread over the prompt"),
    shared: int = typer.Option(128, min=0, help="chunks another request shares in the shared cases (0: none)"),
    rounds: int = typer.Option(15, min=1, max=100, help="interleaved rounds"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    if shared > keys:
        raise typer.BadParameter(f"--shared {shared} is more than --keys {keys}", param_hint="--shared")
    env0 = env_info()
    r = _measure(keys, others, shared, rounds, spread)
    if as_json:
        print(json.dumps({**r, "rounds": rounds, "env_before": env0, "env_after": env_info()}, indent=2))
        return
    f = lambda d, digits=2: Stat(d["median"], d["min"], d["max"], d["n"]).fmt(digits)  # noqa: E731
    con = Console(width=160)
    where = "from chunks spread over the prompt" if spread else "from chunk 0"
    con.print(f"Lookup-pin ledger, one request of {keys} keys beside {others} other holdings {where} "
              f"(shared cases: {shared} chunks held by another request too), us median \\[min..max] "
              f"over {rounds} interleaved rounds; ratio ÷ building the keys (keys {f(r['us']['keys'], 1)} us)")
    for name, ratio in r["ratio"].items():
        con.print(f"  {name:24s} {f(r['us'][name], 1):>30s} us   ratio {f(ratio)}")
    con.print(env_line(env0, env_info()))


if __name__ == "__main__":
    app()
