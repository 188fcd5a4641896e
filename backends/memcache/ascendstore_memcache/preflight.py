"""Checks run before the native client is touched.

MemCache's data path (``init(device_id, init_bm=True)``) needs the Ascend NPU
driver and CANN: MemFabric first reads the driver version file, then loads
``libascendcl.so`` from CANN. Measured on a machine without them: init returns
-1 after 0.6-2 s with a log line about the driver version, and a pure client
without a reachable meta service returns -1 after ~5 s. Checking first gives one
clear message instead, in milliseconds.
"""

from __future__ import annotations

import ctypes.util
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DRIVER_VERSION_FILE = "/usr/local/Ascend/driver/version.info"
INSTALL_HINT = (
    "Install the Ascend NPU driver and firmware (they provide {driver}) and the CANN toolkit "
    "(then `source <CANN>/set_env.sh`, which sets ASCEND_HOME_PATH and LD_LIBRARY_PATH); see "
    "https://www.hiascend.com/document for the versions matching memfabric-hybrid 1.3.0. "
    "On a machine without Ascend, use backend_config {{\"driver\": \"standin\"}} for tests, or "
    "init_bm=false for a lookup-only client."
)


@dataclass(frozen=True)
class Missing:
    what: str
    detail: str


def ascend_missing(
    env: Mapping[str, str] | None = None, driver_version_file: str = DRIVER_VERSION_FILE
) -> list[Missing]:
    """What the MemCache data path needs and this host lacks (empty: all present)."""
    env = os.environ if env is None else env
    missing: list[Missing] = []
    if not Path(driver_version_file).is_file():
        missing.append(Missing("Ascend NPU driver", f"{driver_version_file} not found"))
    home = env.get("ASCEND_HOME_PATH") or env.get("ASCEND_TOOLKIT_HOME")
    if not home:
        missing.append(Missing("CANN", "ASCEND_HOME_PATH is not set"))
    elif not Path(home).is_dir():
        missing.append(Missing("CANN", f"ASCEND_HOME_PATH={home} is not a directory"))
    if not _find_acl(home, env):
        missing.append(Missing("CANN runtime", "libascendcl.so not found (ASCEND_HOME_PATH/lib64, LD_LIBRARY_PATH)"))
    return missing


def _find_acl(home: str | None, env: Mapping[str, str]) -> bool:
    dirs = [os.path.join(home, sub) for sub in ("lib64", "runtime/lib64")] if home else []
    dirs += [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
    if any(Path(d, "libascendcl.so").is_file() for d in dirs):
        return True
    return ctypes.util.find_library("ascendcl") is not None


def missing_message(missing: list[Missing], driver_version_file: str = DRIVER_VERSION_FILE) -> str:
    items = "; ".join(f"{m.what}: {m.detail}" for m in missing)
    return (
        "the MemCache data path (init_bm=true) needs an Ascend driver and CANN, and this host "
        f"lacks them ({items}). " + INSTALL_HINT.format(driver=driver_version_file)
    )


def meta_service_reachable(host: str, port: int, timeout_s: float = 1.0) -> str | None:
    """None if something accepts TCP connections there, else the reason."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
