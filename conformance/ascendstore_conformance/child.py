"""Another process opening the same store, by name and config, as a vLLM
worker on the same node would. Takes a JSON request as its argument, prints a
JSON answer on stdout.

    {"spec": {...BackendFactory.spec()...}, "op": "read", "keys": [...], "sizes": [...]}
    {"spec": {...}, "op": "write_versions", "key": K, "size": N, "writer": W, "seconds": S, "max_count": C}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from ascendstore.contract import Backend, Status
from ascendstore_conformance.factory import BackendFactory
from ascendstore_conformance.harness import Buffer, digest, versioned


def _read(backend: Backend, req: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    keys, sizes = req["keys"], req["sizes"]
    bufs = [Buffer(n) for n in sizes]
    backend.register([b.base for b in bufs])
    exists = backend.exists(keys, timeout_s)
    got = backend.get(keys, [[b.region] for b in bufs], timeout_s)
    return {
        "exists": [s.name for s in exists],
        "get": [s.name for s in got],
        "digests": [digest(b.read()) if s is Status.OK else None for s, b in zip(got, bufs, strict=True)],
    }


def _write_versions(backend: Backend, req: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    buf = Buffer(req["size"])
    backend.register([buf.base])
    statuses: list[str] = []
    end = time.monotonic() + req["seconds"]
    seq = 0
    while time.monotonic() < end and seq < req["max_count"]:
        seq += 1
        buf.write(versioned(req["writer"], seq, req["size"]))
        statuses.append(backend.put([req["key"]], [[buf.region]], timeout_s)[0].name)
    return {"statuses": statuses, "last_seq": seq}


def main() -> None:
    req = json.loads(sys.argv[1])
    spec = req["spec"]
    factory = BackendFactory.from_spec(spec)
    backend = factory.open(small=spec.get("small", False), rank=1)
    try:
        op = {"read": _read, "write_versions": _write_versions}[req["op"]]
        answer = op(backend, req, spec["timeout_s"])
    finally:
        backend.close()
    print(json.dumps(answer))


class Child:
    """A child process run with this process's import path, so backends defined
    in a test module are importable by their module:Class name. Its output goes
    to files: a chatty backend library can never block it on a full pipe."""

    def __init__(self, request: Mapping[str, Any]) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self._out = tempfile.TemporaryFile("w+")
        self._err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ascendstore_conformance.child", json.dumps(request)],
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=self._err,
            text=True,
            env=env,
        )

    def running(self) -> bool:
        return self.proc.poll() is None

    def finish(self, timeout_s: float) -> dict[str, Any]:
        """The child's answer; kills it (and fails) if it overruns."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the other process did not finish within {timeout_s} s") from None
        finally:
            self._out.seek(0)
            self._err.seek(0)
            out, err = self._out.read(), self._err.read()
            self._out.close()
            self._err.close()
        if self.proc.returncode != 0:
            raise AssertionError(f"the other process failed (exit {self.proc.returncode}):\n{err[-4000:]}")
        return json.loads(out.strip().splitlines()[-1])


def run_child(request: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    return Child(request).finish(timeout_s)


if __name__ == "__main__":
    main()
