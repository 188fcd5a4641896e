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


@dataclass(eq=False)  # (compared by identity: the index removes this holding, not an equal one)
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
    #: the chunk position of ``units[0]``'s chunk in its prompt (a native scan's
    #: holding, or key strings placed by ``at``)
    start: int = 0
    #: the backend's ``pin_breaks()`` read before the scan that pinned it (-1: none)
    breaks: int = -1
    #: key strings a lookup of this tenant's prompt counted (``at``): what other
    #: holdings share is found by position, as for a native scan's. None: keys
    #: of unknown origin, counted one by one in the ledger.
    tenant: str | None = None


class LookupPins:
    """Per-request pins of one process's backend client (thread-safe).

    Two ways in: ``pin`` pins key strings through the backend's ``pin``; with
    ``unpin_run`` (a backend whose prefix scan pins what it counts, e.g. the
    local pool), the scan has already pinned and ``took`` records the chunk
    hashes, so a lookup does no per-chunk work in Python at all.

    Requests of this process may hold the same object (a shared system prompt);
    it is unpinned only when no other holding has it. Chunk hashes, and key
    strings placed in their prompt (``at``: the tenant and the chunk position of
    the first), are not counted: hashes are chained (a chunk's hash names its
    whole prefix), so two holdings of one tenant that agree at a chunk position
    agree at every position below it that both hold, and what another holding
    shares with the chunks let go is found by one comparison and a bisection.
    Were hashes not chained, a chunk could be unpinned while another request
    still counts it: its load may then miss and recompute, never read wrong
    bytes. Key strings of unknown origin are counted per key (~0.1 us a key
    each way, which a 128k prompt's 1024 keys made ~0.1 ms per request)."""

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
        #: holders per key string of holdings not placed in a prompt (above)
        self._refs: Counter[str] = Counter()
        #: the other holdings, by (scope, tenant, width), then start, then first unit:
        #: what shares with a holding is found without a look at every holding
        self._firsts: dict[tuple, dict[int, dict[object, list[_Holding]]]] = {}

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
            run = h.run
        return _run_end(run, chunk_hashes, start)

    def held_run(self, req_id: str, tenant: str, chunk_hashes: Sequence, start: int) -> int | None:
        """Where the run ``req_id`` pinned by key (``pin``, ``pinned``) ends, when that
        run is chunks ``start..end-1`` of ``chunk_hashes`` of ``tenant`` with at least
        half its lease left; else None.

        A pin keeps each of its objects from eviction for its lease (the contract), so
        that run is still there and a lookup need not ask about it again. What a pin
        cannot stop (a forced removal, a backend that lost its data) costs the load
        a recompute, as it would between any lookup and its load."""
        h = self._held.get(req_id)  # (a dict read: no lock; its run is read once below)
        if h is None or h.scope is not None or h.expires - self._clock() <= self.lease_s / 2:
            return None
        run = h.run
        if run is None or run[0] != tenant:
            return None
        return _run_end(run, chunk_hashes, start)

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
        ``run`` names what was counted (``holds``), and places the keys: from chunk
        ``run[1]`` of tenant ``run[0]``'s prompt, chunk-major, the first key of each
        chunk naming it (``KeyBuilder.lookup_keys_flat``)."""
        with self._lock:
            self.expire()
            return self._pin(req_id, keys, width, run)

    def _pin(self, req_id: str, keys: Sequence[str], width: int, run: tuple | None = None) -> int:
        at = (run[0], run[1]) if run is not None else None
        statuses = self.guard.pin(keys, self.lease_s, self.timeout_s) if keys else []
        if statuses.count(Status.OK) == len(statuses):
            bad = len(statuses)
        else:
            bad = next(i for i, s in enumerate(statuses) if s is not Status.OK)
        chunks = bad // width if width else 0
        if chunks * width != len(keys):
            run = None  # less than counted is held: not the run the lookup named
        self.pinned(req_id, keys, width, statuses, chunks, run, at)
        return chunks

    def pinned(self, req_id: str, keys: Sequence[str], width: int, statuses: Sequence[Status], chunks: int,
               run: tuple | None, at: tuple[str, int] | None = None) -> None:
        """``guard.pin(keys)`` answered ``statuses`` (``width`` keys per chunk): hold
        the keys of the first ``chunks`` chunks for ``req_id`` (the run ``run`` names;
        None: not a run a lookup counted), replacing its earlier holding. Keys it
        pinned past them are not this request's to hold: they are let go of. ``at``:
        (tenant, chunk position of the first key's chunk) when ``keys`` are a
        lookup's of a prompt, chunk-major (see ``pin``). For a caller that pinned
        through the guard itself, under ``pinning()`` (a lookup whose ``exists`` is
        the pin: PoolLookup)."""
        cut = chunks * width
        kept = list(keys[:cut])
        rest = statuses[cut:]
        # (``in`` runs in C: past a miss at the first chunk of 1024 there is usually nothing)
        extra = [i for i, s in enumerate(rest, cut) if s is Status.OK] if Status.OK in rest else []
        tenant, start = at if at is not None else (None, 0)
        with self._lock:
            now = self._clock()
            old = self._held.get(req_id)
            if (old is not None and old.scope is None and old.tenant == tenant and old.start == start
                    and old.units == kept and not extra):
                # A waiting request looked up again, same chunks: renew, nothing to recount.
                old.expires = now + self.lease_s
                old.run = run
            else:
                new = _Holding(kept, width, now + self.lease_s, run, None, start, tenant=tenant) if kept else None
                drop = self._replace(req_id, new)
                if extra:
                    self._let_go_extra(keys, width, tenant, start, extra, drop)
                self._unpin(drop)
            self._expire_after(now)

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
            old = self._held.get(req_id)
            expires = now + self.lease_s
            if old is not None and old.scope == tenant and old.run == run:
                old.expires = expires  # the same run, pinned again
                old.breaks = breaks
            else:
                units = hashes if type(hashes) is list else list(hashes)
                new = _Holding(units, 1, expires, run, tenant, run[1], breaks)
                if old is None:  # a request's first pins: nothing to let go of
                    self._add(req_id, new)
                    if expires < self._next_expiry:
                        self._next_expiry = expires
                else:
                    self._unpin(self._replace(req_id, new))
            self._expire_after(now)

    def _expire_after(self, now: float) -> None:
        """Holdings whose lease ran out, let go of once a new pin is in the ledger
        (``pinned``, ``took``): the backend call before already pinned the new
        holding's objects again, and a holding that ran out unpins only what no
        holding in the ledger has. Let go of before it, they were unpinned under
        the new holding (the pool then held fewer pins than the ledger)."""
        if now >= self._next_expiry:  # (expire()'s own test, without its call: a lookup's cost)
            self.expire()

    def _replace(self, req_id: str, new: _Holding | None) -> dict[Scope, list]:
        """Put ``new`` in ``req_id``'s place; returns what its old holding lets go of."""
        # Hold the new before letting go of the old: what both have stays pinned.
        old = self._take(req_id)
        if new is not None:
            if new.scope is None and new.tenant is None:
                self._refs.update(new.units)
            self._add(req_id, new)
            self._next_expiry = min(self._next_expiry, new.expires)
        drop: dict[Scope, list] = {}
        if old is not None:
            self._let_go(old, drop)
        return drop

    def _let_go_extra(self, keys: Sequence[str], width: int, tenant: str | None, start: int, extra: list[int],
                      drop: dict[Scope, list]) -> None:
        """Keys a pin call took past the chunks held (``extra``: their indices in
        ``keys``): add to ``drop`` those no holding has."""
        out = drop.setdefault(None, [])
        if tenant is None:
            placed = self._placed_keys()
            out.extend(k for k in map(keys.__getitem__, extra) if not self._refs.get(k) and k not in placed)
            return
        # (the whole pinned list as if held from ``start``: other holdings of this
        # prompt's chunks share a run of positions with it)
        probe = _Holding(keys if type(keys) is list else list(keys), width, 0.0, None, None, start, tenant=tenant)
        shared = self._shared_runs(probe)
        refs = self._refs
        for i in extra:
            pos = start + i // width
            if not any(lo <= pos < hi for lo, hi in shared) and not (refs and refs.get(keys[i])):
                out.append(keys[i])

    def keep(self, req_id: str, chunks: int) -> None:
        """The load covers only the first ``chunks`` of what was pinned: let go of the rest."""
        with self._lock:
            h = self._held.get(req_id)
            if h is None or chunks * h.width >= len(h.units):
                return
            rest = _Holding(h.units[chunks * h.width :], h.width, h.expires, None, h.scope, h.start + chunks,
                            tenant=h.tenant)
            if chunks > 0:
                h.units = h.units[: chunks * h.width]  # (its first unit, which the index has, stays)
                h.run = None  # no longer what a lookup counted
            else:
                self._take(req_id)
            drop: dict[Scope, list] = {}
            self._let_go(rest, drop)
            self._unpin(drop)

    def release(self, req_ids: Sequence[str] | str) -> None:
        """The requests' loads ended (or they finished unloaded): unpin what no one else holds."""
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        with self._lock:
            gone = [h for r in req_ids if (h := self._take(r)) is not None]
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
            gone = [self._take(r) for r in stale]
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
            return len(self._placed_keys().union(self._refs)) + len(chunks)

    def requests(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def close(self) -> None:
        with self._lock:
            drop: dict[Scope, list] = {None: list(self._placed_keys().union(self._refs))}
            for h in self._held.values():
                if h.scope is not None:
                    drop.setdefault(h.scope, []).extend(h.units)
            self._held.clear()
            self._firsts.clear()
            self._refs.clear()
            self._unpin(drop)

    def _let_go(self, h: _Holding, drop: dict[Scope, list]) -> None:
        """``h`` (no longer in the ledger) lets go of its units: add to ``drop``
        those no holding in the ledger has."""
        units = h.units
        out = drop.setdefault(h.scope, [])
        if h.scope is None and h.tenant is None:
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
            gone: list = []
            if alone:
                gone = units[cut:]
                deque(map(dict.__delitem__, repeat(refs), gone), maxlen=0)
            for k in units[:cut]:
                n = refs[k] - 1
                if n <= 0:
                    del refs[k]
                    gone.append(k)
                else:
                    refs[k] = n
            # (a placed holding may hold one of them too: kept)
            placed = self._placed_keys() if gone else None
            out.extend([k for k in gone if k not in placed] if placed else gone)
            return
        w, pos0, n = h.width, h.start, len(units) // h.width
        # (placed keys may also be held by a holding of unknown origin: counted)
        refs = self._refs if h.scope is None else None
        at = pos0
        for lo, hi in self._shared_runs(h):  # positions [lo, hi) another holding has: keep them pinned
            if lo > at:
                out.extend(_unheld(units[(at - pos0) * w : (lo - pos0) * w], refs))
            at = max(at, hi)
        if at < pos0 + n:
            out.extend(_unheld(units[(at - pos0) * w :], refs))

    def _add(self, req_id: str, h: _Holding) -> None:
        self._held[req_id] = h
        if h.scope is not None or h.tenant is not None:
            by_start = self._firsts.setdefault((h.scope, h.tenant, h.width), {})
            by_start.setdefault(h.start, {}).setdefault(h.units[0], []).append(h)

    def _take(self, req_id: str) -> _Holding | None:
        h = self._held.pop(req_id, None)
        if h is not None and (h.scope is not None or h.tenant is not None):
            group = (h.scope, h.tenant, h.width)
            by_start = self._firsts[group]
            firsts = by_start[h.start]
            same = firsts[h.units[0]]
            same.remove(h)
            if not same:
                del firsts[h.units[0]]
                if not firsts:
                    del by_start[h.start]
                    if not by_start:
                        del self._firsts[group]
        return h

    def _shared_runs(self, h: _Holding) -> list[tuple[int, int]]:
        """Chunk positions [lo, hi) of ``h`` that other holdings in the ledger also
        hold (those of its scope, tenant and width), sorted. Chained units agree
        where both begin when they agree anywhere: a holding from a start within
        ``h`` is found by its first unit; one from an earlier start is looked at
        (one comparison). A bisection then finds where each shared run ends."""
        by_start = self._firsts.get((h.scope, h.tenant, h.width))
        if not by_start:
            return []
        units, w, s0 = h.units, h.width, h.start
        end = s0 + len(units) // w
        found = []
        get = units.__getitem__
        for s, firsts in by_start.items():
            if s >= s0:
                if s >= end or (cands := firsts.get(get((s - s0) * w))) is None:
                    continue
            else:
                off, u = (s0 - s) * w, units[0]
                cands = [o for same in firsts.values() for o in same if len(o.units) > off and o.units[off] == u]
            for o in cands:
                if o is not h and (iv := _shared(units, w, s0, o)) is not None:
                    found.append(iv)
        found.sort()
        return found

    def _placed_keys(self) -> set[str]:
        """Every key string held by a holding placed in a prompt (none to look at,
        without a look at every holding, when the index has no group of them)."""
        if not any(scope is None for scope, _, _ in self._firsts):
            return set()
        return {k for h in self._held.values() if h.scope is None and h.tenant is not None for k in h.units}

    def _unpin(self, drop: dict[Scope, list]) -> None:
        # Bounded like every call; a failed unpin leaves a pin that its lease ends.
        for scope, units in drop.items():
            if not units:
                continue
            if scope is None:
                self.guard.unpin(units, self.timeout_s)
            elif self._unpin_run is not None:
                self._unpin_run(scope, units)


def _unheld(keys: list, refs: Counter | None) -> list:
    """``keys`` less those counted in ``refs`` (none when it is empty: the usual case)."""
    return [k for k in keys if not refs.get(k)] if refs else keys


def _shared(units: list, width: int, pos0: int, o: _Holding) -> tuple[int, int] | None:
    """Chunk positions [lo, hi) that ``o`` holds among ``units`` (``width`` per
    chunk, chunk-major, from position ``pos0``; ``o`` of the same group), or None.
    Chained hashes agree below any position where they agree, so the shared part
    starts where both begin and ends at the first difference, found by bisection
    on each chunk's first unit."""
    lo = max(pos0, o.start)
    hi = min(pos0 + len(units) // width, o.start + len(o.units) // width)
    if lo >= hi or units[(lo - pos0) * width] != o.units[(lo - o.start) * width]:
        return None
    a, b = lo + 1, hi  # equal at a - 1; the first difference is in [a, b] (b: none)
    while a < b:
        m = (a + b) // 2
        if units[(m - pos0) * width] == o.units[(m - o.start) * width]:
            a = m + 1
        else:
            b = m
    return lo, a


def _run_end(run: tuple, chunk_hashes: Sequence, start: int) -> int | None:
    """Where ``run`` (tenant, start, first hash, last hash, chunks) ends in
    ``chunk_hashes`` when it begins at ``start`` there; else None. Its last hash is
    compared (and its first): chained hashes that agree there agree on the whole run."""
    _, s0, first, last, count = run
    end = s0 + count
    if s0 != start or end > len(chunk_hashes) or chunk_hashes[end - 1] != last or chunk_hashes[start] != first:
        return None
    return end
