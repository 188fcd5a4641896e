"""Real-model tests that start a real mooncake_master: private network namespace only
(Mooncake clients listen on all interfaces). ``make test-real`` runs them under
``unshare -n`` with ``lo`` up."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parents[2] / "mooncake")]  # real_helpers, mooncake_helpers
from mooncake_helpers import Master  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def private_netns() -> None:
    others = sorted(name for _, name in socket.if_nameindex() if name != "lo")
    if others:
        pytest.fail(f"tests/real/mooncake must run in a private network namespace (found {others}): run "
                    "`make test-real` (unshare -n bash -c 'ip link set lo up && pytest tests/real/mooncake')",
                    pytrace=False)


@pytest.fixture
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    """A master per test: each test's cold pass must find the pool empty."""
    m = Master(tmp_path_factory.mktemp("mooncake-logs"))
    m.start()
    yield m
    m.kill()
