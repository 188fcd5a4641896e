"""How fast a finished request's blocks go back to vLLM (issue: saves reported late).

Drives the real vLLM 0.33 scheduler and worker connector lifecycle on CPU (the
project's harness: real Scheduler, real KV tensors, fake model) the way vLLM's
engine core does with async scheduling: schedule step N+1 before the output of
step N is processed (a batch queue of two), idle steps paced like an idle
engine. For each request (133 tokens, 4 layers, one at a time) it records the
engine steps and milliseconds from the request's end (its last output processed)
to the step whose output names it in ``finished_sending`` — when vLLM frees its
blocks — per backend and transfer mode, and prints p50/p99/max.

    .venv/bin/python bench/bench_release.py [--requests 40] [--backend local|mooncake] [--json]

``--backend mooncake`` starts a real ``mooncake_master`` on 127.0.0.1 and
re-runs itself inside a private network namespace (needs root).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections import deque

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False)
MODES = {"plain": {}, "async load": {"load_async": True}, "layerwise": {"use_layerwise": True}}


def _extra(backend: str, address: str | None) -> dict:
    if backend == "local":
        return {"backend": "local", "backend_config": {"name": f"rel-{uuid.uuid4().hex[:8]}", "capacity": "64MiB"}}
    return {"backend": "mooncake", "backend_config": {
        "master_server_address": address, "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
        "local_hostname": "127.0.0.1", "global_segment_size": "64MiB", "local_buffer_size": "16MiB"}}


def measure(backend: str, mode: str, requests: int, address: str | None) -> dict:
    import vllm.v1.core.sched.scheduler as sched_mod
    from ascendstore_vllm.testing import EngineHarness, EngineSpec
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    plain = sched_mod.Scheduler
    sched_mod.Scheduler = AsyncScheduler  # the harness builds "Scheduler": make it vLLM's async one
    try:
        eng = EngineHarness(EngineSpec(extra_config={**_extra(backend, address), **MODES[mode]}, num_layers=4))
    finally:
        sched_mod.Scheduler = plain
    steps: list[int] = []
    millis: list[float] = []
    try:
        for k in range(requests):
            rid = f"r{k}"
            eng.add_request(rid, [(k * 7919 + i * 31) % 900 + 10 for i in range(133)])
            batches: deque = deque()
            ended: tuple[int, float] | None = None
            for step in range(20_000):
                so = eng.scheduler.schedule()
                eng._track(so)
                out = eng.workers[0].execute(so)
                batches.appendleft((so, out))
                if len(batches) < 2 and so.total_num_scheduled_tokens > 0:
                    continue  # vLLM's engine core: fill the batch queue before taking an output
                so0, out0 = batches.pop()
                eng.scheduler.update_from_output(so0, out0)
                if ended is None and rid not in eng.scheduler.requests or (
                        ended is None and eng.scheduler.requests[rid].is_finished()):
                    ended = (step, time.perf_counter())
                kvo = out0.kv_connector_output
                if ended is not None and kvo is not None and rid in (kvo.finished_sending or ()):
                    steps.append(step - ended[0])
                    millis.append((time.perf_counter() - ended[1]) * 1000)
                    break
                if not so.total_num_scheduled_tokens:
                    time.sleep(0.002)  # an idle engine core's pace
            else:
                raise RuntimeError(f"{rid}: finished_sending never came")
            while batches:
                so0, out0 = batches.pop()
                eng.scheduler.update_from_output(so0, out0)
            while eng.scheduler.requests:
                eng.step()
    finally:
        eng.close()

    def pct(xs: list, q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]

    return {"backend": backend, "mode": mode, "requests": requests,
            "steps_p50": statistics.median(steps), "steps_p99": pct(steps, 0.99), "steps_max": max(steps),
            "ms_p50": round(statistics.median(millis), 2), "ms_p99": round(pct(millis, 0.99), 2),
            "ms_max": round(max(millis), 2)}


@app.command()
def main(
    requests: int = typer.Option(40, min=1, max=10_000, help="requests per mode (one at a time)"),
    backend: str = typer.Option("local", help="local | mooncake"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    master = address = None
    if backend == "mooncake":
        sys.path.insert(0, os.path.dirname(__file__))
        from bench_mooncake import _in_private_netns, _start_master

        if not _in_private_netns():
            if os.geteuid() != 0 or os.environ.get("_BENCH_RELEASE_NETNS"):
                raise SystemExit("run as root: Mooncake clients listen on all interfaces (private netns needed)")
            cmd = " ".join([sys.executable, *map(repr, sys.argv)])
            env = {**os.environ, "_BENCH_RELEASE_NETNS": "1"}
            raise SystemExit(subprocess.call(["unshare", "-n", "bash", "-c", f"ip link set lo up && exec {cmd}"],
                                             env=env))
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        master, address = _start_master()
    elif backend != "local":
        raise SystemExit(f"unknown backend {backend!r}; choices: local, mooncake")
    try:
        rows = [measure(backend, mode, requests, address) for mode in MODES]
    finally:
        if master is not None:
            master.kill()
            master.wait()
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="request end -> finished_sending (vLLM frees the blocks), async scheduling")
    for col in ("backend", "mode", "requests", "steps p50", "steps p99", "steps max", "ms p50", "ms p99", "ms max"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["backend"], r["mode"], str(r["requests"]), *(str(r[k]) for k in (
            "steps_p50", "steps_p99", "steps_max", "ms_p50", "ms_p99", "ms_max")))
    Console(width=140).print(table)


if __name__ == "__main__":
    app()
