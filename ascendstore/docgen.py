"""Generate docs/configuration.md from the config schema (and each backend's options).

Run ``python -m ascendstore.docgen`` after changing a config model; a test checks
the committed file is current.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ascendstore.config import AscendStoreConfig, GRConfig

HEADER = """# Configuration reference

Generated from the config schema by `python -m ascendstore.docgen`; do not edit by hand.

Everything below goes under `kv_connector_extra_config` in vLLM's `--kv-transfer-config`
(or in a JSON/YAML/TOML file named by `config_file` / `ASCENDSTORE_CONFIG_FILE`, whose
values the extra config overrides). Unknown keys and bad values fail at start-up with a
message naming the key, the value, the valid choices and the nearest known key.
Sizes accept units (`4GiB`, `512MB`).
"""


OWN_BACKENDS = ("local", "mooncake", "memcache")


def type_name(ann: Any) -> str:
    """A readable type: Annotated metadata (validators) dropped, so output is stable."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if ann is type(None):
        return "None"
    return getattr(ann, "__name__", str(ann))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    out += [f"| `{k}` | {_cell(t)} | `{_cell(d)}` | {_cell(m)} |" for k, t, d, m in rows]
    return out


def model_rows(model: type[BaseModel], skip: tuple[str, ...] = ()) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        default = info.get_default(call_default_factory=True)
        try:
            default_txt = json.dumps(default)
        except TypeError:
            default_txt = str(default)
        rows.append((name, type_name(info.annotation), default_txt, info.description or ""))
    return rows


def render() -> str:
    lines = [HEADER, "## Connector keys", ""]
    lines += _table(model_rows(AscendStoreConfig, skip=("gr",)))
    lines += ["", "### `gr` (GR mode, nested under the key `gr`)", ""]
    lines += _table([(f"gr.{k}", t, d, m) for k, t, d, m in model_rows(GRConfig)])
    from ascendstore.registry import installed_backends, load_backend_class

    # Our own backends only: a third-party plugin installed beside us documents itself.
    for name in [n for n in OWN_BACKENDS if n in installed_backends()]:
        try:
            cls = load_backend_class(name)
        except Exception as exc:  # a broken plugin is documented as such
            lines += ["", f"## `backend_config` for `{name}`", "", f"(could not be loaded here: {exc})"]
            continue
        doc = (cls.Options.__doc__ or "").strip()
        lines += ["", f"## `backend_config` for `{name}`", ""]
        if doc:
            lines += [doc, ""]
        lines += _table(model_rows(cls.Options))
    return "\n".join(lines) + "\n"


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/configuration.md")
    out.write_text(render())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
