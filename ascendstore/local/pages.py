"""What pages hold the local pool's DRAM tier: 4 KiB ones, transparent huge pages, or hugetlbfs.

A 2 MiB get from a pool in 4 KiB pages runs 19-25% slower on the host measured than from
2 MiB pages, and its speed moves with the host (docs/benchmarking.md). The pool asks for
transparent huge pages on its /dev/shm mapping (``madvise``); whether it gets them is the
tmpfs mount's ``huge=`` option, an operator's setting. This reports both, for
``ascendstore doctor`` and tests, from ``/proc/self/mounts`` and ``/proc/self/smaps``
(read on demand: a large process's smaps takes milliseconds, too slow for ``stats()``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: what ``huge=`` means for a tmpfs pool that asks for huge pages (the kernel's tmpfs options)
_GIVES_HUGE = {"always", "within_size", "advise"}


@dataclass(frozen=True)
class DramPages:
    """The pages of one open pool's segment, as this process maps it."""

    #: "hugetlbfs" (reserved huge pages), "thp" (transparent huge pages: some of the
    #: segment is in them, or nothing is resident yet and the tmpfs grants them) or
    #: "small" (4 KiB pages only)
    kind: str
    #: the segment's file
    path: str
    #: the tmpfs mount's huge= option ("never" when not given; "" on hugetlbfs)
    mount_huge: str
    #: bytes of the segment this process has mapped in, and of those in huge pages
    resident_bytes: int
    huge_bytes: int

    def describe(self) -> str:
        mib = 1 << 20
        held = f"{self.huge_bytes // mib} of {self.resident_bytes // mib} MiB resident in huge pages"
        if self.kind == "hugetlbfs":
            return f"hugetlbfs huge pages ({self.path}): {held}"
        if self.kind == "thp":
            return f"transparent huge pages (tmpfs huge={self.mount_huge}): {held}"
        return (
            f"4 KiB pages (the tmpfs of {os.path.dirname(self.path)} is mounted huge={self.mount_huge}; "
            "`mount -o remount,huge=advise` it, or set hugetlbfs, for 2 MiB pages)"
        )


def mount_option(path: str, option: str, mounts: str = "/proc/self/mounts") -> str | None:
    """``option``'s value on the mount holding ``path`` (None if absent or unknown)."""
    best, opts = "", ""
    try:
        with open(mounts) as f:
            for line in f:
                fields = line.split()
                if len(fields) < 4:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):  # the last, innermost mount wins
                    best, opts = point, fields[3]
    except OSError:
        return None
    for opt in opts.split(","):
        name, _, value = opt.partition("=")
        if name == option:
            return value
    return None


def tmpfs_huge(path: str) -> str:
    """The ``huge=`` of the tmpfs holding ``path`` ("never", the kernel's default, when not given)."""
    return mount_option(path, "huge") or "never"


def mapped_pages(path: str, smaps: str = "/proc/self/smaps") -> tuple[int, int]:
    """(resident bytes, bytes in huge pages) of this process's mappings of ``path``."""
    resident = huge = 0
    mine = False
    try:
        with open(smaps) as f:
            for line in f:
                head = line.split(maxsplit=5)
                if head and "-" in head[0] and not head[0].endswith(":"):
                    mine = len(head) == 6 and head[5].rstrip("\n").removesuffix(" (deleted)") == path
                elif mine and head[0] == "Rss:":
                    resident += int(head[1]) << 10
                elif mine and head[0] in ("ShmemPmdMapped:", "FilePmdMapped:"):
                    huge += int(head[1]) << 10
                elif mine and head[0] in ("Shared_Hugetlb:", "Private_Hugetlb:"):  # not in Rss
                    resident += int(head[1]) << 10
                    huge += int(head[1]) << 10
    except OSError:
        pass
    return resident, huge


def dram_pages(path: str, on_hugetlbfs: bool) -> DramPages:
    if on_hugetlbfs:
        return DramPages("hugetlbfs", path, "", *mapped_pages(path))
    option = tmpfs_huge(path)
    resident, huge = mapped_pages(path)
    # what the mapping holds; with nothing resident yet, what the mount will give
    kind = "thp" if huge or (not resident and option in _GIVES_HUGE) else "small"
    return DramPages(kind, path, option, resident, huge)
