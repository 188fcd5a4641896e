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

* ``state`` (MambaSpec in vLLM's ``mamba_cache_mode='align'``, i.e. prefix
  caching on: Mamba/Mamba2 and linear attention such as Qwen3-Next's gated delta
  net): vLLM keeps a layer's recurrent state (conv + SSM) in the block of the
  position it was taken at; block ``p`` holds the state after ``(p + 1) *
  block_size`` tokens, and only where a scheduler step ended (or a prefill
  checkpoint was written): the other blocks are vLLM's null block. A request
  resumed at chunk boundary H needs exactly one state, the one at H. So a chunk's
  object holds its last block's state, saved only where vLLM kept one (a chunk
  boundary vLLM skipped has no state object, and a lookup cannot stop there);
  the load writes it into the block of the hit's last position, from which vLLM
  copies the state forward when the request resumes. That copy runs before the
  step's forward, i.e. before a synchronous load would land, so loads of models
  with state groups are always asynchronous. ``mamba_cache_mode='none'`` (prefix
  caching off) keeps one running state per request and nothing at chunk
  boundaries: refused.

Lookups (``group_prefix_hits``) take the longest prefix every group can resume
from: full groups need every chunk's object up to the hit, sliding groups only
the objects reaching into the window at the hit, state groups only the hit's
last chunk's object.

Everything else is refused at start-up, naming the model's group types, rather
than served wrong: chunked local attention, cross/encoder attention,
sink/R-SWA/hidden-state caches and any spec this module does not know have block
semantics the pool does not model.

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
    "MambaSpec": "state",
}

#: why a known spec cannot be pooled (the rest: "not known to AscendStore").
REFUSED: dict[str, str] = {
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
    kind: str  # "full" | "sliding" | "state"
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
        the window of the token at B - 1 starts at B - sliding_window. A state
        group keeps one block: the state at B."""
        if self.kind == "state":
            return 1
        if self.sliding_window is None:
            return 0
        return max(1, math.ceil(self.sliding_window / self.block_size))

    def stored_blocks(self, b0: int, b1: int) -> tuple[int, int]:
        """[first, end) block of chunk [b0, b1) that this group's object holds."""
        if self.kind == "full":
            return b0, b1
        return max(b0, b1 - self.window_blocks()), b1

    def needed_blocks(self, hit_blocks: int) -> tuple[int, int]:
        """[first, end) blocks a request resumed after ``hit_blocks`` blocks needs."""
        if self.kind == "full":
            return 0, hit_blocks
        return max(0, hit_blocks - self.window_blocks()), hit_blocks


def _spec_text(spec: Any) -> str:
    keys = ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "sliding_window",
            "kv_quant_mode", "cache_dtype_str", "page_size_padded", "num_head_slots", "tokens_per_state",
            "model_version", "cache_role", "shapes", "dtypes", "mamba_type", "mamba_cache_mode")
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
        if kind in ("full", "sliding") and getattr(spec, "tokens_per_state", 1) != 1:
            kind = None  # compressed states (DeepSeek V4 sparse MLA): not one state per token
        if kind is None:
            why = REFUSED.get(name, "a KV cache spec type AscendStore does not know")
            bad.append(f"group {i} is {name}: {why}")
            continue
        if kind == "state":
            why = _state_refusal(spec)
            if why:
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


def _state_refusal(spec: Any) -> str | None:
    """Why a MambaSpec group cannot be pooled exactly, or None."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        return (f"mamba_cache_mode={mode!r} keeps one running state per request, none at chunk "
                "boundaries (turn prefix caching on: vLLM then uses mamba_cache_mode 'align')")
    if int(getattr(spec, "num_speculative_blocks", 0) or 0):
        return "speculative-decoding state blocks are relocated mid-request; not modelled"
    return None


def has_state(plans: Sequence[GroupPlan]) -> bool:
    """Whether a group keeps recurrent state (loads must then be asynchronous)."""
    return any(p.kind == "state" for p in plans)


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

    def group_lookup_prefixes(self, tenant: str, group: int) -> list[str]:
        """Key prefixes of one group's object of a chunk, on every rank."""
        ranks = self.all_ranks or (self.rank,)
        return [_key_prefix(tenant, self.group_fingerprints[group], r, None) for r in ranks]


# -- lookups: the longest prefix every group can resume from ------------------------
def needed_chunks(plans: Sequence[GroupPlan], group: GroupPlan, hit: int, start: int, blocks_per_chunk: int,
                  end_block: int) -> range | list[int]:
    """Chunks (>= ``start``) of ``group`` whose objects a hit of ``hit`` chunks
    needs; ``end_block`` is the hit's end block (chunk ``hit - 1`` may be a
    partial tail). Every chunk but the last is full."""
    if group.kind == "full":
        return range(start, hit)
    first, _ = group.needed_blocks(end_block)
    # chunk j < hit - 1 ends at (j + 1) * bpc and holds its last window blocks; it is
    # needed when they reach past ``first``: (j + 1) * bpc > first, i.e. j >= first // bpc.
    # So the needed chunks run from there to the hit's last (a range: the lookup tries
    # hits from the longest down, and a loop over every chunk per hit tried made a long
    # prompt whose windows were evicted cost O(chunks^2))
    return list(range(max(start, min(first // blocks_per_chunk, hit - 1)), hit))


def group_prefix_hits(plans: Sequence[GroupPlan], present: Sequence[Sequence[bool]], start: int,
                      blocks_per_chunk: int, last_end_block: int) -> int:
    """The longest hit (in chunks, >= ``start``) every group can resume from.

    ``present[g][j - start]``: group g's object of chunk j is in the pool (on every
    rank). ``last_end_block``: end block of the last chunk offered (a partial tail
    ends before the next chunk boundary)."""
    n = start + (len(present[0]) if present else 0)
    top = n
    for p in plans:
        if p.kind == "full":
            col = present[p.index]
            miss = col.index(False) if False in col else n - start  # (in C: a 128k prompt has 1024)
            top = min(top, start + miss)
    for hit in range(top, start, -1):
        end_block = last_end_block if hit == n else hit * blocks_per_chunk
        if all(present[p.index][j - start] for p in plans if p.kind != "full"
               for j in needed_chunks(plans, p, hit, start, blocks_per_chunk, end_block)):
            return hit
    return start


class GroupLookup:
    """``PoolLookup.prefix_hits`` for hybrid models: one batched ``exists`` of
    every group's object of every offered chunk (all ranks), then
    ``group_prefix_hits``. Used by the scheduler-side client and by worker 0's
    lookup server alike."""

    def __init__(self, guard: Any, keys: GroupedKeyBuilder, plans: Sequence[GroupPlan], blocks_per_chunk: int,
                 timeout_s: float, partial_tail: bool) -> None:
        self.guard = guard
        self.keys = keys
        self.plans = tuple(plans)
        self.bpc = blocks_per_chunk
        self.timeout_s = timeout_s
        #: a partial tail chunk may end the offered hashes: its end block is not known
        #: here, so the window at it is taken from its first block (reads more objects,
        #: never fewer)
        self.partial_tail = partial_tail
        #: no pins between lookup and load for hybrid models yet (PoolLookup's ledger keys
        #: one object per chunk); the scheduler and the lookup server check for None
        self.pins = None

    def prefix_hits(self, tenant: str, chunk_hashes: Sequence[str] | Sequence[bytes], start: int = 0,
                    req_id: str | None = None) -> int:
        from ascendstore.contract import Status

        todo = [h.hex() if isinstance(h, bytes) else h for h in chunk_hashes[start:]]
        if not todo:
            return start
        health = self.guard.monitor
        m = self.guard.metrics
        if health is not None and health.degraded:
            m.add(lookups=1, lookups_skipped_degraded=1)
            return start
        per_group = [self.keys.group_lookup_prefixes(tenant, p.index) for p in self.plans]
        flat = [pre + h for prefixes in per_group for h in todo for pre in prefixes]
        statuses = self.guard.exists(flat, self.timeout_s)
        m.add(lookups=1, lookup_keys=len(flat))
        # A group's object of a chunk is present when it is on every rank (``w`` keys).
        # One pass over the answers, then slices and C-level grouping: a generator per
        # chunk and group was ~1.5 ms of a 128k prompt's lookup with two groups.
        ok = [s is Status.OK for s in statuses]
        present: list[list[bool]] = []
        pos, n = 0, len(todo)
        for prefixes in per_group:
            w = len(prefixes)
            seg = ok[pos: pos + w * n]
            present.append(seg if w == 1 else list(map(all, zip(*[iter(seg)] * w, strict=True))))
            pos += w * n
        n = len(chunk_hashes)
        last_end = (n - 1) * self.bpc + 1 if self.partial_tail else n * self.bpc
        return group_prefix_hits(self.plans, present, start, self.bpc, last_end)


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


def expand_state_caches(kv_caches: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[str, ...]]]:
    """vLLM hands a state (MambaSpec) layer's cache as a list of tensors (conv
    state, SSM state: views into one page per block). Each becomes a layer of its
    own, ``name#i``; returns the flat dict and each layer's names in it."""
    flat: dict[str, Any] = {}
    names: dict[str, tuple[str, ...]] = {}
    for name, t in kv_caches.items():
        if isinstance(t, (list, tuple)):
            sub = tuple(f"{name}#{i}" for i in range(len(t)))
            flat.update(zip(sub, t, strict=True))
            names[name] = sub
        else:
            flat[name] = t
            names[name] = (name,)
    return flat, names


def is_hybrid(plans: Sequence[GroupPlan]) -> bool:
    """Whether objects are per group (more than one group, or a sliding-window one)."""
    return len(plans) > 1 or any(p.kind != "full" for p in plans)


class SlidingPins:
    """Blocks of sliding-window and state saves, held until every worker has stored them.

    vLLM frees a sliding-window block as soon as the window has passed it, and a
    state block once the state has been copied forward, even while the request
    runs (``remove_skipped_blocks``), so a save still reading it on a transfer
    thread would race with the block's next owner. The
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
