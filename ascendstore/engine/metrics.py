"""Engine counters: what the connector reports through vLLM's stats hooks.

Counters accumulate between ``take()`` calls (vLLM collects per interval and
aggregates across workers by adding); gauges (queue depth) keep their peak.
"""

from __future__ import annotations

import threading
from typing import ClassVar

COUNTERS: tuple[str, ...] = (
    "lookups",
    "lookup_keys",
    "lookup_hit_tokens",
    "lookup_miss_tokens",
    "lookup_errors",
    "load_ops",
    "load_bytes",
    "load_time_s",
    "load_failures",
    "load_corrupt",
    "save_ops",
    "save_bytes",
    "save_time_s",
    "save_failures",
    "save_skipped_existing",
    "save_skipped_not_writer",
    "save_dropped_queue_full",
    "save_dropped_late",
    "save_held_late",
    "save_partial_removed",
    "load_buffers_retired",
    "save_no_space",
    "timeouts",
    "unavailable",
)
GAUGES: tuple[str, ...] = ("queue_depth_max", "inflight_bytes_max")


class EngineMetrics:
    """Thread-safe counters; ``take()`` returns and resets them."""

    fields: ClassVar[tuple[str, ...]] = COUNTERS + GAUGES

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = dict.fromkeys(self.fields, 0)
        self._total: dict[str, float] = dict.fromkeys(self.fields, 0)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._data[k] += v
                self._total[k] += v

    def peak(self, **values: float) -> None:
        with self._lock:
            for k, v in values.items():
                if v > self._data[k]:
                    self._data[k] = v
                if v > self._total[k]:
                    self._total[k] = v

    def take(self) -> dict[str, float]:
        """Counters since the last take (zeros dropped), then reset."""
        with self._lock:
            out = {k: v for k, v in self._data.items() if v}
            self._data = dict.fromkeys(self.fields, 0)
        return out

    def totals(self) -> dict[str, float]:
        """Counters since start (never reset); for tests and the CLI."""
        with self._lock:
            return dict(self._total)

    @staticmethod
    def merge(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        out = dict(a)
        for k, v in b.items():
            if k in GAUGES:
                out[k] = max(out.get(k, 0), v)
            else:
                out[k] = out.get(k, 0) + v
        return out
