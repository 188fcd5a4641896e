"""Refuse a broken PD composition when vLLM creates the connector.

MultiConnector builds its children directly from copies of the config that
carry only the child's own ``kv_transfer_config``, so a pool connector cannot
see its siblings (nor notice it is missing). The check therefore wraps
``KVConnectorFactory.create_connector``, which vLLM calls once per process and
role with the top-level config. It looks only at configs this project owns
(the pool connector alone, or a MultiConnector of pool and P2P connectors) and
leaves every other connector setup untouched.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from ascendstore.pd import is_pd_composition, is_pool_child, raise_if_problems, validate_pd_config

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig

log = logging.getLogger(__name__)

_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config", "kv_connector_module_path",
         "kv_load_failure_policy", "engine_id")


def ktc_to_dict(ktc: KVTransferConfig) -> dict[str, Any]:
    if dataclasses.is_dataclass(ktc):
        data = {f.name: getattr(ktc, f.name) for f in dataclasses.fields(ktc)}
    else:
        data = dict(vars(ktc))
    return {k: data.get(k) for k in _KEYS if data.get(k) is not None}


def _num_layers(vllm_config: VllmConfig) -> int | None:
    mc = vllm_config.model_config
    if mc is None:
        return None
    try:
        return int(mc.get_total_num_hidden_layers())
    except Exception:  # unknown architectures: skip the layer-count check
        return None


def check_vllm_config(vllm_config: VllmConfig) -> None:
    """Raise ConfigError naming every problem of this instance's PD setup."""
    ktc = vllm_config.kv_transfer_config
    if ktc is None:
        return
    data = ktc_to_dict(ktc)
    if not is_pd_composition(data):
        return
    pool_cls = _pool_class(data)
    if pool_cls is not None and not pool_cls.__module__.startswith("ascendstore_vllm"):
        # The plain name resolved to another implementation (vllm-ascend's, see
        # ascendstore_vllm.plugin): its keys and behaviour are not ours to judge.
        return
    pc = vllm_config.parallel_config
    problems = validate_pd_config(
        data,
        tp_size=pc.tensor_parallel_size,
        pp_size=pc.pipeline_parallel_size,
        num_layers=_num_layers(vllm_config),
        bounded_load_retry=bool(getattr(pool_cls, "bounded_load_retry", False)),
    )
    raise_if_problems(problems)


def _pool_class(data: dict[str, Any]) -> type | None:
    """The class vLLM will instantiate for the pool connector (None when absent)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    candidates = [data] if is_pool_child(data) else [
        c for c in data.get("kv_connector_extra_config", {}).get("connectors", []) if is_pool_child(c)
    ]
    if not candidates:
        return None
    child = candidates[0]
    try:
        ktc = KVTransferConfig(kv_connector=child.get("kv_connector"), kv_role=child.get("kv_role") or data["kv_role"],
                               kv_connector_module_path=child.get("kv_connector_module_path"))
        return KVConnectorFactory.get_connector_class(ktc)
    except Exception:  # a bad child: validate_pd_config names the problem
        return None


def install_validation() -> None:
    """Make ``KVConnectorFactory.create_connector`` run ``check_vllm_config`` first. Idempotent."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    original = KVConnectorFactory.create_connector.__func__  # type: ignore[attr-defined]
    if getattr(original, "_ascendstore_pd_checked", False):
        return

    def create_connector(cls: Any, config: VllmConfig, *args: Any, **kwargs: Any) -> Any:
        check_vllm_config(config)
        return original(cls, config, *args, **kwargs)

    create_connector._ascendstore_pd_checked = True  # type: ignore[attr-defined]
    create_connector.__doc__ = original.__doc__
    KVConnectorFactory.create_connector = classmethod(create_connector)  # type: ignore[method-assign]
