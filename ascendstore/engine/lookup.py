"""Scheduler-side lookup: how many chunks of a prompt are in the pool, in one call.

A backend with a native prefix scan (``prefix_run``, e.g. the embedded ``local``
pool) answers in one call that builds the keys, probes them and stops at the
first miss; any other backend gets one batched ``exists`` of every key. With
pins on, a scan that can pin (``prefix_run(..., lease_s=)`` and ``unpin_run``)
pins what it counts in that same call. On a backend without a native scan, a
request's first lookup is one ``pin`` of every key (the contract's ``pin`` is an
``exists`` that also pins), and the keys pinned past the first miss are let go
of; a later lookup of a request that holds its pinned run asks only about the
chunks after that run (nothing, when the run is the whole prompt), and is one
``pin`` again when the run changed or half the lease is gone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

from ascendstore.contract import Status
from ascendstore.engine.guard import BackendGuard
from ascendstore.engine.pins import LookupPins
from ascendstore.engine.plan import KeyBuilder

log = logging.getLogger(__name__)

_ANSWERS = {Status.OK, Status.NOT_FOUND}

#: "linear": probe every chunk up to the first miss (exact). "gallop": probe
#: chunks 0, 2, 6, 14, ... then bisect: O(log n) probes, relying on the prefix
#: property of chained keys; an eviction hole below a probed hit is not seen, so
#: the hit can be overcounted (its load then fails and is recomputed). Only
#: backends with a native scan gallop; see docs/benchmarking.md for the trade.
Probe = Literal["linear", "gallop"]


class PoolLookup:
    def __init__(
        self, guard: BackendGuard, keys: KeyBuilder, timeout_s: float, probe: Probe = "linear",
        *, pin_lease_s: float = 0.0,
    ) -> None:
        self.guard = guard
        self.keys = keys
        self.timeout_s = timeout_s
        self.probe = probe
        self._gallop = probe == "gallop"
        #: each tenant's key prefixes for the scan (built once: a waiting request is
        #: looked up every step, and building them was ~5% of a 128k prompt's lookup)
        self._prefixes: dict[str, list[str]] = {}
        #: pins what a lookup with a request id counted (backends declaring ``pins``;
        #: None: no pins). The owner releases them when the request's load ends.
        # In-process and bounded (the guard calls it inline): no thread hand-off needed.
        scan = getattr(guard.backend, "prefix_run", None)
        self._scan = scan if callable(scan) and guard.backend.capabilities.bounded_calls else None
        # A scan that can also pin (and a way to let go of such pins) takes a
        # request's pins in the same native pass: no key string per object.
        unpin_run = getattr(guard.backend, "unpin_run", None)
        self._unpin_run = unpin_run if self._scan is not None and callable(unpin_run) else None
        # Such a backend may also count pinned objects that left it (pin_breaks):
        # then a request's pinned run, unbroken, is not probed again (_pinned_scan).
        breaks = getattr(guard.backend, "pin_breaks", None)
        self._pin_breaks = breaks if self._unpin_run is not None and callable(breaks) else None
        self.pins: LookupPins | None = (
            LookupPins(guard, pin_lease_s, timeout_s, unpin_run=self._unpin_chunks if self._unpin_run else None)
            if pin_lease_s > 0 and LookupPins.supported(guard)
            else None
        )

    def prefix_hits(
        self, tenant: str, chunk_hashes: Sequence[str] | Sequence[bytes], start: int = 0, req_id: str | None = None
    ) -> int:
        """Chunks present in the pool as an unbroken run from ``start``.

        ``chunk_hashes``: hex strings, or raw hashes (bytes) whose hex is meant.
        Returns the absolute chunk count (>= start; == start on a miss). Chunks
        before ``start`` are already on the device and are not queried. With
        ``req_id`` and pins on, the counted chunks are pinned for that request
        (the count is what is pinned) until ``pins.release(req_id)``; the ledger may
        then keep ``chunk_hashes`` itself, so the caller must not change that list."""
        if self.pins is None or req_id is None:
            return self._prefix_hits(tenant, chunk_hashes, start)
        if self.pins.by_run:
            return self._pinned_scan(tenant, chunk_hashes, start, req_id)
        if self._scan is None:
            return self._pinned_keys(tenant, chunk_hashes, start, req_id)
        hits = self._prefix_hits(tenant, chunk_hashes, start)
        if hits <= start:
            self.pins.release(req_id)
            return hits
        counted = chunk_hashes[start:hits]
        run = (tenant, start, counted[0], counted[-1], hits - start)
        if self.pins.holds(req_id, run):
            return hits  # looked up again, same run, lease well within: still pinned
        flat, width = self.keys.lookup_keys_flat(tenant, counted)
        return start + self.pins.pin(req_id, flat, width, run)

    def _pinned_keys(self, tenant: str, chunk_hashes: Sequence[str] | Sequence[bytes], start: int,
                     req_id: str) -> int:
        """A backend without a native scan. A request that holds its pinned run (this
        prompt's from ``start``, half its lease left) is looked up again (vLLM asks
        every step while it waits): only the chunks after that run are asked about,
        none when the run is the whole prompt. The pin keeps the run's objects (the
        contract): asking about them again each step was, on Mooncake, 1024 answers
        checked in the exists cache for a 128k prompt, or a master round trip once
        they aged past its TTL. Any other lookup (the first, a renewal, another run)
        is one ``pin`` of every key from ``start``."""
        pins = self.pins
        assert pins is not None
        if pins.holding(req_id) and not self._degraded():
            # (under the ledger's lock: no release between the answer and the count)
            with pins.pinning():
                end = pins.held_run(req_id, tenant, chunk_hashes, start)
                if end is not None and self._held_answers(tenant, chunk_hashes, end):
                    return end
                # (else: not its run, or more is present after it: pin again, below)
        return self._pinning_exists(tenant, chunk_hashes, start, req_id)

    def _held_answers(self, tenant: str, chunk_hashes: Sequence[str] | Sequence[bytes], end: int) -> bool:
        """The run a request holds, still whole, ends at ``end``: it answers the lookup
        when it is the whole prompt (no call) or nothing more is present after it (the
        chunks after it asked about)."""
        if end == len(chunk_hashes):
            self.guard.metrics.add(lookups=1)
            return True
        return self._prefix_hits(tenant, chunk_hashes, end) == end

    def _pinning_exists(self, tenant: str, chunk_hashes: Sequence[str] | Sequence[bytes], start: int,
                        req_id: str) -> int:
        """A request's first lookup on a backend without a native scan (or one whose
        pinned run no longer answers it, ``_pinned_keys``): one ``pin`` of every key
        answers and pins, replacing what the request held. An ``exists`` and then a
        ``pin`` of what it counted was two calls (two master round trips on Mooncake, a new request's
        lookup at 3.1-3.4x the raw ``batch_is_exist``). Present keys past the first
        miss are pinned by the call too and let go of at once (an ``exists`` there
        would have touched them as well: on Mooncake both are read leases)."""
        pins = self.pins
        assert pins is not None
        todo = self._to_ask(chunk_hashes, start)
        if not todo:
            if pins.holding(req_id):
                pins.release(req_id)  # (nothing counted: what it held is not its to keep)
            return start
        flat, width = self.keys.lookup_keys_flat(tenant, todo)
        # (under the ledger's lock, as pin(): no release between the pins and their record)
        with pins.pinning():
            statuses = self.guard.pin(flat, pins.lease_s, self.timeout_s)
            hits = self._counted(statuses, width)
            run = (tenant, start, todo[0], todo[hits - 1], hits) if hits else None
            pins.pinned(req_id, flat, width, statuses, hits, run, (tenant, start))
        return start + hits

    def _pinned_scan(self, tenant: str, chunk_hashes: Sequence[str] | Sequence[bytes], start: int,
                     req_id: str) -> int:
        """The scan pins what it counts. A request looked up again (vLLM asks every
        step while it waits) that holds its pinned run whole asks only about the
        chunks after it; one that finds the run it holds, with half its lease left,
        makes no pin call."""
        pins = self.pins
        assert pins is not None
        # (read before the pinning scan below: a pinned object leaving after it shows)
        breaks = self._pin_breaks() if self._pin_breaks is not None else -1
        held = None
        # (a request's first lookup holds nothing yet: straight to the pinning scan)
        holding = pins.holding(req_id)
        if holding and breaks >= 0 and not self._degraded():
            # Its pinned run (this prompt's from ``start``) is whole while no pinned
            # object left the pool since it was pinned. Only the chunks after it are
            # asked about: a waiting request of 1024 chunks costs one probe a step, not
            # 1024. (Under the ledger's lock: no release between the answer and its pins.)
            with pins.pinning():
                held = pins.held_prefix(req_id, tenant, chunk_hashes, start, breaks)
                if held is not None and self._held_answers(tenant, chunk_hashes, held):
                    return held
                # (held and more present now: pin the longer run, below)
        if holding and held is None and pins.fresh(req_id):
            hits = self._prefix_hits(tenant, chunk_hashes, start)
            if hits <= start:
                pins.release(req_id)
                return hits
            run = (tenant, start, chunk_hashes[start], chunk_hashes[hits - 1], hits - start)
            if pins.holds(req_id, run):
                return hits  # looked up again, same run, lease well within: still pinned
        # The ledger's lock spans the pinning scan and its record, as it spans pin():
        # a release on another thread must not unpin a chunk between the two.
        with pins.pinning():
            hits = self._prefix_hits(tenant, chunk_hashes, start, pins.lease_s)
            if hits <= start:
                pins.release(req_id)
                return hits
            # (the whole list, unsliced, when the whole prompt hit: lists passed here are not changed)
            counted = chunk_hashes if not start and hits == len(chunk_hashes) else chunk_hashes[start:hits]
            pins.took(req_id, tenant, counted, (tenant, start, counted[0], counted[-1], hits - start), breaks)
        return hits

    def _degraded(self) -> bool:
        health = self.guard.monitor
        return health is not None and health.degraded

    def _tenant_prefixes(self, tenant: str) -> list[str]:
        """Every object's key of a chunk is one of these + the chunk hash (kept per tenant)."""
        prefixes = self._prefixes.get(tenant)
        if prefixes is None:
            if len(self._prefixes) >= 4096:  # tenants come and go: a bound, not an LRU
                self._prefixes.clear()
            prefixes = self._prefixes[tenant] = self.keys.lookup_keys(tenant, "")
        return prefixes

    def _unpin_chunks(self, tenant: str, chunk_hashes: Sequence) -> None:
        assert self._unpin_run is not None
        try:
            status = self._unpin_run(self._tenant_prefixes(tenant), chunk_hashes, self.timeout_s)
        except Exception:
            log.exception("backend unpin of %d chunks raised; their pins end with the lease", len(chunk_hashes))
            return
        if status is not Status.OK:
            log.debug("unpin of %d chunks: %s; their pins end with the lease", len(chunk_hashes), status)

    def _prefix_hits(
        self, tenant: str, chunk_hashes: Sequence[str] | Sequence[bytes], start: int, lease_s: float = 0.0
    ) -> int:
        todo = self._to_ask(chunk_hashes, start)
        if not todo:
            return start
        if self._scan is not None:
            return start + self._scan_hits(tenant, todo, lease_s)
        # every chunk has the same objects (ranks x layers): ``width`` keys each
        flat, width = self.keys.lookup_keys_flat(tenant, todo)
        return start + self._counted(self.guard.exists(flat, self.timeout_s), width)

    def _to_ask(self, chunk_hashes: Sequence[str] | Sequence[bytes], start: int) -> Sequence:
        """The chunks from ``start`` a lookup asks about: none when there are none, or
        when the backend is degraded (no traffic to the sick backend; a miss costs a
        recompute; counted)."""
        todo = chunk_hashes[start:] if start else chunk_hashes
        if todo and self._degraded():
            self.guard.metrics.add(lookups=1, lookups_skipped_degraded=1)
            return ()
        return todo

    def _counted(self, statuses: list[Status], width: int) -> int:
        """Chunks of a lookup's answers (``width`` per chunk) that hit, as a run
        from the first; counted in the lookup metrics."""
        m = self.guard.metrics
        m.add(lookups=1, lookup_keys=len(statuses))
        if statuses.count(Status.OK) == len(statuses):
            # (the usual answer: ``count`` compares by identity first, in C; the set
            # below hashes each answer, ~6 of a whole 128k prompt's 9 us here)
            return len(statuses) // width
        kinds = set(statuses)
        if kinds - _ANSWERS:
            m.add(lookup_errors=1)
        # A chunk hits when all its objects exist; the run stops at the first miss.
        return first_other(statuses, kinds, Status.OK) // width

    def _scan_hits(self, tenant: str, todo: Sequence[str] | Sequence[bytes], lease_s: float = 0.0) -> int:
        prefixes = self._tenant_prefixes(tenant)
        m = self.guard.metrics
        try:
            if lease_s > 0:
                status, hits, probes = self._scan(prefixes, todo, self.timeout_s, gallop=self._gallop, lease_s=lease_s)
            else:
                status, hits, probes = self._scan(prefixes, todo, self.timeout_s, gallop=self._gallop)
        except Exception:
            log.exception("backend prefix scan of %d chunks raised; reporting a miss", len(todo))
            m.add(lookups=1, lookup_errors=1, unavailable=len(todo) * len(prefixes))
            return 0
        m.add(lookups=1, lookup_keys=probes * len(prefixes))
        if status is not Status.OK:
            m.add(lookup_errors=1, **({"timeouts": 1} if status is Status.TIMEOUT else {}))
            return 0
        return hits


def first_other(items: list, kinds: set, value: object) -> int:
    """Index of the first of ``items`` that is not ``value`` (``len(items)`` when all
    are); ``kinds``: ``set(items)``. Found with ``list.index`` per other kind, in C:
    a Python loop over a 128k prompt's 1024 answers was ~120 us of a lookup's ~260
    on a 2-vCPU host (backends without a native scan: Mooncake, MemCache)."""
    others = [k for k in kinds if k is not value]
    return min(map(items.index, others)) if others else len(items)
