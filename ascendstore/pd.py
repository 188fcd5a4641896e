"""Prefill/decode split: who touches the pool, and what a correct
``--kv-transfer-config`` looks like for each side.

PD split means vLLM's ``MultiConnector`` with a P2P connector first (it hands a
request's KV from the prefill instance to the decode instance) and the pool
connector second (it serves prefixes across prefill instances), or the pool
alone as the hand-off (prefill saves, decode loads with ``consumer_is_to_load``).
PD mixed means one pool connector with ``kv_role: kv_both``.

Pure data in, data out: no vLLM import. ``ascendstore config pd`` prints
``build_pd_config``; the connector runs ``validate_pd_config`` when vLLM creates
it, so the command line and the engine refuse the same mistakes.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping
from typing import Any, NamedTuple

from ascendstore.config import AscendStoreConfig, load_config
from ascendstore.errors import ConfigError

ROLES: dict[str, str] = {"prefill": "kv_producer", "decode": "kv_consumer", "mixed": "kv_both"}
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("recompute", "fail")

#: names under which vLLM finds our pool connector (see ascendstore_vllm.plugin).
POOL_CONNECTOR = "AscendStoreConnector"
POOL_CONNECTOR_ALIAS = "AscendStorePoolConnector"
POOL_MODULE = "ascendstore_vllm.connector"
#: connectors whose job is the prefill -> decode hand-off (vLLM 0.33 and vllm-ascend names).
P2P_CONNECTORS = frozenset({
    "MooncakeConnector", "NixlConnector", "NixlPullConnector", "NixlPushConnector", "MoRIIOConnector",
    "P2pNcclConnector", "MooncakeConnectorV1", "MooncakeConnectorV2", "MooncakeLayerwiseConnector",
    "LLMDataDistCMgrConnector",
})
P2P_CHOICES = ("MooncakeConnector", "MooncakeConnectorV1")
#: vLLM's MooncakeConnector protocol choices (its ``mooncake_protocol`` key).
PROTOCOLS = ("rdma", "tcp", "ascend")


# -- role semantics: the one place that decides pool access ---------------------
class PoolAccess(NamedTuple):
    load: bool  # look up and load prefixes from the pool
    save: bool  # write the prompt's full chunks to the pool
    save_decode: bool  # also write chunks filled during decode


def pool_access(kv_role: str | None, cfg: AscendStoreConfig) -> PoolAccess:
    """Prefill (kv_producer) and mixed (kv_both) nodes read and write the pool;
    decode (kv_consumer) nodes do neither unless ``consumer_is_to_load`` /
    ``consumer_is_to_put``. ``save_decode_cache`` adds decode-time chunks to
    whatever a node saves."""
    role = kv_role or "kv_both"
    if role not in KV_ROLES:
        raise ConfigError(f"bad value {kv_role!r} for 'kv_role'. Valid choices: {', '.join(KV_ROLES)}.")
    consumer = role == "kv_consumer"
    load = not consumer or cfg.consumer_is_to_load
    save = not consumer or cfg.consumer_is_to_put
    return PoolAccess(load=load, save=save, save_decode=save and cfg.save_decode_cache)


# -- the composition --------------------------------------------------------------
def is_pool_child(child: Mapping[str, Any]) -> bool:
    """AscendStore's prefix-pool connector (not, say, the GR user-store connector)."""
    path = child.get("kv_connector_module_path")
    if path:
        return path == POOL_MODULE
    return child.get("kv_connector") in (POOL_CONNECTOR, POOL_CONNECTOR_ALIAS)


def is_p2p_child(child: Mapping[str, Any]) -> bool:
    return child.get("kv_connector") in P2P_CONNECTORS and not is_pool_child(child)


def mentions_pool(ktc: Mapping[str, Any]) -> bool:
    """Whether a kv-transfer-config involves the AscendStore pool at all."""
    if is_pool_child(ktc):
        return True
    return any(isinstance(c, Mapping) and is_pool_child(c) for c in _children(ktc))


def is_pd_composition(ktc: Mapping[str, Any]) -> bool:
    """A MultiConnector whose children are the pool and/or P2P connectors only:
    the shape this module owns (someone else's MultiConnector is left alone)."""
    if ktc.get("kv_connector") != "MultiConnector":
        return mentions_pool(ktc)
    kids = [c for c in _children(ktc) if isinstance(c, Mapping)]
    return bool(kids) and all(is_pool_child(c) or is_p2p_child(c) for c in kids)


def _children(ktc: Mapping[str, Any]) -> list[Any]:
    extra = ktc.get("kv_connector_extra_config") or {}
    kids = extra.get("connectors") if isinstance(extra, Mapping) else None
    return list(kids) if isinstance(kids, list) else []


def pool_extra_config(ktc: Mapping[str, Any]) -> dict[str, Any]:
    """The pool connector's ``kv_connector_extra_config`` inside a
    kv-transfer-config, whether PD mixed (top level) or PD split (a child)."""
    if ktc.get("kv_connector") == "MultiConnector":
        for child in _children(ktc):
            if isinstance(child, Mapping) and is_pool_child(child):
                return dict(child.get("kv_connector_extra_config") or {})
        raise ConfigError(f"the MultiConnector has no pool connector ({POOL_CONNECTOR}) among its children")
    return dict(ktc.get("kv_connector_extra_config") or {})


def validate_pd_config(
    kv_transfer_config: Mapping[str, Any],
    *,
    tp_size: int | None = None,
    pp_size: int | None = None,
    num_layers: int | None = None,
    bounded_load_retry: bool = True,
) -> list[str]:
    """Every known mistake in a PD-mixed or PD-split kv-transfer-config, as
    sentences naming the key, the value and the fix; [] when it is sound.

    ``tp_size``/``pp_size``/``num_layers`` describe this instance when known (the
    engine knows them; the command line may be told) and enable the layout checks.
    ``bounded_load_retry``: whether the pool connector stops offering a request
    the chunks whose load failed (AscendStore's does; see ``_check_hangs``).
    """
    ktc = kv_transfer_config
    if not isinstance(ktc, Mapping):
        return [f"the kv-transfer-config must be a JSON object, not {type(ktc).__name__}"]
    problems: list[str] = []
    role = ktc.get("kv_role")
    if role not in KV_ROLES:
        problems.append(f"bad value {role!r} for 'kv_role'. Valid choices: {', '.join(KV_ROLES)}.")
        return problems
    policy = ktc.get("kv_load_failure_policy", "fail")
    if policy not in FAILURE_POLICIES:
        problems.append(
            f"bad value {policy!r} for 'kv_load_failure_policy'. Valid choices: {', '.join(FAILURE_POLICIES)}."
        )

    # PD split through the pool alone (no P2P connector): the prefill node saves the prompt,
    # the decode node (consumer_is_to_load) loads it. Checked below, once the pool's keys are read.
    no_p2p = False
    if ktc.get("kv_connector") == "MultiConnector":
        pool_child = _check_children(ktc, role, policy, problems)
        pool_extra = pool_child.get("kv_connector_extra_config") if pool_child else None
        no_p2p = pool_child is not None and not any(is_p2p_child(c) for c in _children(ktc) if isinstance(c, Mapping))
    elif is_pool_child(ktc):
        pool_extra = ktc.get("kv_connector_extra_config")
        no_p2p = True
    else:
        problems.append(
            f"kv_connector {ktc.get('kv_connector')!r} is neither the pool connector ({POOL_CONNECTOR}) nor a "
            "MultiConnector holding it: the pool connector is missing."
        )
        return problems

    if pool_extra is None:
        return problems
    if not isinstance(pool_extra, Mapping):
        problems.append("the pool connector's kv_connector_extra_config must be a JSON object")
        return problems
    try:
        cfg = load_config(pool_extra)
    except ConfigError as exc:
        problems.append(str(exc))
        return problems
    if no_p2p and role == "kv_consumer" and not cfg.consumer_is_to_load:
        problems.append(
            "a decode node (kv_role 'kv_consumer') without a P2P connector gets the prompt's KV only from the "
            "pool, but its pool connector never loads (consumer_is_to_load is false): set consumer_is_to_load: "
            "true (PD split through the pool), put a P2P connector (one of "
            f"{', '.join(P2P_CHOICES)}) first in a MultiConnector, or use kv_role 'kv_both' (PD mixed)."
        )
    problems += _check_roles(role, cfg, tp_size=tp_size, pp_size=pp_size, num_layers=num_layers)
    if not bounded_load_retry:
        problems += _check_hangs(policy, cfg)
    return problems


def _check_children(ktc: Mapping[str, Any], role: str, policy: str, problems: list[str]) -> dict[str, Any] | None:
    kids = _children(ktc)
    if not kids:
        problems.append("MultiConnector needs kv_connector_extra_config.connectors: [P2P connector, pool connector]")
        return None
    for i, c in enumerate(kids):
        if not isinstance(c, Mapping) or not c.get("kv_connector"):
            problems.append(f"connectors[{i}] must be an object with a 'kv_connector' name")
    kids = [c for c in kids if isinstance(c, Mapping)]
    pools = [i for i, c in enumerate(kids) if is_pool_child(c)]
    p2ps = [i for i, c in enumerate(kids) if is_p2p_child(c)]
    if not pools:
        problems.append(
            f"the pool connector is missing: add {{\"kv_connector\": \"{POOL_CONNECTOR}\", "
            f"\"kv_connector_module_path\": \"{POOL_MODULE}\", \"kv_role\": \"{role}\", ...}} as the last "
            "entry of connectors (with only a P2P connector, configure it directly, without MultiConnector)."
        )
    if len(pools) > 1:
        problems.append(
            f"connectors{pools} are all pool connectors: keep one (two would save every chunk twice and "
            "share one lookup IPC path)."
        )
    if pools and p2ps and min(pools) < max(p2ps):
        problems.append(
            f"connectors are in the wrong order: the pool connector is connectors[{min(pools)}] but the P2P "
            f"connector {kids[max(p2ps)].get('kv_connector')!r} is connectors[{max(p2ps)}]. MultiConnector "
            "loads from the first child that reports a hit, so with the pool first a partial pool hit on the "
            "decode node skips the P2P hand-off of the rest of the prompt. Put the P2P connector first."
        )
    for i, c in enumerate(kids):
        child_role = c.get("kv_role")
        if child_role is not None and child_role != role:
            problems.append(
                f"connectors[{i}] ({c.get('kv_connector')}) has kv_role {child_role!r} but the MultiConnector "
                f"has {role!r}: give every child the node's role."
            )
        child_policy = c.get("kv_load_failure_policy")
        if child_policy is not None and child_policy != policy:
            problems.append(
                f"connectors[{i}] sets kv_load_failure_policy {child_policy!r}, which vLLM ignores (its scheduler "
                f"reads only the top-level value, {policy!r}): set it at the top level."
            )
    return kids[pools[0]] if pools else None


def _check_roles(
    role: str, cfg: AscendStoreConfig, *, tp_size: int | None, pp_size: int | None, num_layers: int | None
) -> list[str]:
    problems: list[str] = []
    access = pool_access(role, cfg)
    if role != "kv_consumer":
        for key in ("consumer_is_to_load", "consumer_is_to_put"):
            if getattr(cfg, key):
                problems.append(
                    f"config key {key!r} is set on a {role} node; it only applies to decode (kv_consumer) nodes, "
                    "which otherwise leave the pool alone. Remove it here."
                )
    if cfg.save_decode_cache and not access.save:
        problems.append(
            "config key 'save_decode_cache' is true but this decode node saves nothing to the pool: "
            "set consumer_is_to_put: true as well, or drop save_decode_cache."
        )
    # Layout declarations: a node must agree with what it declares for its own side.
    if role == "kv_producer":
        if tp_size is not None and cfg.prefill_tp_size is not None and cfg.prefill_tp_size != tp_size:
            problems.append(
                f"config key 'prefill_tp_size' is {cfg.prefill_tp_size} but this prefill instance runs "
                f"tensor_parallel_size {tp_size}: make them equal."
            )
        if pp_size is not None and cfg.prefill_pp_size != pp_size:
            problems.append(
                f"config key 'prefill_pp_size' is {cfg.prefill_pp_size} but this prefill instance runs "
                f"pipeline_parallel_size {pp_size}: make them equal."
            )
    if role == "kv_consumer" and tp_size is not None and cfg.decode_tp_size is not None and cfg.decode_tp_size != tp_size:
        problems.append(
            f"config key 'decode_tp_size' is {cfg.decode_tp_size} but this decode instance runs "
            f"tensor_parallel_size {tp_size}: make them equal."
        )
    if cfg.prefill_pp_layer_partition is not None:
        problems += _check_partition(cfg, num_layers)
    if role == "kv_consumer" and (access.load or access.save):
        # Pool keys carry the parallel layout (TP and PP sizes are part of the
        # KV fingerprint), so a decode node shares pool entries with prefill
        # nodes only when both run the same layout. Resharding heads or
        # regrouping layers across layouts is not supported: refuse it now
        # rather than serve a silent 0% hit rate.
        if tp_size is not None and cfg.prefill_tp_size is not None and cfg.prefill_tp_size != tp_size:
            problems.append(
                f"unsupported: decode tensor_parallel_size {tp_size} differs from prefill_tp_size "
                f"{cfg.prefill_tp_size}, and consumer_is_to_load/consumer_is_to_put make this decode node share "
                "the pool with prefill nodes. Pool entries are per parallel layout, so they would never match. "
                "Run decode with the prefill TP size, or turn consumer_is_to_load/consumer_is_to_put off "
                "(the P2P connector hands over the KV whatever the TP sizes)."
            )
        if pp_size is not None and cfg.prefill_pp_size != pp_size:
            problems.append(
                f"unsupported: decode pipeline_parallel_size {pp_size} differs from prefill_pp_size "
                f"{cfg.prefill_pp_size}, and consumer_is_to_load/consumer_is_to_put make this decode node share "
                "the pool with prefill nodes. Pool entries are per parallel layout, so they would never match. "
                "Run decode with the prefill PP size, or turn consumer_is_to_load/consumer_is_to_put off."
            )
    return problems


def _check_partition(cfg: AscendStoreConfig, num_layers: int | None) -> list[str]:
    text = str(cfg.prefill_pp_layer_partition)
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        return [f"bad value {text!r} for config key 'prefill_pp_layer_partition': expected comma-separated "
                "layer counts, one per prefill PP stage, e.g. \"14,14\""]
    problems = []
    if len(parts) != cfg.prefill_pp_size:
        problems.append(
            f"config key 'prefill_pp_layer_partition' {text!r} has {len(parts)} stage(s) but prefill_pp_size is "
            f"{cfg.prefill_pp_size}: give one layer count per stage."
        )
    if any(p <= 0 for p in parts):
        problems.append(f"config key 'prefill_pp_layer_partition' {text!r}: every stage needs at least one layer")
    if num_layers is not None and sum(parts) != num_layers:
        problems.append(
            f"config key 'prefill_pp_layer_partition' {text!r} covers {sum(parts)} layers but the model has "
            f"{num_layers}."
        )
    return problems


def _check_hangs(policy: str, cfg: AscendStoreConfig) -> list[str]:
    problems = []
    if policy == "recompute" and cfg.load_async and not cfg.use_layerwise:
        # vLLM rewinds an asynchronous load that fails at its first block to
        # token 0 and asks the connectors again; a pool whose lookup still
        # reports the hit (metadata fine, data path broken) is chosen again,
        # fails again, forever (the loop vLLM PR #55297 fixes for its own
        # MooncakeStoreConnector). Synchronous loads rewind in place and
        # recompute without a new lookup. AscendStore's connector caps the
        # request's next hit below the first failed chunk, which ends the loop;
        # a pool connector without that bound must not run this combination.
        problems.append(
            "kv_load_failure_policy 'recompute' with load_async: true can loop forever: a failed asynchronous "
            "load that restarts from token 0 is looked up again, hits the same pool entry and fails again. "
            "Use load_async: false (failed blocks are then recomputed in place), or kv_load_failure_policy "
            "'fail'."
        )
    return problems


def validate_host(configs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Mistakes between instances that share one host, keyed by a name for each
    instance: two pool connectors answering lookups on one IPC path."""
    seen: dict[tuple[str, int], str] = {}
    problems = []
    for name, ktc in configs.items():
        try:
            extra = pool_extra_config(ktc)
            cfg = load_config(extra)
        except ConfigError:
            continue  # validate_pd_config reports it
        ident = cfg.instance_id or ktc.get("engine_id")
        if ident is None:
            # vLLM gives every instance a fresh engine_id, which the IPC path includes.
            continue
        key = (str(ident), cfg.lookup_rpc_port)
        if key in seen:
            problems.append(
                f"instances {seen[key]!r} and {name!r} share the lookup IPC path (instance "
                f"{key[0]!r}, lookup_rpc_port {key[1]}): give each instance on a host its own lookup_rpc_port "
                "(ascendstore config pd --instance N) or its own instance_id."
            )
        else:
            seen[key] = name
    return problems


def lookup_path_in_use(path: str) -> bool:
    """Whether a live process already answers on this ``ipc://`` lookup path.

    Call before binding: a stale socket file (its owner died) may be removed, a
    live one belongs to another instance and must not be taken over."""
    fs_path = path.removeprefix("ipc://")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(0.5)
    try:
        s.connect(fs_path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
            return False
        return True  # permission denied, timeout, ...: someone holds it
    finally:
        s.close()
    return True


#: bytes a Unix socket path may have on Linux (sun_path is 108 with the NUL).
MAX_UNIX_PATH = 107


def ensure_lookup_path_free(path: str, lookup_rpc_port: int | None = None) -> None:
    """Raise ConfigError when ``path`` cannot be bound (too long for a Unix socket)
    or another live instance serves it."""
    fs_path = path.removeprefix("ipc://")
    if len(os.fsencode(fs_path)) > MAX_UNIX_PATH:
        raise ConfigError(
            f"the lookup IPC path {path} is {len(os.fsencode(fs_path))} bytes long; a Unix socket path holds at "
            f"most {MAX_UNIX_PATH}: set VLLM_RPC_BASE_PATH to a shorter directory (or a shorter instance_id)."
        )
    if lookup_path_in_use(path):
        this = f" (this one has {lookup_rpc_port})" if lookup_rpc_port is not None else ""
        raise ConfigError(
            f"the lookup IPC path {path} is already served by another vLLM instance on this host: give each "
            f"instance its own lookup_rpc_port{this} or its own instance_id."
        )


def raise_if_problems(problems: list[str], where: str = "kv-transfer-config") -> None:
    if problems:
        raise ConfigError(f"invalid {where} for AscendStore:\n  " + "\n  ".join(problems))


# -- the config helper --------------------------------------------------------------
def build_pd_config(
    role: str,
    *,
    backend: str = "local",
    backend_config: Mapping[str, Any] | None = None,
    p2p: str = "MooncakeConnector",
    protocol: str = "rdma",
    instance: int = 0,
    bootstrap_address: str | None = None,
    kv_port: int | None = None,
    prefill_tp_size: int | None = None,
    decode_tp_size: int | None = None,
    prefill_pp_size: int = 1,
    prefill_dp_size: int = 1,
    decode_dp_size: int = 1,
    consumer_is_to_load: bool = False,
    consumer_is_to_put: bool = False,
    save_decode_cache: bool = False,
    load_async: bool = False,
    failure_policy: str = "recompute",
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``--kv-transfer-config`` for one side of a PD deployment.

    ``role``: prefill | decode (PD split: MultiConnector [P2P, pool]; with ``p2p="none"``
    MultiConnector [pool], the pool hands the prompt over and decode gets
    ``consumer_is_to_load``) or mixed (PD mixed: the pool connector alone, kv_both). ``instance`` numbers the
    instances of one host (it becomes ``lookup_rpc_port``). Raises ConfigError
    when the result would not pass ``validate_pd_config``.
    """
    if role not in ROLES:
        raise ConfigError(f"bad value {role!r} for 'role'. Valid choices: {', '.join(ROLES)}.")
    if p2p not in (*P2P_CHOICES, "none"):
        raise ConfigError(f"bad value {p2p!r} for 'p2p'. Valid choices: {', '.join(P2P_CHOICES)}, none.")
    if protocol not in PROTOCOLS:
        raise ConfigError(f"bad value {protocol!r} for 'protocol'. Valid choices: {', '.join(PROTOCOLS)}.")
    if failure_policy not in FAILURE_POLICIES:
        raise ConfigError(
            f"bad value {failure_policy!r} for 'failure_policy'. Valid choices: {', '.join(FAILURE_POLICIES)}."
        )
    kv_role = ROLES[role]
    if p2p == "none" and role == "decode":
        consumer_is_to_load = True  # the pool is the hand-off: decode loads the prompt from it
    pool: dict[str, Any] = {"backend": backend, "lookup_rpc_port": instance}
    if backend_config:
        pool["backend_config"] = dict(backend_config)
    flags = {
        "load_async": load_async,
        "consumer_is_to_load": consumer_is_to_load,
        "consumer_is_to_put": consumer_is_to_put,
        "save_decode_cache": save_decode_cache,
    }
    pool.update({k: v for k, v in flags.items() if v})
    if prefill_pp_size != 1:
        pool["prefill_pp_size"] = prefill_pp_size
    if prefill_tp_size is not None:
        pool["prefill_tp_size"] = prefill_tp_size
    if decode_tp_size is not None:
        pool["decode_tp_size"] = decode_tp_size
    pool.update(extra or {})
    pool_child = {
        "kv_connector": POOL_CONNECTOR,
        "kv_connector_module_path": POOL_MODULE,
        "kv_role": kv_role,
        "kv_connector_extra_config": pool,
    }
    if role == "mixed":
        out = {
            "kv_connector": POOL_CONNECTOR,
            "kv_connector_module_path": POOL_MODULE,
            "kv_role": kv_role,
            "kv_load_failure_policy": failure_policy,
            "kv_connector_extra_config": pool,
        }
    else:
        out = {
            "kv_connector": "MultiConnector",
            "kv_role": kv_role,
            "kv_load_failure_policy": failure_policy,
            "kv_connector_extra_config": {
                "connectors": ([] if p2p == "none" else [
                    _p2p_child(p2p, kv_role, protocol=protocol, bootstrap_address=bootstrap_address,
                               kv_port=kv_port, instance=instance,
                               prefill=(prefill_dp_size, prefill_tp_size or 1, prefill_pp_size),
                               decode=(decode_dp_size, decode_tp_size or 1)),
                ]) + [pool_child]
            },
        }
    raise_if_problems(validate_pd_config(out), where=f"{role} configuration")
    return out


def _p2p_child(p2p: str, kv_role: str, *, protocol: str, bootstrap_address: str | None, kv_port: int | None,
               instance: int, prefill: tuple[int, int, int], decode: tuple[int, int]) -> dict[str, Any]:
    if p2p == "MooncakeConnector":
        # vLLM 0.33's own connector: the decode side pulls over the transfer
        # engine; prefill rank 0 runs an HTTP bootstrap server
        # (VLLM_MOONCAKE_BOOTSTRAP_PORT, default 8998) unless one is named here.
        extra: dict[str, Any] = {"mooncake_protocol": protocol}
        if bootstrap_address:
            extra["bootstrap_server_address"] = bootstrap_address
        return {"kv_connector": "MooncakeConnector", "kv_role": kv_role, "kv_connector_extra_config": extra}
    # vllm-ascend's MooncakeConnectorV1: fixed ports, both sides' layouts declared.
    dp, tp, pp = prefill
    return {
        "kv_connector": "MooncakeConnectorV1",
        "kv_role": kv_role,
        "kv_port": str(kv_port if kv_port is not None else 20001 + instance),
        "kv_connector_extra_config": {
            "prefill": {"dp_size": dp, "tp_size": tp, "pp_size": pp},
            "decode": {"dp_size": decode[0], "tp_size": decode[1]},
        },
    }
