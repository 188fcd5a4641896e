"""How the suite finds and opens the backend under test.

A backend is named the way the connector names it (an entry point in the
``ascendstore.backends`` group, found through the same stevedore registry), or
by ``module:Class``, or given as the class itself. Opening always goes through
the backend's own ``Options`` model and ``create``, as in production.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ascendstore.contract import Backend, BackendContext
from ascendstore.registry import create_backend, load_backend_class, parse_options
from ascendstore_conformance.harness import TIMEOUT_MARGIN_S

#: Placeholders substituted in string config values, per test, so every test
#: gets a private store (its own directory, shared-memory name, namespace...).
TMP_PLACEHOLDER = "{tmp}"
UNIQUE_PLACEHOLDER = "{unique}"


def substitute_placeholders(value: Any, tmp: str, unique: str) -> Any:
    if isinstance(value, str):
        return value.replace(TMP_PLACEHOLDER, tmp).replace(UNIQUE_PLACEHOLDER, unique)
    if isinstance(value, Mapping):
        return {k: substitute_placeholders(v, tmp, unique) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [substitute_placeholders(v, tmp, unique) for v in value]
    return value


def _import_target(target: str) -> type[Backend]:
    module, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Backend)):
        raise TypeError(f"{target} is not an ascendstore Backend subclass")
    return obj


@dataclasses.dataclass(frozen=True)
class BackendFactory:
    """The backend under test and the configuration(s) to open it with.

    ``target``: an entry-point name (``"local"``), ``"package.module:Class"``, or
    the Backend subclass. ``config`` is the ``backend_config`` mapping; string
    values may contain ``{tmp}`` (a fresh directory per test) and ``{unique}``
    (a fresh token per test). ``small_config`` opens a store small enough to
    fill (a few MiB); without it the capacity tests are skipped.
    """

    target: str | type[Backend]
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    small_config: Mapping[str, Any] | None = None
    #: timeout_s the suite passes to every call.
    timeout_s: float = 5.0
    #: how far past its timeout_s a call may return before the suite fails it.
    timeout_margin_s: float = TIMEOUT_MARGIN_S
    #: largest object the suite writes (the maximum-size test is capped here).
    max_test_bytes: int = 32 << 20
    #: identifies the store of one test (BackendContext.instance_id).
    instance_id: str = "conformance"

    @property
    def name(self) -> str:
        t = self.target
        return t if isinstance(t, str) else f"{t.__module__}:{t.__qualname__}"

    @property
    def by_entry_point(self) -> bool:
        return isinstance(self.target, str) and ":" not in self.target

    def backend_class(self) -> type[Backend]:
        if isinstance(self.target, type):
            return self.target
        if self.by_entry_point:
            return load_backend_class(self.target)
        return _import_target(self.target)

    def bound(self, tmp: Path, unique: str) -> BackendFactory:
        """This factory with the per-test placeholders filled in."""
        small = None
        if self.small_config is not None:
            (tmp / "small").mkdir(exist_ok=True)
            small = substitute_placeholders(self.small_config, str(tmp / "small"), unique + "-small")
        return dataclasses.replace(
            self,
            config=substitute_placeholders(self.config, str(tmp), unique),
            small_config=small,
            instance_id=unique,
        )

    def context(
        self, *, small: bool = False, role: str = "worker", rank: int = 0, existing_only: bool = False
    ) -> BackendContext:
        instance = self.instance_id + ("-small" if small else "")
        return BackendContext(
            role=role, rank=rank, instance_id=instance, timeout_s=self.timeout_s, existing_only=existing_only
        )

    def open(
        self, *, small: bool = False, role: str = "worker", rank: int = 0, existing_only: bool = False
    ) -> Backend:
        """A new client of the store (the small one when ``small``; ``existing_only``: as a
        tool that inspects it opens it, BackendContext.existing_only)."""
        config = self.small_config if small else self.config
        if small and config is None:
            raise ValueError("no small_config given")
        ctx = self.context(small=small, role=role, rank=rank, existing_only=existing_only)
        if self.by_entry_point:
            assert isinstance(self.target, str)
            return create_backend(self.target, dict(config or {}), ctx)
        cls = self.backend_class()
        return cls.create(parse_options(cls, dict(config or {})), ctx)

    def spec(self, *, small: bool = False) -> dict[str, Any]:
        """JSON form that another process turns back into a client (see child.py)."""
        return {
            "target": self.name,
            "config": dict((self.small_config if small else self.config) or {}),
            "small": small,
            "instance_id": self.instance_id,
            "timeout_s": self.timeout_s,
        }

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> BackendFactory:
        config = spec["config"]
        return cls(
            target=spec["target"],
            config=config,
            small_config=config if spec.get("small") else None,
            timeout_s=spec["timeout_s"],
            instance_id=spec["instance_id"],
        )


def parse_json_option(text: str | None, option: str) -> dict[str, Any] | None:
    """A JSON object given on the command line, or ``@path`` to a JSON file."""
    if text is None:
        return None
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{option}: not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option}: expected a JSON object, got {type(value).__name__}")
    return value
