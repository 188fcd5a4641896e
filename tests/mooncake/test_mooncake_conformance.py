"""The conformance suite (ascendstore_conformance) against the Mooncake backend and a real master."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.mooncake


def _config(master) -> dict:
    return {
        "master_server_address": master.address,
        "local_hostname": "127.0.0.1",
        "global_segment_size": "64MB",
        "local_buffer_size": "8MB",
    }


def test_conformance_suite_passes(master_factory, tmp_path) -> None:
    pytest.importorskip("ascendstore_conformance", reason="install conformance/ (make setup)")
    main, small = master_factory(), master_factory()
    small_cfg = {**_config(small), "global_segment_size": "16MB"}
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
        "-p", "ascendstore_conformance.plugin", "--pyargs", "ascendstore_conformance",
        "--backend", "mooncake",
        "--backend-config", json.dumps(_config(main)),
        "--backend-small-config", json.dumps(small_cfg),
        # lets the suite write our largest object (half the 64 MiB segment) and one byte more
        "--backend-max-test-bytes", str(64 << 20),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=270)
    report = "\n".join(
        line for line in (proc.stdout + proc.stderr).splitlines() if not (line[:1] in "IW" and line[1:5].isdigit())
    )
    assert proc.returncode == 0, report[-6000:]
    # print the suite's summary (passed/skipped with reasons, performance table) into our log
    print(report[-3000:])
