"""Pins between lookup and load: what a lookup counted stays loadable.

A pool shared by many engines evicts; a chunk counted present by the lookup
can be gone when its load runs a step later (a miss costs a recompute). A
backend declaring ``capabilities.pins`` can keep objects from eviction for a
short lease; this ledger pins exactly the keys a lookup counted, per request,
and lets go when the request's load ends (success or failure), when the
request is finished or aborted before loading, or when the lease runs out.

The backend pins per *process* (a key pinned twice by one client is one pin,
and ``unpin`` ends it) while several requests of this process may count the
same chunk (a shared system prompt): the ledger counts holders per key and
unpins a key only when its last holder lets go. Leases are the backstop: a
holding the ledger forgets (a lost RPC, a crashed scheduler) ends by itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING

from ascendstore.contract import Status

if TYPE_CHECKING:
    from ascendstore.engine.guard import BackendGuard

log = logging.getLogger(__name__)


#: where a holding's units live: None for key strings (every backend's pin/unpin),
#: else the tenant whose key prefixes complete the chunk hashes (a native scan's pins)
Scope = str | None
#: unpin_run(tenant, chunk hashes): drop this process's pins of those chunks' objects
UnpinRun = Callable[[str, Sequence], object]


@dataclass
class _Holding:
    #: what is pinned, chunk-major: ``width`` key strings per chunk; or, for pins
    #: a native scan took (``scope`` set), one chunk hash per chunk (width 1)
    units: list
    width: int
    expires: float
    #: what the lookup counted, (tenant, start, first chunk hash, last chunk hash, chunks):
    #: chained hashes name their whole prefix, so this names the run without its keys
    run: tuple | None = None
    scope: Scope = None
    #: a native scan's holding: the chunk position of ``units[0]`` in its prompt
    start: int = 0
    #: the backend's ``pin_breaks()`` read before the scan that pinned it (-1: none)
    breaks: int = -1


class LookupPins:
    """Per-request pins of one process's backend client (thread-safe).

    Two ways in: ``pin`` pins key strings through the backend's ``pin``; with
    ``unpin_run`` (a backend whose prefix scan pins what it counts, e.g. the
    local pool), the scan has already pinned and ``took`` records the chunk
    hashes, so a lookup does no per-chunk work in Python at all.

    Requests of this process may hold the same object (a shared system prompt);
    it is unpinned only when no other holding has it. Key strings are counted
    per key. Chunk hashes are not counted: they are chained (a chunk's hash
    names its whole prefix), so two holdings of one tenant that agree at a chunk
    position agree at every position below it that both hold, and what another
    holding shares with the chunks let go is found by one comparison and a
    bisection. Were hashes not chained, a chunk could be unpinned while another
    request still counts it: its load may then miss and recompute, never read
    wrong bytes."""

    def __init__(
        self, guard: BackendGuard, lease_s: float, timeout_s: float, *, unpin_run: UnpinRun | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be > 0")
        self.guard = guard
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self._unpin_run = unpin_run
        self._clock = clock
        self._lock = threading.RLock()  # held across the backend calls too: one ledger update at a time
        self._held: dict[str, _Holding] = {}
        #: no holding's lease ends before this (a lower bound: renewals only extend
        #: leases), so expire() need not walk every holding on each pinning lookup
        self._next_expiry = float("inf")
        #: holders per key string (a native scan's holdings are not counted, above)
        self._refs: Counter[str] = Counter()

    @staticmethod
    def supported(guard: BackendGuard | None) -> bool:
        return guard is not None and bool(guard.capabilities.pins)

    @property
    def by_run(self) -> bool:
        """Pins are taken by the backend's native scan and let go by ``unpin_run``."""
        return self._unpin_run is not None

    def holds(self, req_id: str, run: tuple) -> bool:
        """``req_id`` already holds exactly this run with at least half its lease left.

        A waiting request is looked up again every step; while its lookup finds the
        same run it needs no new pin call (one per key: as much again as the scan,
        a master round trip on Mooncake) until half the lease is gone."""
        h = self._held.get(req_id)  # a dict read: no lock (a stale answer only costs a renewal)
        return h is not None and h.run == run and h.expires - self._clock() > self.lease_s / 2

    def held_prefix(self, req_id: str, tenant: str, chunk_hashes: Sequence, start: int, breaks: int) -> int | None:
        """Where the run ``req_id`` holds ends, when that run is still whole and is
        chunks ``start..end-1`` of ``chunk_hashes`` of ``tenant``; else None.

        Whole: a native scan pinned it, at least half its lease is left, and the
        backend's ``pin_breaks()`` still reads ``breaks``, what it read before that
        scan (no pinned object has left since; pins stop eviction). Its last hash
        is compared (and its first): chained hashes that agree there agree on
        the whole run."""
        with self._lock:  # (keep() changes a holding's run and units together)
            h = self._held.get(req_id)
            if (h is None or h.run is None or h.scope != tenant or h.breaks < 0 or h.breaks != breaks
                    or h.expires - self._clock() <= self.lease_s / 2):
                return None
            _, s0, first, last, count = h.run
        end = s0 + count
        if s0 != start or end > len(chunk_hashes) or chunk_hashes[end - 1] != last or chunk_hashes[start] != first:
            return None
        return end

    def pinning(self) -> threading.RLock:
        """The ledger's lock, for a caller whose backend call takes pins the
        ledger then records (``took``): nothing is unpinned in between."""
        return self._lock

    def holding(self, req_id: str) -> bool:
        """``req_id`` holds pins (a dict read: no lock; a stale answer costs a probe)."""
        return req_id in self._held

    def fresh(self, req_id: str) -> bool:
        """``req_id`` holds a run with at least half its lease left (whatever run)."""
        h = self._held.get(req_id)
        return h is not None and h.run is not None and h.expires - self._clock() > self.lease_s / 2

    def pin(self, req_id: str, keys: Sequence[str], width: int, run: tuple | None = None) -> int:
        """Pin the keys of the chunks a lookup counted (``width`` keys per chunk,
        in chunk order) for ``req_id``; returns how many leading chunks are now
        pinned (every key OK). A chunk gone since the lookup ends the run: the
        request counts only what is held. Replaces the request's earlier holding
        (a waiting request is looked up again every step: its lease is renewed).
        ``run`` names what was counted (``holds``)."""
        with self._lock:
            self.expire()
            return self._pin(req_id, keys, width, run)

    def _pin(self, req_id: str, keys: Sequence[str], width: int, run: tuple | None = None) -> int:
        statuses = self.guard.pin(keys, self.lease_s, self.timeout_s) if keys else []
        if statuses.count(Status.OK) == len(statuses):
            bad = len(statuses)
        else:
            bad = next(i for i, s in enumerate(statuses) if s is not Status.OK)
        chunks = bad // width if width else 0
        if chunks * width != len(keys):
            run = None  # less than counted is held: not the run the lookup named
        self.pinned(req_id, keys, width, statuses, chunks, run)
        return chunks

    def pinned(self, req_id: str, keys: Sequence[str], width: int, statuses: Sequence[Status], chunks: int,
               run: tuple | None) -> None:
        """``guard.pin(keys)`` answered ``statuses`` (``width`` keys per chunk): hold
        the keys of the first ``chunks`` chunks for ``req_id`` (the run ``run`` names;
        None: not a run a lookup counted), replacing its earlier holding. Keys it
        pinned past them are not this request's to hold: they are let go of. For a
        caller that pinned through the guard itself, under ``pinning()`` (a lookup
        whose ``exists`` is the pin: PoolLookup)."""
        cut = chunks * width
        kept = list(keys[:cut])
        rest = statuses[cut:]
        # (``in`` runs in C: past a miss at the first chunk of 1024 there is usually nothing)
        extra = [k for k, s in zip(keys[cut:], rest, strict=False) if s is Status.OK] if Status.OK in rest else []
        with self._lock:
            now = self._clock()
            if now >= self._next_expiry:  # (expire()'s own test, without its call: a lookup's cost)
                self.expire()
            old = self._held.get(req_id)
            if old is not None and old.scope is None and old.units == kept and not extra:
                # A waiting request looked up again, same chunks: renew, nothing to recount.
                old.expires = now + self.lease_s
                old.run = run
                return
            self._replace(req_id, _Holding(kept, width, now + self.lease_s, run) if kept else None, extra)

    def took(self, req_id: str, tenant: str, hashes: Sequence, run: tuple, breaks: int = -1) -> None:
        """The native scan pinned ``hashes`` (the chunks it counted, of ``tenant``,
        from chunk ``run[1]``) for ``req_id``: hold them in its place (replacing
        its earlier holding). ``breaks``: the backend's ``pin_breaks()`` read
        before that scan (-1: none; see held_prefix). Hashes are compared as
        given: one connector passes one form (raw or hex); a mix would only unpin
        early. A list is kept as it is (the caller's own copy: a first lookup of a
        128k prompt copies 1024 hashes once, not twice)."""
        with self._lock:
            now = self._clock()
            if now >= self._next_expiry:  # (expire()'s own test, without its call: a lookup's cost)
                self.expire()
            old = self._held.get(req_id)
            expires = now + self.lease_s
            if old is not None and old.scope == tenant and old.run == run:
                old.expires = expires  # the same run, pinned again
                old.breaks = breaks
                return
            units = hashes if type(hashes) is list else list(hashes)
            new = _Holding(units, 1, expires, run, tenant, run[1], breaks)
            if old is None:  # a request's first pins: nothing to let go of
                self._held[req_id] = new
                if expires < self._next_expiry:
                    self._next_expiry = expires
                return
            self._replace(req_id, new)

    def _replace(self, req_id: str, new: _Holding | None, extra: Sequence = ()) -> None:
        # Hold the new before letting go of the old: what both have stays pinned.
        old = self._held.pop(req_id, None)
        if new is not None:
            if new.scope is None:
                self._refs.update(new.units)
            self._held[req_id] = new
            self._next_expiry = min(self._next_expiry, new.expires)
        drop: dict[Scope, list] = {}
        if old is not None:
            self._let_go(old, drop)
        if extra:
            drop.setdefault(None, []).extend(k for k in extra if not self._refs.get(k))
        self._unpin(drop)

    def keep(self, req_id: str, chunks: int) -> None:
        """The load covers only the first ``chunks`` of what was pinned: let go of the rest."""
        with self._lock:
            h = self._held.get(req_id)
            if h is None or chunks * h.width >= len(h.units):
                return
            rest = _Holding(h.units[chunks * h.width :], h.width, h.expires, None, h.scope, h.start + chunks)
            h.units = h.units[: chunks * h.width]
            h.run = None  # no longer what a lookup counted
            if not h.units:
                del self._held[req_id]
            drop: dict[Scope, list] = {}
            self._let_go(rest, drop)
            self._unpin(drop)

    def release(self, req_ids: Sequence[str] | str) -> None:
        """The requests' loads ended (or they finished unloaded): unpin what no one else holds."""
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        with self._lock:
            gone = [h for r in req_ids if (h := self._held.pop(r, None)) is not None]
            drop: dict[Scope, list] = {}
            for h in gone:
                self._let_go(h, drop)
            self._unpin(drop)

    def expire(self) -> None:
        """Forget holdings whose lease ran out (the backend dropped those pins by itself)."""
        now = self._clock()
        if now < self._next_expiry:
            return
        with self._lock:
            stale = [r for r, h in self._held.items() if h.expires <= now]
            self._next_expiry = min((h.expires for h in self._held.values() if h.expires > now), default=float("inf"))
            gone = [self._held.pop(r) for r in stale]
            drop: dict[Scope, list] = {}
            for h in gone:
                self._let_go(h, drop)
            if stale:
                log.debug("lookup pins of %d requests ran out of lease before their loads", len(stale))
            # Unpin anyway: a pin taken later than the ledger's clock says may still hold.
            self._unpin(drop)

    def holders(self) -> int:
        with self._lock:
            return len(self._held)

    def held_keys(self) -> int:
        """Distinct units held: keys, or chunks for a native scan's pins."""
        with self._lock:
            chunks = {(h.scope, u) for h in self._held.values() if h.scope is not None for u in h.units}
            return len(self._refs) + len(chunks)

    def requests(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def close(self) -> None:
        with self._lock:
            drop: dict[Scope, list] = {None: list(self._refs)}
            for h in self._held.values():
                if h.scope is not None:
                    drop.setdefault(h.scope, []).extend(h.units)
            self._held.clear()
            self._refs.clear()
            self._unpin(drop)

    def _let_go(self, h: _Holding, drop: dict[Scope, list]) -> None:
        """``h`` (no longer in the ledger) lets go of its units: add to ``drop``
        those no holding in the ledger has."""
        units = h.units
        out = drop.setdefault(h.scope, [])
        if h.scope is None:
            refs = self._refs
            # Keys counted once are this holding's alone (a key in it twice counts 2):
            # usually every key, or all after a leading run other requests share (a
            # system prompt). Those go in C-level passes; a key at a time was ~0.7 us
            # (Counter's __delitem__ is Python), ~0.5-0.9 ms to release a 128k
            # prompt's 1024 keys on the scheduler's thread.
            counts = list(map(refs.__getitem__, reversed(units)))
            alone = len(counts) if counts.count(1) == len(counts) else min(
                map(counts.index, set(counts) - {1}))
            cut = len(units) - alone
            if alone:
                gone = units[cut:]
                deque(map(dict.__delitem__, repeat(refs), gone), maxlen=0)
                out.extend(gone)
            for k in units[:cut]:
                n = refs[k] - 1
                if n <= 0:
                    del refs[k]
                    out.append(k)
                else:
                    refs[k] = n
            return
        pos0, n = h.start, len(units)
        shared = sorted(iv for o in self._held.values() if o.scope == h.scope
                        if (iv := _shared(units, pos0, o)) is not None)
        at = pos0
        for lo, hi in shared:  # positions [lo, hi) another holding has: keep them pinned
            if lo > at:
                out.extend(units[at - pos0 : lo - pos0])
            at = max(at, hi)
        if at < pos0 + n:
            out.extend(units[at - pos0 :])

    def _unpin(self, drop: dict[Scope, list]) -> None:
        # Bounded like every call; a failed unpin leaves a pin that its lease ends.
        for scope, units in drop.items():
            if not units:
                continue
            if scope is None:
                self.guard.unpin(units, self.timeout_s)
            elif self._unpin_run is not None:
                self._unpin_run(scope, units)


def _shared(units: list, pos0: int, o: _Holding) -> tuple[int, int] | None:
    """Chunk positions [lo, hi) that ``o`` holds among ``units`` (at positions
    from ``pos0``), or None. Chained hashes agree below any position where they
    agree, so the shared part starts where both begin and ends at the first
    difference, found by bisection."""
    lo = max(pos0, o.start)
    hi = min(pos0 + len(units), o.start + len(o.units))
    if lo >= hi or units[lo - pos0] != o.units[lo - o.start]:
        return None
    a, b = lo + 1, hi  # equal at a - 1; the first difference is in [a, b] (b: none)
    while a < b:
        m = (a + b) // 2
        if units[m - pos0] == o.units[m - o.start]:
            a = m + 1
        else:
            b = m
    return lo, a
