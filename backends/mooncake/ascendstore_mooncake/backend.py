"""AscendStore backend over Mooncake Store (``mooncake.store.MooncakeDistributedStore``).

A thin translation of the contract: zero-copy batched puts and gets from
registered memory (one key may span several regions), batched exists, remove
by keys and by prefix, health. What Mooncake does differently from the
contract's defaults is declared in ``capabilities`` rather than hidden:

* a put of an existing key returns success and keeps the *first* value;
* reads and exists() grant a read lease (10 s by default) that blocks eviction
  and plain removal, so exists() answers are reused briefly instead of renewing
  leases on every scheduler step (Mooncake issue #2187);
* objects live in the memory of the clients that mounted segments and in the
  master's memory map: a master restart loses every key (reads then miss).
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from itertools import islice, repeat
from typing import Any

from ascendstore.contract import (
    Backend,
    BackendContext,
    BackendSetupError,
    Capabilities,
    Health,
    Region,
    Status,
    caller_is_watched,
    caller_may_block,
    keys_fit,
)
from ascendstore_mooncake.errors import OBJECT_NOT_FOUND, TRANSFER_FAIL, status_of
from ascendstore_mooncake.guard import NativeGuard, Outcome
from ascendstore_mooncake.options import MooncakeOptions, resolve_options

log = logging.getLogger(__name__)

_QUARANTINE: list[Any] = []


def _quarantine(store: Any) -> None:
    """Keep a client that failed set-up, or could not be closed, alive forever.

    Its methods can crash the process (after a failed set-up) and its destructor
    unmounts through the master while holding the GIL (17 s measured with the
    master gone), so it must never be called nor garbage-collected, not even
    at interpreter exit: hold an extra reference the interpreter never drops.
    """
    _QUARANTINE.append(store)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(store))
_SCHEDULER_BUFFER = 16 << 20
_SETUP_HINTS: dict[int | None, str] = {
    -1: "Check that mooncake_master runs at that address and that this host can reach it.",
    -600: "Mooncake rejected the parameters: check protocol/device_name (RDMA devices present?) and sizes.",
    None: "Check the master address, the protocol and its devices.",
}
_HEALTH_CODES = {0: "ok", 1: "not initialised or closed", 2: "master unreachable"}


def _import_store() -> tuple[Any, Any]:
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:
        hint = ""
        if "libibverbs" in str(exc) or "libnl" in str(exc):
            hint = " Install the system libraries: apt-get install libibverbs1 libnl-3-200 libnl-route-3-200."
        raise BackendSetupError(
            f"backend 'mooncake' needs Mooncake's Python client (mooncake.store) and it does not import: "
            f"{exc}.{hint} Install mooncake-transfer-engine-non-cuda (CPU), mooncake-transfer-engine-npu "
            "(Ascend) or mooncake-transfer-engine (CUDA)."
        ) from exc
    return MooncakeDistributedStore, ReplicateConfig


def _route_address(master: str) -> str:
    """The local address the OS uses to reach the master: what peers can dial back."""
    host = master.rpartition(":")[0].strip("[]")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP connect sends nothing; it only picks a route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _probe_master(address: str, timeout_s: float) -> None:
    """Fail fast, before Mooncake's set-up, when nothing listens at the master address.

    Mooncake's setup() holds the GIL while it retries (4.4 s per try without a
    master, 30 s against a port that accepts but never answers), so no thread
    can bound it: a plain TCP connect first turns the common case (master not
    running, wrong address) into an immediate, clear error.
    """
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise BackendSetupError(
            f"cannot reach mooncake_master at master_server_address={address!r}: {exc}. "
            "Start mooncake_master there (e.g. mooncake_master --rpc_port=50051) or fix the address "
            "(backend_config, mooncake.json or env MOONCAKE_MASTER)."
        ) from None


def _regex_prefix(prefix: str) -> str:
    """Anchored regex matching keys that start with ``prefix`` literally.

    Mooncake compiles it with std::regex; ``\\xhh`` escapes are understood by
    that dialect and by Python's, so every non-alphanumeric byte is escaped so.
    """
    return "^" + "".join(c if c.isascii() and c.isalnum() else f"\\x{ord(c):02x}" for c in prefix)


class MooncakeBackend(Backend):
    """``backend: mooncake``."""

    Options = MooncakeOptions

    @classmethod
    def create(cls, options: MooncakeOptions | Mapping[str, Any] | None, ctx: BackendContext) -> MooncakeBackend:
        opts = resolve_options(options)  # mooncake.json and env merged under backend_config
        return cls(opts, ctx)

    def __init__(self, opts: MooncakeOptions, ctx: BackendContext) -> None:
        self.options = opts
        self.ctx = ctx
        store_cls, replicate_cls = _import_store()
        # The scheduler only asks which keys exist; it lends no memory to the pool.
        scheduler = ctx.role == "scheduler"
        self._segment = 0 if scheduler else opts.global_segment_size
        buffer = min(opts.local_buffer_size, _SCHEDULER_BUFFER) if scheduler else opts.local_buffer_size
        self._hostname = opts.local_hostname or _route_address(opts.master_server_address or "")
        # Bound Mooncake's own set-up loop (20 tries, 90 s without a master, by default).
        if "setup_retries" in opts.model_fields_set or "MC_STORE_CLIENT_SETUP_RETRIES" not in os.environ:
            os.environ["MC_STORE_CLIENT_SETUP_RETRIES"] = str(opts.setup_retries)

        self._guard = NativeGuard(opts.max_inflight_calls, allow_inline=opts.inline_puts or opts.inline_gets)
        self._close_lock = threading.Lock()
        self._exists_cache: dict[str, float] = {}
        self._cache_lock = threading.Lock()
        self._counters = {"exists_cache_hits": 0}
        self._delay_s = 0.0

        _probe_master(opts.master_server_address or "", min(opts.setup_timeout_s, 5.0))
        store = store_cls()
        args = (
            self._hostname,
            opts.metadata_server,
            self._segment,
            buffer,
            opts.protocol,
            opts.device_name,
            opts.master_server_address,
            None,
            opts.enable_ssd_offload,
            opts.ssd_offload_path,
            opts.tenant_id,
            opts.enable_client_http_server,
            opts.client_http_port,
        )
        started = time.monotonic()
        # On a thread of its own, never one of the workers that later run data calls (guard.call_alone).
        outcome, rc = self._guard.call_alone(lambda: store.setup(*args), opts.setup_timeout_s)
        if outcome is not Outcome.DONE or rc != 0:
            _quarantine(store)
            self._guard.close(0)
            what = (
                f"did not finish within setup_timeout_s={opts.setup_timeout_s}"
                if outcome is not Outcome.DONE
                else f"returned {rc}"
            )
            raise BackendSetupError(
                f"Mooncake client set-up {what} after {time.monotonic() - started:.1f} s "
                f"(master_server_address={opts.master_server_address!r}, protocol={opts.protocol!r}, "
                f"device_name={opts.device_name!r}, metadata_server={opts.metadata_server!r}, "
                f"local_hostname={self._hostname!r}, global_segment_size={self._segment}). "
                f"{_SETUP_HINTS.get(rc, _SETUP_HINTS[None])} Mooncake's log above has the details. "
                "The failed client is never called again (Mooncake crashes when used after a failed set-up)."
            )
        self._store = store
        self._replicate = replicate_cls()
        self._replicate.replica_num = opts.replica_num
        if opts.preferred_segment:
            self._replicate.preferred_segment = opts.preferred_segment
        self._replicate.prefer_alloc_in_same_node = opts.prefer_alloc_in_same_node
        self._caps = Capabilities(
            zero_copy=True,
            layerwise=True,
            shared_across_processes=True,
            shared_across_nodes=True,
            persistent=False,
            evicts=True,
            overwrite_on_put=False,
            # The master turns the put of a stored key away before any transfer and
            # the client answers success (0), at about the cost of an exists
            # (docs/benchmarking.md): the engine asks no exists before saving chunks
            # it has just computed.
            dedups_puts=True,
            detects_corruption=False,
            remove_by_prefix=True,
            listing=False,
            device_memory=opts.protocol != "tcp" and ctx.device_type in ("npu", "cuda"),
            needs_registration=opts.protocol != "tcp",
            scheduler_client=True,
            empty_objects=False,
            # Native calls run under the backend's own deadline (it returns in
            # time) but may go on after a timeout: see quiescent().
            bounded_calls=True,
            detaches_calls=True,
            # A pin is a read lease renewed on exactly the counted keys (pin()).
            pins=opts.lease_pins,
            max_key_bytes=4096,
            # An object must fit in one segment's free space: promise half of ours.
            max_object_bytes=(self._segment // 2) or (1 << 30),
        )
        log.info(
            "mooncake backend ready: master=%s protocol=%s segment=%d buffer=%d host=%s",
            opts.master_server_address, opts.protocol, self._segment, buffer, self._hostname,
        )

    # -- helpers -------------------------------------------------------------------

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def _key_ok(self, key: str) -> bool:
        return bool(key) and key.isascii() and len(key) <= self._caps.max_key_bytes

    def _guarded(self, fn: Any, timeout_s: float, *, inline: bool = False) -> tuple[Status | None, Any]:
        """Run fn(store) bounded; (None, result) on success else (status for every key, None).

        Each call first reads the client's cached master state (microseconds) so
        that with the master known down it fails fast instead of blocking ~4 s.
        """
        store = self._store

        def task() -> Any:
            if self._delay_s:
                time.sleep(self._delay_s)  # test hook: a slow store
            if store.health_check() == 2:
                return _MASTER_DOWN
            return fn(store)

        outcome, result = self._guard.call(task, timeout_s, inline=inline)
        if outcome is Outcome.CLOSED:
            return Status.UNAVAILABLE, None
        if outcome is Outcome.TIMEOUT:
            self._forget_all()
            return Status.TIMEOUT, None
        if result is _MASTER_DOWN:
            self._forget_all()
            return Status.UNAVAILABLE, None
        return None, result

    def _forget_all(self) -> None:
        with self._cache_lock:
            self._exists_cache.clear()

    def _forget_on_failure(self, out: Sequence[Status | None]) -> None:
        # An unreachable master may come back empty: cached answers are then stale.
        # (``in`` runs in C: a pass per key in Python was a sizeable share of a lookup)
        if Status.UNAVAILABLE in out or Status.TIMEOUT in out:
            self._forget_all()

    def _forget(self, keys: Sequence[str]) -> None:
        with self._cache_lock:
            for k in keys:
                self._exists_cache.pop(k, None)

    def _arguments(
        self, keys: Sequence[str], regions: Sequence[Sequence[Region]]
    ) -> tuple[list[Status | None], list[int], list[str], list[list[int]], list[list[int]], list[int]]:
        """Per-key INVALID for what Mooncake would reject, and the client's
        arguments, in one pass (per-key Python is a sizeable share of a small
        get): indexes sent, and their names, addresses, lengths and totals."""
        if len(keys) != len(regions):
            raise ValueError(f"{len(keys)} keys but {len(regions)} region lists")
        out: list[Status | None] = [None] * len(keys)
        send: list[int] = []
        names: list[str] = []
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        totals: list[int] = []
        limit = self._caps.max_object_bytes
        max_key = self._caps.max_key_bytes
        for i, k in enumerate(keys):
            rs = regions[i]
            if len(rs) == 1:  # the usual shape: one region per object
                r = rs[0]
                p, length = [r.addr], [r.length]
                total = r.length
            else:
                p, length = [r.addr for r in rs], [r.length for r in rs]
                total = sum(length)
            if not k or not k.isascii() or len(k) > max_key or total == 0 or total > limit:
                out[i] = Status.INVALID
                continue
            send.append(i)
            names.append(k)
            ptrs.append(p)
            sizes.append(length)
            totals.append(total)
        return out, send, names, ptrs, sizes, totals

    # -- memory ----------------------------------------------------------------------

    def register(self, regions: Sequence[Region]) -> Status:
        if not self._caps.needs_registration:
            return Status.OK  # TCP copies from any address
        return self._buffers(regions, register=True)

    def unregister(self, regions: Sequence[Region]) -> Status:
        if not self._caps.needs_registration:
            return Status.OK
        return self._buffers(regions, register=False)

    def _buffers(self, regions: Sequence[Region], register: bool) -> Status:
        def fn(store: Any) -> list[int]:
            if register:
                return [store.register_buffer(r.addr, r.length) for r in regions]
            return [store.unregister_buffer(r.addr) for r in regions]

        # Registering large regions pins memory and can take a while: use the set-up bound.
        status, codes = self._guarded(fn, self.options.setup_timeout_s)
        if status is not None:
            return status
        bad = [c for c in codes if c != 0]
        return Status.OK if not bad else status_of(bad[0]) if bad[0] < 0 else Status.UNAVAILABLE

    # -- data path ---------------------------------------------------------------------

    def exists(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        # Per-key Python was most of a long prompt's lookup here (the scheduler asks for
        # every waiting request each step): the usual batch (every key valid, and all
        # or none answered from the cache) makes only C-level passes over the keys
        # (join, map, count); per-key loops are left for the rest.
        if self._guard.closed:
            return [Status.UNAVAILABLE] * len(keys)
        out = self._valid(keys)
        ttl = self.options.exists_cache_ttl_s
        now = time.monotonic()
        if ttl > 0:
            cutoff = now - ttl
            with self._cache_lock:
                seen = list(map(self._exists_cache.get, keys))
            # (an invalid key is never cached: a fresh entry is a valid key's)
            fresh = [t is not None and t > cutoff for t in seen]
            hits = fresh.count(True)
            if hits:
                with self._cache_lock:
                    self._counters["exists_cache_hits"] += hits
                if hits == len(out):
                    return [Status.OK] * hits
                out = [Status.OK if f else s for f, s in zip(fresh, out, strict=True)]
        ask = _unanswered(out)
        if not ask:
            return _filled(out, Status.UNAVAILABLE)
        names, whole = self._is_exist(keys, out, ask, timeout_s)
        if not whole:
            self._forget_on_failure(out)
        self._remember(keys, names, out, ask, whole, now)
        return out if whole else _filled(out, Status.UNAVAILABLE)  # type: ignore[return-value]

    def _remember(self, keys: Sequence[str], names: list[str], out: list[Status | None], ask: Sequence[int],
                  whole: bool, now: float) -> None:
        """Cache the present answers of a batch_is_exist (``names``, the keys at
        ``ask``; ``whole``: all keys asked, all present) for ``exists_cache_ttl_s``."""
        if self.options.exists_cache_ttl_s <= 0:
            return
        with self._cache_lock:
            if whole:
                # (pairs straight into the cache: a dict of the keys first, then an update,
                # took 87 us for a 128k prompt's 1024 against 70 into a cache of 32768)
                self._exists_cache.update(zip(names, repeat(now)))
            else:
                for i in ask:
                    if out[i] is Status.OK:
                        self._exists_cache[keys[i]] = now
            _trim(self._exists_cache, now - self.options.exists_cache_ttl_s, EXISTS_CACHE_MAX, len(names))

    def pin(self, keys: Sequence[str], lease_s: float, timeout_s: float) -> list[Status]:
        """Mooncake 0.3 cannot pin a stored object (soft and hard pins are set by
        the put that writes it), but its master grants a read lease on every
        ExistKey and never evicts a leased object. So a pin is a batch_is_exist
        of exactly these keys that always reaches the master (never the exists
        cache, whose answers renew nothing). The lease lasts the master's
        --default_kv_lease_ttl (10 s by default) whatever ``lease_s`` asks; the
        connector renews it once half of its own lease is gone. Its answers do
        not go into the exists cache: the engine asks nothing again about a run
        it holds pinned (PoolLookup), and filling the cache with a 128k prompt's
        1024 answers was 12-17% of a new request's first lookup. What it
        finds absent is dropped from the cache."""
        if self._guard.closed:
            return [Status.UNAVAILABLE] * len(keys)
        out = self._valid(keys)
        ask = _unanswered(out)
        if not ask:
            return _filled(out, Status.UNAVAILABLE)
        _, whole = self._is_exist(keys, out, ask, timeout_s)
        if not whole:
            self._forget_on_failure(out)
            self._forget([keys[i] for i in ask if out[i] is Status.NOT_FOUND])
        return out if whole else _filled(out, Status.UNAVAILABLE)  # type: ignore[return-value]

    def _valid(self, keys: Sequence[str]) -> list[Status | None]:
        """None for each key Mooncake takes, INVALID for the others (``keys_fit``: no
        Python pass per key when every key is fine, as in every batch the engine makes)."""
        if keys_fit(keys, self._caps.max_key_bytes):
            return [None] * len(keys)
        return [None if self._key_ok(k) else Status.INVALID for k in keys]

    def _is_exist(self, keys: Sequence[str], out: list[Status | None], ask: Sequence[int],
                  timeout_s: float) -> tuple[list[str], bool]:
        """One batch_is_exist of the keys at ``ask``, its answers put in ``out``;
        returns the names asked and whether every key was asked and is present."""
        # (a list of its own: a call given up at its deadline may still run later)
        names = list(keys) if len(ask) == len(keys) else [keys[i] for i in ask]
        status, codes = self._guarded(lambda st: st.batch_is_exist(names), timeout_s)
        return names, self._answer(out, ask, status, codes)

    @staticmethod
    def _answer(out: list[Status | None], ask: Sequence[int], status: Status | None, codes: Any) -> bool:
        """Fill ``out`` at ``ask`` from a batch_is_exist's codes (1 present, 0 absent,
        < 0 an error), or with ``status`` when the whole call failed. True: every key
        was asked and every one is present (``out`` all OK, the usual answer)."""
        if status is None and codes.count(1) == len(ask):
            if len(ask) == len(out):
                out[:] = [Status.OK] * len(out)
                return True
            for i in ask:
                out[i] = Status.OK
            return False
        for j, i in enumerate(ask):
            if status is not None:
                out[i] = status
            else:
                c = codes[j]
                out[i] = Status.OK if c == 1 else Status.NOT_FOUND if c == 0 else (
                    status_of(c) if c < 0 else Status.UNAVAILABLE)
        return False

    def unpin(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        """Nothing to send: Mooncake has no call that ends a read lease early; it
        lapses at the master's TTL (the object is evictable again then)."""
        if self._guard.closed:
            return [Status.UNAVAILABLE] * len(keys)
        return _filled(self._valid(keys), Status.OK)  # (every valid key: OK)

    def put(self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float) -> list[Status]:
        out, send, names, ptrs, sizes, _ = self._arguments(keys, regions)
        if not send:
            return _filled(out, Status.INVALID)
        cfg = self._replicate
        # On the engine's save thread, which nothing waits on, run there while the
        # store is healthy (guard.py; options.inline_puts); anywhere else (GR's saves
        # on vLLM's forward thread, its records in the scheduler) keep the deadline.
        # A put given up at its deadline may still complete. What it stores is left
        # alone: its caller keeps the source memory until quiescent() (the contract),
        # so the bytes are whole; and its answers cannot tell a stored key from one
        # the master turned away because another engine holds it (both are 0), so
        # removing "ours" could remove theirs.
        status, codes = self._guarded(
            lambda st: st.batch_put_from_multi_buffers(names, ptrs, sizes, cfg), timeout_s,
            inline=self.options.inline_puts and caller_may_block(),
        )
        if status is None and len(send) == len(out) and type(codes) is list and codes.count(0) == len(out) == len(codes):
            return [Status.OK] * len(out)  # the usual answer, without a pass per key
        for j, i in enumerate(send):
            out[i] = status if status is not None else status_of(codes[j])
        self._forget_on_failure(out)
        return _filled(out, Status.UNAVAILABLE)

    def get(self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float) -> list[Status]:
        out, send, names, ptrs, sizes, totals = self._arguments(keys, regions)
        if not send:
            return _filled(out, Status.INVALID)
        same_node = self.options.prefer_alloc_in_same_node

        def fn(st: Any) -> list[int]:
            codes = list(st.batch_get_into_multi_buffers(names, ptrs, sizes, same_node))
            if TRANSFER_FAIL not in codes:
                return codes
            # Regions larger than the object make Mooncake report a transfer failure;
            # tell that apart from a real one (only on this failure path: get_size
            # is another master round trip).
            for j, c in enumerate(codes):
                if c == TRANSFER_FAIL:
                    size = st.get_size(names[j])
                    if size >= 0 and size != totals[j]:
                        codes[j] = _SIZE_MISMATCH
                    elif size == OBJECT_NOT_FOUND:
                        codes[j] = OBJECT_NOT_FOUND
            return codes

        # On a thread the engine watches (its load thread), run on that thread: the
        # engine gives up on an overrun itself and keeps the buffer out of use.
        status, codes = self._guarded(fn, timeout_s, inline=self.options.inline_gets and caller_is_watched())
        if status is None and len(send) == len(out) and codes == totals:
            return [Status.OK] * len(out)  # every object whole (codes are byte counts), the usual answer
        missing = []
        for j, i in enumerate(send):
            if status is not None:
                out[i] = status
            elif codes[j] == _SIZE_MISMATCH or (codes[j] >= 0 and codes[j] != totals[j]):
                out[i] = Status.INVALID
            else:
                out[i] = status_of(codes[j])
                if out[i] is Status.NOT_FOUND:
                    missing.append(names[j])
        self._forget(missing)
        self._forget_on_failure(out)
        return _filled(out, Status.UNAVAILABLE)

    def remove(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        out: list[Status | None] = [None if self._key_ok(k) else Status.INVALID for k in keys]
        ask = [i for i, s in enumerate(out) if s is None]
        names = [keys[i] for i in ask]
        self._forget(names)
        if names:
            force = self.options.force_remove
            status, codes = self._guarded(lambda st: st.batch_remove(names, force), timeout_s)
            for j, i in enumerate(ask):
                out[i] = status if status is not None else status_of(codes[j])
        return _filled(out, Status.UNAVAILABLE)

    def remove_prefix(self, prefix: str, timeout_s: float) -> tuple[Status, int]:
        if not prefix or not prefix.isascii():  # "" would empty the whole cluster: refused
            return Status.INVALID, 0
        with self._cache_lock:
            for k in [k for k in self._exists_cache if k.startswith(prefix)]:
                del self._exists_cache[k]
        pattern = _regex_prefix(prefix)
        force = self.options.force_remove
        status, count = self._guarded(lambda st: st.remove_by_regex(pattern, force), timeout_s)
        if status is not None:
            return status, 0
        return (Status.OK, count) if count >= 0 else (status_of(count), 0)

    # -- service -------------------------------------------------------------------------

    def health(self, timeout_s: float) -> Health:
        detail: dict[str, Any] = {
            "master": self.options.master_server_address,
            "protocol": self.options.protocol,
            "segment_bytes": self._segment,
        }
        def probe() -> int:
            if self._delay_s:
                time.sleep(self._delay_s)  # test hook: a slow store
            return self._store.health_check()

        outcome, code = self._guard.call(probe, timeout_s)
        if outcome is Outcome.CLOSED:
            return Health(Status.UNAVAILABLE, {**detail, "reason": "closed"})
        if outcome is Outcome.TIMEOUT:
            return Health(Status.TIMEOUT, {**detail, "reason": "health_check did not answer"})
        if code == 0:
            # The client learns of a dead master only after several missed pings;
            # a refused connection to the master's port is a faster, surer sign.
            try:
                _probe_master(self.options.master_server_address, min(timeout_s, 0.5))
            except BackendSetupError:
                code = 2
        detail["mooncake_health"] = _HEALTH_CODES.get(code, str(code))
        return Health(Status.OK if code == 0 else Status.UNAVAILABLE, detail)

    def quiescent(self) -> bool:
        # A native call we stopped waiting for may still read or write its buffers.
        return self._guard.inflight == 0

    def stats(self) -> Mapping[str, Any]:
        return {
            "inflight_calls": self._guard.inflight,
            "timeouts": self._guard.timeouts,
            "late_completions": self._guard.late_completions,
            "inline_calls": self._guard.inline_calls,
            "inline_overruns": self._guard.inline_overruns,
            **self._counters,
        }

    def test_hooks(self) -> _Hooks:
        return _Hooks(self)

    def close(self) -> None:
        with self._close_lock:
            if self._guard.closed:
                return
            limit = self.options.close_timeout_s
            started = time.monotonic()
            store = self._store
            self._forget_all()
            if not self._guard.close(limit):
                # A native call is stuck; closing under it could crash. Leave the client be.
                _quarantine(store)
                log.warning("mooncake: calls still running after %.1f s; client left open", limit)
                return
            if store.health_check() == 2:
                # close() unmounts through the master while holding the GIL: 17 s measured
                # with the master gone, freezing every thread. The master forgets this
                # client by itself (client_ttl), so skip the native close.
                _quarantine(store)
                log.warning("mooncake: master unreachable at close; client abandoned, not closed")
                return
            done = threading.Event()

            def shut() -> None:
                try:
                    store.close()
                finally:
                    done.set()

            threading.Thread(target=shut, name="mooncake-close", daemon=True).start()
            if not done.wait(max(0.0, limit - (time.monotonic() - started))):
                _quarantine(store)
                log.warning("mooncake: close did not finish within %.1f s", limit)


class _Hooks:
    """Conformance fault injection: a slow store (data calls, remove_prefix and
    health sleep on the native threads). No break_store: the master is another
    process (tests/mooncake kill it for real)."""

    def __init__(self, backend: MooncakeBackend) -> None:
        self._backend = backend

    def delay(self, seconds: float) -> None:
        self._backend._delay_s = max(0.0, seconds)


#: most answers the exists cache keeps (a 128k-token prompt's lookup is 1024 keys a rank)
EXISTS_CACHE_MAX = 65536
#: stale answers a call drops beyond as many as it added (a backlog drains by this much a call)
_TRIM_EXTRA = 256


def _trim(cache: dict[str, float], cutoff: float, limit: int, added: int) -> None:
    """Drop answers dated ``cutoff`` or before from the cache's oldest end, at most
    ``added`` + _TRIM_EXTRA of them; then, still over ``limit``, the oldest, fresh or not.

    Answers go in as they arrive, so the front holds the oldest. A refreshed key keeps
    its place: the sweep stops at the first fresh answer and stale ones behind it wait
    (a stale answer is never used: each is dated). So each answer is dropped once and a
    call drops about as many as it added: no pass over the whole cache and no sort, where
    sorting 65536 answers by age to drop half held the caller (a scheduler's lookup)
    ~5 ms once every 32768 new keys (17-22 ms with their dates out of order)."""
    drop: list[str] = []
    most = added + _TRIM_EXTRA
    for k, t in cache.items():
        if t > cutoff or len(drop) >= most:
            break
        drop.append(k)
    over = len(cache) - len(drop) - limit
    if over > 0:
        drop.extend(islice(cache, len(drop), len(drop) + over))
    for k in drop:
        del cache[k]


def _filled(out: list[Status | None], default: Status) -> list[Status]:
    # Status.OK is 0, so never `s or default`
    if None not in out:
        return out  # type: ignore[return-value]  # (every answer given: no pass per key)
    if out[0] is None and out.count(None) == len(out):
        # none given (an unpin of valid keys: a request's lookup pins let go of, 1024
        # keys for a 128k prompt): no pass per key in Python (8.5 us to 1.1 there)
        return [default] * len(out)
    return [default if s is None else s for s in out]


def _unanswered(out: list[Status | None]) -> Sequence[int]:
    """Indexes of the keys still to ask about (None in ``out``). ``count`` runs in C;
    a batch all or none of which is answered (the usual ones) makes no pass per key
    in Python."""
    n = out.count(None)
    if n == len(out):
        return range(n)
    return [i for i, s in enumerate(out) if s is None] if n else []


_MASTER_DOWN = object()
_SIZE_MISMATCH = -(10**9)
