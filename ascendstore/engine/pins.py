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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ascendstore.contract import Status

if TYPE_CHECKING:
    from ascendstore.engine.guard import BackendGuard

log = logging.getLogger(__name__)


@dataclass
class _Holding:
    keys: list[str]  # chunk-major: ``width`` keys per chunk
    width: int
    expires: float
    #: what the lookup counted, (tenant, start, first chunk hash, last chunk hash, chunks):
    #: chained hashes name their whole prefix, so this names the run without its keys
    run: tuple | None = None


class LookupPins:
    """Per-request pins of one process's backend client (thread-safe)."""

    def __init__(
        self, guard: BackendGuard, lease_s: float, timeout_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be > 0")
        self.guard = guard
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.RLock()  # held across the backend calls too: one ledger update at a time
        self._held: dict[str, _Holding] = {}
        self._refs: Counter[str] = Counter()

    @staticmethod
    def supported(guard: BackendGuard | None) -> bool:
        return guard is not None and bool(guard.capabilities.pins)

    def holds(self, req_id: str, run: tuple) -> bool:
        """``req_id`` already holds exactly this run with at least half its lease left.

        A waiting request is looked up again every step; while its lookup finds the
        same run it needs no new pin call (one per key: as much again as the scan,
        a master round trip on Mooncake) until half the lease is gone."""
        h = self._held.get(req_id)  # a dict read: no lock (a stale answer only costs a renewal)
        return h is not None and h.run == run and h.expires - self._clock() > self.lease_s / 2

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
        kept = list(keys[: chunks * width])
        if chunks * width != len(keys):
            run = None  # less than counted is held: not the run the lookup named
        # Found and pinned, but past the counted run: not this request's to hold.
        extra = [k for k, s in zip(keys[chunks * width :], statuses[chunks * width :], strict=False)
                 if s is Status.OK]
        with self._lock:
            old = self._held.get(req_id)
            if old is not None and old.keys == kept and not extra:
                # A waiting request looked up again, same chunks: renew, nothing to recount.
                old.expires = self._clock() + self.lease_s
                old.run = run
                return chunks
            self._held.pop(req_id, None)
            self._refs.update(kept)
            if kept:
                self._held[req_id] = _Holding(kept, width, self._clock() + self.lease_s, run)
            drop = self._decref(old.keys if old else [])
            drop += [k for k in extra if not self._refs.get(k)]
            self._unpin(drop)
        return chunks

    def keep(self, req_id: str, chunks: int) -> None:
        """The load covers only the first ``chunks`` of what was pinned: let go of the rest."""
        with self._lock:
            h = self._held.get(req_id)
            if h is None or chunks * h.width >= len(h.keys):
                return
            rest, h.keys = h.keys[chunks * h.width :], h.keys[: chunks * h.width]
            h.run = None  # no longer what a lookup counted
            if not h.keys:
                del self._held[req_id]
            drop = self._decref(rest)
            self._unpin(drop)

    def release(self, req_ids: Sequence[str] | str) -> None:
        """The requests' loads ended (or they finished unloaded): unpin what no one else holds."""
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        with self._lock:
            drop: list[str] = []
            for r in req_ids:
                h = self._held.pop(r, None)
                if h is not None:
                    drop += self._decref(h.keys)
            self._unpin(drop)

    def expire(self) -> None:
        """Forget holdings whose lease ran out (the backend dropped those pins by itself)."""
        now = self._clock()
        with self._lock:
            stale = [r for r, h in self._held.items() if h.expires <= now]
            drop: list[str] = []
            for r in stale:
                drop += self._decref(self._held.pop(r).keys)
            if stale:
                log.debug("lookup pins of %d requests ran out of lease before their loads", len(stale))
            # Unpin anyway: a pin taken later than the ledger's clock says may still hold.
            self._unpin(drop)

    def holders(self) -> int:
        with self._lock:
            return len(self._held)

    def held_keys(self) -> int:
        with self._lock:
            return len(self._refs)

    def requests(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def close(self) -> None:
        with self._lock:
            keys = list(self._refs)
            self._held.clear()
            self._refs.clear()
            self._unpin(keys)

    def _decref(self, keys: Sequence[str]) -> list[str]:
        drop = []
        for k in keys:
            n = self._refs[k] - 1
            if n <= 0:
                del self._refs[k]
                drop.append(k)
            else:
                self._refs[k] = n
        return drop

    def _unpin(self, keys: list[str]) -> None:
        if keys:
            # Bounded like every call; a failed unpin leaves a pin that its lease ends.
            self.guard.unpin(keys, self.timeout_s)
