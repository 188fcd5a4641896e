"""Configuration errors that name the key, the value, the choices and the nearest key."""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """A configuration the user gave cannot be used. Raised at start-up."""


def _choices(model: type[BaseModel], field: str) -> list[str]:
    info = model.model_fields.get(field)
    if info is None:
        return []
    ann = info.annotation
    args = typing.get_args(ann)
    if typing.get_origin(ann) is typing.Literal:
        return [repr(a) for a in args]
    for a in args:
        if typing.get_origin(a) is typing.Literal:
            return [repr(x) for x in typing.get_args(a)]
    return []


def _known_keys(model: type[BaseModel]) -> list[str]:
    keys: list[str] = []
    for name, info in model.model_fields.items():
        keys.append(name)
        if isinstance(info.alias, str):
            keys.append(info.alias)
        if info.validation_alias is not None:
            choices = getattr(info.validation_alias, "choices", [info.validation_alias])
            keys.extend(c for c in choices if isinstance(c, str))
    return sorted(set(keys))


def _submodel(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[type[BaseModel], str]:
    """Walk nested models along loc; return (model owning the last key, key)."""
    cur = model
    for part in loc[:-1]:
        info = cur.model_fields.get(str(part))
        ann = info.annotation if info else None
        for cand in (ann, *typing.get_args(ann)):
            if isinstance(cand, type) and issubclass(cand, BaseModel):
                cur = cand
                break
    return cur, str(loc[-1]) if loc else ""


def format_validation_error(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not isinstance(p, int))
        owner, key = _submodel(model, loc)
        path = ".".join(str(p) for p in ((prefix,) if prefix else ()) + loc)
        value = err.get("input")
        if err["type"] == "extra_forbidden":
            known = _known_keys(owner)
            near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            lines.append(
                f"unknown config key {path!r} (value {value!r}).{hint} Valid keys: {', '.join(known)}."
            )
        else:
            choices = _choices(owner, key)
            choice_txt = f" Valid choices: {', '.join(choices)}." if choices else ""
            lines.append(f"bad value {value!r} for config key {path!r}: {err['msg']}.{choice_txt}")
    return "invalid AscendStore configuration:\n  " + "\n  ".join(lines)
