"""Subcommands contributed by other packages through the entry-point group
``ascendstore.cli`` (name -> a ``typer.Typer`` app or a plain function).

This is how commands that need vLLM reach the CLI without the core importing
vLLM: the connectors package registers ``bench``. A plugin that fails to
import becomes a command that explains the failure; a command the docs promise
but whose package is missing explains what to install.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import typer

GROUP = "ascendstore.cli"

#: commands documented for the CLI that other distributions provide.
EXPECTED: dict[str, tuple[str, str]] = {
    "bench": ("ascendstore-vllm", "connectors"),
}


def plugin_entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def _explainer(name: str, message: str) -> Callable[..., None]:
    def explain(args: list[str] | None = typer.Argument(None, hidden=True)) -> None:
        typer.secho(f"error: `ascendstore {name}` is unavailable: {message}", fg="red", err=True)
        raise typer.Exit(2)

    explain.__doc__ = f"(unavailable) {message}"
    return explain


_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def add_plugins(app: typer.Typer, reserved: set[str]) -> None:
    eps = plugin_entry_points()
    for name, ep in sorted(eps.items()):
        if name in reserved:
            continue  # a plugin cannot shadow a core command
        try:
            obj: Any = ep.load()
        except Exception as exc:
            app.command(name, context_settings=_PASSTHROUGH)(
                _explainer(name, f"its plugin {ep.value} failed to import: {type(exc).__name__}: {exc}")
            )
            continue
        if isinstance(obj, typer.Typer):
            app.add_typer(obj, name=name)
        elif callable(obj):
            app.command(name)(obj)
        else:
            app.command(name, context_settings=_PASSTHROUGH)(
                _explainer(name, f"entry point {ep.value} is neither a typer app nor a function")
            )
    for name, (dist, folder) in EXPECTED.items():
        if name not in eps and name not in reserved:
            app.command(name, context_settings=_PASSTHROUGH)(
                _explainer(
                    name,
                    f"it is provided by the {dist} package; install it with "
                    f"`pip install -e {folder}` (or `make setup`).",
                )
            )
