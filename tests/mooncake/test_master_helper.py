"""The test helper's mooncake_master: distinct ports, and a failed test shows the log of a master that died."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

from conftest import pytest_runtest_makereport
from mooncake_helpers import Master


def _report_of_failed_test() -> SimpleNamespace:
    report = SimpleNamespace(failed=True, sections=[])
    hook = pytest_runtest_makereport(None, None)  # type: ignore[arg-type]
    next(hook)
    try:
        hook.send(SimpleNamespace(get_result=lambda: report))
    except StopIteration:
        pass
    return report


def test_a_master_that_died_is_shown_once_and_a_killed_one_never(tmp_path):
    gone, killed = Master(tmp_path), Master(tmp_path)
    assert gone.port != gone.metrics_port
    gone.start()
    killed.start()
    try:
        killed.kill()
        assert not killed.died()
        os.kill(gone.proc.pid, signal.SIGKILL)  # not through the helper: as if it had crashed
        gone.proc.wait(10)
        assert gone.died()
        sections = _report_of_failed_test().sections
        assert [title for title, _ in sections] == [f"mooncake_master {gone.address} exited by itself (-9)"]
        assert f"Master service started on port {gone.port}" in sections[0][1]
        assert _report_of_failed_test().sections == []  # once
        gone.start()  # restarted by the test: alive again
        assert not gone.died()
    finally:
        gone.kill()
        killed.kill()
