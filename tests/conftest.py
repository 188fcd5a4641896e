"""Settings every test session shares."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


@pytest.fixture(scope="session", autouse=True)
def private_rpc_dir():
    """Each session publishes health files and lookup sockets in its own directory.

    Both go to ``VLLM_RPC_BASE_PATH`` (else the temp dir), which ``ascendstore
    doctor`` reads host-wide: on a long-lived CI host the temp dir keeps files of
    engines other jobs left, and a doctor test must judge only its own session.
    Short on purpose: a Unix socket path has ~107 bytes.
    """
    if os.environ.get("VLLM_RPC_BASE_PATH"):
        yield os.environ["VLLM_RPC_BASE_PATH"]
        return
    d = tempfile.mkdtemp(prefix="as-rpc-")
    os.environ["VLLM_RPC_BASE_PATH"] = d
    try:
        yield d
    finally:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
        shutil.rmtree(d, ignore_errors=True)
