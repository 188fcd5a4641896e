"""A real mooncake_master and real Mooncake clients, inside a private network namespace.

Mooncake clients listen on every interface whatever address they are given,
so these tests must run in a network namespace that has only loopback:
``make test-mooncake`` runs them under ``unshare -n`` with ``lo`` up.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from mooncake_helpers import BUFFER, SEGMENT, Master

from ascendstore.contract import BackendContext
from ascendstore.registry import create_backend


def _interfaces() -> list[str]:
    # if_nameindex() asks the kernel about *this* namespace (/sys/class/net may be the host's)
    return sorted(name for _, name in socket.if_nameindex())


def _loopback_works() -> bool:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        with socket.socket() as cli:
            cli.settimeout(2)
            return cli.connect_ex(srv.getsockname()) == 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test shows the log of any master that died by itself (once): a test
    that fails for want of its master otherwise says only "cannot reach"."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not report.failed:
        return
    for m in Master.started:
        if m.died() and not m.reported:
            m.reported = True
            assert m.proc is not None
            report.sections.append((f"mooncake_master {m.address} exited by itself ({m.proc.returncode})",
                                    m.log_tail(20)))


@pytest.fixture(scope="session", autouse=True)
def private_netns() -> None:
    """Refuse to run where Mooncake clients would listen on real interfaces."""
    others = [i for i in _interfaces() if i != "lo"]
    if others:
        pytest.fail(
            f"tests/mooncake must run in a private network namespace (found interfaces {others}): "
            "Mooncake clients listen on all interfaces. Run `make test-mooncake` "
            "(unshare -n bash -c 'ip link set lo up && pytest tests/mooncake').",
            pytrace=False,
        )
    if not _loopback_works():
        pytest.fail("loopback is down in this namespace: run `ip link set lo up` first", pytrace=False)


@pytest.fixture(scope="session")
def master_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    masters: list[Master] = []
    log_dir = tmp_path_factory.mktemp("mooncake-logs")

    def make(extra: list[str] | None = None) -> Master:
        m = Master(log_dir, extra)
        m.start()
        masters.append(m)
        return m

    yield make
    for m in masters:
        m.kill()


@pytest.fixture(scope="session")
def master(master_factory: Any) -> Master:
    """The shared master of the session (tests use distinct key prefixes)."""
    return master_factory()


def backend_config(master: Master, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "master_server_address": master.address,
        "local_hostname": "127.0.0.1",
        "global_segment_size": SEGMENT,
        "local_buffer_size": BUFFER,
        "setup_timeout_s": 15,
        "close_timeout_s": 10,
    }
    cfg.update(over)
    return cfg


@pytest.fixture
def open_backend(master: Master, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Factory for backends on the shared master (closed at the end of the test)."""
    for var in [v for v in os.environ if v.startswith("MOONCAKE_")]:
        monkeypatch.delenv(var)
    opened: list[Any] = []

    def make(m: Master | None = None, role: str = "worker", **over: Any) -> Any:
        b = create_backend("mooncake", backend_config(m or master, **over), BackendContext(role=role))
        opened.append(b)
        return b

    yield make
    for b in opened:
        b.close()


