"""The Mooncake backend with a real mooncake_master, under a real OpenAI server,
in layerwise mode (per-layer objects, loads overlapping the forward pass) and
with async loads straight into vLLM's blocks (``direct_async_loads``: no landing
buffer between Mooncake and the KV cache).

The cold pass finds nothing in the pool (asserted), so it computes every token
itself, as a server without a connector would; the warm pass after
``/reset_prefix_cache`` must reproduce it token for token from pool KV.
"""

from __future__ import annotations

import time

import pytest
from ascendstore_vllm.testing.openai_server import BLOCK_SIZE, VllmServer
from real_helpers import assert_same_output

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.timeout(900)]


MODES = {"layerwise": {"use_layerwise": True, "lookup_rpc_port": 11},
         "async-direct": {"load_async": True, "direct_async_loads": True, "lookup_rpc_port": 12}}


@pytest.mark.parametrize("mode", list(MODES))
def test_mooncake_round_trip(master, llama_model, documents, tmp_path, mode) -> None:
    ktc = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "backend": "mooncake", **MODES[mode],
        "backend_config": {"master_server_address": master.address, "local_hostname": "127.0.0.1",
                           "protocol": "tcp", "global_segment_size": 64 << 20, "local_buffer_size": 32 << 20}}}
    with VllmServer(llama_model, log_path=tmp_path / f"mooncake-{mode}.log", kv_transfer_config=ktc) as s:
        print(f"\n[mooncake-{mode}] healthy after {s.started_s:.1f} s")
        cold = [s.complete(d, 8) for d in documents]
        assert all(c.cached_tokens == 0 for c in cold)
        time.sleep(1.0)  # saves finish after the request does
        m0 = s.metrics()
        assert m0.get("vllm:ascendstore_lookup_hit_tokens_total", 0) == 0
        assert m0["vllm:ascendstore_save_bytes_total"] > 0
        s.reset_prefix_cache()
        for i, doc in enumerate(documents):
            warm = s.complete(doc, 8)
            assert_same_output(warm, cold[i], f"mooncake {mode} warm, document {i}")
            assert warm.cached_tokens == (warm.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
        m1 = s.metrics()
        assert m1["vllm:ascendstore_load_bytes_total"] > 0
        assert m1["vllm:ascendstore_lookup_hit_tokens_total"] == sum(
            (c.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE for c in cold)
