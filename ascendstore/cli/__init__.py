"""The ``ascendstore`` command line.

Core commands need neither vLLM nor any backend library: ``backends``,
``config show``, ``doctor``, ``pool``, ``conformance`` (runs the separately
installed conformance suite), ``workload`` and ``report``. ``bench`` comes from
the ascendstore-vllm package through the ``ascendstore.cli`` entry points.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ascendstore.cli import pool
from ascendstore.cli.common import (
    EXIT_USAGE,
    BackendConfigOpt,
    BackendOpt,
    ConfigFileOpt,
    KvTransferConfigOpt,
    _json_arg,
    config_or_exit,
    console,
    fail,
)
from ascendstore.cli.plugins import add_plugins
from ascendstore.errors import ConfigError

app = typer.Typer(
    name="ascendstore",
    help="AscendStore: a KV-cache pool for vLLM. Check a setup, inspect the pool, run benchmarks.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Validate and show the configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(pool.app, name="pool")

CORE_COMMANDS = {"backends", "config", "doctor", "pool", "conformance", "workload", "report"}


@app.command()
def backends() -> None:
    """List installed storage backends and what they declare they can do."""
    from ascendstore.registry import installed_backends, load_backend_class

    t = Table(title="installed backends (entry-point group ascendstore.backends)")
    for col in ("name", "kind", "entry point", "imports", "declared capabilities"):
        t.add_column(col)
    problems = []
    for name, target in sorted(installed_backends().items()):
        try:
            cls = load_backend_class(name)
        except Exception as exc:
            t.add_row(name, "?", target, "[red]no[/]", "")
            problems.append(f"{name}: {exc}")
            continue
        kind = "[yellow]test tool[/] (fault injection, not for serving)" if cls.test_tool else "storage"
        caps = [k for k, v in _declared_caps(cls).items() if v]
        t.add_row(name, kind, target, "[green]yes[/]", ", ".join(caps) or "(known once opened)")
    console.print(t)
    for p in problems:
        console.print(f"[red]{p}[/]", highlight=False)
    if problems:
        console.print(
            "A backend that does not import is installed but broken: reinstall it, or its missing "
            "dependency, into this Python environment.",
            highlight=False,
        )


def _declared_caps(cls: type) -> dict[str, bool]:
    """Capabilities declared on the class (a class attribute or a constant), if
    readable without opening a client; otherwise empty."""
    caps = getattr(cls, "CAPABILITIES", None) or getattr(cls, "capabilities", None)
    if caps is None or isinstance(caps, property):
        return {}
    return {k: bool(getattr(caps, k, False)) for k in
            ("zero_copy", "shared_across_processes", "shared_across_nodes", "persistent", "evicts", "listing")}


@config_app.command("show")
def config_show(
    config: ConfigFileOpt = None,
    kv_transfer_config: KvTransferConfigOpt = None,
    backend: BackendOpt = None,
    backend_config: BackendConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
) -> None:
    """Validate the configuration and print every key with its effective value."""
    cfg = config_or_exit(config_file=config, kv_transfer_config=kv_transfer_config, backend=backend,
                         backend_config=backend_config)
    from ascendstore.registry import load_backend_class, parse_options

    try:
        opts = parse_options(load_backend_class(cfg.backend), cfg.backend_config).model_dump(mode="json")
    except ConfigError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    except Exception as exc:
        raise fail(str(exc)) from None
    data = cfg.model_dump(mode="json")
    data["backend_config"] = opts
    if as_json:
        print(json.dumps(data, indent=2))
        return
    defaults = type(cfg)().model_dump(mode="json")
    t = Table(title="AscendStore configuration (validated)")
    t.add_column("key")
    t.add_column("value")
    t.add_column("")
    for k, v in _flatten(data).items():
        t.add_row(k, json.dumps(v), "" if _flatten(defaults).get(k, object()) == v else "[cyan]set[/]")
    console.print(t)


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@app.command()
def doctor(
    config: ConfigFileOpt = None,
    kv_transfer_config: KvTransferConfigOpt = None,
    backend: BackendOpt = None,
    backend_config: BackendConfigOpt = None,
) -> None:
    """Validate the configuration, connect to the backend and do a put/exists/get round trip."""
    from ascendstore.cli.doctor import run_doctor

    cfg = config_or_exit(config_file=config, kv_transfer_config=kv_transfer_config, backend=backend,
                         backend_config=backend_config)
    raise typer.Exit(run_doctor(cfg))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def conformance(
    ctx: typer.Context,
    backend_name: Annotated[
        str, typer.Argument(metavar="BACKEND", help="installed backend to test (entry-point name, or module:Class)")
    ],
    backend_config: Annotated[
        str | None,
        typer.Option(
            "--backend-config",
            metavar="JSON",
            help="backend_config as a JSON object (or @file.json); '{tmp}' and '{unique}' in string values "
            "become a fresh directory and token per test",
        ),
    ] = None,
    backend_small_config: Annotated[
        str | None,
        typer.Option(
            "--backend-small-config",
            metavar="JSON",
            help="backend_config of a store of a few MiB, for the capacity-full test (skipped without it)",
        ),
    ] = None,
    backend_timeout: Annotated[
        float | None,
        typer.Option("--backend-timeout", metavar="SECONDS", help="timeout_s passed to every backend call (default 5)"),
    ] = None,
    backend_timeout_margin: Annotated[
        float | None,
        typer.Option(
            "--backend-timeout-margin",
            metavar="SECONDS",
            help="how far past its timeout_s a call may return before it fails (default 0.5)",
        ),
    ] = None,
    backend_max_test_bytes: Annotated[
        int | None,
        typer.Option(
            "--backend-max-test-bytes",
            metavar="BYTES",
            help="largest object the suite writes; the maximum-size test is capped here (default 32 MiB)",
        ),
    ] = None,
) -> None:
    """Run the backend conformance suite against BACKEND. Takes the options of the
    pytest form (`pytest --pyargs ascendstore_conformance --backend BACKEND ...`);
    other arguments go to pytest."""
    try:
        suite = importlib.import_module("ascendstore_conformance")
    except ImportError as exc:
        raise fail(f"the conformance suite is not installed ({exc}); install it with "
                   "`pip install -e conformance` (or `make setup`)", EXIT_USAGE) from None
    run = getattr(suite, "run", None)
    if run is None:
        raise fail("ascendstore_conformance has no run(backend, config, extra_pytest_args); "
                   "the installed suite is too old or broken")
    try:
        opts = _json_arg(backend_config, "--backend-config") if backend_config else {}
    except ConfigError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    # The plugin parses and checks these itself, exactly as in the pytest form.
    given = {
        "--backend-small-config": backend_small_config,
        "--backend-timeout": backend_timeout,
        "--backend-timeout-margin": backend_timeout_margin,
        "--backend-max-test-bytes": backend_max_test_bytes,
    }
    args = [a for flag, v in given.items() if v is not None for a in (flag, str(v))]
    raise typer.Exit(int(run(backend_name, opts, [*args, *ctx.args])))


@app.command()
def workload(
    name: Annotated[str, typer.Argument(help="gr | chat | docqa | trace")],
    param: Annotated[list[str] | None, typer.Option("--param", "-p", help="generator parameter KEY=VALUE")] = None,
    block_size: Annotated[int, typer.Option(help="vLLM block size for the infinite-cache bound")] = 16,
) -> None:
    """Describe a benchmark workload and its infinite-cache bound (no vLLM needed)."""
    from ascendstore.bench.bound import infinite_cache_hits, reusable_blocks, working_set_blocks
    from ascendstore.bench.workloads import make_workload

    try:
        w = make_workload(name, **parse_params(param or []))
    except (ValueError, TypeError, OSError) as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    hits = infinite_cache_hits(w.requests, block_size)
    lens = [r.prompt_len for r in w.requests]
    t = Table(title=f"workload {w.name}")
    t.add_column("property")
    t.add_column("value", justify="right")
    t.add_row("requests", str(len(w.requests)))
    t.add_row("prompt tokens (total / min / max)", f"{sum(lens)} / {min(lens)} / {max(lens)}")
    t.add_row("span (s)", f"{w.requests[-1].arrival_s - w.requests[0].arrival_s:.1f}")
    t.add_row("distinct full blocks", str(working_set_blocks(w.requests, block_size)))
    t.add_row("... used by more than one request (working set)", str(reusable_blocks(w.requests, block_size)))
    t.add_row("infinite-cache bound", f"{100 * sum(hits) / max(1, sum(lens)):.1f}% of prompt tokens")
    for k, v in w.params.items():
        t.add_row(f"param {k}", str(v))
    console.print(t)


def parse_params(items: list[str]) -> dict[str, object]:
    """KEY=VALUE pairs; values are read as JSON when they parse (numbers, bools)."""
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"bad --param {item!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


@app.command()
def report(
    path: Annotated[Path, typer.Argument(help="a JSON report written by `ascendstore bench --json`")],
    plot: Annotated[Path | None, typer.Option("--plot", help="write PNG plots into this folder")] = None,
) -> None:
    """Print (and plot) a saved benchmark report (or a --pool-capacity/--granularity sweep)."""
    from ascendstore.bench.display import print_report, sweep_table, write_plots, write_sweep_plot
    from ascendstore.bench.report import BenchReport

    try:
        data = json.loads(path.read_text())
        items = data["sweep"] if isinstance(data, dict) and "sweep" in data else [data]
        reps = [BenchReport.model_validate(x) for x in items]
    except Exception as exc:
        raise fail(f"cannot read report {str(path)!r}: {exc}", EXIT_USAGE) from None
    for rep in reps:
        print_report(rep, console)
    if len(reps) > 1:
        console.print(sweep_table(reps))
    if plot is not None:
        for rep in reps:
            sub = plot if len(reps) == 1 else plot / f"{rep.granularity}-{rep.pool_capacity_fraction or 'all'}"
            for p in write_plots(rep, sub):
                console.print(f"wrote {p}", highlight=False)
        if len(reps) > 1:
            console.print(f"wrote {write_sweep_plot(reps, plot)}", highlight=False)


# `ascendstore config pd` (implementation in ascendstore/pd_cli.py).
from ascendstore.pd_cli import config_pd  # noqa: E402

config_app.command("pd")(config_pd)

_plugins_added = False


def get_app() -> typer.Typer:
    """The full CLI: core commands plus entry-point plugins (added once)."""
    global _plugins_added
    if not _plugins_added:
        add_plugins(app, CORE_COMMANDS)
        _plugins_added = True
    return app


def main() -> None:
    get_app()()


if __name__ == "__main__":
    main()
