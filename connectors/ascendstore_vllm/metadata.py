"""Scheduler -> worker plan for one step (plain dataclasses, pickled by vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # vLLM before the worker-meta path: no landing reports, so no BlockStored
    KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]


@dataclass(slots=True)
class ChunkRef:
    """A chunk of a request: absolute index, chained hash and its device blocks.

    Slotted: the worker reads these once per object per step with cold caches
    (the previous step's copy evicted them); no per-object ``__dict__`` to miss on."""

    index: int
    chunk_hash: str
    block_ids: list[int]
    #: KV cache group (hybrid models: one ref per chunk and group; see groups.py)
    group: int = 0


@dataclass
class LoadSpec:
    req_id: str
    tenant: str
    chunks: list[ChunkRef]
    is_async: bool = False


@dataclass
class SaveSpec:
    req_id: str
    tenant: str
    chunks: list[ChunkRef]
    #: >= 0: the scheduler pinned blocks vLLM may free mid-request (sliding
    #: window) for this save; workers report it done in AscendStoreWorkerMeta.
    pin: int = -1
    #: every chunk was computed for this request, none is part of its device
    #: prefix hit (re-saved in case the pool lost it): the pool is unlikely to
    #: hold any, so a store whose put turns duplicates away is asked no exists.
    computed: bool = False


@dataclass
class AscendStoreMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: finished requests whose blocks wait for their saves (report finished_sending).
    delayed_free: list[str] = field(default_factory=list)
    #: requests preempted this step: their transfers must stop touching blocks.
    preempted: list[str] = field(default_factory=list)
    #: request-level extension data (GR/PD helpers), opaque to this connector.
    extensions: dict[str, dict] = field(default_factory=dict)
    #: blocks some request of this step would read stale (stale.py): every worker
    #: reports them as load errors, so vLLM recomputes them.
    stale_blocks: list[int] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.delayed_free or self.preempted or self.stale_blocks)


@dataclass
class AscendStoreWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step (vLLM merges the ranks' metas with
    ``aggregate``): keys of this worker's saves now in the pool (put OK, or found
    there and skipped) since the last step -- the scheduler announces a chunk (KV
    event ``BlockStored``) once the union holds every object of it -- and the
    pinned saves (hybrid models' sliding-window blocks) this worker has finished,
    ``(req_id, pin) -> workers``."""

    landed: set[str] = field(default_factory=set)
    pins_done: dict[tuple[str, int], int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> AscendStoreWorkerMeta:
        assert isinstance(other, AscendStoreWorkerMeta)
        pins = dict(self.pins_done)
        for k, n in other.pins_done.items():
            pins[k] = pins.get(k, 0) + n
        return AscendStoreWorkerMeta(self.landed | other.landed, pins)

    def __bool__(self) -> bool:
        return bool(self.landed or self.pins_done)
