"""Helpers of the memcache tests that run the real library (not a test module)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ascendstore_memcache import conf
from ascendstore_memcache.meta_service import MetaServiceError, MetaServiceProcess
from ascendstore_memcache.options import MemcacheOptions

from ascendstore.loopback import free_ports


def meta_options(tmp: Path, **extra: object) -> MemcacheOptions:
    meta, store, metrics = free_ports(3)
    return MemcacheOptions(
        meta_service_url=f"tcp://127.0.0.1:{meta}",
        config_store_url=f"tcp://127.0.0.1:{store}",
        metrics_url=f"http://127.0.0.1:{metrics}",
        conf_dir=str(tmp),
        protocol="host_tcp",
        dram_size="64MiB",
        log_level="error",
        **extra,
    )


def start_meta(opts: MemcacheOptions, tmp: Path) -> MetaServiceProcess:
    resolved = conf.resolve(opts, "test")
    deadline = time.monotonic() + 60
    while True:  # another test run on this host may hold the per-host lock for a while
        try:
            return MetaServiceProcess(resolved.meta_path, tmp / "meta.log").start()
        except MetaServiceError as exc:
            if "one per host" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(1)


def run_child(code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, f"child exited {out.returncode}\n{out.stderr[-3000:]}"
    # the native library writes its own log lines to stdout: take our JSON line
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


