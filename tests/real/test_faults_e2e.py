"""A sick pool never changes a real model's tokens (the real OpenAI server, real model).

The lean lifecycle tests prove recompute-on-failure against vLLM's scheduler
with a stand-in model; this module proves it where a user sees it: the real
server, a real model, requests over HTTP. The pool is a ``faulty``-wrapped local
pool whose gets fail per key, run slow, or hang past the deadline and then
scribble 0xA5 over their buffers (``late_garbage``), while batches of requests
that share prefixes arrive together, so one step holds a failed load and device
hits on the same blocks. After every round: each completion equals the
no-connector server's (greedy ids; a difference is allowed only from a near-tie
of the reference's top-5 onwards), and the round did see failed loads and pool
hits (else it proved nothing). vLLM's CPU platform turns async scheduling off,
so these servers schedule synchronously (as the lean harness does).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from ascendstore_vllm.testing.openai_server import Completion, VllmServer
from real_helpers import LOGPROB_ATOL

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

MAX_TOKENS = 8
ROUNDS = int(os.environ.get("ASCENDSTORE_REAL_FAULT_ROUNDS", "4"))
#: requests sent at once (one batch: their steps overlap)
BATCH = 4
TIMEOUT_MS = 150
#: per mode: connector options; each starts its own server
MODES = {"sync": {}, "layerwise": {"use_layerwise": True}, "async-load": {"load_async": True}}


#: faults of each round after the first (a clean one that fills the pool), in turn
FAULTS = [
    {"fail_rate": {"get": 0.35}},
    # every get hangs past the deadline, then overwrites its buffer with 0xA5
    {"hang_s": {"get": 0.3}, "late_garbage": True},
    {"fail_rate": {"get": 0.2}, "delay_s": {"get": 0.05}},
    {"fail_rate": {"get": 0.5}, "hang_s": {"get": 0.2}, "late_garbage": True},
]


def faults(rnd: int) -> dict:
    """Round ``rnd``'s faults: 0 is clean (fills the pool), then FAULTS in turn."""
    return {"seed": rnd, **FAULTS[(rnd - 1) % len(FAULTS)]} if rnd else {}


@pytest.fixture(scope="module")
def prompts(documents) -> list[str]:
    """Pairs sharing a document as their prefix, questions of their own: sent in one
    batch, both members of a pair are in one step, one loading what the other hits."""
    out = []
    for i, doc in enumerate(documents):
        for q in range(2):
            out.append(f"{doc}\nFollow-up {q} on document {i}: answer briefly.")
    return out


@pytest.fixture(scope="module")
def reference(llama_model, servers, logdir, prompts) -> list[Completion]:
    s = VllmServer(llama_model, log_path=logdir / "no-connector.log")
    servers.append(s)
    s.start()
    try:
        return [s.complete(p, MAX_TOKENS) for p in prompts]
    finally:
        s.stop()


def same_up_to_a_tie(got: Completion, want: Completion, what: str) -> None:
    """Greedy ids equal; at the first difference (if any) the reference must have had a
    near-tie there (the served token within LOGPROB_ATOL of the chosen one in the
    reference's top-5): batch shapes differ between servers, their float sums too."""
    for pos, (g, w) in enumerate(zip(got.token_ids, want.token_ids, strict=True)):
        if g == w:
            continue
        top = want.top[pos]
        assert g in top and abs(top[g] - top[w]) <= LOGPROB_ATOL, (
            f"{what}: token {pos} is {g}, the reference's is {w} (reference top-5 {top}): "
            f"wrong KV, not a tie; ids {got.token_ids} vs {want.token_ids}")
        return


def send_batches(server: VllmServer, prompts: list[str], rng: random.Random) -> list[Completion]:
    order = list(range(len(prompts)))
    rng.shuffle(order)
    out: dict[int, Completion] = {}
    with ThreadPoolExecutor(BATCH) as ex:
        for b in range(0, len(order), BATCH):
            idx = order[b:b + BATCH]
            for i, c in zip(idx, ex.map(lambda i: server.complete(prompts[i], MAX_TOKENS), idx), strict=True):
                out[i] = c
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("mode", list(MODES))
def test_failed_and_hung_loads_never_change_tokens(mode, llama_model, servers, logdir, prompts, reference) -> None:
    with tempfile.TemporaryDirectory(prefix="as-faults-") as d:
        control = os.path.join(d, "faults.json")
        with open(control, "w") as f:
            json.dump({}, f)
        pool = {
            "backend": "faulty",
            "backend_config": {
                "backend": "local",
                "backend_config": {"name": f"faults-{uuid.uuid4().hex[:8]}", "capacity": "64MiB"},
                "control_file": control,
            },
            # every failure must reach a load, not be absorbed by degraded mode
            "health_failure_threshold": 0,
            "timeout_ms": TIMEOUT_MS,
            "lookup_rpc_port": 7,
            **MODES[mode],
        }
        ktc = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
               "kv_load_failure_policy": "recompute", "kv_connector_extra_config": pool}
        s = VllmServer(llama_model, log_path=logdir / f"faults-{mode}.log", kv_transfer_config=ktc)
        servers.append(s)
        s.start()
        try:
            rng = random.Random(f"faults-{mode}")
            before = s.metrics()
            for rnd in range(ROUNDS + 1):
                with open(control + ".tmp", "w") as f:
                    json.dump(faults(rnd), f)
                os.replace(control + ".tmp", control)
                time.sleep(0.05)  # a new mtime for the control file's readers
                s.reset_prefix_cache()
                got = send_batches(s, prompts, rng)
                for i, (g, w) in enumerate(zip(got, reference, strict=True)):
                    same_up_to_a_tie(g, w, f"{mode}, round {rnd}, prompt {i}")
                after = s.metrics()
                hits = after.get("vllm:ascendstore_lookup_hit_tokens_total", 0) - before.get(
                    "vllm:ascendstore_lookup_hit_tokens_total", 0)
                failed = after.get("vllm:ascendstore_load_failures_total", 0) - before.get(
                    "vllm:ascendstore_load_failures_total", 0)
                print(f"{mode} round {rnd}: {faults(rnd)} -> pool hit tokens {hits:.0f}, failed loads {failed:.0f}")
                if rnd:
                    assert hits > 0, f"{mode}, round {rnd}: no pool hits, the round proved nothing"
                    assert failed > 0, f"{mode}, round {rnd}: no load failed, the round proved nothing"
                before = after
            assert "Traceback" not in s.log_text(), s.log_tail(60)
        finally:
            s.stop()
