"""Benchmark building blocks that need no vLLM: workloads, the prefill cost
model, the infinite-cache bound, the report schema, tables and plots.

The part that drives vLLM's scheduler and the connector lives in
``ascendstore_vllm.bench`` and registers the ``ascendstore bench`` command.
"""

from ascendstore.bench.bound import block_hashes, infinite_cache_hits, working_set_blocks
from ascendstore.bench.cost import PrefillCostModel
from ascendstore.bench.report import BenchReport, RequestRecord, build_report
from ascendstore.bench.workloads import WORKLOADS, BenchRequest, Workload, make_workload

__all__ = [
    "WORKLOADS",
    "BenchReport",
    "BenchRequest",
    "PrefillCostModel",
    "RequestRecord",
    "Workload",
    "block_hashes",
    "build_report",
    "infinite_cache_hits",
    "make_workload",
    "working_set_blocks",
]
