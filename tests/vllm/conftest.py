"""Connector tests through the real vLLM 0.33 scheduler/worker lifecycle on CPU.

The test backend ``testdir`` (tests/testpool) is put on sys.path here; spawned
engine processes inherit sys.path, so they find it through the same entry point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
for p in (HERE.parent / "testpool", HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(HERE.parent / "testpool"), str(HERE)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
)

pytest.importorskip("vllm")


def pytest_collection_modifyitems(items):
    for item in items:
        if str(HERE) in str(item.fspath):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture
def pool_root(tmp_path) -> str:
    root = tmp_path / "pool"
    root.mkdir()
    return str(root)


def pool_config(root: str, **extra) -> dict:
    """kv_connector_extra_config for the shared test pool."""
    backend_config = {"root": root, **extra.pop("backend_config", {})}
    return {"backend": "testdir", "backend_config": backend_config, **extra}


def local_pool_config(name: str, **extra) -> dict:
    """kv_connector_extra_config for the embedded ``local`` shared-memory pool."""
    backend_config = {"name": name, "capacity": "32MiB", "page_size": "4KiB", **extra.pop("backend_config", {})}
    return {"backend": "local", "backend_config": backend_config, **extra}


@pytest.fixture(params=["local", "testdir"])
def pool(request, tmp_path):
    """A config builder for a pool that engines in different processes share."""
    if request.param == "local":
        import uuid

        name = "t-" + uuid.uuid4().hex[:12]
        return lambda **extra: local_pool_config(name, **extra)
    root = tmp_path / "pool"
    root.mkdir()
    return lambda **extra: pool_config(str(root), **extra)


def run_bench(script: str, *args: str, **env: str) -> dict:
    """The JSON a script under bench/ prints with ``--json`` (CPU clock unless ``env`` says)."""
    out = subprocess.run(
        [sys.executable, str(HERE.parents[1] / "bench" / script), *args, "--json"],
        capture_output=True, text=True, timeout=300, check=True,
        env={**os.environ, "BENCH_CLOCK": "cpu", **env},
    )
    return json.loads(out.stdout)
