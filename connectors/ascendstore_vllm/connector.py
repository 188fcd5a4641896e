"""AscendStoreConnector: vLLM's KVConnectorBase_V1 over the AscendStore pool.

One object per role, as vLLM builds them; each delegates to a thin role class
(``AscendStoreScheduler`` / ``AscendStoreWorker``) over ``ascendstore.engine``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ascendstore_vllm.compat import async_recompute_warning, cache_hit_source
from ascendstore_vllm.context import ConnectorContext
from ascendstore_vllm.gr.stats import prefixed
from ascendstore_vllm.gr.wiring import PLAN_KEY, GRFieldsIgnored, attach_gr, plan_of
from ascendstore_vllm.metadata import AscendStoreMetadata, AscendStoreWorkerMeta
from ascendstore_vllm.stats import AscendStorePromMetrics, AscendStoreStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _vllm_publishes_kv_events(vllm_config: Any) -> bool:
    ev = getattr(vllm_config, "kv_events_config", None)
    return bool(ev is not None and ev.enable_kv_cache_events)


class AscendStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """Supports vLLM's hybrid KV cache manager: blocks come per KV cache group,
    and ascendstore_vllm.groups decides what each group pools (or refuses the
    model at start-up)."""

    #: After a failed load, a request's next lookup stops below the first failed
    #: chunk (scheduler ``_bad_from``), so kv_load_failure_policy "recompute" with
    #: load_async cannot loop; ascendstore_vllm.pd reads this.
    bounded_load_retry = True

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.ctx = ConnectorContext.from_vllm(vllm_config, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER and self.ctx.groups:
            log.info("AscendStore KV cache groups: %s", "; ".join(
                f"{p.index}:{p.spec_type} ({p.kind}, {len(p.layer_names)} layers"
                + (f", window {p.sliding_window} tokens: pools the last {p.window_blocks()} blocks of a chunk)"
                   if p.kind == "sliding" else ")") for p in self.ctx.groups))
        self.scheduler = None
        self.worker = None
        # KV events cost a little per step (landed keys, the removal record): only
        # when vLLM publishes them (--kv-events-config enable_kv_cache_events).
        self.kv_events = self.ctx.config.kv_events and _vllm_publishes_kv_events(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            from ascendstore_vllm.scheduler import AscendStoreScheduler

            self.scheduler = AscendStoreScheduler(self.ctx, kv_events=self.kv_events)
            # Hybrid models always load asynchronously (see ConnectorContext.hybrid).
            warning = async_recompute_warning(vllm_config, self.ctx.config.load_async or self.ctx.hybrid)
            if warning:
                log.warning(warning)
        else:
            from ascendstore_vllm.worker import AscendStoreWorker

            self.worker = AscendStoreWorker(self.ctx, kv_events=self.kv_events)
            # Async scheduling plans a step before the previous one's failed loads are known.
            self.worker.repeat_failures = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        # GR mode (gr.enabled): requests carrying a uid are the user store's alone;
        # every other request uses the chunk pool.
        # It shares this role's guarded client (one connection per process).
        shared = self.worker.guard if self.worker is not None else getattr(self.scheduler, "_guard", None)
        self.gr = attach_gr(self.ctx, role == KVConnectorRole.SCHEDULER, kv_cache_config, backend=shared)
        self._gr_ignored = GRFieldsIgnored() if self.gr is None else None

    @property
    def requires_kv_delivery(self) -> bool:
        # A pool is a best-effort cache: a dropped save is a future miss.
        return False

    # -- scheduler side ----------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:
            self.scheduler.pins.block_pool = kv_cache_manager.block_pool
        if self.gr is not None:
            self.gr.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        if self.gr is not None:
            res = self.gr.get_num_new_matched_tokens(request, num_computed_tokens)
            if res is not None:
                return res
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        if self.gr is not None and self.gr.claims(request):
            self.gr.update_state_after_alloc(request, num_external_tokens)
            return  # no chunk-pool tracker: the chunk pool neither loads nor saves it
        if self._gr_ignored is not None:
            # (here, once a request is scheduled, not at its lookups: those run for each
            # waiting request every step, and a request is pooled only once it runs)
            self._gr_ignored.check(request)
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        meta = self.scheduler.build_connector_meta(scheduler_output)
        if self.gr is not None:
            meta.extensions[PLAN_KEY] = {"plan": self.gr.build_plan(scheduler_output)}
        return meta

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict:
        if num_external_tokens == 0 or self.scheduler is None:
            return {}
        source = cache_hit_source(self.scheduler.hit_tier())
        return {source: num_external_tokens} if source is not None else {}

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.scheduler is not None:
            self.scheduler.update_connector_output(connector_output)
        if self.gr is not None:
            self.gr.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        if self.gr is not None and self.gr.request_finished(request):
            # an async GR swap-in is writing its blocks (GR requests have no chunk-pool state)
            self.scheduler.request_finished(request, block_ids)
            return True, None
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Delayed free covers every group's blocks alike (vLLM frees them together).
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def delete_user(self, uid: str, cache_salt: str | None = None) -> int:
        """GR: delete a user's KV from the pool and this engine's device (user ``uid``
        of ``cache_salt``'s tenant; None: the default tenant)."""
        if self.gr is None:
            raise RuntimeError("delete_user needs gr.enabled")
        return self.gr.delete_user(uid, cache_salt)

    def take_events(self):
        return self.scheduler.take_events() if self.scheduler is not None else ()

    def reset_cache(self) -> bool | None:
        return self.scheduler.reset_cache() if self.scheduler is not None else None

    # -- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)
        if self.gr is not None:
            # GR stages user objects through bounded buffers of its own where it must
            # (the chunk pool's are busy on its transfer threads), never a copy of the cache.
            self.gr.register_kv_caches(kv_caches, on_device=self.worker.kv_on_device)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None:
            assert isinstance(connector_metadata, AscendStoreMetadata)
            self.worker.bind(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.worker is not None:
            self.worker.clear()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.worker is not None and isinstance(kv_connector_metadata, AscendStoreMetadata):
            self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_load_kv(forward_context)
        if self.gr is not None:
            self.gr.start_load(plan_of(self._connector_metadata))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.wait_for_save()
            if self.gr is not None:
                self.gr.save(plan_of(self._connector_metadata))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.worker is not None
        sending, recving = self.worker.get_finished(finished_req_ids)
        if self.gr is not None:
            gr_sending, gr_recving = self.gr.get_finished(finished_req_ids)
            sending = (set(sending or ()) | gr_sending) or None
            recving = (set(recving or ()) | gr_recving) or None
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM >= 0.32: finished sends and receives, and the receives that failed
        (hybrid models report failures per request: vLLM maps block-level errors
        back to requests only with one KV cache group)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        sending, recving = self.get_finished(finished_req_ids)
        failed = self.worker.take_failed_recving() if self.worker is not None else set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self.worker.take_load_errors() if self.worker is not None else set()
        if self.gr is not None:
            errors |= self.gr.take_load_errors()
        return errors

    def build_connector_worker_meta(self) -> AscendStoreWorkerMeta | None:
        # Merged across ranks by vLLM, read by the scheduler side in
        # update_connector_output: pinned saves done (hybrid models) and, for KV
        # events, keys whose saves landed this step.
        if self.worker is None:
            return None
        meta = self.worker.worker_meta() or AscendStoreWorkerMeta()
        if self.kv_events:
            meta.landed = self.worker.take_landed()
        return meta or None

    def get_kv_connector_stats(self) -> AscendStoreStats | None:
        role = self.worker or self.scheduler
        data = role.metrics.take() if role is not None else {}
        if self.gr is not None:
            data.update(prefixed(self.gr.take_stats()))
        return AscendStoreStats(data=data) if data else None

    def shutdown(self) -> None:
        for role in (self.worker, self.scheduler):
            if role is not None:
                role.shutdown()
        if self.gr is not None:
            self.gr.shutdown()

    # -- class-level hooks -------------------------------------------------------------
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        from ascendstore.config import load_config

        return load_config(extra_config).use_layerwise

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> AscendStoreStats | None:
        return AscendStoreStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return AscendStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
