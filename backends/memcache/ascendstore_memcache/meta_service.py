"""Run MemCache's meta service, in the foreground or as a managed child.

The meta service holds the pool's metadata; every client connects to it. It
runs anywhere (no Ascend needed). MemCache allows one per host: it takes a
lock file in /tmp (``mmc_meta_service.lock``), whatever TMPDIR says.

    ascendstore-memcache-meta --config /etc/mmc/mmc-meta.conf
    ascendstore-memcache-meta --backend-config '{"meta_service_url": "tcp://10.0.0.1:5000"}'
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from ascendstore_memcache import conf
from ascendstore_memcache.options import MemcacheOptions
from ascendstore_memcache.preflight import meta_service_reachable

LOCK_HELD = "lock file is locked"


class MetaServiceError(RuntimeError):
    pass


def serve(meta_conf: Path) -> int:
    """Run the meta service in this process until it is signalled."""
    os.environ[conf.META_ENV] = str(meta_conf)
    import memcache_hybrid

    # main() without setup() reads $MMC_META_CONFIG_PATH: the whole file applies.
    return int(memcache_hybrid.MetaService.main())


class MetaServiceProcess:
    """A meta service child process: started, waited for, stopped (bounded)."""

    def __init__(self, meta_conf: str | os.PathLike[str], log_file: str | os.PathLike[str]) -> None:
        self.meta_conf = Path(meta_conf)
        self.values = conf.read_conf(self.meta_conf, "mmc-meta.conf")
        self.url = self.values.get("ock.mmc.meta_service_url", "tcp://127.0.0.1:5000")
        self.log_file = Path(log_file)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout_s: float = 20.0) -> MetaServiceProcess:
        host, port = conf.tcp_endpoint(self.url)
        if meta_service_reachable(host, port, 0.2) is None:
            raise MetaServiceError(f"something already listens at {self.url}; stop it or pick another port")
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ascendstore_memcache.meta_service", "--config", str(self.meta_conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        end = time.monotonic() + ready_timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                text = self.log_file.read_text(errors="replace")
                why = (
                    "another meta service holds /tmp/mmc_meta_service.lock (one per host)"
                    if LOCK_HELD in text
                    else f"exit code {self.proc.returncode}"
                )
                raise MetaServiceError(f"meta service at {self.url} did not start: {why}; log {self.log_file}")
            if meta_service_reachable(host, port, 0.2) is None:
                return self
            time.sleep(0.05)
        self.stop()
        raise MetaServiceError(f"meta service at {self.url} not accepting after {ready_timeout_s}s; log {self.log_file}")

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def __enter__(self) -> MetaServiceProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *_: object) -> None:
        self.stop()


app = typer.Typer(add_completion=False, help=__doc__)


@app.command()
def run(
    config: Annotated[Path | None, typer.Option(help="mmc-meta.conf (default: $MMC_META_CONFIG_PATH)")] = None,
    backend_config: Annotated[
        str | None, typer.Option(help="JSON of the memcache backend_config to generate the file from")
    ] = None,
    instance_id: Annotated[str, typer.Option(help="names the generated conf directory")] = "meta",
) -> None:
    """Run the MemCache meta service in the foreground."""
    if config is None:
        opts = MemcacheOptions.model_validate(json.loads(backend_config) if backend_config else {})
        config = conf.resolve(opts, instance_id).meta_path
        typer.echo(f"meta service config: {config}", err=True)
    raise typer.Exit(serve(config))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
