"""AscendStoreGRConnector: a KV connector that pools user histories only.

For GR deployments that want the user-granular pool without the chunk pool:
GR requests go through the GR hooks; any other request is served by vLLM's
device prefix cache alone. The main ``AscendStoreConnector`` attaches the same
hooks when ``gr.enabled`` and keeps its chunk pool for other requests.

    --kv-transfer-config '{"kv_connector": "AscendStoreGRConnector",
        "kv_connector_module_path": "ascendstore_vllm.gr.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"backend": "local", "gr": {"enabled": true, "user_lru": true}}}'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ascendstore_vllm.context import ConnectorContext
from ascendstore_vllm.gr.hooks import GRPlan
from ascendstore_vllm.gr.stats import GRConnectorStats, GRPromMetrics
from ascendstore_vllm.gr.wiring import GRAttachment

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass
class GRConnectorMetadata(KVConnectorMetadata):
    plan: GRPlan = field(default_factory=GRPlan)


class AscendStoreGRConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.ctx = ConnectorContext.from_vllm(vllm_config, kv_cache_config)
        # choosing this connector means GR mode, whatever gr.enabled says
        self.gr = GRAttachment(self.ctx, role == KVConnectorRole.SCHEDULER, kv_cache_config)
        self.sched = self.gr.sched

    # -- scheduler side ---------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.gr.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        res = self.gr.get_num_new_matched_tokens(request, num_computed_tokens)
        return res if res is not None else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.gr.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return GRConnectorMetadata(plan=self.gr.build_plan(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        self.gr.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # saves complete inside the step that planned them; an async swap-in still
        # writing the blocks delays their free until the workers report it
        return self.gr.request_finished(request), None

    def delete_user(self, uid: str, cache_salt: str | None = None) -> int:
        """Delete a user's KV from the pool (every model) and this engine's device.
        The user is ``uid`` of ``cache_salt``'s tenant (None: the default tenant)."""
        return self.gr.delete_user(uid, cache_salt)

    # -- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.gr.register_kv_caches(kv_caches)

    def _plan(self) -> GRPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, GRConnectorMetadata)
        return meta.plan

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.gr.start_load(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        self.gr.save(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self.gr.get_finished(finished_req_ids)
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.gr.take_load_errors()

    def get_kv_connector_stats(self) -> GRConnectorStats | None:
        """This role's GR counters since the last call (vLLM sums the roles)."""
        data = self.gr.take_stats()
        return GRConnectorStats(data=data) if data else None

    def totals(self) -> dict[str, int]:
        return self.gr.totals()

    def shutdown(self) -> None:
        self.gr.shutdown()

    # -- class-level hooks ------------------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> GRConnectorStats | None:
        return GRConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return GRPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
