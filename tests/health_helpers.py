"""Shared by the CLI test modules that run ``ascendstore doctor``."""

from __future__ import annotations

import tempfile

import pytest


@pytest.fixture(autouse=True)
def private_health_dir(monkeypatch):
    """doctor reads every engine's health file in $VLLM_RPC_BASE_PATH (else the temp
    dir), host-wide: on a long-lived CI host files other jobs left there must not
    decide this test. Short (not tmp_path): lookup sockets live there too."""
    with tempfile.TemporaryDirectory(prefix="as-rpc-") as d:
        monkeypatch.setenv("VLLM_RPC_BASE_PATH", d)
        yield d
