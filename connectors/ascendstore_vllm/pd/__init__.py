"""Prefill/decode split on vLLM: presets as vLLM's own ``KVTransferConfig`` and
the composition check vLLM runs when it creates a connector.

The rules live in ``ascendstore.pd`` (no vLLM import, shared with
``ascendstore config pd``); this package feeds them what only vLLM knows (the
instance's TP/PP sizes and layer count) and hooks them into connector creation.
"""

from ascendstore_vllm.pd.presets import kv_transfer_config
from ascendstore_vllm.pd.validation import check_vllm_config, install_validation, ktc_to_dict

__all__ = ["check_vllm_config", "install_validation", "kv_transfer_config", "ktc_to_dict"]
