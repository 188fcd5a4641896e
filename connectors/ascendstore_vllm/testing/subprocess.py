"""Run a harness scenario in a fresh (spawned) process: a second vLLM engine."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any


def run_in_subprocess(fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a spawned process; returns its (picklable) result.

    ``fn`` must be importable (module level). Bounded: raises TimeoutError."""
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        fut = pool.submit(fn, *args, **kwargs)
        try:
            return fut.result(timeout=timeout_s)
        except TimeoutError:
            for p in list(getattr(pool, "_processes", {}).values()):
                p.kill()
            raise
