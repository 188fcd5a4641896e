"""The layerwise global-address (GVA) flow of MemCache, as vllm-ascend drives it.

Writers: ``gva_alloc`` -> ``gva_copy_in`` (per layer, at gva + offset) ->
``gva_write_finish`` (the object becomes readable). Readers: ``gva_lease``
(key info + read lease) -> ``gva_copy_out`` (per layer) -> ``gva_release``.
A reader's lease keeps the object from eviction and removal while it copies.
Mixed into the backend (it declares ``layerwise``); it uses the backend's
bounded native calls and per-key batching.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ascendstore.contract import Region, Status
from ascendstore_memcache.calls import Deadline
from ascendstore_memcache.codes import MAX_BATCH_KEYS, MAX_LAYERS, to_status


@dataclass(frozen=True, slots=True)
class GlobalObject:
    """Where a readable object lives in MemFabric's global address space."""

    gva: int
    size: int


def coalesce(regions: Sequence[Region]) -> list[Region]:
    """Merge touching regions (fewer layers per key; MemCache allows 255) and
    drop empty ones."""
    out: list[Region] = []
    for r in regions:
        if r.length == 0:
            continue
        if out and out[-1].addr + out[-1].length == r.addr:
            out[-1] = Region(out[-1].addr, out[-1].length + r.length)
        else:
            out.append(r)
    return out


class GvaFlow:
    """The GVA methods; the backend provides the attributes declared here."""

    _store: Any
    _options: Any
    _init_bm: bool
    _closed: bool
    _put_dir: int
    _get_dir: int
    _native: Callable[..., tuple[Status | None, Any]]
    _per_key: Callable[..., list[Status]]
    _key_ok: Callable[[str], bool]

    def gva_alloc(self, keys: Sequence[str], sizes: Sequence[int], timeout_s: float) -> list[tuple[Status, int]]:
        """Reserve objects; (OK, gva) per key, or (status, 0). An existing key
        fails (write only what is missing)."""
        keys = list(keys)
        if len(keys) != len(sizes):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
        deadline = Deadline(timeout_s)
        out: list[tuple[Status, int]] = []
        for start in range(0, len(keys), MAX_BATCH_KEYS):
            ks, ss = keys[start : start + MAX_BATCH_KEYS], list(sizes[start : start + MAX_BATCH_KEYS])
            err, gvas = self._native(deadline, self._store.batch_alloc, ks, ss)
            if err is None and (gvas is None or len(gvas) != len(ks)):
                err = Status.UNAVAILABLE
            for j in range(len(ks)):
                if err is not None:
                    out.append((err, 0))
                else:
                    gva = int(gvas[j])
                    # 0 means the allocation failed (full pool, existing key) [measured: 0 on failure]
                    out.append((Status.OK, gva) if gva > 0 else (Status.NO_SPACE, 0))
        return out

    def gva_copy_in(self, spans: Sequence[tuple[int, Sequence[Region]]], timeout_s: float) -> Status:
        """Copy local regions into allocated objects: each span is (gva, regions)
        and its regions land back to back from that address."""
        return self._gva_copy(spans, self._put_dir, timeout_s)

    def gva_copy_out(self, spans: Sequence[tuple[int, Sequence[Region]]], timeout_s: float) -> Status:
        """Copy from leased objects into local regions (same span shape)."""
        return self._gva_copy(spans, self._get_dir, timeout_s)

    def _gva_copy(self, spans: Sequence[tuple[int, Sequence[Region]]], direct: int, timeout_s: float) -> Status:
        if not self._init_bm:
            return Status.UNAVAILABLE if self._closed else Status.INVALID
        if not spans:
            return Status.OK
        gvas = [int(g) for g, _ in spans]
        merged = [coalesce(regs) for _, regs in spans]
        if any(not m or len(m) > MAX_LAYERS for m in merged):
            return Status.INVALID
        err, code = self._native(
            Deadline(timeout_s),
            self._store.batch_copy_layers,
            gvas,
            [[r.addr for r in m] for m in merged],
            [[r.length for r in m] for m in merged],
            direct,
        )
        return err or to_status(int(code), "gva")

    def gva_write_finish(self, keys: Sequence[str], results: Sequence[Status], timeout_s: float) -> list[Status]:
        """Publish written objects (OK) or drop them (any other status)."""
        keys = list(keys)
        if len(keys) != len(results):
            raise ValueError(f"{len(keys)} keys but {len(results)} results")
        res = [0 if s is Status.OK else -1 for s in results]
        deadline = Deadline(timeout_s)

        def call(idx: list[int]) -> tuple[Status | None, Any]:
            return self._native(
                deadline, self._store.batch_write_finish, [keys[i] for i in idx], [res[i] for i in idx]
            )

        return self._per_key(keys, call, lambda c: to_status(c, "gva"))

    def gva_lease(
        self, keys: Sequence[str], timeout_s: float, lease_ms: int | None = None
    ) -> list[tuple[Status, GlobalObject | None]]:
        """Find readable objects and lease them for reading."""
        keys = list(keys)
        deadline = Deadline(timeout_s)
        valid = [self._key_ok(k) for k in keys]
        found: list[tuple[Status, GlobalObject | None]] = [(Status.INVALID, None)] * len(keys)
        todo = [i for i, ok in enumerate(valid) if ok]
        for start in range(0, len(todo), MAX_BATCH_KEYS):
            idx = todo[start : start + MAX_BATCH_KEYS]
            err, infos = self._native(deadline, self._store.batch_get_key_info, [keys[i] for i in idx])
            if err is None and (infos is None or len(infos) != len(idx)):
                err = Status.UNAVAILABLE
            for j, i in enumerate(idx):
                if err is not None:
                    found[i] = (err, None)
                    continue
                size, gvas = int(infos[j].size()), list(infos[j].gva_list())
                if size > 0 and gvas:
                    found[i] = (Status.OK, GlobalObject(int(gvas[0]), size))
                else:
                    found[i] = (Status.NOT_FOUND, None)
        ttl = (self._options.lease_ttl_ms or 0) if lease_ms is None else lease_ms  # 0: meta default
        want = [status is Status.OK for status, _ in found]

        def call(idx: list[int]) -> tuple[Status | None, Any]:
            return self._native(deadline, self._store.batch_add_lease, [keys[i] for i in idx], ttl)

        leased = self._per_key(keys, call, lambda c: to_status(c, "gva"), want)
        out: list[tuple[Status, GlobalObject | None]] = []
        for i in range(len(keys)):
            if not want[i]:
                out.append(found[i])
            elif leased[i] is Status.OK:
                out.append(found[i])
            else:
                out.append((leased[i], None))
        return out

    def gva_release(self, keys: Sequence[str], timeout_s: float) -> Status:
        """Give back read leases taken by gva_lease."""
        keys = list(keys)
        if not keys:
            return Status.OK
        worst = Status.OK
        deadline = Deadline(timeout_s)
        for start in range(0, len(keys), MAX_BATCH_KEYS):
            err, code = self._native(deadline, self._store.batch_remove_lease, keys[start : start + MAX_BATCH_KEYS])
            status = err or to_status(int(code), "gva")
            if status is not Status.OK:
                worst = status
        return worst
