"""The ``memcache`` backend: AscendStore's contract over MemCache (MemFabric).

Data moves through MemCache's layers API: an object is the concatenation of a
key's regions, written with ``batch_put_from_layers`` and read with
``batch_get_into_layers``, copying L2G/G2L for device (NPU) memory and H2G/G2H
for host memory. The layerwise global-address (GVA) flow of vllm-ascend is
offered behind the ``layerwise`` capability: writers allocate, copy and finish;
readers take a lease, copy and release it.

The store module is injected: the real ``memcache_hybrid`` by default, the
stand-in (``driver="standin"``) for tests and hosts without Ascend. The same
translation code runs against both.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from ascendstore.contract import (
    Backend,
    BackendContext,
    BackendOptions,
    BackendSetupError,
    Capabilities,
    Health,
    Region,
    Status,
    keys_fit,
)
from ascendstore.errors import ConfigError
from ascendstore_memcache import conf, preflight
from ascendstore_memcache.calls import CallTimeout, Deadline, NativeCalls
from ascendstore_memcache.codes import (
    MAX_BATCH_KEYS,
    MAX_KEY_BYTES,
    MAX_LAYERS,
    describe,
    exist_status,
    to_status,
)
from ascendstore_memcache.layerwise import GvaFlow, coalesce
from ascendstore_memcache.options import MemcacheOptions

log = logging.getLogger(__name__)

HEALTH_KEY = "ascendstore/health-probe"
INSTALL_MEMCACHE = "pip install memcache-hybrid==1.3.0 memfabric-hybrid==1.3.0"

# The native client is a process-wide singleton (MmcClientDefault::GetInstance):
# two open clients in one process would share and then tear down each other.
_open_lock = threading.Lock()
_open_native: MemcacheBackend | None = None
_env_lock = threading.Lock()


def load_store_module(options: MemcacheOptions, instance_id: str, local_conf: str | None = None) -> tuple[Any, bool]:
    """The module the adapter drives, per ``options.driver``, and whether it
    will read ``local_conf`` through $MMC_LOCAL_CONFIG_PATH by itself.

    The real library takes its view of the environment when it is loaded
    (measured: setting the variable after ``import memcache_hybrid`` -- even
    with libc setenv -- is not seen, init() answers "MMC_LOCAL_CONFIG_PATH is
    not set"). So the variable is set before the first import; a library
    loaded earlier gets its configuration through setup(LocalConfig) instead.
    """
    if options.driver == "standin":
        from ascendstore_memcache.standin import StandinModule

        path = options.standin_path or str(
            conf.default_conf_dir(instance_id).parent
            / ("standin-" + options.meta_service_url.split("://")[-1].replace(":", "-"))
        )
        return StandinModule(path), True
    loaded_before = "memcache_hybrid" in sys.modules
    if local_conf is not None and not loaded_before:
        os.environ[conf.LOCAL_ENV] = local_conf
    try:
        import memcache_hybrid
    except ImportError as exc:
        raise BackendSetupError(
            f"backend 'memcache' needs the MemCache client library, which does not import here "
            f"({type(exc).__name__}: {exc}). Install it with `{INSTALL_MEMCACHE}`."
        ) from exc
    return memcache_hybrid, not loaded_before


def _device_id(options: MemcacheOptions, ctx: BackendContext) -> int:
    """The NPU this client uses: the option, else the device the worker already
    set (as vllm-ascend does), else the context's local rank."""
    if options.device_id is not None:
        return options.device_id
    if "torch_npu" in sys.modules:  # only when the process already uses NPUs
        try:
            import torch

            return int(torch.npu.current_device())
        except Exception:  # no device set yet: fall back to the local rank
            log.debug("torch.npu.current_device() unavailable", exc_info=True)
    return ctx.local_rank


class _StandinHooks:
    """Conformance fault injection, offered by the stand-in only."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def delay(self, seconds: float) -> None:
        self._store.set_delay(seconds)

    def corrupt(self, key: str) -> bool:
        return bool(self._store.corrupt(key))

    def break_store(self) -> None:
        self._store.break_meta()  # the meta service dies


class MemcacheBackend(GvaFlow, Backend):
    Options: ClassVar[type[BackendOptions]] = MemcacheOptions

    def __init__(
        self,
        store: Any,
        module: Any,
        options: MemcacheOptions,
        resolved: conf.ResolvedConf,
        ctx: BackendContext,
        init_bm: bool,
        device_memory: bool,
    ) -> None:
        self._store = store
        self._module = module
        self._options = options
        self._conf = resolved
        self._ctx = ctx
        self._init_bm = init_bm
        self._device_memory = device_memory
        self._standin = options.driver == "standin"
        self._calls = NativeCalls(options.workers, "mmc")
        self._closed = False
        self._close_lock = threading.Lock()
        # Copy directions: device memory copies local HBM <-> global (L2G/G2L),
        # host memory copies DRAM <-> global (H2G/G2H).
        self._put_dir = int(module.L2G if device_memory else module.H2G)
        self._get_dir = int(module.G2L if device_memory else module.G2H)
        self._register = (
            options.register_buffers
            if options.register_buffers is not None
            else resolved.protocol == "device_rdma"
        )
        self._replicate = None
        if options.replica_num:
            self._replicate = module.ReplicateConfig()
            self._replicate.replicaNum = options.replica_num

    # -- creation ---------------------------------------------------------------------
    @classmethod
    def create(
        cls, options: BackendOptions, ctx: BackendContext, *, store_module: Any = None
    ) -> MemcacheBackend:
        """Open a client. ``store_module`` replaces the driver's module (tests)."""
        assert isinstance(options, MemcacheOptions)
        init_bm = options.init_bm if options.init_bm is not None else ctx.role != "scheduler"
        device_memory = options.memory == "device" or (
            options.memory == "auto" and ctx.device_type not in ("cpu", "")
        )
        try:
            resolved = conf.resolve(options, ctx.instance_id)
        except ConfigError as exc:
            raise BackendSetupError(f"backend 'memcache': {exc}") from None
        real = store_module is None and options.driver == "memcache_hybrid"
        if real and init_bm and options.preflight:
            missing = preflight.ascend_missing()
            if missing:
                raise BackendSetupError("backend 'memcache': " + preflight.missing_message(missing))
        if store_module is not None:
            module, reads_env = store_module, True
        else:
            module, reads_env = load_store_module(options, ctx.instance_id, str(resolved.local_path))
        if real:
            host, port = conf.tcp_endpoint(resolved.meta_service_url)
            why = preflight.meta_service_reachable(host, port)
            if why is not None:
                raise BackendSetupError(
                    f"backend 'memcache': no MemCache meta service at {resolved.meta_service_url} ({why}). "
                    f"Start one first: `ascendstore-memcache-meta --config {resolved.meta_path}` "
                    f"(or set meta_service_url / {conf.LOCAL_ENV} to the running one)."
                )
        global _open_native
        with _open_lock:
            if real and _open_native is not None:
                raise BackendSetupError(
                    "backend 'memcache': this process already has an open MemCache client; the native "
                    "library allows one per process (close it first, or share it)."
                )
            store = cls._init_store(module, options, resolved, ctx, init_bm, reads_env)
            backend = cls(store, module, options, resolved, ctx, init_bm, device_memory)
            if real:
                _open_native = backend
        log.info(
            "memcache backend open: driver=%s init_bm=%s memory=%s conf=%s",
            options.driver if store_module is None else getattr(module, "__name__", "injected"),
            init_bm,
            "device" if device_memory else "host",
            resolved.local_path,
        )
        return backend

    @staticmethod
    def _init_store(
        module: Any,
        options: MemcacheOptions,
        resolved: conf.ResolvedConf,
        ctx: BackendContext,
        init_bm: bool,
        reads_env: bool,
    ) -> Any:
        device_id = _device_id(options, ctx)
        store = module.DistributedObjectStore()
        deadline = Deadline(options.setup_timeout_s)
        calls = NativeCalls(1, "mmc-init")
        try:
            if reads_env:
                # init() without setup() reads the whole local file, as in
                # vllm-ascend deployments (keys LocalConfig lacks keep working).
                with _env_lock:
                    os.environ[conf.LOCAL_ENV] = str(resolved.local_path)
                    code = calls.run(deadline, store.init, device_id, init_bm)
            else:
                cfg, dropped = conf.local_config_object(module, resolved.local)
                if dropped:
                    log.warning(
                        "memcache: the library was loaded before AscendStore could point it at %s; "
                        "configuring it through setup(), which cannot carry %s",
                        resolved.local_path,
                        ", ".join(dropped),
                    )
                code = calls.run(deadline, store.setup, cfg)
                if code == 0:
                    code = calls.run(deadline, store.init, device_id, init_bm)
        except CallTimeout:
            raise BackendSetupError(
                f"backend 'memcache': client setup/init did not return within {options.setup_timeout_s}s "
                f"(meta service {resolved.meta_service_url}, protocol {resolved.protocol})."
            ) from None
        finally:
            calls.shutdown()
        if code != 0:
            try:
                store.close()
            except Exception:  # the init error below is the one to report
                log.debug("close after failed init", exc_info=True)
            hint = (
                "Check the local service log above; with init_bm=true the host needs the Ascend driver "
                "and CANN, and dram_size/hbm_size must fit the protocol's alignment."
                if init_bm
                else "Check that the meta service runs and matches meta_service_url."
            )
            raise BackendSetupError(
                f"backend 'memcache': init(device_id={device_id}, init_bm={init_bm}) failed with "
                f"{describe(code)} using {resolved.local_path}. {hint}"
            )
        return store

    # -- description ------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            zero_copy=True,
            layerwise=True,
            shared_across_processes=True,
            # the stand-in's SQLite file is one host's; MemCache spans nodes
            shared_across_nodes=not self._standin,
            persistent=False,
            evicts=True,
            overwrite_on_put=False,  # a duplicate put is skipped and reported OK
            detects_corruption=False,
            remove_by_prefix=False,
            listing=False,
            device_memory=not self._standin,
            needs_registration=False,
            scheduler_client=True,
            empty_objects=False,
            # Native calls run under the backend's own deadline (it returns in
            # time) but may go on after a timeout: see quiescent().
            bounded_calls=True,
            detaches_calls=True,
            max_key_bytes=MAX_KEY_BYTES,
            max_object_bytes=1 << 30,
        )

    def quiescent(self) -> bool:
        # A native call we stopped waiting for may still read or write its buffers.
        return self._calls.inflight == 0

    def stats(self) -> Mapping[str, Any]:
        out: dict[str, Any] = {
            "driver": self._options.driver,
            "protocol": self._conf.protocol,
            "meta_service_url": self._conf.meta_service_url,
            "local_config_path": str(self._conf.local_path),
            "init_bm": self._init_bm,
            "memory": "device" if self._device_memory else "host",
            "native_calls_in_flight": self._calls.inflight,
        }
        if not self._closed:
            out["local_service_id"] = self._store.get_local_service_id()
            if self._standin:
                out.update(self._store.stats())
        return out

    def test_hooks(self) -> _StandinHooks | None:
        return _StandinHooks(self._store) if self._standin else None

    # -- plumbing ---------------------------------------------------------------------------
    def _native(self, deadline: Deadline, fn: Callable[..., Any], *args: Any) -> tuple[Status | None, Any]:
        """(None, result) or (error status, None) for one native call."""
        if self._closed:
            return Status.UNAVAILABLE, None
        try:
            return None, self._calls.run(deadline, fn, *args)
        except CallTimeout:
            log.warning("memcache %s: no answer within the deadline", getattr(fn, "__name__", "call"))
            return Status.TIMEOUT, None
        except Exception:  # a native exception must not escape as a result
            if not self._closed:  # closing under a call: its executor is gone, nothing to report
                log.exception("memcache %s raised", getattr(fn, "__name__", "call"))
            return Status.UNAVAILABLE, None

    def _per_key(
        self,
        keys: Sequence[str],
        call: Callable[[list[int]], tuple[Status | None, Any]],
        decode: Callable[[int], Status],
        valid: Sequence[bool] | None = None,
    ) -> list[Status]:
        """Run ``call`` on batches of at most MAX_BATCH_KEYS indices (of the
        valid keys) and decode its per-key codes.

        With every key valid (``valid`` None or all True, as in every batch the
        engine makes) the indices are ranges (``_pick`` slices them) and the
        answers land by slice; each distinct code is decoded once and mapped in C.
        A pass per key in Python was ~0.8 ms of a 1024-key exists."""
        n = len(keys)
        out = [Status.INVALID] * n
        whole = valid is None or valid.count(False) == 0
        todo: Sequence[int] = range(n) if whole else [i for i in range(n) if valid[i]]  # type: ignore[index]
        for start in range(0, len(todo), MAX_BATCH_KEYS):
            idx = todo[start : start + MAX_BATCH_KEYS]
            err, codes = call(idx)  # type: ignore[arg-type]
            if err is None and (not isinstance(codes, list | tuple) or len(codes) != len(idx)):
                # the pybind layer returns [] when the client is gone [measured]
                log.warning("memcache: got %r for %d keys", codes, len(idx))
                err = Status.UNAVAILABLE
            if err is not None:
                got = [err] * len(idx)
            else:
                table = {c: decode(int(c)) for c in set(codes)}
                got = list(map(table.__getitem__, codes))
            if whole:
                out[start : start + len(idx)] = got
            else:
                for i, st in zip(idx, got, strict=True):
                    out[i] = st
        return out

    def _valid_keys(self, keys: list[str]) -> list[bool] | None:
        """None when every key is one MemCache takes (``keys_fit``: no Python pass
        per key for the usual batch), else a verdict per key."""
        if keys and keys_fit(keys, MAX_KEY_BYTES):
            return None
        return [self._key_ok(k) for k in keys]

    @staticmethod
    def _key_ok(key: str) -> bool:
        return 0 < len(key.encode()) <= MAX_KEY_BYTES

    def _layers(
        self, keys: Sequence[str], regions: Sequence[Sequence[Region]]
    ) -> tuple[list[bool], list[list[int]], list[list[int]]]:
        if len(keys) != len(regions):
            raise ValueError(f"{len(keys)} keys but {len(regions)} region lists")
        valid, ptrs, lens = [], [], []
        for key, regs in zip(keys, regions, strict=True):
            merged = coalesce(regs)
            ok = self._key_ok(key) and 0 < len(merged) <= MAX_LAYERS
            valid.append(ok)
            ptrs.append([r.addr for r in merged])
            lens.append([r.length for r in merged])
        return valid, ptrs, lens

    # -- registration -------------------------------------------------------------------
    def register(self, regions: Sequence[Region]) -> Status:
        return self._registration(regions, "register_buffer")

    def unregister(self, regions: Sequence[Region]) -> Status:
        return self._registration(regions, "unregister_buffer")

    def _registration(self, regions: Sequence[Region], method: str) -> Status:
        if self._closed:
            return Status.UNAVAILABLE
        if not self._init_bm:
            # a pure client has no memory to register; the real call segfaults [measured]
            return Status.INVALID
        if not self._register:
            return Status.OK
        fn = getattr(self._store, method)
        deadline = Deadline(self._ctx.timeout_s * max(1, len(regions)))
        for r in regions:
            err, code = self._native(deadline, fn, r.addr, r.length)
            status = err or to_status(int(code), "register")
            if status is not Status.OK:
                return status
        return Status.OK

    # -- data path --------------------------------------------------------------------------
    def exists(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        keys = list(keys)
        deadline = Deadline(timeout_s)
        valid = self._valid_keys(keys)

        def call(idx: Sequence[int]) -> tuple[Status | None, Any]:
            return self._native(deadline, self._store.batch_is_exist, _pick(keys, idx))

        return self._per_key(keys, call, exist_status, valid)

    def put(self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float) -> list[Status]:
        keys = list(keys)
        if not self._init_bm and keys:
            log.warning("memcache: put on a pure client (init_bm=false) cannot move data")
            return [Status.UNAVAILABLE if self._closed else Status.INVALID] * len(keys)
        deadline = Deadline(timeout_s)
        valid, ptrs, lens = self._layers(keys, regions)
        extra = (self._replicate,) if self._replicate is not None else ()

        def call(idx: list[int]) -> tuple[Status | None, Any]:
            return self._native(
                deadline,
                self._store.batch_put_from_layers,
                [keys[i] for i in idx],
                [ptrs[i] for i in idx],
                [lens[i] for i in idx],
                self._put_dir,
                *extra,
            )

        return self._per_key(keys, call, lambda c: to_status(c, "put"), valid)

    def get(self, keys: Sequence[str], regions: Sequence[Sequence[Region]], timeout_s: float) -> list[Status]:
        keys = list(keys)
        if not self._init_bm and keys:
            log.warning("memcache: get on a pure client (init_bm=false) cannot move data")
            return [Status.UNAVAILABLE if self._closed else Status.INVALID] * len(keys)
        deadline = Deadline(timeout_s)
        valid, ptrs, lens = self._layers(keys, regions)
        result = [Status.INVALID] * len(keys)
        if self._options.check_sizes:
            sizes = self._object_sizes(keys, valid, deadline)
            for i, size in enumerate(sizes):
                if not valid[i]:
                    continue
                if isinstance(size, Status):
                    result[i], valid[i] = size, False
                elif size != sum(lens[i]):
                    result[i], valid[i] = Status.INVALID, False  # regions must cover the object exactly

        def call(idx: list[int]) -> tuple[Status | None, Any]:
            return self._native(
                deadline,
                self._store.batch_get_into_layers,
                [keys[i] for i in idx],
                [ptrs[i] for i in idx],
                [lens[i] for i in idx],
                self._get_dir,
            )

        got = self._per_key(keys, call, lambda c: to_status(c, "get"), valid)
        return [got[i] if valid[i] else result[i] for i in range(len(keys))]

    def _object_sizes(self, keys: list[str], valid: list[bool], deadline: Deadline) -> list[int | Status]:
        """Object size per key (NOT_FOUND when absent) from one key-info query per batch."""
        sizes: list[int | Status] = [Status.INVALID] * len(keys)
        todo = [i for i, ok in enumerate(valid) if ok]
        for start in range(0, len(todo), MAX_BATCH_KEYS):
            idx = todo[start : start + MAX_BATCH_KEYS]
            err, infos = self._native(deadline, self._store.batch_get_key_info, [keys[i] for i in idx])
            if err is None and (infos is None or len(infos) != len(idx)):
                err = Status.UNAVAILABLE  # [] when the client is gone [measured]
            for j, i in enumerate(idx):
                if err is not None:
                    sizes[i] = err
                else:
                    size = int(infos[j].size())
                    sizes[i] = size if size > 0 else Status.NOT_FOUND
        return sizes

    def remove(self, keys: Sequence[str], timeout_s: float) -> list[Status]:
        keys = list(keys)
        deadline = Deadline(timeout_s)
        valid = self._valid_keys(keys)

        def call(idx: Sequence[int]) -> tuple[Status | None, Any]:
            return self._native(deadline, self._store.remove_batch, _pick(keys, idx))

        return self._per_key(keys, call, lambda c: to_status(c, "remove"), valid)

    def health(self, timeout_s: float) -> Health:
        detail: dict[str, Any] = {
            "driver": self._options.driver,
            "meta_service_url": self._conf.meta_service_url,
            "protocol": self._conf.protocol,
            "init_bm": self._init_bm,
        }
        if self._closed:
            return Health(Status.UNAVAILABLE, {**detail, "reason": "closed"})
        # MemCache has no health call; an existence query round-trips to the
        # meta service and fails with LINK_NOT_FOUND at once when it is down [measured].
        err, codes = self._native(Deadline(timeout_s), self._store.batch_is_exist, [HEALTH_KEY])
        if err is not None:
            return Health(err, {**detail, "reason": err.name.lower()})
        code = int(codes[0]) if codes else -1
        if code in (0, 1):
            return Health(Status.OK, detail)
        return Health(to_status(code, "exists"), {**detail, "code": describe(code)})

    def close(self) -> None:
        global _open_native
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        # let overrunning calls finish before the client goes away under them
        if not self._calls.drain(self._ctx.timeout_s):
            log.warning("memcache close: %d native calls still running", self._calls.inflight)
        closer = NativeCalls(1, "mmc-close")
        try:
            code = closer.run(Deadline(max(5.0, self._ctx.timeout_s)), self._store.close)
            if code:
                log.warning("memcache close returned %s", describe(int(code)))
        except CallTimeout:
            log.warning("memcache close did not return in time; leaving it to finish in the background")
        except Exception:
            log.exception("memcache close raised")
        finally:
            closer.shutdown()
            self._calls.shutdown()
            with _open_lock:
                if _open_native is self:
                    _open_native = None


def _pick(items: list, idx: Sequence[int]) -> list:
    """``items`` at ``idx``: a slice when ``idx`` is a range (every key valid)."""
    if type(idx) is range:
        return items[idx.start : idx.stop]
    return [items[i] for i in idx]
