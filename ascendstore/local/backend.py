"""The embedded ``local`` backend: a node-wide DRAM pool in POSIX shared memory.

A thin translation of the contract onto :mod:`ascendstore.local._shmpool`, whose
C core does each batch in one call (lock, index, LRU, copies without the GIL).
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ascendstore.contract import (
    Backend,
    BackendContext,
    BackendOptions,
    BackendSetupError,
    Capabilities,
    Health,
    Region,
    RemovalEvent,
    Status,
    StoreNotFound,
)
from ascendstore.local import _shmpool
from ascendstore.local.hugefill import HugePageFiller
from ascendstore.local.options import LocalOptions
from ascendstore.local.pages import SCATTERED_BELOW, DramPages, dram_pages, tmpfs_huge

log = logging.getLogger(__name__)

#: the options a pool keeps in its header, which a process opening it with existing_only takes
_MADE_WITH = ("capacity", "page_size", "max_keys", "checksum", "disk_path", "disk_capacity", "disk_segment_size")

#: pools from this size on get a start-up hint when /dev/shm gives them 4 KiB pages
_PAGE_HINT_BYTES = 1 << 30

_shmpool.set_status_table(tuple(Status))

#: pools still open in this process, closed at interpreter exit so the last user
#: of a pool removes its shared memory even when nobody called close().
_OPEN: weakref.WeakSet[_shmpool.Pool] = weakref.WeakSet()


@atexit.register
def _close_open_pools() -> None:
    for pool in list(_OPEN):
        pool.close(False)


class LocalHooks:
    """Fault injection for tests and the conformance suite (never used in serving)."""

    def __init__(self, pool: _shmpool.Pool, backend: LocalBackend | None = None) -> None:
        self._pool = pool
        self._backend = backend

    def delay(self, seconds: float) -> None:
        """Every later call of this client acts as if the store took ``seconds``
        (the C core delays data calls; remove_prefix and health wait here)."""
        self._pool.debug_delay(seconds)
        if self._backend is not None:
            self._backend._hook_delay_s = max(0.0, seconds)

    def break_store(self) -> None:
        """Destroy the pool under every process, as if its shared memory were gone."""
        self._pool.close(True)

    def corrupt(self, key: str, offset: int = 0) -> bool:
        """Flip a stored byte of ``key`` (in DRAM or on disk); False if absent."""
        return self._pool.debug_corrupt(key, offset)

    def hold_lock(self, seconds: float) -> bool:
        """Hold the pool lock (blocks every process) for ``seconds``."""
        return self._pool.debug_hold_lock(seconds)

    def stall_put(self, key: str, size: int, seconds: float) -> Status:
        """Reserve pages for a put of ``size`` bytes, then stall before copying."""
        return self._pool.debug_stall_put(key, size, seconds)

    def stall_spills(self, seconds: float) -> None:
        """This client's spills to the disk tier pause ``seconds`` after writing,
        before the victims leave DRAM (0 turns it off)."""
        self._pool.debug_spill_stall(seconds)

    def stall_scans(self, seconds: float) -> None:
        """This client's linear prefix scans pause ``seconds`` between their
        blocks of chunks (16, 64, 256, ...), with the pool unlocked (0: off)."""
        self._pool.debug_scan_stall(seconds)

    def stall_puts(self, seconds: float) -> None:
        """This client's puts pause ``seconds`` after reserving their pages, before
        copying in (a writer caught mid-put that then writes its bytes; 0: off)."""
        self._pool.debug_put_stall(seconds)

    def holder(self) -> int:
        """pid in hold_lock (negative: in stall_put or a stalled spill), 0 if none; read without the lock."""
        return self._pool.debug_holder()

    def pages(self, keys: Sequence[str]) -> list[list[int]]:
        """Arena page numbers of each key's object, in order ([] when absent or on disk)."""
        return self._pool.debug_pages(list(keys))

    def check(self, timeout_s: float = 5.0) -> str:
        """Sweep dead processes, then verify every pool invariant; '' when consistent."""
        return self._pool.check(timeout_s)


def _warn_if_scattered(name: str, share: float | None) -> None:
    """Say so when the pool's 4 KiB pages are scattered over 2 MiB frames, which halved
    the pool's copies where measured. Silent where frame numbers are hidden (not root)
    or too few pages are resident to tell (a pool that is not prefaulted, at start-up)."""
    if share is not None and share < SCATTERED_BELOW:
        log.warning(
            "local pool %r: only %.2f of its 4 KiB pages share a 2 MiB frame with their neighbour (the "
            "host's free memory was fragmented); copies on such pages measured up to 2x slower: create the "
            "pool after `echo 1 > /proc/sys/vm/compact_memory`, or on huge pages "
            "(docs/local-backend.md#huge-pages)", name, share,
        )


class LocalBackend(Backend):
    """DRAM pool in shared memory, shared by every process of the node."""

    Options = LocalOptions

    def __init__(self, pool: _shmpool.Pool, options: LocalOptions, ctx: BackendContext) -> None:
        self._pool = pool
        self.options = options
        self._ctx = ctx
        self._filler: HugePageFiller | None = None
        self._caps = Capabilities(
            zero_copy=False,
            layerwise=True,
            shared_across_processes=True,
            shared_across_nodes=False,
            persistent=False,
            evicts=True,
            overwrite_on_put=True,
            detects_corruption=options.checksum,
            remove_by_prefix=True,
            listing=True,
            scheduler_client=True,
            empty_objects=True,
            # In-process C calls whose lock waits honour the deadline: never abandoned.
            bounded_calls=True,
            removal_events=True,
            pins=True,
            max_key_bytes=_shmpool.MAX_KEY_BYTES,
            max_object_bytes=options.pages * options.page_size,
        )

    @classmethod
    def create(cls, options: BackendOptions, ctx: BackendContext) -> LocalBackend:
        if not isinstance(options, LocalOptions):
            options = LocalOptions.model_validate(options.model_dump() if options else {})
        existing = ctx.existing_only
        if options.disk_path is not None and not existing:
            try:
                os.makedirs(options.disk_path, exist_ok=True)
            except OSError as exc:
                raise BackendSetupError(
                    f"local backend: cannot use disk_path {options.disk_path!r}: {exc}"
                ) from exc
        try:
            pool = _shmpool.Pool(
                options.name,
                options.capacity,
                options.page_size,
                options.effective_max_keys,
                options.checksum,
                options.disk_path,
                options.disk_capacity if options.disk_path else 0,
                options.effective_segment_size,
                options.open_timeout_s,
                # (a tool that looked at a pool whose processes all died leaves it as it found it)
                options.unlink_on_last_close and not existing,
                options.prefault,
                options.hugetlbfs,
                existing,
            )
        except FileNotFoundError as exc:  # (existing_only)
            raise StoreNotFound(f"local backend (pool {options.name!r}): {exc}") from exc
        except (OSError, ValueError) as exc:
            raise BackendSetupError(f"local backend (pool {options.name!r}): {exc}") from exc
        _OPEN.add(pool)
        if existing:
            # Opened as it was made: the options describe that pool, and a tool starts no thread.
            made = pool.made_with
            options = options.model_copy(update={k: made[k] for k in _MADE_WITH} | {"prefault": False})
            return cls(pool, options, ctx)
        backend = cls(pool, options, ctx)
        if (options.hugetlbfs is None and options.capacity >= _PAGE_HINT_BYTES and not pool.collapsed
                and tmpfs_huge("/dev/shm") == "never"):
            if not options.prefault and options.lazy_huge_pages:
                # 2 MiB pages made as the pool fills, by a thread of one process at a time
                # (ascendstore.local.hugefill): every process that opens it starts one
                backend._filler = HugePageFiller(pool, options.name)
                return backend
            # What this process maps (an attacher maps in a sample of what the segment
            # holds): a pool whose arena the kernel made 2 MiB pages of reads "thp".
            pages = backend.dram_pages()
            if pages.kind == "small":
                log.info(
                    "local pool %r: DRAM tier in 4 KiB pages (/dev/shm is mounted huge=never%s); in 2 MiB pages "
                    "large gets run ~25%% faster: `mount -o remount,huge=advise /dev/shm`, or set hugetlbfs "
                    "(docs/local-backend.md#huge-pages)", options.name,
                    "; the kernel could not make 2 MiB pages of the whole prefaulted pool" if options.prefault
                    else "; 2 MiB pages are made of it as it fills unless `lazy_huge_pages: false`"
                    if options.lazy_huge_pages else "; `lazy_huge_pages: true` makes 2 MiB pages of it as it fills",
                )
                _warn_if_scattered(options.name, pages.frame_share)
        return backend

    @property
    def huge_page_filler(self) -> HugePageFiller | None:
        """This process's thread making 2 MiB pages as the pool fills (lazy_huge_pages), or None;
        one process's thread at a time does the work (its ``filling``)."""
        return self._filler

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def shm_name(self) -> str:
        """The segment's name under /dev/shm."""
        return self._pool.shm_name.lstrip("/")

    def dram_pages(self) -> DramPages:
        """The pages holding the DRAM tier as this process maps it (reads /proc: not for hot paths)."""
        where = self.options.hugetlbfs.rstrip("/") if self.options.hugetlbfs else "/dev/shm"
        return dram_pages(where + self._pool.shm_name, self.options.hugetlbfs is not None)

    def exists(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        return self._pool.exists(keys, timeout_s)

    def prefix_run(
        self, prefixes: Sequence[str], suffixes: Sequence[str] | Sequence[bytes], timeout_s: float,
        gallop: bool = False, lease_s: float = 0.0,
    ) -> tuple[Status, int, int]:
        """The lookup of a prompt in one native call: how many chunks from 0 are
        present, chunk i being present when every ``prefix + suffixes[i]`` is.
        Returns (status, chunks, chunks probed); see PoolLookup for ``gallop``.
        ``lease_s`` > 0 also pins the chunks counted (as ``pin`` does), in the
        same pass: the count is exactly what is pinned."""
        return self._pool.prefix_run(prefixes, suffixes, gallop, timeout_s, lease_s)

    def unpin_run(
        self, prefixes: Sequence[str], suffixes: Sequence[str] | Sequence[bytes], timeout_s: float
    ) -> Status:
        """Drop this process's pins of every ``prefix + suffixes[i]`` (what a
        ``prefix_run`` with a lease pinned)."""
        return self._pool.unpin_run(prefixes, suffixes, timeout_s)

    def put(self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float) -> list[Status]:
        return self._pool.put(keys, regions, timeout_s)

    def put_absent(
        self, keys: Sequence[str], regions: Sequence[Sequence[Region]], present: list[int], timeout_s: float
    ) -> list[Status]:
        """put of only the keys the pool lacks, in one native call under one lock:
        a key it holds keeps its value (touched, as exists touches it) and answers
        OK, and its index is appended to ``present``; so is one another writer
        stored while this call copied (the first value stays). The engine's saves
        use it for their dedup instead of an exists first (``BackendGuard.put_absent``).
        Not part of the contract, like ``prefix_run``."""
        statuses, held = self._pool.put_absent(keys, regions, timeout_s)
        if held:
            present.extend(held)
        return statuses

    def get(self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float) -> list[Status]:
        return self._pool.get(keys, regions, timeout_s)

    def remove(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        return self._pool.remove(keys, timeout_s)

    def pin(self, keys: Sequence[str], lease_s: float, timeout_s: float) -> list[Status]:
        """exists + pin: an object found is neither evicted nor spilled (from DRAM
        or from the disk tier) until the lease ends, unpin(), or this process
        dies; a put that finds only pinned victims reports NO_SPACE. An explicit
        remove still removes. lease_s: 0 < lease_s <= 3600."""
        return self._pool.pin(keys, lease_s, timeout_s)

    def unpin(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        return self._pool.unpin(keys, timeout_s)

    def pin_breaks(self) -> int:
        """How many pinned objects have left the pool other than by a newer value
        of their key (removed, or lost in a rebuild after a crash); -1 once closed.
        Pins stop eviction only, so a run a lookup pinned while this read N is
        still whole, within its lease, while it reads N (PoolLookup)."""
        return self._pool.pin_breaks()

    def pinned(self, timeout_s: float | None = None) -> int:
        """Objects pinned now by a live process (-1 when the pool does not answer):
        lookups must leave none behind once their loads ended."""
        status, n = self._pool.pinned(self._ctx.timeout_s if timeout_s is None else timeout_s)
        return n if status is Status.OK else -1

    def remove_prefix(self, prefix: str, timeout_s: float) -> tuple[Status, int]:
        if (slow := self._hook_wait(timeout_s)) is not None:
            return slow, 0
        if not prefix:  # would empty the pool of every tenant: refused (a closed client says so first)
            status, _ = self._pool.scan("", False, 0, timeout_s)
            return (Status.INVALID if status is Status.OK else status), 0
        return self._pool.scan(prefix, True, -1, timeout_s)

    def list_keys(self, prefix: str = "", limit: int = 1000) -> Iterator[str]:
        status, keys = self._pool.scan(prefix, False, limit, self._ctx.timeout_s)
        return iter(keys if status is Status.OK else ())

    def removed_since(self, cursor: int, limit: int = 4096) -> tuple[int, list[RemovalEvent], int]:
        """Removal records of the whole pool (every process's evictions and
        removals), read from the bounded ring in the segment. On a lock timeout
        or a closed pool: the same cursor and no events."""
        status, nxt, records, lost = self._pool.removed_since(cursor, limit, self._ctx.timeout_s)
        if status is not Status.OK:
            return cursor, [], 0
        return nxt, [RemovalEvent(k, t, r, m, seq) for seq, k, t, r, m in records], lost

    def stats(self) -> Mapping[str, Any]:
        status, stats = self._pool.stats(self._ctx.timeout_s)
        return stats if status is Status.OK else {"status": status.name}

    def health(self, timeout_s: float) -> Health:
        if (slow := self._hook_wait(timeout_s)) is not None:
            return Health(slow)
        status, stats = self._pool.stats(timeout_s)
        return Health(status, stats)

    #: test hook delay for the calls the C core does not delay (LocalHooks.delay)
    _hook_delay_s = 0.0

    def _hook_wait(self, timeout_s: float) -> Status | None:
        if not self._hook_delay_s:
            return None
        time.sleep(max(0.0, min(self._hook_delay_s, timeout_s)))
        return Status.TIMEOUT if self._hook_delay_s >= timeout_s else None

    def test_hooks(self) -> LocalHooks:
        return LocalHooks(self._pool, self)

    def close(self) -> None:
        """Detach; the last process to close (with unlink_on_last_close) frees the pool."""
        self._stop_filler()
        self._pool.close(False)

    def destroy(self) -> None:
        """Remove the pool now for every process (they then get UNAVAILABLE)."""
        self._stop_filler()
        self._pool.close(True)

    def _stop_filler(self) -> None:
        if self._filler is not None:
            self._filler.stop()
