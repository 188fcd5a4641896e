"""Helpers shared by the Mooncake tests: a real mooncake_master process, test data."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from ascendstore.contract import Region
from ascendstore.loopback import free_ports

MASTER_BIN = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
#: small pools keep the suite light on a shared 2-core machine
SEGMENT = 32 << 20
BUFFER = 8 << 20


class Master:
    """One mooncake_master on 127.0.0.1 (no HTTP metadata server: clients use P2PHANDSHAKE)."""

    #: every master started in this process, so a failed test can show the log of one that died
    started: list[Master] = []

    def __init__(self, log_dir: Path, extra: list[str] | None = None) -> None:
        # drawn together: two draws in a row once gave both the same port (ascendstore.loopback)
        self.port, self.metrics_port = free_ports(2)
        self.extra = extra or []
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.ended_by_us = False  # kill() or stop(): an exit the test asked for
        self.reported = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "master already running"
        self.starts += 1
        self.ended_by_us = False
        if self not in Master.started:
            Master.started.append(self)
        self.log_path = self.log_dir / f"master-{self.port}-{self.starts}.log"
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                MASTER_BIN,
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                *self.extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}:\n{self.log_tail()}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.02)
        raise RuntimeError("mooncake_master did not open its port within 10 s")

    def log_tail(self, lines: int = 8) -> str:
        """The master's last log lines (its own periodic metrics lines left out)."""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join([line for line in text if "Master Admin Metrics" not in line][-lines:])

    def capacity_bytes(self) -> int:
        """Bytes of the segments mounted on this master now (its metrics endpoint, loopback).

        A restarted master knows no segment until each client re-mounts its own, which a
        Mooncake client does on its next heartbeat after it reconnects (1 s apart), so
        until then every put fails for want of space.
        """
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "master_total_capacity_bytes":
                    return int(sample.value)
        raise RuntimeError(f"{url} reports no master_total_capacity_bytes")

    def died(self) -> bool:
        """Exited without a test asking it to (a crash, or a port it could not bind)."""
        return self.proc is not None and self.proc.poll() is not None and not self.ended_by_us

    def kill(self) -> None:
        self.ended_by_us = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        self.ended_by_us = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()


def payload(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def region(arr: np.ndarray, start: int = 0, length: int | None = None) -> Region:
    length = arr.nbytes - start if length is None else length
    return Region(arr.ctypes.data + start, length)
