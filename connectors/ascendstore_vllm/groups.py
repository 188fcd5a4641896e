"""vLLM's KV cache groups -> what the pool stores for each (hybrid KV cache manager).

With the hybrid KV cache manager (HMA) vLLM hands a connector one block list per
KV cache group (``KVCacheBlocks.get_block_ids()``); the layers of a group share
one block table, and layers of different groups may alias the same memory (one
physical tensor per "slot" of every group). So a chunk is stored as one object
per group, holding only that group's layers, and the group's spec goes into the
key fingerprint (``group_fingerprint``).

What is pooled per group (``GroupPlan.kind``):

* ``full`` (FullAttentionSpec, MLAAttentionSpec): every block of every chunk.
* ``sliding`` (SlidingWindowSpec): a request resumed at a chunk boundary H needs
  only the blocks vLLM keeps for the window of the token at H: the last
  ``window_blocks = ceil(sliding_window / block_size)`` blocks before H
  (vLLM pads the earlier ones with its null block). Each chunk's object holds the
  chunk's last ``min(blocks_per_chunk, window_blocks)`` blocks, which covers
  every boundary; a load reads only the objects whose blocks reach into the
  window of the hit's end.

Everything else is refused at start-up, naming the model's group types, rather
than served wrong: recurrent state (MambaSpec: Mamba, linear attention) is one
running state per request, not per-token KV at a chunk boundary; chunked local
attention, cross/encoder attention, sink/R-SWA/hidden-state caches and any spec
this module does not know have block semantics the pool does not model.

Specs are read by class name and attributes (no import of vLLM's spec classes),
so one mapping serves every supported vLLM version.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ascendstore.engine.plan import KeyBuilder, _key_prefix
from ascendstore.errors import ConfigError
from ascendstore_vllm.metadata import ChunkRef

#: spec class name -> kind. Exact names: a subclass vLLM adds later (e.g. RSWASpec
#: derives from FullAttentionSpec but frees blocks mid-request) is refused until
#: someone checks its semantics.
SUPPORTED: dict[str, str] = {
    "FullAttentionSpec": "full",
    "MLAAttentionSpec": "full",
    "SlidingWindowSpec": "sliding",
}

#: why a known spec cannot be pooled (the rest: "not known to AscendStore").
REFUSED: dict[str, str] = {
    "MambaSpec": "recurrent state (Mamba / linear attention) is one running state per request, "
                 "not per-token KV the pool can cut at chunk boundaries",
    "ChunkedLocalAttentionSpec": "chunked local attention frees blocks per attention chunk; not modelled",
    "SlidingWindowMLASpec": "sliding-window MLA (DeepSeek V4) is not modelled yet",
    "CrossAttentionSpec": "cross-attention KV depends on the encoder input, not the prompt prefix",
    "EncoderOnlyAttentionSpec": "encoder-only attention keeps no KV across steps",
    "SinkFullAttentionSpec": "attention-sink caches keep extra blocks the pool does not model",
    "RSWASpec": "R-SWA evicts a middle gap of blocks mid-request; not modelled",
    "HiddenStateCacheSpec": "hidden-state caches are not KV",
    "CircularBufferSpec": "ring buffers are not prefix-cacheable",
    "UniformTypeKVCacheSpecs": "per-layer mixed specs in one group are not modelled",
}


@dataclass(frozen=True)
class GroupPlan:
    """One KV cache group as the pool sees it."""

    index: int
    kind: str  # "full" | "sliding"
    spec_type: str
    layer_names: tuple[str, ...]
    block_size: int
    #: sliding: tokens of the window (None for full attention)
    sliding_window: int | None
    #: text of every spec field that changes the bytes of a block (fingerprint part)
    spec_text: str

    def window_blocks(self) -> int:
        """Blocks before a chunk boundary B that vLLM keeps when a request resumes
        at B or at B - 1 (a whole-prompt hit recomputes the last prompt token):
        the window of the token at B - 1 starts at B - sliding_window."""
        if self.sliding_window is None:
            return 0
        return max(1, math.ceil(self.sliding_window / self.block_size))

    def stored_blocks(self, b0: int, b1: int) -> tuple[int, int]:
        """[first, end) block of chunk [b0, b1) that this group's object holds."""
        if self.kind != "sliding":
            return b0, b1
        return max(b0, b1 - self.window_blocks()), b1

    def needed_blocks(self, hit_blocks: int) -> tuple[int, int]:
        """[first, end) blocks a request resumed after ``hit_blocks`` blocks needs."""
        if self.kind != "sliding":
            return 0, hit_blocks
        return max(0, hit_blocks - self.window_blocks()), hit_blocks


def _spec_text(spec: Any) -> str:
    keys = ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "sliding_window",
            "kv_quant_mode", "cache_dtype_str", "page_size_padded", "num_head_slots", "tokens_per_state",
            "model_version", "cache_role")
    parts = [type(spec).__name__]
    for k in keys:
        v = getattr(spec, k, None)
        if v is not None:
            parts.append(f"{k}={v}")
    return ",".join(parts)


def describe_groups(kv_cache_groups: Sequence[Any]) -> str:
    """``0:FullAttentionSpec(2 layers), 1:SlidingWindowSpec(window 64, 2 layers)`` for messages."""
    out = []
    for i, g in enumerate(kv_cache_groups):
        spec = g.kv_cache_spec
        win = getattr(spec, "sliding_window", None)
        extra = f"window {win}, " if win is not None else ""
        out.append(f"{i}:{type(spec).__name__}({extra}{len(g.layer_names)} layers)")
    return ", ".join(out)


def plan_groups(kv_cache_groups: Sequence[Any]) -> tuple[GroupPlan, ...]:
    """Map vLLM's kv_cache_groups to GroupPlans, or fail naming what cannot be pooled."""
    plans = []
    bad = []
    for i, g in enumerate(kv_cache_groups):
        spec = g.kv_cache_spec
        name = type(spec).__name__
        kind = SUPPORTED.get(name)
        if kind is not None and getattr(spec, "tokens_per_state", 1) != 1:
            kind = None  # compressed states (DeepSeek V4 sparse MLA): not one state per token
        if kind is None:
            why = REFUSED.get(name, "a KV cache spec type AscendStore does not know")
            bad.append(f"group {i} is {name}: {why}")
            continue
        window = getattr(spec, "sliding_window", None) if kind == "sliding" else None
        # FullAttentionSpec.sliding_window (HMA off): vLLM keeps every block, so it is "full".
        plans.append(GroupPlan(i, kind, name, tuple(g.layer_names), int(spec.block_size),
                               int(window) if window is not None else None, _spec_text(spec)))
    if bad:
        raise ConfigError(
            "AscendStoreConnector cannot pool this model's KV cache groups "
            f"[{describe_groups(kv_cache_groups)}]: " + "; ".join(bad)
            + ". Supported group types: " + ", ".join(SUPPORTED)
            + ". Serve the model without the connector (or without the hybrid KV cache manager, "
              "--disable-hybrid-kv-cache-manager, where vLLM allows it)."
        )
    block_sizes = {p.block_size for p in plans}
    if len(block_sizes) > 1:
        raise ConfigError(f"KV cache groups with different block sizes {sorted(block_sizes)} "
                          f"[{describe_groups(kv_cache_groups)}] are not supported")
    return tuple(plans)


def group_fingerprint_extra(plans: Sequence[GroupPlan], group: GroupPlan) -> str:
    """The fingerprint part naming a group: its index, spec and layers, and the
    whole grouping (two models grouped differently never share objects)."""
    layout = ";".join(f"{p.index}:{p.spec_text}:{len(p.layer_names)}" for p in plans)
    return f"group={group.index}|{group.spec_text}|layers={','.join(group.layer_names)}|groups={layout}"


# -- keys ---------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupedKeyBuilder(KeyBuilder):
    """KeyBuilder of a hybrid model: one fingerprint per KV cache group.

    ``fingerprint`` (the base class's) is group 0's; lookups ask for every
    group's object of each chunk, so a chunk hits only when every group can
    serve it."""

    group_fingerprints: tuple[str, ...] = ()

    def group_key(self, group: int, tenant: str, chunk_hash: str, layer: int | None = None) -> str:
        return _key_prefix(tenant, self.group_fingerprints[group], self.rank, layer) + chunk_hash

    def _lookup_prefixes(self, tenant: str) -> list[str]:
        ranks = self.all_ranks or (self.rank,)
        return [_key_prefix(tenant, fp, r, None) for fp in self.group_fingerprints for r in ranks]


# -- plans: which blocks of which group ------------------------------------------------
def load_refs(plans: Sequence[GroupPlan], bounds: Sequence[tuple[int, int]], hashes: Sequence[str],
              block_ids: Sequence[Sequence[int]], null: Sequence[Sequence[bool]], local_tokens: int,
              end_tokens: int, block_size: int) -> list[ChunkRef]:
    """ChunkRefs (one per chunk and group) that bring a request from
    ``local_tokens`` (on the device) to ``end_tokens`` (``hashes[i]`` names chunk i).

    Blocks vLLM keeps already (local hit) or does not keep (outside a sliding
    window: its null block) land in scratch (-1); a sliding-window object is read
    only if one of its blocks is needed."""
    refs: list[ChunkRef] = []
    end_block = -(-end_tokens // block_size)
    for i, (b0, b1) in enumerate(bounds):
        if b1 * block_size <= local_tokens:
            continue
        if b0 * block_size >= end_tokens:
            break
        for p in plans:
            ids, n = block_ids[p.index], null[p.index]
            if b1 > len(ids):
                return refs  # vLLM allocated no block for the rest: load what has somewhere to land
            s0, s1 = p.stored_blocks(b0, b1)
            want = [ids[b] if b * block_size >= local_tokens and b < end_block and not n[b] else -1
                    for b in range(s0, s1)]
            if all(b < 0 for b in want):
                continue  # nothing of this object is needed (outside the window, or local)
            refs.append(ChunkRef(i, hashes[i], want, p.index))
    return refs


def save_refs(plans: Sequence[GroupPlan], bounds: Sequence[tuple[int, int]], hashes: Sequence[str],
              block_ids: Sequence[Sequence[int]], first_block: int, null_block: int) -> list[ChunkRef]:
    """ChunkRefs of the chunks from ``first_block`` on, one per group. A group's
    object whose blocks vLLM does not hold (its null block: a sliding window
    that started past them on a local hit) is left out: the chunk then misses in
    lookups rather than serve garbage."""
    refs: list[ChunkRef] = []
    for i, (b0, b1) in enumerate(bounds):
        if b0 < first_block:
            continue
        for p in plans:
            ids = block_ids[p.index]
            if b1 > len(ids):
                continue
            s0, s1 = p.stored_blocks(b0, b1)
            chosen = list(ids[s0:s1])
            if any(b == null_block for b in chosen):
                continue
            refs.append(ChunkRef(i, hashes[i], chosen, p.index))
    return refs


def is_hybrid(plans: Sequence[GroupPlan]) -> bool:
    """Whether objects are per group (more than one group, or a sliding-window one)."""
    return len(plans) > 1 or any(p.kind != "full" for p in plans)


class SlidingPins:
    """Blocks of sliding-window saves, held until every worker has stored them.

    vLLM frees a sliding-window block as soon as the window has passed it, even
    while the request runs (``remove_skipped_blocks``), so a save still reading
    it on a transfer thread would race with the block's next owner. The
    scheduler takes one extra reference on each such block (``block_pool.touch``,
    as vLLM's own SimpleCPUOffloadConnector does for stores) and drops it when
    all ``world`` workers have reported the save done (``AscendStoreWorkerMeta``)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.block_pool: Any = None
        self._seq = 0
        #: blocks pinned so far (observability, tests)
        self.pinned_total = 0
        self._held: dict[tuple[str, int], list[Any]] = {}
        self._reports: dict[tuple[str, int], int] = {}

    def pin(self, req_id: str, block_ids: Sequence[int]) -> int:
        """Hold these blocks; the pin number travels with the save (SaveSpec.pin)."""
        assert self.block_pool is not None
        blocks = [self.block_pool.blocks[b] for b in block_ids]
        self.block_pool.touch(blocks)
        self.pinned_total += len(blocks)
        self._seq += 1
        self._held[(req_id, self._seq)] = blocks
        return self._seq

    def reported(self, pins_done: dict[tuple[str, int], int]) -> None:
        for key, n in pins_done.items():
            total = self._reports.get(key, 0) + n
            if total < self.world:
                self._reports[key] = total
                continue
            self._reports.pop(key, None)
            blocks = self._held.pop(key, None)
            if blocks is not None:
                self.block_pool.free_blocks(blocks)

    @property
    def held_blocks(self) -> int:
        return sum(len(b) for b in self._held.values())
