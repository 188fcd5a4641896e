"""``make demo``: a short generative-recommendation run on the embedded ``local`` pool.

Drives vLLM's real scheduler and AscendStoreConnector on CPU (``ascendstore
bench``, provided by the ascendstore-vllm package through the CLI's entry
points, so the core still never imports vLLM) in GR mode -- user-granular
pool, device-side user LRU on with the GR design's defaults (at most 100
resident users, a floor of free blocks) -- then the same trace with the
block-granular chunk pool for contrast. Prints each run's table (three-level
hits and the five GR statistics) and one line per granularity.
Finishes in well under two minutes on a laptop-class CPU.

    python -m ascendstore.demo [--json out/demo.json] [--plot out/demo]
"""

from __future__ import annotations

import sys

#: 32 Zipf-popular users with stable ~768-token histories and rotating candidates.
#: The device cache is kept small (a full batch plus two of the longest requests),
#: so vLLM's own prefix cache evicts histories and the pool matters.
# fmt: off
DEMO_ARGS = [
    "bench", "--workload", "gr", "--backend", "local", "--granularity", "both",
    "-p", "users=32", "-p", "requests=128", "-p", "history_tokens=768", "-p", "candidates=12",
    "--layers", "4", "--kv-heads", "4", "--head-size", "32",
]
# fmt: on


def main(argv: list[str] | None = None) -> int:
    from ascendstore.cli import get_app

    app = get_app()
    print(
        "AscendStore demo: GR workload through vLLM 0.33's scheduler + AscendStoreConnector "
        "on the embedded local pool (CPU, fake model, modeled prefill time): GR mode "
        "(user-granular, user LRU on), then block-granular on the same trace",
        flush=True,
    )
    try:
        app([*DEMO_ARGS, *(sys.argv[1:] if argv is None else argv)], standalone_mode=False)
    except SystemExit as exc:  # typer.Exit inside standalone_mode=False surfaces as its code
        return int(exc.code or 0)
    except Exception as exc:
        code = getattr(exc, "exit_code", None)
        if code is not None:
            return int(code)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
