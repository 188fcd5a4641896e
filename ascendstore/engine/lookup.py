"""Scheduler-side lookup: one batched existence query per request."""

from __future__ import annotations

from collections.abc import Sequence

from ascendstore.contract import Status
from ascendstore.engine.guard import BackendGuard
from ascendstore.engine.plan import KeyBuilder


class PoolLookup:
    def __init__(self, guard: BackendGuard, keys: KeyBuilder, timeout_s: float) -> None:
        self.guard = guard
        self.keys = keys
        self.timeout_s = timeout_s

    def prefix_hits(self, tenant: str, chunk_hashes: Sequence[str], start: int = 0) -> int:
        """Chunks present in the pool as an unbroken run from ``start``.

        Returns the absolute chunk count (>= start; == start on a miss). Chunks
        before ``start`` are already on the device and are not queried."""
        todo = list(chunk_hashes[start:])
        if not todo:
            return start
        per_chunk = [self.keys.lookup_keys(tenant, h) for h in todo]
        flat = [k for ks in per_chunk for k in ks]
        statuses = self.guard.exists(flat, self.timeout_s)
        m = self.guard.metrics
        m.add(lookups=1, lookup_keys=len(flat))
        if any(s not in (Status.OK, Status.NOT_FOUND) for s in statuses):
            m.add(lookup_errors=1)
        i = 0
        hits = 0
        for ks in per_chunk:
            if all(s is Status.OK for s in statuses[i : i + len(ks)]):
                hits += 1
                i += len(ks)
            else:
                break
        return start + hits
