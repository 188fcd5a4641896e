"""Which computed chunks are worth a write to the pool.

A pool shared by many engines fills with whatever was computed last. One-off
prompts (a long cold document asked about once) then evict the hot prefixes
every engine reuses. Two scheduler-side filters, planned where saves are
planned so no bytes move for a chunk that is not admitted:

- ``admit_after_hits`` N: a chunk is saved only once N requests have used it
  (the N-th sighting writes it). Sightings are counted in a bounded LRU of
  chunk keys (``cachetools.LRUCache``): a chunk not seen for a long while is
  forgotten and starts again from 0, memory stays ``track_chunks`` entries.
- ``budget_bytes_per_step``: KV bytes (per rank) one scheduler step may plan to
  save; chunks beyond it are skipped (a future miss, never a stall).

Admission is prefix-closed per request: chunk keys are chained, a chunk is
useless in the pool without the chunks before it, so once one chunk of a
request is refused, the request's later chunks in that plan are refused too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cachetools import LRUCache


@dataclass
class AdmissionStats:
    refused_hits: int = 0
    refused_budget: int = 0


class SaveAdmission:
    def __init__(self, admit_after_hits: int = 1, budget_bytes_per_step: int = 0, track_chunks: int = 65536) -> None:
        if admit_after_hits < 1 or track_chunks < 1 or budget_bytes_per_step < 0:
            raise ValueError("admit_after_hits and track_chunks must be >= 1, budget_bytes_per_step >= 0")
        self.admit_after_hits = admit_after_hits
        self.budget = budget_bytes_per_step
        # Only needed when chunks must be seen more than once.
        self._seen: LRUCache[str, int] | None = LRUCache(track_chunks) if admit_after_hits > 1 else None
        self._spent = 0

    @property
    def active(self) -> bool:
        return self._seen is not None or bool(self.budget)

    @property
    def tracked(self) -> int:
        return 0 if self._seen is None else len(self._seen)

    def new_step(self) -> None:
        self._spent = 0

    def sight(self, key: str) -> int:
        """Count one more use of a chunk; returns its uses so far."""
        if self._seen is None:
            return 1
        n = self._seen.get(key, 0) + 1
        self._seen[key] = n
        return n

    def admit(self, keys: Sequence[str], chunk_bytes: int) -> tuple[int, AdmissionStats]:
        """How many leading chunks of one request's plan (``keys`` in order) to
        save; every chunk is counted as sighted either way."""
        stats = AdmissionStats()
        admitted = len(keys)
        for i, key in enumerate(keys):
            seen = self.sight(key)
            if admitted < len(keys):
                continue  # prefix-closed: later chunks only count their sighting
            if seen < self.admit_after_hits:
                admitted = i
                stats.refused_hits = len(keys) - i
            elif self.budget and self._spent + chunk_bytes > self.budget:
                admitted = i
                stats.refused_budget = len(keys) - i
            else:
                self._spent += chunk_bytes
        return admitted, stats
