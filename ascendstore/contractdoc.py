"""Render the backend contract's signatures into docs/backend-authors.md.

The call table of the guide is generated from ``ascendstore/contract.py`` (the
``Backend`` methods and the ``BackendTestHooks`` protocol: names, parameters,
return types, first docstring paragraph), between two marker lines, so it
cannot drift from the code. Run ``python -m ascendstore.contractdoc`` after
changing the contract; a test checks the committed guide is current.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from pathlib import Path

from ascendstore import contract

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "backend-authors.md"
BEGIN = "<!-- BEGIN contract: generated from ascendstore/contract.py by `python -m ascendstore.contractdoc` -->"
END = "<!-- END contract -->"


def _summary(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")


def _param(p: inspect.Parameter) -> str:
    text = p.name
    if p.annotation is not inspect.Parameter.empty:
        text += f": {p.annotation}"  # a string: the contract uses postponed annotations
    if p.default is not inspect.Parameter.empty:
        text += f" = {p.default!r}"
    return text


def _signature(name: str, fn: Callable[..., object]) -> str:
    sig = inspect.signature(fn)
    params = [_param(p) for p in sig.parameters.values() if p.name not in ("self", "cls")]
    text = f"{name}({', '.join(params)})"
    if sig.return_annotation is not inspect.Signature.empty:
        text += f" -> {sig.return_annotation}"
    return text


def _code(text: str) -> str:
    """A table cell in code type (a pipe must be escaped even there)."""
    return "`" + text.replace("|", "\\|") + "`"


def _backend_rows() -> list[str]:
    rows = []
    abstract = contract.Backend.__abstractmethods__
    for name, member in vars(contract.Backend).items():
        if name.startswith("_") or name in ("Options", "test_tool"):
            continue
        required = "**required**" if name in abstract else "optional"
        if isinstance(member, property):
            ret = inspect.signature(member.fget).return_annotation  # type: ignore[arg-type]
            sig, required = f"{name} -> {ret}", f"{required}, a `@property`"
            doc = member.fget
        elif isinstance(member, classmethod):
            sig, required = _signature(name, member.__func__), f"{required}, a `@classmethod`"
            doc = member.__func__
        elif callable(member):
            sig, doc = _signature(name, member), member
        else:
            continue
        rows.append(f"| {_code(sig)} | {required} | {_summary(doc)} |")
    return rows


def _hook_rows() -> list[str]:
    rows = []
    for name, member in vars(contract.BackendTestHooks).items():
        if name.startswith("_") or not callable(member):
            continue
        rows.append(f"| {_code(_signature(name, member))} | {_summary(member)} |")
    return rows


def render_block() -> str:
    lines = [
        BEGIN,
        "",
        "`class MyBackend(ascendstore.contract.Backend)`; statuses are `ascendstore.contract.Status`,",
        "regions `Region(addr, length)`. Class attributes: `Options` (a `BackendOptions` pydantic",
        "model validating `backend_config`) and `test_tool` (True only for test tools such as `faulty`).",
        "",
        "| call | implement | contract |",
        "|---|---|---|",
        *_backend_rows(),
        "",
        "Test hooks (`BackendTestHooks`, returned by `test_hooks()`; offer the ones you can):",
        "",
        "| hook | does |",
        "|---|---|",
        *_hook_rows(),
        "",
        END,
    ]
    return "\n".join(lines)


def render(guide: str) -> str:
    """``guide`` with its generated block replaced by the current one."""
    start, end = guide.find(BEGIN), guide.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the guide has no generated block ({BEGIN!r} ... {END!r})")
    return guide[:start] + render_block() + guide[end + len(END) :]


def main() -> None:
    current = GUIDE.read_text()
    new = render(current)
    if new != current:
        GUIDE.write_text(new)
        print(f"wrote {GUIDE}", file=sys.stderr)


if __name__ == "__main__":
    main()
