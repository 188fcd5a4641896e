"""Engine runs for the chaos tests: a faulty-wrapped local pool under the real
vLLM 0.33 scheduler + worker connector lifecycle, with per-step timing.
Module level so spawned engine processes can import them."""

from __future__ import annotations

import time
from typing import Any

BS = 16


def prompts(n: int, blocks: int = 6, tail: int = 4, seed: int = 0) -> list[list[int]]:
    """n distinct prompts of ``blocks`` full blocks plus a partial tail."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(10, 900, blocks * BS + tail).tolist() for _ in range(n)]


def faulty_extra(pool: str, *, checksum: bool = True, capacity: str = "32MiB", timeout_ms: int = 300,
                 lookup_timeout_ms: int = 200, **faults: Any) -> dict[str, Any]:
    """kv_connector_extra_config: ``faulty`` over a private ``local`` pool."""
    extra_top = {k: faults.pop(k) for k in list(faults) if k in ("load_async", "use_layerwise", "lookup_mode",
                                                                  "lookup_rpc_port", "instance_id", "gr",
                                                                  "direct_async_loads")}
    return {
        "backend": "faulty",
        "backend_config": {
            "backend": "local",
            "backend_config": {"name": pool, "capacity": capacity, "page_size": "4KiB", "checksum": checksum},
            **faults,
        },
        "timeout_ms": timeout_ms,
        "lookup_timeout_ms": lookup_timeout_ms,
        **extra_top,
    }


def run_timed(eng: Any, timeout_s: float = 120.0) -> list[float]:
    """Step until every request is finished and freed; the wall time of each step."""
    times: list[float] = []
    deadline = time.monotonic() + timeout_s
    while eng.scheduler.requests:
        if time.monotonic() > deadline:
            raise TimeoutError(f"requests still pending: {list(eng.scheduler.requests)}")
        t0 = time.monotonic()
        rec = eng.step()
        times.append(time.monotonic() - t0)
        if not rec.scheduled:
            time.sleep(0.002)
    return times


def exact(eng: Any, req_id: str, prompt: list[int]) -> bool:
    from ascendstore_vllm.testing import prompt_bytes

    return prompt_bytes(eng.prompt_kv(req_id)) == prompt_bytes(eng.expected_prompt_kv(prompt))


def serve_and_report(extra: dict[str, Any], reqs: list[tuple[str, list[int]]], hold_s: float = 0.0) -> dict[str, Any]:
    """A second engine (own process): serve, check KV, report; optionally stay up a while."""
    import os

    from ascendstore_vllm.testing import EngineHarness, EngineSpec

    eng = EngineHarness(EngineSpec(extra_config=extra))
    try:
        for r, p in reqs:
            eng.add_request(r, p)
        run_timed(eng)
        time.sleep(hold_s)
        return {
            "pid": os.getpid(),
            "exact": all(exact(eng, r, p) for r, p in reqs),
            "read_errors": eng.read_errors(),
            "first": {r: eng.first_schedule(r) for r, _ in reqs},
            "stats": eng.stats_total(),
            "ipc": eng.workers[0].connector.worker.ctx.lookup_ipc_path(),
        }
    finally:
        eng.close()
