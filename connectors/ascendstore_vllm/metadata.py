"""Scheduler -> worker plan for one step (plain dataclasses, pickled by vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

try:  # vLLM >= 0.32: a worker -> scheduler channel
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM: no pins (groups.py refuses sliding saves)
    KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]


@dataclass
class ChunkRef:
    """A chunk of a request: absolute index, chained hash and its device blocks."""

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

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.delayed_free or self.preempted)


@dataclass
class AscendStoreWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: pinned saves this worker has finished, ``(req_id, pin)
    -> workers`` (summed over TP/PP workers by vLLM's aggregator)."""

    pins_done: dict[tuple[str, int], int] = field(default_factory=dict)

    def aggregate(self, other: AscendStoreWorkerMeta) -> AscendStoreWorkerMeta:
        out = dict(self.pins_done)
        for k, n in other.pins_done.items():
            out[k] = out.get(k, 0) + n
        return AscendStoreWorkerMeta(out)

    def __bool__(self) -> bool:
        return bool(self.pins_done)
