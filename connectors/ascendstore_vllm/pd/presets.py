"""PD presets as vLLM ``KVTransferConfig`` objects (what ``--kv-transfer-config`` becomes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ascendstore.pd import build_pd_config

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig


def kv_transfer_config(role: str, **options: Any) -> KVTransferConfig:
    """``role`` prefill | decode | mixed; options as ``ascendstore.pd.build_pd_config``.

    Built by vLLM's own class, so vLLM's checks (role names, policy values)
    run too; pass the result as ``VllmConfig(kv_transfer_config=...)`` or
    ``LLM(kv_transfer_config=...)``."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**build_pd_config(role, **options))
