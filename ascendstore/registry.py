"""Backend discovery through stevedore under the ``ascendstore.backends`` group.

The built-in ``local`` backend registers itself the same way (the core's own
entry point), so a third-party backend is a peer of ours, not a special case.

Entry points are always read fresh from ``importlib.metadata``, never from
stevedore's caches: its on-disk cache keys on file times packed as 32-bit
floats (about two minutes apart today), and its in-process cache never
refreshes, so a backend installed or reinstalled a moment ago would be
reported missing or loaded from its old target.
"""

from __future__ import annotations

import difflib
import sys
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from pydantic import ValidationError
from stevedore import DriverManager

from ascendstore.contract import Backend, BackendContext, BackendOptions, BackendSetupError
from ascendstore.errors import ConfigError, format_validation_error

GROUP = "ascendstore.backends"


class UnknownBackendError(ConfigError):
    pass


class BackendImportError(BackendSetupError):
    pass


def installed_backends() -> dict[str, str]:
    """name -> "module:Class" for every registered backend (loads nothing)."""
    return {ep.name: ep.value for ep in entry_points(group=GROUP)}


class _FreshDriverManager(DriverManager):
    """stevedore's DriverManager over the entry points installed *now*."""

    def list_entry_points(self) -> list[EntryPoint]:
        return list(entry_points(group=self.namespace))


def load_backend_class(name: str) -> type[Backend]:
    """The class registered as ``name``.

    An unknown name lists what is installed; a backend whose import fails
    reports that import error, not "unknown backend"."""
    available = installed_backends()
    if name not in available:
        close = difflib.get_close_matches(name, list(available), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownBackendError(
            f"unknown backend {name!r} (config key 'backend'). Installed backends: "
            f"{', '.join(sorted(available)) or 'none'}.{hint} A third-party backend registers an "
            f"entry point in the group {GROUP!r}; install its package into this Python environment "
            f"({sys.executable} -m pip install ...), then `ascendstore backends` lists it."
        )
    failure: list[BaseException] = []

    def on_fail(_mgr: Any, _ep: Any, exc: BaseException) -> None:
        failure.append(exc)

    try:
        mgr = _FreshDriverManager(
            namespace=GROUP,
            name=name,
            invoke_on_load=False,
            on_load_failure_callback=on_fail,
        )
    except Exception as exc:  # stevedore raises NoMatches when loading failed
        if failure:
            err = failure[0]
            raise BackendImportError(
                f"backend {name!r} is installed ({available[name]}) but failed to import: "
                f"{type(err).__name__}: {err}"
            ) from err
        raise BackendImportError(f"backend {name!r} could not be loaded: {exc}") from exc
    cls = mgr.driver
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendImportError(
            f"entry point {name!r} -> {available[name]} is not an ascendstore Backend subclass"
        )
    return cls


def parse_options(cls: type[Backend], options: dict[str, Any] | BackendOptions | None) -> BackendOptions:
    if isinstance(options, BackendOptions):
        return options
    try:
        return cls.Options.model_validate(options or {})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, cls.Options, prefix="backend_config")) from None


def create_backend(
    name: str,
    options: dict[str, Any] | BackendOptions | None = None,
    ctx: BackendContext | None = None,
) -> Backend:
    """Find, validate options for, and open the backend called ``name``."""
    cls = load_backend_class(name)
    opts = parse_options(cls, options)
    return cls.create(opts, ctx or BackendContext())
