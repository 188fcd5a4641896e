"""Real vLLM 0.33 scheduler on CPU for GR tests: builder, requests, a fake step.

Only the model forward is absent: ``step()`` runs the real ``schedule()`` and
``update_from_output()`` with one sampled token per request whose prefill is
complete (vLLM's own unit-test pattern).
"""

from __future__ import annotations

import itertools
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_counter = itertools.count()


def make_model_dir(path: Path, num_layers: int = 2, num_kv_heads: int = 2, head_size: int = 16) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4 * head_size, "num_attention_heads": 4, "num_key_value_heads": num_kv_heads,
        "head_dim": head_size, "num_hidden_layers": num_layers, "intermediate_size": 128,
        "vocab_size": 50000, "max_position_embeddings": 8192, "torch_dtype": "float32",
    }))
    return str(path)


def build_vllm_config(
    *,
    block_size: int = 16,
    num_blocks: int = 64,
    max_model_len: int = 2048,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 16,
    kv_transfer_config: Any = None,
    model_dir: str | None = None,
) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = model_dir or make_model_dir(Path(tempfile.mkdtemp(prefix="gr-model-")))
    mc = ModelConfig(model=model, max_model_len=max_model_len, dtype="float32", skip_tokenizer_init=True)
    cc = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, enable_prefix_caching=True)
    cc.num_gpu_blocks = num_blocks
    sc = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, is_encoder_decoder=False, enable_chunked_prefill=True,
    )
    return VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc, device_config=DeviceConfig("cpu"),
                      kv_transfer_config=kv_transfer_config)


def build_kv_cache_config(vllm_config: Any, num_blocks: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    mc = vllm_config.model_config
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(mc.get_num_layers(vllm_config.parallel_config))]
    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
        head_size=mc.get_head_size(), dtype=torch.float32,
    )
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


@dataclass
class SchedulerRig:
    scheduler: Any
    block_size: int
    hasher: Any
    finished: list[str] = field(default_factory=list)

    @property
    def kv_cache_manager(self) -> Any:
        return self.scheduler.kv_cache_manager

    @property
    def free_blocks(self) -> int:
        return self.kv_cache_manager.block_pool.get_num_free_blocks()

    def request(self, prompt: list[int], *, max_tokens: int = 1, extra_args: dict | None = None,
                kv_transfer_params: dict | None = None, req_id: str | None = None) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        extra = dict(extra_args or {})
        if kv_transfer_params is not None:
            extra["kv_transfer_params"] = kv_transfer_params
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra or None)
        return Request(req_id or f"req-{next(_counter)}", list(prompt), sp, None, block_hasher=self.hasher)

    def add(self, *requests: Any) -> None:
        for r in requests:
            self.scheduler.add_request(r)

    def step(self, kv_connector_output: Any = None) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.scheduler.requests[rid]
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled, kv_connector_output=kv_connector_output)
        eco = self.scheduler.update_from_output(out, mro)
        for outs in eco.values():
            for o in outs.outputs:
                if o.finish_reason is not None:
                    self.finished.append(o.request_id)
        return out

    def run(self, *requests: Any, max_steps: int = 200) -> list[Any]:
        """Add requests and step until all of them (none given: every request)
        finished; returns the scheduler outputs."""
        self.add(*requests)
        outs = []
        want = {r.request_id for r in requests}
        for _ in range(max_steps):
            if want <= set(self.finished) and (want or not self.scheduler.has_unfinished_requests()):
                return outs
            outs.append(self.step())
        raise AssertionError(f"requests {sorted(want - set(self.finished))} did not finish")


def build_scheduler(*, block_size: int = 16, num_blocks: int = 64, **kw: Any) -> SchedulerRig:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vc = build_vllm_config(block_size=block_size, num_blocks=num_blocks, **kw)
    kvc = build_kv_cache_config(vc, num_blocks)
    hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    sched = Scheduler(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
                      block_size=block_size)
    return SchedulerRig(sched, block_size, get_request_block_hasher(block_size, hash_fn))
