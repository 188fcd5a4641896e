"""Engine counters: what the connector reports through vLLM's stats hooks.

Counters accumulate between ``take()`` calls (vLLM collects per interval and
aggregates across workers by adding); gauges (queue depth) keep their peak.
State gauges (``degraded``) are reported by ``take()`` while non-zero and once
more after each change, so a return to 0 reaches Prometheus without a dict per
step from every idle process; across processes the maximum wins (1: some
process of the engine is degraded).

Labelled counters (hits by tier and by tenant) travel in the same flat dict
under ``name/label-value`` keys (see :func:`labelled`); label values are
bounded by the code that makes them (tiers are few, tenants are capped).
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
    # ... kept instead, where the store turns duplicate puts away (they may be another engine's)
    "save_partial_left",
    "load_buffers_retired",
    # a direct async load whose get overran: its request held until the get ended
    "load_held_late",
    # a load thread's get the watchdog gave up on (engine/watch.py)
    "loads_abandoned",
    "save_no_space",
    "timeouts",
    "unavailable",
    # admission (scheduler): chunks not saved
    "save_skipped_admission",
    "save_skipped_budget",
    # health (every process with a backend client)
    "health_degraded",
    "health_recovered",
    "health_probes",
    "degraded_skipped_keys",
    "lookups_skipped_degraded",
    "save_skipped_degraded",
    # a chunk counted as present at lookup, missing at load (evicted in between)
    "lookup_load_misses",
    # prompt tokens of requests the scheduler admitted (denominator of hit ratios)
    "prompt_tokens",
)
GAUGES: tuple[str, ...] = ("queue_depth_max", "inflight_bytes_max")
STATES: tuple[str, ...] = ("degraded",)
#: labelled counters: name -> label name.
LABELLED: dict[str, str] = {"hit_tokens": "tier", "tenant_hit_tokens": "tenant", "tenant_prompt_tokens": "tenant"}
LABEL_SEP = "/"


def labelled(name: str, value: str) -> str:
    """Key of one label value of a labelled counter in the stats dict."""
    return f"{name}{LABEL_SEP}{value}"


def split_labelled(key: str) -> tuple[str, str] | None:
    """(name, label value) of a labelled key, or None."""
    name, sep, value = key.partition(LABEL_SEP)
    return (name, value) if sep and name in LABELLED else None


class LabelCap:
    """Bounded label values: the first ``limit`` distinct values keep their own
    label, later ones share ``other`` (Prometheus series stay few)."""

    OTHER = "other"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        with self._lock:
            if len(self._seen) < self.limit:
                self._seen.add(value)
                return value
        return self.OTHER


class EngineMetrics:
    """Thread-safe counters; ``take()`` returns and resets them."""

    fields: ClassVar[tuple[str, ...]] = COUNTERS + GAUGES

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = dict.fromkeys(self.fields, 0)
        #: what earlier take()s returned, summed (gauges: their peak): totals() adds
        #: ``_data`` to it, so add() writes one dict, not two (it runs for every
        #: lookup and every transfer)
        self._taken: dict[str, float] = dict.fromkeys(self.fields, 0)
        self._states: dict[str, float] = {}
        self._changed: set[str] = set()

    def add(self, **deltas: float) -> None:
        # (acquire/release rather than ``with``: ~15% cheaper, and this runs for
        # every lookup and every transfer; the try keeps an unknown name from
        # leaving the lock held)
        lock = self._lock
        lock.acquire()
        try:
            data = self._data
            for k, v in deltas.items():
                data[k] += v
        finally:
            lock.release()

    def add_labelled(self, name: str, value: str, delta: float) -> None:
        """Add to one label value of a labelled counter (``LABELLED``)."""
        assert name in LABELLED, name
        key = labelled(name, value)
        with self._lock:
            self._data[key] = self._data.get(key, 0) + delta

    def set_state(self, **values: float) -> None:
        """A state gauge (``STATES``): reported in every take() from now on."""
        with self._lock:
            for k, v in values.items():
                assert k in STATES, k
                if self._states.get(k) != v:
                    self._changed.add(k)
                self._states[k] = v

    def peak(self, **values: float) -> None:
        with self._lock:
            for k, v in values.items():
                if v > self._data[k]:
                    self._data[k] = v

    def take(self) -> dict[str, float]:
        """Counters since the last take (zeros dropped), then reset."""
        with self._lock:
            out = {k: v for k, v in self._data.items() if v}
            if out:  # (an idle step, vLLM takes every step: no fresh dict of zeros)
                self._fold(out)
                self._data = dict.fromkeys(self.fields, 0)
            if self._states:
                out.update({k: v for k, v in self._states.items() if v or k in self._changed})
                self._changed.clear()
        return out

    def _fold(self, data: dict[str, float]) -> None:
        taken = self._taken
        for k, v in data.items():
            if k in GAUGES:
                taken[k] = max(taken[k], v)
            else:
                taken[k] = taken.get(k, 0) + v

    def totals(self) -> dict[str, float]:
        """Counters since start (never reset); for tests and the CLI."""
        with self._lock:
            out = dict(self._taken)
            for k, v in self._data.items():
                out[k] = max(out[k], v) if k in GAUGES else out.get(k, 0) + v
            out.update(self._states)
            return out

    @staticmethod
    def merge(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        out = dict(a)
        for k, v in b.items():
            if k in GAUGES or k in STATES:
                out[k] = max(out.get(k, 0), v)
            else:
                out[k] = out.get(k, 0) + v
        return out


def lookup_load_miss_counter(metrics: EngineMetrics):  # type: ignore[no-untyped-def]
    """A guard observer counting gets that found no object: every load is planned
    from a lookup that counted the chunk present, so each NOT_FOUND is a chunk
    that disappeared between lookup and load (evicted, expired, master restart)."""
    from ascendstore.contract import Status

    def observe(op: str, statuses: list) -> None:
        if op == "get":
            n = statuses.count(Status.NOT_FOUND)
            if n:
                metrics.add(lookup_load_misses=n)

    return observe
