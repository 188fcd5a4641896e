"""Programmatic entry: what ``ascendstore conformance NAME`` calls."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest


def run(backend: str, config: Mapping[str, Any], extra_pytest_args: Sequence[str] = ()) -> int:
    """Run the suite against the backend registered as ``backend`` with
    ``config`` as its backend_config; returns pytest's exit code. Skipped tests
    are listed with their reasons (``-rs``; a later ``-r`` replaces it)."""
    args = [
        "-rs",
        "-p",
        "ascendstore_conformance.plugin",
        "--pyargs",
        "ascendstore_conformance",
        "--backend",
        backend,
        "--backend-config",
        json.dumps(dict(config)),
        *extra_pytest_args,
    ]
    return int(pytest.main(args))
