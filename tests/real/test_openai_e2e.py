"""Token-identical outputs through the real OpenAI server, with and without the pool.

One tiny Llama (GQA, fp32), greedy decoding, top-5 logprobs, a device cache of
96 blocks. The no-connector server gives the reference outputs; pool servers
must reproduce them when cold (everything computed, KV saved), warm after
``/reset_prefix_cache`` (the device cache is empty, the pool serves the prompt),
in a second server process that shares the pool (async loads), and with GR
fields in the request body.
"""

from __future__ import annotations

import random
import time
import uuid

import pytest
from ascendstore_vllm.testing.openai_server import BLOCK_SIZE, Completion, VllmServer
from real_helpers import assert_same_output

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 8
POOL = {"backend": "local", "backend_config": {"name": f"real-{uuid.uuid4().hex[:8]}", "capacity": "64MiB"}}


def pool_config(port: int, **extra: object) -> dict:
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {**POOL, "lookup_rpc_port": port, **extra}}


def pooled(prompt_tokens: int) -> int:
    """Prompt tokens a pool can serve: whole blocks, never the last prompt token."""
    return (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def wait_saved(server: VllmServer, timeout_s: float = 30.0) -> dict[str, float]:
    """Metrics once the pool's save counter stops moving (saves finish after a request does)."""
    last, deadline = -1.0, time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        now = m.get("vllm:ascendstore_save_bytes_total", 0.0)
        if now > 0 and now == last:
            return m
        if time.monotonic() > deadline:
            return m
        last = now
        time.sleep(0.5)


@pytest.fixture(scope="module")
def start(llama_model, servers, logdir):
    def make(name: str, ktc: dict | None) -> VllmServer:
        s = VllmServer(llama_model, log_path=logdir / f"{name}.log", kv_transfer_config=ktc)
        servers.append(s)
        s.start()
        print(f"\n[{name}] healthy after {s.started_s:.1f} s")
        return s
    return make


@pytest.fixture(scope="module")
def pd_documents(documents) -> list[str]:
    """Documents no server sees before the PD test (so only its prefill can put them in the pool)."""
    from ascendstore_vllm.testing.tiny_models import CORPUS

    lines = [ln for ln in CORPUS.read_text().splitlines() if ln.strip()]
    rng = random.Random(7)
    return [f"PD request {i}.\n" + "\n".join(rng.sample(lines, len(lines))[:16]) + "\nAnswer:" for i in range(3)]


@pytest.fixture(scope="module")
def reference(start, documents, pd_documents) -> list[Completion]:
    """Outputs of the server without a connector (stopped afterwards: 2 cores):
    ``documents`` first, then ``pd_documents``."""
    s = start("no-connector", None)
    try:
        return [s.complete(d, MAX_TOKENS) for d in documents + pd_documents]
    finally:
        s.stop()


@pytest.fixture(scope="module")
def pool_a(start, reference) -> VllmServer:
    # The device-side user LRU refuses vLLM other than 0.33 (it extends vLLM's
    # KVCacheManager internals): off here, GR fields and user keys still work.
    return start("pool-a", pool_config(1, gr={"enabled": True, "user_lru": False}))


def test_cold_pool_matches_no_connector(pool_a, reference, documents) -> None:
    worst = 0.0
    for i, doc in enumerate(documents):
        out = pool_a.complete(doc, MAX_TOKENS)
        worst = max(worst, assert_same_output(out, reference[i], f"cold pool, document {i}"))
        assert out.cached_tokens == 0, "an empty pool and an empty device cache serve nothing"
    m = wait_saved(pool_a)
    assert m.get("vllm:ascendstore_lookup_hit_tokens_total", 0) == 0
    assert m.get("vllm:ascendstore_save_bytes_total", 0) > 0, "the cold pass saved nothing"
    print(f"cold: largest top-5 logprob difference {worst:.2e}")


def test_warm_pool_after_reset_serves_prompts_from_the_pool(pool_a, reference, documents) -> None:
    before = wait_saved(pool_a)
    pool_a.reset_prefix_cache()
    served = 0
    worst = 0.0
    for i, doc in enumerate(documents):
        out = pool_a.complete(doc, MAX_TOKENS)
        worst = max(worst, assert_same_output(out, reference[i], f"warm pool, document {i}"))
        # The device cache was emptied: every cached prompt token came from the pool.
        assert out.cached_tokens == pooled(out.prompt_tokens), (out.cached_tokens, out.prompt_tokens)
        served += out.cached_tokens
    after = pool_a.metrics()
    hit = after["vllm:ascendstore_lookup_hit_tokens_total"] - before.get("vllm:ascendstore_lookup_hit_tokens_total", 0)
    loaded = after["vllm:ascendstore_load_bytes_total"] - before.get("vllm:ascendstore_load_bytes_total", 0)
    assert hit == served > 0
    # 4 layers x (K + V) x 2 KV heads x 64 x fp32 = 4 KiB of KV per token, all of it loaded
    assert loaded == served * 4 * 2 * 2 * 64 * 4
    print(f"warm: {served} prompt tokens from the pool; largest top-5 logprob difference {worst:.2e}")


def test_gr_fields_in_the_request_body_reach_the_connector(pool_a, reference, documents) -> None:
    """``kv_transfer_params`` with GR fields: a miss that saves the user's history, then a pool hit."""
    doc = documents[0]
    prompt_tokens = reference[0].prompt_tokens or pool_a.complete(doc, 1, logprobs=0).prompt_tokens
    params = {"uid": "user-7", "user_history_len": prompt_tokens - 5}
    m0 = pool_a.metrics()
    pool_a.reset_prefix_cache()
    first = pool_a.complete(doc, MAX_TOKENS, kv_transfer_params=params)
    assert_same_output(first, reference[0], "GR miss")
    time.sleep(1.0)
    m1 = pool_a.metrics()
    assert m1.get("vllm:ascendstore_gr_dram_misses_total", 0) == m0.get("vllm:ascendstore_gr_dram_misses_total", 0) + 1
    pool_a.reset_prefix_cache()
    second = pool_a.complete(doc, MAX_TOKENS, kv_transfer_params=params)
    assert_same_output(second, reference[0], "GR pool hit")
    m2 = pool_a.metrics()
    assert m2.get("vllm:ascendstore_gr_dram_hits_total", 0) == m1.get("vllm:ascendstore_gr_dram_hits_total", 0) + 1
    assert second.cached_tokens == (prompt_tokens - 5) // BLOCK_SIZE * BLOCK_SIZE


def test_second_server_process_shares_the_pool_with_async_loads(start, pool_a, reference, documents) -> None:
    """A second server process (load_async: loads on a transfer thread, the request
    waits in the scheduler) reads what pool-a wrote. Layerwise mode stores other
    objects (one per layer), so it is proven on its own pool: tests/real/mooncake."""
    wait_saved(pool_a)
    other = start("pool-async", pool_config(2, load_async=True))
    try:
        for i, doc in enumerate(documents):
            out = other.complete(doc, MAX_TOKENS)
            assert_same_output(out, reference[i], f"async server, document {i}")
            # A fresh process: its device cache is empty, so the pool served these.
            assert out.cached_tokens == pooled(out.prompt_tokens), (out.cached_tokens, out.prompt_tokens)
        m = other.metrics()
        assert m["vllm:ascendstore_lookup_hit_tokens_total"] > 0
    finally:
        other.stop()


def pd_complete(prefill: VllmServer, decode: VllmServer, prompt: str, max_tokens: int) -> tuple[Completion, Completion]:
    """The PD proxy: the prompt to the prefill server with max_tokens 1, then to the decode server.
    With the pool as the hand-off nothing else travels (no kv_transfer_params): the prefill
    node's saves of the prompt are in the pool when its response ends (the local pool saves
    on the forward thread, inline_save_bytes), and the decode node looks the prompt up."""
    first = prefill.complete(prompt, 1, logprobs=0)
    return first, decode.complete(prompt, max_tokens)


def test_pd_split_through_the_pool_alone(start, pool_a, reference, documents, pd_documents) -> None:
    """PD split without a P2P connector (vLLM's MooncakeConnector cannot start on a CPU-only
    torch, docs/real-models.md): prefill is pool-a (kv_both), decode a server whose
    MultiConnector holds only AscendStoreConnector as kv_consumer with consumer_is_to_load
    (``ascendstore config pd --role decode --p2p none``). Decode takes every whole block of
    the prompt from the pool and its outputs equal a single server's; a prompt no prefill
    node saw is computed on decode (nothing in the pool), and decode saves nothing."""
    from ascendstore.pd import build_pd_config

    ref = reference[len(documents):]
    decode = start("pd-decode", build_pd_config("decode", p2p="none", backend="local",
                                                backend_config=POOL["backend_config"], instance=3))
    try:
        for i, doc in enumerate(pd_documents[:2]):
            first, out = pd_complete(pool_a, decode, doc, MAX_TOKENS)
            assert first.cached_tokens == 0, "a PD document reached the pool before its prefill"
            assert_same_output(out, ref[i], f"PD split, document {i}")
            assert out.cached_tokens == pooled(out.prompt_tokens), (out.cached_tokens, out.prompt_tokens)
        alone = decode.complete(pd_documents[2], MAX_TOKENS)  # not prefilled: nothing to load
        assert_same_output(alone, ref[2], "decode without prefill")
        assert alone.cached_tokens == 0
        m = decode.metrics()
        served = sum(pooled(r.prompt_tokens) for r in ref[:2])
        assert m["vllm:ascendstore_lookup_hit_tokens_total"] == served
        assert m.get("vllm:ascendstore_save_bytes_total", 0) == 0, "a decode node without consumer_is_to_put saved"
    finally:
        decode.stop()
