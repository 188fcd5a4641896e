"""What both roles derive identically from vLLM's config: chunking, key
fingerprint, rank parts, replication, instance identity, role switches."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ascendstore.config import AscendStoreConfig, load_config
from ascendstore.engine import KeyBuilder, PoolLookup, ReplicaGroup
from ascendstore.errors import ConfigError
from ascendstore.keys import KVFingerprint, RankPart, model_key_name, tenant_id
from ascendstore_vllm.groups import (
    GroupedKeyBuilder,
    GroupLookup,
    GroupPlan,
    describe_groups,
    group_fingerprint_extra,
    is_hybrid,
    plan_groups,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def parallel_ranks(vllm_config: VllmConfig) -> tuple[int, int]:
    """(tp_rank, pp_rank) of this process.

    vLLM's process groups when they are initialised with the configured sizes;
    otherwise (scheduler process, in-process test ranks) the global rank in the
    parallel config, which vLLM lays out as pp-major, tp-minor."""
    pc = vllm_config.parallel_config
    tp = pc.tensor_parallel_size
    try:
        from vllm.distributed import parallel_state as ps

        if ps.model_parallel_is_initialized() and ps.get_tp_group().world_size == tp:
            return ps.get_tensor_model_parallel_rank(), ps.get_pp_group().rank_in_group
    except Exception:
        pass
    rank = pc.rank
    return rank % tp, (rank // tp) % pc.pipeline_parallel_size



#: vLLM seeds these block-hash algorithms per process unless PYTHONHASHSEED is set.
NON_CRYPTO_HASH_ALGOS = frozenset({"xxhash", "xxhash_cbor"})


def check_hash_determinism(hash_algo: str, env: Any) -> None:
    """Fail at start-up when block hashes would differ between processes: every
    pool lookup would then miss, silently."""
    if hash_algo in NON_CRYPTO_HASH_ALGOS and env.get("PYTHONHASHSEED") is None:
        raise ConfigError(
            f"prefix_caching_hash_algo={hash_algo!r} seeds block hashes randomly per process unless "
            "PYTHONHASHSEED is set, so no engine could reuse another's pooled KV. Set the same "
            "PYTHONHASHSEED on every node, or use prefix_caching_hash_algo 'sha256' / 'sha256_cbor'."
        )

@dataclass(frozen=True)
class ConnectorContext:
    config: AscendStoreConfig
    block_size: int
    chunk_size: int
    fingerprint: KVFingerprint
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    replicas: ReplicaGroup
    num_layers: int
    instance_id: str
    engine_id: str
    kv_role: str
    dp_rank: int = 0
    #: vLLM's KV cache groups as pooled (groups.py); empty without a kv_cache_config
    groups: tuple[GroupPlan, ...] = ()

    @cached_property
    def hybrid(self) -> bool:
        """Objects per KV cache group (hybrid KV cache manager, sliding windows). Cached: the
        scheduler asks for every running request in every step, and ``groups`` is fixed."""
        return is_hybrid(self.groups)

    @cached_property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    # -- role switches (PD split hooks) -------------------------------------------
    @property
    def is_consumer(self) -> bool:
        return self.kv_role == "kv_consumer"

    @property
    def can_load(self) -> bool:
        return not self.is_consumer or self.config.consumer_is_to_load

    @property
    def can_save(self) -> bool:
        return not self.is_consumer or self.config.consumer_is_to_put

    # -- keys ---------------------------------------------------------------------
    def rank_part(self) -> RankPart:
        return RankPart(head_rank=self.tp_rank // self.replicas.size, pp_rank=self.pp_rank)

    def key_builder(self) -> KeyBuilder:
        heads = self.tp_size // self.replicas.size
        all_ranks = tuple(RankPart(h, p) for p in range(self.pp_size) for h in range(heads))
        if self.hybrid:
            fps = tuple(replace(self.fingerprint, group=group_fingerprint_extra(self.groups, g)).digest()
                        for g in self.groups)
            return GroupedKeyBuilder(fingerprint=fps[0], rank=self.rank_part(), num_layers=self.num_layers,
                                     all_ranks=all_ranks, group_fingerprints=fps)
        return KeyBuilder(
            fingerprint=self.fingerprint.digest(),
            rank=self.rank_part(),
            layerwise=self.config.use_layerwise,
            num_layers=self.num_layers,
            all_ranks=all_ranks,
        )

    def pool_lookup(self, guard: Any, timeout_s: float, *, pin_lease_s: float = 0.0) -> Any:
        """The chunk lookup over ``guard``: per group for hybrid models (groups.py, which pins
        nothing: ``pin_lease_ms`` covers single-group models only)."""
        if self.hybrid:
            return GroupLookup(guard, self.key_builder(), self.groups, self.blocks_per_chunk,  # type: ignore[arg-type]
                               timeout_s, partial_tail=not self.config.discard_partial_chunks)
        return PoolLookup(guard, self.key_builder(), timeout_s, pin_lease_s=pin_lease_s)

    def tenant(self, cache_salt: str | None) -> str:
        return tenant_id(cache_salt or self.config.tenant)

    # -- IPC ----------------------------------------------------------------------
    def lookup_ipc_path(self) -> str:
        """Per-instance path: engine id + instance id + port + dp rank, so two
        vLLM instances on one host never clash (vllm-ascend #8938/#16237)."""
        base = os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()
        name = f"ascendstore-lookup-{self.instance_id}-p{self.config.lookup_rpc_port}-dp{self.dp_rank}.ipc"
        return "ipc://" + os.path.join(base, name)

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> ConnectorContext:
        from ascendstore_vllm.compat import require_servable_kv, require_supported_vllm

        require_supported_vllm()  # both connectors start here: name both versions, not a stray AttributeError
        require_servable_kv(vllm_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        extra: dict[str, Any] = dict(ktc.kv_connector_extra_config or {})
        config = load_config(extra)
        block_size = vllm_config.cache_config.block_size
        spec = None
        groups: tuple[GroupPlan, ...] = ()
        if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
            # Every group type must be one the pool can serve exactly (else: fail here).
            groups = plan_groups(kv_cache_config.kv_cache_groups)
            if is_hybrid(groups) and config.use_layerwise:
                raise ConfigError(
                    "use_layerwise is not supported with hybrid KV cache groups "
                    f"[{describe_groups(kv_cache_config.kv_cache_groups)}]: layerwise loads run inside the "
                    "step, so a failed one could only be reported per block, which vLLM refuses with several "
                    "KV cache groups, and a state group's state must be in place before vLLM copies it forward "
                    "at the start of the step; set use_layerwise: false"
                )
            if is_hybrid(groups) and config.gr.enabled:
                raise ConfigError(
                    "gr.enabled is not supported with hybrid KV cache groups "
                    f"[{describe_groups(kv_cache_config.kv_cache_groups)}]: the GR user store keeps one block table"
                )
            # The fingerprint's attention fields come from the first attention group (a
            # state group has no heads); each group's own spec is in its group fingerprint.
            specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
            spec = next((s for s in specs if getattr(s, "num_kv_heads", None)), specs[0])
            block_size = spec.block_size
        chunk_size = config.chunk_size or block_size
        if chunk_size % block_size:
            raise ConfigError(
                f"bad value {chunk_size} for config key 'chunk_size': must be a multiple of "
                f"vLLM's block_size ({block_size})"
            )
        pc = vllm_config.parallel_config
        tp_rank, pp_rank = parallel_ranks(vllm_config)
        mc = vllm_config.model_config
        use_mla = bool(getattr(mc, "use_mla", False))
        replicas = 1
        if kv_cache_config is not None:
            replicas = max(1, int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1))
        if use_mla:
            replicas = pc.tensor_parallel_size
        hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
        num_layers = int(getattr(hf, "num_hidden_layers", 0) or 0)
        if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
            num_layers = max(num_layers, len(kv_cache_config.kv_cache_groups[0].layer_names))
        hash_algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
        check_hash_determinism(hash_algo, os.environ)
        fp = KVFingerprint(
            model=model_key_name(mc.model),
            dtype=str(getattr(spec, "dtype", vllm_config.cache_config.cache_dtype)),
            kv_layout=str((kv_cache_config.kv_cache_layout if kv_cache_config else None) or "default"),
            block_size=block_size,
            chunk_size=chunk_size,
            num_layers=num_layers,
            num_kv_heads=int(getattr(spec, "num_kv_heads", 0) or 0),
            head_size=int(getattr(spec, "head_size", 0) or 0),
            tp_size=pc.tensor_parallel_size,
            pp_size=pc.pipeline_parallel_size,
            dcp_size=getattr(pc, "decode_context_parallel_size", 1),
            use_mla=use_mla,
            # Engines that hash blocks differently can never share chunk keys.
            extra=f"hash={hash_algo}",
        )
        engine_id = str(ktc.engine_id or "engine")
        return cls(
            config=config,
            block_size=block_size,
            chunk_size=chunk_size,
            fingerprint=fp,
            tp_rank=tp_rank,
            tp_size=pc.tensor_parallel_size,
            pp_rank=pp_rank,
            pp_size=pc.pipeline_parallel_size,
            replicas=ReplicaGroup.for_tp(tp_rank, pc.tensor_parallel_size, replicas),
            num_layers=num_layers,
            instance_id=config.instance_id or engine_id,
            engine_id=engine_id,
            kv_role=str(ktc.kv_role or "kv_both"),
            dp_rank=getattr(pc, "data_parallel_rank", 0) or 0,
            groups=groups,
        )


def chunk_bounds(num_full_blocks: int, blocks_per_chunk: int, partial_tail: bool) -> list[tuple[int, int]]:
    """[start_block, end_block) of each chunk among the first num_full_blocks.

    With partial_tail (``discard_partial_chunks: false``) a trailing run of
    fewer than blocks_per_chunk full blocks is a chunk of its own (its key is
    the hash of its last block, which never names a full chunk)."""
    n = num_full_blocks // blocks_per_chunk
    out = [(i * blocks_per_chunk, (i + 1) * blocks_per_chunk) for i in range(n)]
    if partial_tail and num_full_blocks % blocks_per_chunk:
        out.append((n * blocks_per_chunk, num_full_blocks))
    return out
