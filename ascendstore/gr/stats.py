"""GR statistics: the seed's five counters plus what explains them.

Three-level hit per GR request: ``device_hits`` (HBM prefix cache already
holds the history), ``dram_hits`` (the pool holds it: a swap-in follows),
``dram_misses`` (neither: the history is recomputed and saved).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

#: the counters named by the GR design (kept first, in this order, in reports)
SEED_COUNTERS = ("lru_evictions", "dram_hits", "dram_misses", "swapin_attempts", "swapin_successes")


@dataclass
class GRStats:
    lru_evictions: int = 0  # users evicted from the device by the user-level LRU
    dram_hits: int = 0  # requests whose history (beyond the device hit) the pool holds
    dram_misses: int = 0  # requests the pool could not serve
    swapin_attempts: int = 0  # pool -> device loads started
    swapin_successes: int = 0  # ... that completed byte-exact
    device_hits: int = 0  # requests whose whole pooled history was already on the device
    hit_tokens_device: int = 0
    hit_tokens_pool: int = 0
    saves: int = 0  # user histories written to the pool
    bytes_saved: int = 0  # KV bytes written (this rank's objects)
    bytes_loaded: int = 0  # KV bytes read into the device (this rank; skipped blocks excluded)
    save_failures: int = 0
    late_saves_reclaimed: int = 0  # objects a timed-out save stored late, removed once its call ended
    invalidations: int = 0  # stored histories cut back because a request rewrote them
    expired: int = 0  # users dropped for TTL
    quota_truncations: int = 0  # saves cut to fit the per-user quota
    quota_evictions: int = 0  # users removed from the pool to fit a tenant quota
    quota_skips: int = 0  # saves skipped because the quota left no room
    deleted_users: int = 0
    invalid_inputs: int = 0  # GR requests with unusable fields (served as ordinary requests)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                setattr(self, name, getattr(self, name) + d)

    def snapshot(self, reset: bool = False) -> dict[str, int]:
        with self._lock:
            data = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
            if reset:
                for name in data:
                    setattr(self, name, 0)
        return data

    def merge(self, data: dict[str, int]) -> None:
        self.add(**{k: v for k, v in data.items() if k in _NAMES})


_NAMES = {f.name for f in fields(GRStats) if not f.name.startswith("_")}
