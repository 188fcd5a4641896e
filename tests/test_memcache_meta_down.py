"""REAL memcache-hybrid: a client whose meta service dies reports UNAVAILABLE at
once (the library answers LINK_NOT_FOUND, measured), never hangs, and a new
meta service can start on the host after the old one was SIGKILLed (its lock
file does not outlive it). Own module: the meta service is one per host, and
test_memcache_real.py's runs for that whole module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("memcache_hybrid")

from memcache_helpers import meta_options, start_meta

CHILD = r"""
import json, sys
from ascendstore.contract import BackendContext
from ascendstore.registry import create_backend
b = create_backend("memcache", json.loads(sys.argv[1]), BackendContext(role="scheduler"))
print(json.dumps({"health": b.health(5).status.name}), flush=True)
sys.stdin.readline()  # the parent kills the meta service now
out = {"health": b.health(5).status.name, "exists": [s.name for s in b.exists(["a", "b"], 5)]}
b.close()
print(json.dumps(out), flush=True)
"""


def test_meta_service_death_is_unavailable_and_recoverable(tmp_path: Path) -> None:
    opts = meta_options(tmp_path)
    meta = start_meta(opts, tmp_path)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(opts.model_dump(mode="json", exclude_none=True))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ),
    )
    try:
        first = _json_line(child)
        assert first == {"health": "OK"}
        meta.kill()  # SIGKILL: no clean shutdown
        child.stdin.write("go\n")
        child.stdin.flush()
        after = _json_line(child)
        assert after["health"] == "UNAVAILABLE"
        assert after["exists"] == ["UNAVAILABLE", "UNAVAILABLE"]
        assert child.wait(30) == 0
        # the per-host lock died with the process: a new meta service starts
        again = start_meta(opts, tmp_path)
        again.stop(timeout_s=3)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(5)
        meta.kill()


def _json_line(proc: subprocess.Popen[str]) -> dict:
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        assert line, "child ended without a result"
        if line.startswith("{"):
            return json.loads(line)


def test_meta_service_cli_generates_its_config(tmp_path: Path) -> None:
    from ascendstore_memcache import conf
    from ascendstore_memcache.preflight import meta_service_reachable

    opts = meta_options(tmp_path)
    cfg = json.dumps(opts.model_dump(mode="json", exclude_none=True))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ascendstore_memcache.meta_service", "--backend-config", cfg],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        host, port = conf.tcp_endpoint(opts.meta_service_url)
        deadline = time.monotonic() + 20
        while meta_service_reachable(host, port, 0.2) is not None:
            assert proc.poll() is None, "meta service CLI exited"
            assert time.monotonic() < deadline, "meta service CLI not listening"
            time.sleep(0.1)
        written = conf.parse_conf((tmp_path / "mmc-meta.conf").read_text())
        assert written["ock.mmc.meta_service_url"] == opts.meta_service_url
        assert written["ock.mmc.log_path"] == str(tmp_path / "logs")
    finally:
        proc.kill()
        proc.wait(10)
