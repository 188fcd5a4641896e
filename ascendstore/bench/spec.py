"""What one benchmark run is, and how its knobs map onto connector config.

The vLLM driver (``ascendstore_vllm.bench``) takes a ``BenchSpec`` and turns it
into vLLM's ``--kv-transfer-config`` with :func:`connector_extra_config`. The
granularity switch and the pool capacity live here, vLLM-free, so the mapping
is one function that the GR mode and the tests can read:

- ``block``: the ordinary chunk pool (every full chunk of every prompt).
- ``user``: the GR user-granular pool (``gr.enabled``); requests carry
  ``uid`` and ``user_history_len`` (see ``ascendstore.gr.inputs``).
- pool capacity: ``capacity_fraction`` of the workload's working set (its
  distinct chunks, each rounded up to the backend's allocation unit) becomes
  the backend's capacity option.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ascendstore.bench.cost import PrefillCostModel
from ascendstore.config import parse_bytes

Granularity = Literal["block", "user"]

#: backend -> (capacity option name, allocation-unit option name or None).
CAPACITY_OPTIONS: dict[str, tuple[str, str | None]] = {
    "local": ("capacity", "page_size"),
    "dirstore": ("capacity_bytes", None),
}


class BenchSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    workload: str = "gr"
    workload_params: dict[str, Any] = Field(default_factory=dict)
    backend: str = "local"
    backend_config: dict[str, Any] = Field(default_factory=dict)
    #: further kv_connector_extra_config keys (under the ones set here).
    extra_config: dict[str, Any] = Field(default_factory=dict)
    granularity: Granularity = "block"
    #: vLLM connector class name (e.g. AscendStoreGRConnector for a user-only pool).
    kv_connector: str = "AscendStoreConnector"
    #: pool capacity as a fraction of the working set; None: the backend's own setting.
    capacity_fraction: float | None = Field(None, gt=0, le=1.0)
    # -- the fake engine -------------------------------------------------------------
    block_size: int = Field(16, ge=1)
    chunk_size: int | None = Field(None, ge=1)
    #: device (HBM) KV blocks. None: a fifth of the workload's working set (blocks
    #: more than one request uses), but at least what one full batch plus two of the
    #: longest requests need; so vLLM's own prefix cache evicts and the pool matters.
    device_blocks: int | None = Field(None, ge=16)
    max_num_seqs: int = Field(16, ge=1)
    max_num_batched_tokens: int = Field(4096, ge=16)
    num_layers: int = Field(2, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    head_size: int = Field(16, ge=1)
    cost_model: PrefillCostModel = Field(default_factory=PrefillCostModel)
    #: check every loaded token's KV against what the writer produced.
    verify: bool = True
    seed: int = 0

    @property
    def effective_chunk_size(self) -> int:
        return self.chunk_size or self.block_size

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV bytes per token across all layers (K and V) of the fake model."""
        return self.num_layers * self.num_kv_heads * 2 * self.head_size * dtype_bytes


def auto_device_blocks(spec: BenchSpec, working_set_blocks: int, longest_tokens: int) -> int:
    bs = spec.block_size
    need = -(-(spec.max_num_batched_tokens + 2 * longest_tokens) // bs) + spec.max_num_seqs
    return max(need, working_set_blocks // 5, 16)


def _round_up_pow2(n: int, lo: int) -> int:
    p = lo
    while p < n:
        p <<= 1
    return p


def pool_backend_config(
    spec: BenchSpec, working_set_chunks: int, chunk_bytes: int
) -> tuple[dict[str, Any], int | None]:
    """The backend options for the run and the pool capacity in bytes (None: unchanged)."""
    opts = dict(spec.backend_config)
    if spec.capacity_fraction is None:
        return opts, None
    if spec.backend not in CAPACITY_OPTIONS:
        raise ValueError(
            f"--pool-capacity needs to know the capacity option of backend {spec.backend!r}; "
            f"supported: {', '.join(CAPACITY_OPTIONS)} (or set it yourself in --backend-config)"
        )
    cap_key, unit_key = CAPACITY_OPTIONS[spec.backend]
    unit = chunk_bytes
    if unit_key is not None:
        # One chunk per allocation unit, so capacity counts chunks exactly.
        unit = _round_up_pow2(chunk_bytes, 4096)
        opts.setdefault(unit_key, unit)
        unit = parse_bytes(opts[unit_key])
        unit = max(unit, -(-chunk_bytes // unit) * unit)
    capacity = max(unit, int(spec.capacity_fraction * working_set_chunks) * unit)
    opts[cap_key] = capacity
    return opts, capacity


def connector_extra_config(spec: BenchSpec, backend_config: dict[str, Any]) -> dict[str, Any]:
    """``kv_connector_extra_config`` for the run."""
    extra: dict[str, Any] = {**spec.extra_config}
    extra["backend"] = spec.backend
    extra["backend_config"] = backend_config
    if spec.chunk_size:
        extra["chunk_size"] = spec.chunk_size
    gr = dict(extra.get("gr") or {})
    gr["enabled"] = spec.granularity == "user"
    extra["gr"] = gr
    return extra


def gr_request_params(user: str | None, history_len: int) -> dict[str, Any] | None:
    """What a GR client attaches to a request (``kv_transfer_params``) in user mode."""
    if user is None:
        return None
    from ascendstore.gr.inputs import HISTORY_KEY, UID_KEY

    return {UID_KEY: user, HISTORY_KEY: history_len}


def gr_simulation(
    workload_params: dict[str, Any],
    block_size: int,
    capacities: list[float],
    granularities: list[str],
) -> list[Any]:
    """The GR pool-only simulation (``ascendstore.gr.sim``) of the same ``gr``
    workload shape: user- vs block-granular LRU pools with no device cache in
    front, as a model to read the measured runs against."""

    from ascendstore.bench.workloads import gr
    from ascendstore.gr.sim import GRWorkload, sweep

    p = {k: v.default for k, v in inspect.signature(gr).parameters.items()}
    p.update(workload_params)
    h = int(p["history_tokens"])
    w = GRWorkload(
        users=int(p["users"]),
        requests=int(p["requests"]),
        zipf_s=float(p["zipf_s"]),
        block_size=block_size,
        history_blocks=(max(1, h // 2 // block_size), max(1, h * 3 // 2 // block_size)),
        candidate_tokens=int(p["candidates"]) * int(p["item_tokens"]),
        seed=int(p["seed"]),
    )
    return sweep(capacities, granularities, w)
