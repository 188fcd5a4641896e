"""Chunks, keys, writer selection (dedup) and staggered read order.

A chunk is ``blocks_per_chunk`` consecutive vLLM blocks; its hash is vLLM's
chained block hash of its last block (see ``ascendstore.keys``), so a chunk
key names the whole prefix up to and including that chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from ascendstore.contract import Region
from ascendstore.keys import PoolKey, RankPart
from ascendstore.local._shmpool import hex_keys  # the core's one C extension (as transfer.py's scatter)


@lru_cache(maxsize=8192)
def _key_prefix(tenant: str, fingerprint: str, rank: RankPart, layer: int | None) -> str:
    """Everything of a key but the chunk hash. Lookups of long prompts build
    thousands of keys; concatenating onto a cached prefix keeps that cheap (and
    a worker step builds one key per object: ~4 us each uncached)."""
    return PoolKey(tenant, fingerprint, rank, "", layer).text()


def chunk_count(num_tokens: int, chunk_size: int) -> int:
    """Full chunks in ``num_tokens`` tokens."""
    return num_tokens // chunk_size


@dataclass(frozen=True)
class KeyBuilder:
    """Builds key text for one rank (or for every rank, for lookups)."""

    fingerprint: str
    rank: RankPart
    layerwise: bool = False
    num_layers: int = 1
    #: rank parts whose objects must all exist for a chunk to count as a hit.
    all_ranks: tuple[RankPart, ...] = ()

    def key(self, tenant: str, chunk_hash: str, layer: int | None = None) -> str:
        return _key_prefix(tenant, self.fingerprint, self.rank, layer) + chunk_hash

    def prefix(self, tenant: str, layer: int | None = None) -> str:
        """Everything of this rank's key but the chunk hash (``key`` is ``prefix + chunk_hash``)."""
        return _key_prefix(tenant, self.fingerprint, self.rank, layer)

    def keys(self, tenant: str, chunk_hashes: Sequence[str]) -> list[str]:
        prefix = _key_prefix(tenant, self.fingerprint, self.rank, None)
        return [prefix + h for h in chunk_hashes]

    def layer_keys(self, tenant: str, chunk_hash: str) -> list[str]:
        return [self.key(tenant, chunk_hash, layer) for layer in range(self.num_layers)]

    def lookup_keys(self, tenant: str, chunk_hash: str) -> list[str]:
        """Every object that must be present for this chunk to be loadable."""
        return [p + chunk_hash for p in self._lookup_prefixes(tenant)]

    def lookup_keys_flat(self, tenant: str, chunk_hashes: Sequence[str] | Sequence[bytes]) -> tuple[list[str], int]:
        """``lookup_keys`` of many chunks in one flat list, and the keys per chunk.
        Raw hashes (bytes, as vLLM's scheduler has them) stand for their hex."""
        prefixes = self._lookup_prefixes(tenant)
        raw = bool(chunk_hashes) and isinstance(chunk_hashes[0], bytes)
        if raw and all(p.isascii() for p in prefixes):
            # Most of a long prompt's lookup on a backend without a native scan was
            # these keys: in C one string each (14 us for 1024, against 61 for
            # ``p + h.hex()``, two strings each). (isascii is a flag, not a pass.)
            return hex_keys(prefixes, chunk_hashes), len(prefixes)
        if raw:
            chunk_hashes = [h.hex() for h in chunk_hashes]  # type: ignore[union-attr]
        if len(prefixes) == 1:
            p = prefixes[0]
            return [p + h for h in chunk_hashes], 1  # type: ignore[operator]
        return [p + h for h in chunk_hashes for p in prefixes], len(prefixes)  # type: ignore[operator]

    def _lookup_prefixes(self, tenant: str) -> list[str]:
        ranks = self.all_ranks or (self.rank,)
        layers: Sequence[int | None] = range(self.num_layers) if self.layerwise else (None,)
        return [_key_prefix(tenant, self.fingerprint, r, lay) for r in ranks for lay in layers]


@dataclass(frozen=True)
class ReplicaGroup:
    """Ranks that hold identical KV (MLA, or fewer KV heads than TP ranks).

    ``size`` consecutive TP ranks form a group; ``index`` is this rank's place
    in it. Exactly one rank of a group writes each chunk, round robin over the
    chunk's absolute index so writes spread evenly and every rank agrees.
    """

    size: int = 1
    index: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.index < self.size:
            raise ValueError(f"bad replica group size={self.size} index={self.index}")

    def writes(self, chunk_index: int) -> bool:
        return chunk_index % self.size == self.index

    @classmethod
    def for_tp(cls, tp_rank: int, tp_size: int, replicas: int) -> ReplicaGroup:
        replicas = max(1, min(replicas, tp_size))
        return cls(replicas, tp_rank % replicas)


def stagger(items: Sequence, index: int, size: int) -> list:
    """Rotate a read list so ranks reading the same chunks start apart.

    Rank ``index`` of ``size`` starts ``index/size`` of the way along, so no
    storage node is hit by every rank for the same object at once."""
    n = len(items)
    if n <= 1 or size <= 1:
        return list(items)
    shift = (index * n) // size
    return list(items[shift:]) + list(items[:shift])


@dataclass(eq=False, slots=True)
class ChunkOp:
    """One object to move: key, regions in order, and the device blocks it fills.

    ``build`` (with ``nbytes``) defers computing the regions until the transfer
    thread needs them, so building one batch's regions overlaps the previous
    batch's copy."""

    key: str
    regions: list[Region]
    block_ids: list[int]
    chunk_index: int = 0
    layer: int | None = None
    nbytes: int = field(default=0)
    build: Callable[[], list[Region]] | None = None

    def __post_init__(self) -> None:
        if not self.nbytes:
            self.nbytes = sum(r.length for r in self.regions)

    def materialize(self) -> list[Region]:
        if self.build is not None:
            self.regions = self.build()
            self.build = None
        return self.regions
