"""The pool engine: everything between vLLM's connector API and a storage backend.

No vLLM import here. The connector in ``connectors/`` is a thin adapter that
turns vLLM objects (block hashes, block ids, KV tensors) into the plain data
this package works on: chunk hashes, memory regions and block ids.
"""

from ascendstore.engine.guard import BackendGuard
from ascendstore.engine.layout import KVLayout, LayerSpan, tensor_block_runs
from ascendstore.engine.lookup import PoolLookup
from ascendstore.engine.metrics import EngineMetrics
from ascendstore.engine.plan import ChunkOp, KeyBuilder, ReplicaGroup, chunk_count, stagger
from ascendstore.engine.transfer import SharedExists, Stager, StepObjects, TransferEngine, TransferResult

__all__ = [
    "BackendGuard",
    "ChunkOp",
    "EngineMetrics",
    "KVLayout",
    "KeyBuilder",
    "LayerSpan",
    "PoolLookup",
    "ReplicaGroup",
    "SharedExists",
    "Stager",
    "StepObjects",
    "TransferEngine",
    "TransferResult",
    "chunk_count",
    "stagger",
    "tensor_block_runs",
]
