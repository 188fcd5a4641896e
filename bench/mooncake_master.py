"""A real ``mooncake_master`` for the benchmarks, in a private network namespace.

Mooncake clients listen on all interfaces, so a script that starts one re-runs
itself under ``unshare -n`` (needs root) with only loopback up, unless it is in
such a namespace already. The master binds 127.0.0.1.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from ascendstore.loopback import free_ports

#: set in the re-run process: it must not try again (and fail loudly if still not isolated).
_NETNS_FLAG = "_BENCH_MOONCAKE_NETNS"


def in_private_netns() -> bool:
    return [n for _, n in socket.if_nameindex()] == ["lo"]


def ensure_private_netns() -> None:
    """Return when in a private namespace; else re-run this command in one and exit with its status."""
    if in_private_netns():
        return
    if os.geteuid() != 0 or os.environ.get(_NETNS_FLAG):
        raise SystemExit("run as root (or inside `unshare -n` with lo up): Mooncake clients listen on all interfaces")
    cmd = " ".join([sys.executable, *map(repr, sys.argv)])
    env = {**os.environ, _NETNS_FLAG: "1"}
    raise SystemExit(subprocess.call(["unshare", "-n", "bash", "-c", f"ip link set lo up && exec {cmd}"], env=env))


def start_master() -> tuple[subprocess.Popen[bytes], str]:
    """A master on a free loopback port: (its process, ``host:port``). Kill it when done."""
    binary = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    port, metrics_port = free_ports(2)  # drawn together, never the same port twice
    proc = subprocess.Popen(
        [binary, "--rpc_address=127.0.0.1", f"--rpc_port={port}", "--metrics_host=127.0.0.1",
         f"--metrics_port={metrics_port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"127.0.0.1:{port}"
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError("mooncake_master did not open its port within 10 s")


_LENDER = """
import sys
from ascendstore.contract import BackendContext
from ascendstore.registry import create_backend
b = create_backend("mooncake", {{"master_server_address": {address!r}, "local_hostname": "127.0.0.1",
                   "global_segment_size": {size}, "local_buffer_size": 16 << 20}}, BackendContext(role="worker"))
print("ready", flush=True)
sys.stdin.read()  # until the parent closes it (or dies)
b.close()
"""


def start_lender(address: str, size: int) -> subprocess.Popen[str]:
    """Another Mooncake client, in a process of its own, lending ``size`` bytes of
    segment: a client that lends none puts its objects there and reads them across
    a TCP socket (loopback), as from another node's memory. Kill it when done (or close
    its stdin)."""
    proc = subprocess.Popen([sys.executable, "-c", _LENDER.format(address=address, size=size)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError(f"the lending Mooncake client did not start (exit {proc.wait()})")
    return proc
