"""A hugetlbfs mount with huge pages reserved, for tests of the local pool on
huge pages: root only; skips the test where the host does not allow it, and
gives the pages and the mount back afterwards."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

NR = "/proc/sys/vm/nr_hugepages"


def free_pages() -> int:
    """Huge pages neither in use nor promised to a mapping (HugePages_Free - HugePages_Rsvd)."""
    info: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(("HugePages_Free:", "HugePages_Rsvd:")):
                info[line.split(":")[0]] = int(line.split()[1])
    return info.get("HugePages_Free", 0) - info.get("HugePages_Rsvd", 0)


@contextlib.contextmanager
def hugetlbfs_mount(where: Path, pages: int) -> Iterator[str]:
    """Mount a hugetlbfs at ``where`` with ``pages`` more huge pages reserved."""
    if os.geteuid() != 0:
        pytest.skip("hugetlbfs needs root (a mount, and pages reserved in vm.nr_hugepages)")
    with open(NR) as f:
        before = int(f.read())
    try:
        with open(NR, "w") as f:
            f.write(str(before + pages))
    except OSError as exc:
        pytest.skip(f"cannot reserve huge pages here ({NR}: {exc})")
    try:
        mounted = subprocess.run(["mount", "-t", "hugetlbfs", "none", str(where)], capture_output=True, text=True)
        if mounted.returncode:
            pytest.skip(f"cannot mount hugetlbfs here: {mounted.stderr.strip()}")
        try:
            if free_pages() < pages:
                pytest.skip(f"the host gave only {free_pages()} free huge pages")
            yield str(where)
        finally:
            subprocess.run(["umount", str(where)], check=False)
    finally:
        with open(NR, "w") as f:
            f.write(str(before))
