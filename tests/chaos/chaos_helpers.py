"""Shared pieces of the chaos tests: private local pools, buffers, figures."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import numpy as np

from ascendstore.contract import Region

KiB, MiB = 1 << 10, 1 << 20
FIGURES_ENV = "ASCENDSTORE_CHAOS_FIGURES"


def pool_name(tag: str = "chaos") -> str:
    return f"{tag}-{uuid.uuid4().hex[:10]}"


def local_config(name: str, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"name": name, "capacity": 4 * MiB, "page_size": 4 * KiB}
    cfg.update(over)
    return cfg


def faulty_config(inner: dict[str, Any], backend: str = "local", **faults: Any) -> dict[str, Any]:
    return {"backend": backend, "backend_config": inner, **faults}


def payload(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def region(arr: np.ndarray) -> Region:
    return Region(arr.ctypes.data, arr.nbytes)


def report(name: str, **figures: Any) -> None:
    """Print a test's measured figures (``-s`` shows them) and append them to the
    file named by $ASCENDSTORE_CHAOS_FIGURES, which `make chaos` collects."""
    line = json.dumps({"test": name, **figures}, sort_keys=True, default=str)
    print(f"\nCHAOS-FIGURES {line}")
    path = os.environ.get(FIGURES_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
