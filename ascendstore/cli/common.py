"""Shared CLI plumbing: reading the configuration the way vLLM would get it,
opening a backend, and bounding every call so no command can hang."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from ascendstore.config import AscendStoreConfig, load_config
from ascendstore.contract import Backend, BackendContext
from ascendstore.errors import ConfigError
from ascendstore.registry import create_backend

console = Console()
err_console = Console(stderr=True)

T = TypeVar("T")

# Exit codes: 0 fine, 1 a check failed, 2 the input itself is wrong.
EXIT_FAILED = 1
EXIT_USAGE = 2

KvTransferConfigOpt = Annotated[
    str | None,
    typer.Option(
        "--kv-transfer-config",
        help="vLLM's --kv-transfer-config JSON (its kv_connector_extra_config is used), or the extra "
        "config itself; @FILE reads the JSON from a file.",
    ),
]
ConfigFileOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="AscendStore config file (JSON, YAML or TOML).")
]
BackendOpt = Annotated[
    str | None, typer.Option("--backend", "-b", help="backend name (overrides the config).")
]
BackendConfigOpt = Annotated[
    str | None,
    typer.Option("--backend-config", help="backend options as JSON (overrides the config's backend_config)."),
]


class CallTimeout(TimeoutError):
    pass


def bounded(fn: Callable[..., T], *args: Any, timeout_s: float, what: str = "call") -> T:
    """Run ``fn(*args)`` on a daemon thread and stop waiting after ``timeout_s``.

    Exceptions propagate; an overrun raises CallTimeout (the thread is abandoned:
    a daemon thread cannot keep the CLI alive)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, name=f"ascendstore-cli-{what}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise CallTimeout(f"{what} did not return within {timeout_s:.1f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _json_arg(text: str, what: str) -> Any:
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        if not path.is_file():
            raise ConfigError(f"{what}: file {str(path)!r} does not exist")
        text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} is not valid JSON: {exc}") from None


def extra_config_from(kv_transfer_config: str | None) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` inside a --kv-transfer-config JSON (or
    the JSON itself when it is already the extra config)."""
    if not kv_transfer_config:
        return {}
    data = _json_arg(kv_transfer_config, "--kv-transfer-config")
    if not isinstance(data, dict):
        raise ConfigError(f"--kv-transfer-config must be a JSON object, not {type(data).__name__}")
    if data.get("kv_connector") == "MultiConnector":
        # PD split: the pool connector is one of the children (ascendstore config pd).
        from ascendstore.pd import pool_extra_config

        return pool_extra_config(data)
    if "kv_connector" in data or "kv_role" in data or "kv_connector_extra_config" in data:
        extra = data.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ConfigError("kv_connector_extra_config in --kv-transfer-config must be a JSON object")
        return dict(extra)
    return data


def build_config(
    *,
    kv_transfer_config: str | None = None,
    config_file: Path | None = None,
    backend: str | None = None,
    backend_config: str | None = None,
) -> AscendStoreConfig:
    """Validate the configuration from the CLI's sources, later ones winning:
    config file < --kv-transfer-config < --backend/--backend-config."""
    extra = extra_config_from(kv_transfer_config)
    if config_file is not None:
        extra.setdefault("config_file", str(config_file))
    if backend:
        extra["backend"] = backend
    if backend_config:
        opts = _json_arg(backend_config, "--backend-config")
        if not isinstance(opts, dict):
            raise ConfigError("--backend-config must be a JSON object")
        extra["backend_config"] = opts
    return load_config(extra)


def backend_context(cfg: AscendStoreConfig, role: str = "tool", existing_only: bool = False) -> BackendContext:
    return BackendContext(
        role=role,
        instance_id=cfg.instance_id or "default",
        timeout_s=cfg.timeout_ms / 1000.0,
        existing_only=existing_only,
    )


def open_backend(cfg: AscendStoreConfig, existing_only: bool = False) -> Backend:
    """Create the configured backend; creation is bounded too (a client that
    retries forever against a missing service must not hang the CLI).
    ``existing_only``: only a store that exists, as it was made (BackendContext)."""
    ctx = backend_context(cfg, existing_only=existing_only)
    return bounded(
        create_backend,
        cfg.backend,
        cfg.backend_config,
        ctx,
        timeout_s=max(10.0, 2 * ctx.timeout_s),
        what=f"opening backend {cfg.backend!r}",
    )


def close_quietly(backend: Backend | None, timeout_s: float = 5.0) -> None:
    if backend is None:
        return
    try:
        bounded(backend.close, timeout_s=timeout_s, what="close")
    except Exception as exc:
        err_console.print(f"[yellow]warning:[/] closing the backend failed: {exc}")


def fail(message: str, code: int = EXIT_FAILED) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code)


def config_or_exit(**kwargs: Any) -> AscendStoreConfig:
    try:
        return build_config(**kwargs)
    except ConfigError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
