"""``ascendstore config pd``: print (or check) the ``--kv-transfer-config`` of
each side of a PD deployment. The rules are ``ascendstore.pd``'s, the same the
connector applies when vLLM creates it."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from ascendstore.cli.common import EXIT_USAGE, _json_arg, console, fail
from ascendstore.errors import ConfigError
from ascendstore.pd import (
    FAILURE_POLICIES,
    P2P_CHOICES,
    PROTOCOLS,
    ROLES,
    build_pd_config,
    validate_host,
    validate_pd_config,
)


def _choice(value: str, choices: tuple[str, ...] | list[str], key: str) -> str:
    if value not in choices:
        raise fail(f"bad value {value!r} for {key}. Valid choices: {', '.join(choices)}.", EXIT_USAGE)
    return value


def config_pd(
    role: Annotated[str | None, typer.Option("--role", help=f"one of {', '.join(ROLES)}")] = None,
    backend: Annotated[str, typer.Option("--backend", "-b", help="pool backend")] = "local",
    backend_config: Annotated[
        str | None, typer.Option("--backend-config", help="backend options as JSON, or @file.json")
    ] = None,
    p2p: Annotated[str, typer.Option("--p2p", help=f"P2P connector: {', '.join(P2P_CHOICES)}, or none (the pool hands the prompt over)")] = "MooncakeConnector",
    protocol: Annotated[str, typer.Option("--protocol", help=f"Mooncake transfer protocol: {', '.join(PROTOCOLS)}")] = "rdma",
    instance: Annotated[int, typer.Option("--instance", min=0, help="index of this instance on its host (its lookup_rpc_port)")] = 0,
    bootstrap_address: Annotated[
        str | None, typer.Option("--bootstrap-address", help="host:port of an external Mooncake bootstrap server")
    ] = None,
    kv_port: Annotated[int | None, typer.Option("--kv-port", help="MooncakeConnectorV1 port (default 20001 + instance)")] = None,
    prefill_tp: Annotated[int | None, typer.Option("--prefill-tp", min=1, help="prefill_tp_size")] = None,
    decode_tp: Annotated[int | None, typer.Option("--decode-tp", min=1, help="decode_tp_size")] = None,
    prefill_pp: Annotated[int, typer.Option("--prefill-pp", min=1, help="prefill_pp_size")] = 1,
    prefill_dp: Annotated[int, typer.Option("--prefill-dp", min=1, help="prefill DP size (MooncakeConnectorV1)")] = 1,
    decode_dp: Annotated[int, typer.Option("--decode-dp", min=1, help="decode DP size (MooncakeConnectorV1)")] = 1,
    consumer_load: Annotated[bool, typer.Option("--consumer-load", help="decode nodes load from the pool")] = False,
    consumer_put: Annotated[bool, typer.Option("--consumer-put", help="decode nodes save to the pool")] = False,
    save_decode_cache: Annotated[bool, typer.Option("--save-decode-cache", help="also save chunks filled while decoding")] = False,
    load_async: Annotated[bool, typer.Option("--load-async", help="load pool hits asynchronously")] = False,
    failure_policy: Annotated[
        str, typer.Option("--failure-policy", help=f"vLLM kv_load_failure_policy: {', '.join(FAILURE_POLICIES)}")
    ] = "recompute",
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="extra pool key=value (value parsed as JSON when it can be)")
    ] = None,
    check: Annotated[
        list[str] | None,
        typer.Option("--check", help="validate these kv-transfer-configs (JSON or @file) instead; several = one host"),
    ] = None,
    tp: Annotated[int | None, typer.Option("--tp", min=1, help="with --check: this instance's tensor_parallel_size")] = None,
    pp: Annotated[int | None, typer.Option("--pp", min=1, help="with --check: this instance's pipeline_parallel_size")] = None,
    pretty: Annotated[bool, typer.Option("--pretty", help="indent the JSON")] = False,
) -> None:
    """Print a correct --kv-transfer-config for one side of a PD deployment (or --check existing ones).

    PD split: --role prefill on prefill nodes, --role decode on decode nodes
    (MultiConnector: the P2P connector first, the pool connector second). PD
    mixed: --role mixed. Give every instance on one host its own --instance.
    """
    if check:
        _check(check, tp=tp, pp=pp)
        return
    if role is None:
        raise fail(f"--role is required. Valid choices: {', '.join(ROLES)}.", EXIT_USAGE)
    _choice(role, list(ROLES), "--role")
    try:
        bc = _json_arg(backend_config, "--backend-config") if backend_config else None
        out = build_pd_config(
            role, backend=backend, backend_config=bc, p2p=p2p, protocol=protocol, instance=instance,
            bootstrap_address=bootstrap_address, kv_port=kv_port, prefill_tp_size=prefill_tp,
            decode_tp_size=decode_tp, prefill_pp_size=prefill_pp, prefill_dp_size=prefill_dp,
            decode_dp_size=decode_dp, consumer_is_to_load=consumer_load, consumer_is_to_put=consumer_put,
            save_decode_cache=save_decode_cache, load_async=load_async, failure_policy=failure_policy,
            extra=_parse_sets(set_ or []),
        )
    except ConfigError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    print(json.dumps(out, indent=2 if pretty else None))


def _parse_sets(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def _check(items: list[str], *, tp: int | None, pp: int | None) -> None:
    configs: dict[str, Any] = {}
    problems: list[str] = []
    for i, item in enumerate(items):
        name = item[1:] if item.startswith("@") else f"config #{i + 1}"
        try:
            configs[name] = _json_arg(item, "--check")
        except ConfigError as exc:
            problems.append(f"{name}: {exc}")
            continue
        problems += [f"{name}: {p}" for p in validate_pd_config(configs[name], tp_size=tp, pp_size=pp)]
    if len(configs) > 1:
        problems += validate_host({k: v for k, v in configs.items() if isinstance(v, dict)})
    if problems:
        raise fail("\n  " + "\n  ".join(problems), EXIT_USAGE)
    console.print(f"[green]ok[/]: {len(configs)} configuration(s) pass the PD checks", highlight=False)
