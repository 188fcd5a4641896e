"""Scheduler-side lookup: one batched existence query per request."""

from __future__ import annotations

from collections.abc import Sequence

from ascendstore.contract import Status
from ascendstore.engine.guard import BackendGuard
from ascendstore.engine.plan import KeyBuilder

_ANSWERS = {Status.OK, Status.NOT_FOUND}


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
        health = self.guard.monitor
        if health is not None and health.degraded:
            # Degraded: no traffic to the sick backend; a miss costs a recompute.
            self.guard.metrics.add(lookups=1, lookups_skipped_degraded=1)
            return start
        # every chunk has the same objects (ranks x layers): ``width`` keys each
        flat, width = self.keys.lookup_keys_flat(tenant, todo)
        statuses = self.guard.exists(flat, self.timeout_s)
        m = self.guard.metrics
        m.add(lookups=1, lookup_keys=len(flat))
        if set(statuses) - _ANSWERS:
            m.add(lookup_errors=1)
        # A chunk hits when all its objects exist; the run stops at the first miss.
        first_missing = next((i for i, s in enumerate(statuses) if s is not Status.OK), len(statuses))
        return start + first_missing // width
