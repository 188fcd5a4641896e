"""What a perfect cache could save: the infinite-cache bound of a workload.

A pure function of the requests' prompts in arrival order. A request can reuse
the longest run of leading *full* blocks that some earlier request already
produced; like vLLM, at least the last prompt token is always computed. No
finite cache, device or pool, can save more at block granularity, so the
benchmark reports its savings against this bound.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ascendstore.bench.workloads import BenchRequest


def block_hashes(tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[bytes]:
    """Chained content hash of each full block (a block's hash covers its whole
    prefix, as vLLM's do). Only identity matters here, not vLLM's exact bytes."""
    arr = np.asarray(tokens, dtype=np.int64)
    parent = hashlib.sha256((salt or "").encode()).digest()
    out = []
    for i in range(len(arr) // block_size):
        parent = hashlib.blake2b(
            parent + arr[i * block_size : (i + 1) * block_size].tobytes(), digest_size=16
        ).digest()
        out.append(parent)
    return out


def cacheable_blocks(prompt_len: int, block_size: int) -> int:
    """Full blocks a cache may serve: vLLM always computes the last prompt token."""
    return max(0, prompt_len - 1) // block_size


def infinite_cache_hits(requests: Sequence[BenchRequest], block_size: int) -> list[int]:
    """Per request (in the given order), the prompt tokens an infinite cache serves."""
    seen: set[bytes] = set()
    hits = []
    for r in requests:
        hashes = block_hashes(r.prompt, block_size, r.tenant)
        n = 0
        for h in hashes[: cacheable_blocks(r.prompt_len, block_size)]:
            if h not in seen:
                break
            n += 1
        hits.append(n * block_size)
        seen.update(hashes)
    return hits


def working_set_blocks(requests: Sequence[BenchRequest], block_size: int) -> int:
    """Distinct full blocks across all prompts: what an infinite pool would hold."""
    seen: set[bytes] = set()
    for r in requests:
        seen.update(block_hashes(r.prompt, block_size, r.tenant))
    return len(seen)


def reusable_blocks(requests: Sequence[BenchRequest], block_size: int) -> int:
    """Distinct full blocks that more than one request's prompt contains: the
    working set a pool is for (one-off blocks, e.g. GR candidates, never hit)."""
    count: dict[bytes, int] = {}
    for r in requests:
        for h in set(block_hashes(r.prompt, block_size, r.tenant)):
            count[h] = count.get(h, 0) + 1
    return sum(1 for n in count.values() if n > 1)
