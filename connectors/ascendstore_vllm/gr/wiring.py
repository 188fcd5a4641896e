"""GR mode inside a connector: one object per role, a one-line call per hook.

``attach_gr(ctx, role, kv_cache_config)`` returns a ``GRAttachment`` when
``gr.enabled`` (else None). A connector forwards its hooks to it; a request the
attachment claims (a request with a ``uid``) is GR's alone -- the chunk pool
neither looks it up nor saves it, so candidates are never pooled.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ascendstore.contract import BackendContext
from ascendstore.errors import ConfigError
from ascendstore.gr import GRStats, UserStore
from ascendstore.gr.inputs import KNOWN_KEYS
from ascendstore.registry import create_backend
from ascendstore_vllm.context import ConnectorContext
from ascendstore_vllm.gr.hooks import GRPlan, GRSchedulerHooks, GRWorkerHooks
from ascendstore_vllm.gr.staging import GRStaging

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from ascendstore_vllm.device import HostBuffers

#: where the plan travels in a connector's metadata ``extensions``
PLAN_KEY = "ascendstore.gr"
#: the scheduler's staging buffers for token records (a 1M-token history's record is 4 MiB)
RECORD_BUFFER_BYTES = 16 << 20

log = logging.getLogger(__name__)


def carries_gr_fields(request: Any) -> bool:
    """Whether a vLLM request carries GR fields (uid, user_history_len, candidate_num)."""
    sp = getattr(request, "sampling_params", None)
    for src in (getattr(request, "kv_transfer_params", None), getattr(sp, "extra_args", None)):
        if isinstance(src, dict) and any(k in src for k in KNOWN_KEYS):
            return True
    return False


class GRFieldsIgnored:
    """A connector without ``gr.enabled`` pools GR requests block-wise, candidates
    included. Say so once in the log, so an operator who forgot the switch finds out."""

    def __init__(self) -> None:
        self.warned = False

    def check(self, request: Any) -> None:
        if not self.warned and carries_gr_fields(request):
            self.warned = True
            log.warning(
                "request %s carries GR fields (uid / user_history_len / candidate_num) but gr.enabled is "
                "off: it is pooled block-wise by the chunk pool, candidates included. Set "
                "gr.enabled=true in kv_connector_extra_config for the user-granular pool "
                "(docs/gr-mode.md). This is logged once.",
                request.request_id,
            )


def gr_model_token(ctx: ConnectorContext) -> str:
    """The ``{model}`` part of user keys: the model name plus the digest of
    everything that makes KV bytes compatible (dtype, layout, heads, TP...)."""
    return f"{ctx.fingerprint.model}.{ctx.fingerprint.digest()[:12]}"


def build_user_store(ctx: ConnectorContext, role: str, stats: GRStats | None = None,
                     backend: Any = None) -> UserStore:
    """A user store on ``backend`` (e.g. the connector's guarded client) or a new one."""
    from ascendstore.engine import BackendGuard

    cfg = ctx.config
    world = ctx.tp_size * ctx.pp_size
    rank = ctx.tp_rank + ctx.pp_rank * ctx.tp_size
    if backend is None:
        raw = create_backend(
            cfg.backend, cfg.backend_config,
            BackendContext(role=role, rank=rank, world_size=world, instance_id=ctx.instance_id,
                           timeout_s=cfg.timeout_ms / 1000),
        )
        if role == "scheduler" and not raw.capabilities.scheduler_client:
            raw.close()
            raise ConfigError(
                f"gr.enabled needs a scheduler-side client of backend {cfg.backend!r} (its user lookups "
                f"read the pool from the scheduler); this backend has none. Set gr.enabled=false."
            )
        backend = BackendGuard(raw, cfg.timeout_ms / 1000, name=f"ascendstore-gr-{role}")
    return UserStore(
        backend, model=gr_model_token(ctx), world_size=world, block_size=ctx.block_size, config=cfg.gr,
        worker_id=rank, num_layers=ctx.num_layers, layerwise=cfg.use_layerwise,
        timeout_s=cfg.timeout_ms / 1000, stats=stats,
    )


def bytes_per_block(ctx: ConnectorContext, kv_cache_config: KVCacheConfig | None) -> int:
    """KV bytes of one block over all layers and ranks (tenant quota accounting)."""
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return 0
    group = kv_cache_config.kv_cache_groups[0]
    return int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names) * ctx.tp_size * ctx.pp_size


class GRAttachment:
    def __init__(self, ctx: ConnectorContext, is_scheduler: bool, kv_cache_config: KVCacheConfig | None,
                 backend: Any = None) -> None:
        self.ctx = ctx
        self.stats = GRStats()
        self._reported = GRStats()
        self.sched: GRSchedulerHooks | None = None
        self.worker: GRWorkerHooks | None = None
        self._errors: set[int] = set()
        self._owns_backend = backend is None
        rank = ctx.tp_rank + ctx.pp_rank * ctx.tp_size
        # every rank saves and loads its own objects; rank 0 speaks for all in the counters
        counted = self.stats if is_scheduler or rank == 0 else GRStats()
        store = build_user_store(ctx, "scheduler" if is_scheduler else "worker", counted, backend)
        self.staging: GRStaging | None = None
        if is_scheduler:
            if store.caps.needs_registration:
                # Its record reads and writes go through registered host buffers (RDMA);
                # records are token ids, so smaller ones than a worker's.
                from ascendstore_vllm.device import HostBuffers

                self._stage_through(store, HostBuffers(min(ctx.config.staging_buffer_bytes, RECORD_BUFFER_BYTES)))
            self.sched = GRSchedulerHooks(
                store, config=ctx.config.gr, block_size=ctx.block_size,
                bytes_per_block=bytes_per_block(ctx, kv_cache_config), default_tenant=ctx.config.tenant,
                stats=self.stats, load_async=ctx.config.load_async,
            )
        else:
            self.worker = GRWorkerHooks(store, count_stats=rank == 0, load_async=ctx.config.load_async)

    def _stage_through(self, store: UserStore, buffers: HostBuffers) -> None:
        """Every user object ``store`` moves goes through ``buffers`` (registered with
        the backend where it reads registered memory only)."""
        caps, backend = store.caps, store.backend
        registers = caps.needs_registration or caps.zero_copy
        self.staging = store.staging = GRStaging(
            buffers, backend.register if registers else None, backend.unregister if registers else None)

    @property
    def store(self) -> UserStore:
        hooks = self.sched or self.worker
        assert hooks is not None
        return hooks.store

    # -- scheduler side ---------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        if self.sched is not None:
            self.sched.bind_kv_cache_manager(kv_cache_manager)

    def claims(self, request: Any) -> bool:
        return self.sched is not None and self.sched.is_gr(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool] | None:
        """GR's answer for a GR request; None: not GR (use the ordinary path)."""
        assert self.sched is not None
        if not self.ctx.can_load:
            return (0, False) if self.sched.is_gr(request) else None
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        assert self.sched is not None
        self.sched.update_state_after_alloc(request, num_external_tokens)

    def build_plan(self, scheduler_output: Any) -> GRPlan:
        assert self.sched is not None
        plan = self.sched.build_plan(scheduler_output)
        if not self.ctx.can_save:
            plan.saves = []
        return plan

    def update_connector_output(self, connector_output: Any) -> None:
        if self.sched is not None:
            self.sched.update_connector_output(getattr(connector_output, "finished_recving", None))

    def request_finished(self, request: Any) -> bool:
        """Whether to delay freeing the request's blocks (an async swap-in in flight)."""
        return self.sched.request_finished(request) if self.sched is not None else False

    def delete_user(self, uid: str, cache_salt: str | None = None) -> int:
        """Delete user ``uid`` of ``cache_salt``'s tenant (None: the default tenant)."""
        assert self.sched is not None
        return self.sched.delete_user(uid, cache_salt)

    # -- worker side ------------------------------------------------------------------
    #: take CPU KV for device KV (tests run the device paths with it)
    treat_kv_as_device = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], on_device: bool | None = None) -> None:
        """Map block ids to vLLM's KV bytes, and decide what the backend is handed.

        ``on_device``: the KV is device memory (default: its tensors' device is not
        the CPU, or ``treat_kv_as_device``). User objects go through
        connector-owned buffers (``GRStaging``, ``staging_buffer_bytes`` per
        direction, never a copy of the whole KV cache) unless the backend may
        be given the caller's memory as it is: host KV, calls that never outlive
        their deadline, no registration needed."""
        from ascendstore.engine import KVLayout, LayerSpan
        from ascendstore_vllm.device import DeviceBuffers, DeviceSync, HostStaging

        assert self.worker is not None
        device = next(iter(kv_caches.values())).device
        if on_device is None:
            on_device = device.type != "cpu" or self.treat_kv_as_device
        caps = self.store.caps
        guard = self.store.backend
        # A backend whose calls may outlive their deadline never gets vLLM's blocks
        # (docs/failure-semantics.md); one that needs registration gets only
        # registered memory, one that reads device memory only device memory.
        direct = bool(getattr(guard, "direct", True))
        if on_device or not direct or caps.needs_registration:
            kind = DeviceBuffers if on_device and caps.device_memory else HostStaging
            # (device KV copies batched: a device's default, also for CPU KV taken for device KV)
            self._stage_through(self.store, kind(kv_caches, self.ctx.config.staging_buffer_bytes,
                                                 batched=True if on_device else None))
        sync = DeviceSync(device)
        self.worker.before_save = lambda block_ids: sync.synchronize()
        layout = KVLayout([
            LayerSpan.from_view(name, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())
            for name, t in kv_caches.items()
        ])
        self.worker.block_regions = lambda ids: [[lay.block_regions(b) for b in ids] for lay in layout.layers]

    def start_load(self, plan: GRPlan | None) -> None:
        if self.worker is not None and plan is not None:
            self._errors |= self.worker.load(plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose blocks may be freed now, async swap-ins done) on this rank."""
        if self.worker is None:
            return set(), set()
        sending, recving = self.worker.finished(finished_req_ids)
        self._errors |= self.worker.take_errors()
        return sending, recving

    def save(self, plan: GRPlan | None) -> None:
        if self.worker is not None and plan is not None:
            self.worker.save(plan)

    def take_load_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    # -- stats ------------------------------------------------------------------------
    def take_stats(self) -> dict[str, int]:
        """Counters since the last call (non-zero only)."""
        data = self.stats.snapshot(reset=True)
        self._reported.merge(data)
        return {k: v for k, v in data.items() if v}

    def totals(self) -> dict[str, int]:
        """Counters since start, reported or not."""
        out = self._reported.snapshot()
        for k, v in self.stats.snapshot().items():
            out[k] += v
        return out

    def shutdown(self) -> None:
        if self.sched is not None and self.sched.lru is not None:
            self.sched.lru.uninstall()
        if self.worker is not None:
            self.worker.shutdown()
        if self._owns_backend:
            self.store.backend.close()


def attach_gr(ctx: ConnectorContext, is_scheduler: bool, kv_cache_config: KVCacheConfig | None = None,
              backend: Any = None) -> GRAttachment | None:
    """The GR attachment of a connector role, or None when ``gr.enabled`` is off."""
    if not ctx.config.gr.enabled:
        return None
    return GRAttachment(ctx, is_scheduler, kv_cache_config, backend)


def plan_of(meta: Any) -> GRPlan | None:
    """The GR plan carried in a connector's metadata ``extensions`` (None if absent)."""
    ext = getattr(meta, "extensions", None) or {}
    entry = ext.get(PLAN_KEY)
    return entry.get("plan") if entry else None
