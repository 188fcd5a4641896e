"""The stated prefill cost model the benchmark charges instead of running a model.

The CPU benchmark drives the real scheduler and connector but not a real
model, so compute time is *modeled*: a prefill of ``n`` new tokens on top of
``c`` cached tokens costs

    step_overhead_s + n * per_token_s + n * (c + n / 2) * per_token_pair_s

(weights: linear in new tokens; attention: each new token attends to the cached
context and, causally, to half of the new tokens). Loading ``b`` bytes of KV from
the pool costs ``b / load_bytes_per_s``. Defaults describe an 8B dense model
(32 layers, hidden 4096, 8 KV heads of 128, bf16) on an accelerator sustaining
~320 TFLOP/s in prefill, loading from a pool at 20 GB/s:

- per_token_s = 2 * 8e9 FLOP / 320e12 FLOP/s = 5.0e-5 s
- per_token_pair_s = 4 * 32 layers * 4096 / 320e12 = 1.6e-9 s
- kv_bytes_per_token = 2 (K,V) * 32 * 8 * 128 * 2 B = 131072 B

Only ratios between runs under the same model are meant to be compared.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PrefillCostModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "8B-dense@320TFLOPs"
    step_overhead_s: float = Field(2.0e-3, ge=0)
    per_token_s: float = Field(5.0e-5, ge=0)
    per_token_pair_s: float = Field(1.6e-9, ge=0)
    kv_bytes_per_token: int = Field(131072, ge=0)
    load_bytes_per_s: float = Field(20e9, gt=0)

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Compute time of prefilling ``new_tokens`` after ``cached_tokens``, without the step overhead."""
        n = max(0, new_tokens)
        return n * self.per_token_s + n * (cached_tokens + n / 2) * self.per_token_pair_s

    def load_s(self, tokens: int) -> float:
        """Time to bring ``tokens`` worth of the modeled model's KV in from the pool."""
        return tokens * self.kv_bytes_per_token / self.load_bytes_per_s

    def request_ttft_s(self, prompt_tokens: int, device_hit: int = 0, pool_hit: int = 0) -> float:
        """Modeled time to first token of one request served alone."""
        cached = device_hit + pool_hit
        return self.step_overhead_s + self.load_s(pool_hit) + self.prefill_s(prompt_tokens - cached, cached)
