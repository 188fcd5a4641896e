"""Reusable harness: the real vLLM 0.33 Scheduler + worker connector lifecycle
with a deterministic fake model, for connector tests and benchmarks.

    from ascendstore_vllm.testing import EngineHarness, EngineSpec
    eng = EngineHarness(EngineSpec(extra_config={"backend": "local"}))
    eng.add_request("r1", list(range(100)))
    eng.run()
    assert eng.prompt_kv("r1") == eng.expected_prompt_kv(list(range(100)))  # per layer
"""

from ascendstore_vllm.testing.harness import (
    EngineHarness,
    EngineSpec,
    RankWorker,
    StepRecord,
    VllmAsyncRecomputeError,
    build_vllm_config,
    fake_kv,
    load_plugins,
    prompt_bytes,
    tmp_pool_dir,
)
from ascendstore_vllm.testing.model import make_model_dir
from ascendstore_vllm.testing.subprocess import run_in_subprocess

__all__ = [
    "EngineHarness",
    "EngineSpec",
    "RankWorker",
    "StepRecord",
    "VllmAsyncRecomputeError",
    "build_vllm_config",
    "fake_kv",
    "load_plugins",
    "make_model_dir",
    "prompt_bytes",
    "run_in_subprocess",
    "tmp_pool_dir",
]
