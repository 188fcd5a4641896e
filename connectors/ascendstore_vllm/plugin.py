"""vLLM general-plugin entry point: makes ``kv_connector: AscendStoreConnector``
work after ``pip install`` with no ``kv_connector_module_path``.

vllm-ascend registers a connector under the same plain name. Whatever order
vLLM loads plugins in:
  * ``AscendStorePoolConnector`` (the alias) always reaches ours;
  * the plain name ``AscendStoreConnector`` belongs to the implementation chosen
    by ``ASCENDSTORE_CONNECTOR_OWNER`` = ``ascendstore`` | ``vllm-ascend`` |
    ``auto`` (default: vllm-ascend's when the vllm_ascend package is installed,
    else ours), decided when vLLM resolves the name, and logged;
  * nothing here raises: a plugin error must not stop vLLM from starting.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ascendstore_vllm")

NAME = "AscendStoreConnector"
ALIAS = "AscendStorePoolConnector"
#: the GR-only connector (pools user histories, nothing else)
GR_NAME = "AscendStoreGRConnector"
GR_MODULE = "ascendstore_vllm.gr.connector"
OWNER_ENV = "ASCENDSTORE_CONNECTOR_OWNER"
MODULE = "ascendstore_vllm.connector"
CLASS = "AscendStoreConnector"

#: the other implementation's loader, if one registered the plain name.
_other_loader: Callable[[], type] | None = None
_announced = False


def _ours() -> type:
    from ascendstore_vllm.connector import AscendStoreConnector

    return AscendStoreConnector


def owner() -> str:
    """Who owns the plain name: "ascendstore" or "vllm-ascend"."""
    choice = os.environ.get(OWNER_ENV, "auto").strip().lower()
    if choice in ("ascendstore", "ours"):
        return "ascendstore"
    if choice == "vllm-ascend":
        return "vllm-ascend"
    if choice != "auto":
        log.warning("%s=%r is not one of ascendstore, vllm-ascend, auto; using auto", OWNER_ENV, choice)
    has_vllm_ascend = _other_loader is not None or importlib.util.find_spec("vllm_ascend") is not None
    return "vllm-ascend" if has_vllm_ascend else "ascendstore"


def _resolve_plain_name() -> type:
    global _announced
    who = owner()
    cls: type | None = None
    if who == "vllm-ascend":
        if _other_loader is not None:
            cls = _other_loader()
        else:
            log.warning(
                "%s: vllm-ascend was chosen but has not registered %r; using AscendStore's", OWNER_ENV, NAME
            )
            who = "ascendstore"
    if cls is None:
        cls = _ours()
    if not _announced:
        _announced = True
        log.info("kv_connector %r -> %s (%s.%s); set %s to choose; %r always means AscendStore's",
                 NAME, who, cls.__module__, cls.__qualname__, OWNER_ENV, ALIAS)
    return cls


def register() -> None:
    """Entry point ``vllm.general_plugins: ascendstore``. Idempotent, never raises."""
    try:
        _register()
        # PD composition check on every connector vLLM creates (ascendstore_vllm.pd).
        from ascendstore_vllm.pd import install_validation

        install_validation()
    except Exception:
        log.exception("AscendStore: registering the vLLM connector failed")


def _register() -> None:
    global _other_loader
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry: dict[str, Callable[[], Any]] = KVConnectorFactory._registry
    if ALIAS not in registry:
        KVConnectorFactory.register_connector(ALIAS, MODULE, CLASS)
    if GR_NAME not in registry:
        KVConnectorFactory.register_connector(GR_NAME, GR_MODULE, GR_NAME)
    current = registry.get(NAME)
    if current is _resolve_plain_name:
        return
    if current is not None:
        # Someone (vllm-ascend) registered first: keep its loader as the alternative.
        _other_loader = current
    registry[NAME] = _resolve_plain_name

    # Someone registering later must neither fail (the name is "taken") nor
    # silently replace the choice: record their loader as the alternative.
    original = KVConnectorFactory.register_connector.__func__  # type: ignore[attr-defined]
    if getattr(original, "_ascendstore_wrapped", False):
        return

    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        global _other_loader
        if name == NAME and cls._registry.get(NAME) is _resolve_plain_name:
            def loader() -> type:
                return getattr(importlib.import_module(module_path), class_name)

            _other_loader = loader
            log.info("%s registered by %s.%s kept as the alternative (owner: %s)", NAME, module_path,
                     class_name, owner())
            return
        original(cls, name, module_path, class_name)

    register_connector._ascendstore_wrapped = True  # type: ignore[attr-defined]
    KVConnectorFactory.register_connector = classmethod(register_connector)  # type: ignore[method-assign]

