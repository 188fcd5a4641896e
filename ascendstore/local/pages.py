"""What pages hold the local pool's DRAM tier: 4 KiB ones, transparent huge pages, or hugetlbfs.

A 2 MiB get from a pool in 4 KiB pages runs 19-25% slower on the host measured than from
2 MiB pages, and its speed moves with the host (docs/benchmarking.md). The pool asks for
transparent huge pages on its /dev/shm mapping (``madvise``); whether it gets them is the
tmpfs mount's ``huge=`` option, an operator's setting, except that a prefaulted pool's
creator has the kernel make them on any mount (``MADV_COLLAPSE``, Linux 6.1+). This reports both, for
``ascendstore doctor`` and tests, from ``/proc/self/mounts`` and ``/proc/self/smaps``
(read on demand: a large process's smaps takes milliseconds, too slow for ``stats()``).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
from dataclasses import dataclass

import numpy as np

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
    #: on 4 KiB pages, how physically contiguous they are (``frame_share``) over a
    #: sample of the resident ones; None on huge pages or where it cannot be read
    frame_share: float | None = None

    def describe(self) -> str:
        mib = 1 << 20
        held = f"{self.huge_bytes // mib} of {self.resident_bytes // mib} MiB resident in huge pages"
        if self.kind == "hugetlbfs":
            return f"hugetlbfs huge pages ({self.path}): {held}"
        if self.kind == "thp" and self.mount_huge == "never":
            return f"2 MiB pages the pool had the kernel make (MADV_COLLAPSE; tmpfs huge=never): {held}"
        if self.kind == "thp":
            return f"transparent huge pages (tmpfs huge={self.mount_huge}): {held}"
        scattered = ""
        if self.frame_share is not None:
            scattered = f", {self.frame_share:.2f} of neighbouring pages in one 2 MiB frame"
            if self.frame_share < SCATTERED_BELOW:
                scattered += (
                    " (scattered: the host's free memory was fragmented when the pool was created, and "
                    "copies measured up to 2x slower than on contiguous pages; create it after "
                    "`echo 1 > /proc/sys/vm/compact_memory`)"
                )
        return (
            f"4 KiB pages{scattered} (the tmpfs of {os.path.dirname(self.path)} is mounted huge={self.mount_huge}; "
            "`mount -o remount,huge=advise` it, or set hugetlbfs, for 2 MiB pages)"
        )


#: 4 KiB pages per 2 MiB frame
FRAME_PAGES = 512
#: a ``frame_share`` below this is reported as scattered (on the VM measured: 0.6-1.0 just
#: after compaction, 0.4-0.9 as found, 0.0 with free memory fragmented on purpose;
#: docs/benchmarking.md)
SCATTERED_BELOW = 0.5
#: pagemap entries read at most: windows of a frame's pages spread over a larger mapping
SAMPLE_PAGES = 1 << 15
#: fewer neighbouring resident pairs than this read tell nothing
_MIN_PAIRS = 256


def share_in_frames(entries: np.ndarray) -> tuple[int, int]:
    """(pairs of neighbouring pages both resident, of those in one 2 MiB frame) among
    pagemap entries (uint64: bit 63 present, bits 0-54 the frame number, which reads 0
    where the kernel hides it: then (0, 0))."""
    present = ((entries >> np.uint64(63)) & np.uint64(1)).astype(bool)
    pfn = entries & np.uint64((1 << 55) - 1)
    if not pfn[present].any():
        return 0, 0
    both = present[1:] & present[:-1]
    frames = pfn // np.uint64(FRAME_PAGES)
    return int(np.count_nonzero(both)), int(np.count_nonzero(both & (frames[1:] == frames[:-1])))


def _windows(addr: int, nbytes: int, sample_pages: int) -> list[tuple[int, int]]:
    """(first page, pages) of the windows to read: the whole mapping, or windows of a
    frame's worth of pages spread evenly over it."""
    first, count = addr // 4096, -(-(addr % 4096 + nbytes) // 4096)
    if count <= sample_pages:
        return [(first, count)]
    n = max(1, sample_pages // FRAME_PAGES)
    step = count // n
    return [(first + i * step, FRAME_PAGES) for i in range(n)]


def frames_visible(pagemap: str = "/proc/self/pagemap") -> bool:
    """Whether this process reads physical frame numbers (CAP_SYS_ADMIN: root outside a
    container that drops it); without them ``frame_share`` is always None."""
    probe = np.ones(1, dtype=np.uint8)  # resident: just written
    try:
        with open(pagemap, "rb") as f:
            f.seek(probe.ctypes.data // 4096 * 8)
            entry = int.from_bytes(f.read(8), "little")
    except OSError:
        return False
    return bool(entry >> 63) and bool(entry & ((1 << 55) - 1))


def frame_share(addr: int, nbytes: int, sample_pages: int = SAMPLE_PAGES,
                pagemap: str = "/proc/self/pagemap") -> float | None:
    """The share of a mapping's resident 4 KiB pages whose neighbour sits in the same
    2 MiB physical frame: 1.0 when physically contiguous (as a huge page is), near 0
    when every page came from somewhere else. None where the frame numbers are hidden
    (they need CAP_SYS_ADMIN) or too few pages are resident to tell.

    Why it matters: a fresh mapping's 4 KiB pages come from wherever the host's free
    memory is, and on a fragmented host they scatter. On the KVM guest measured, the
    pool's 64 KiB puts and gets ran at 14 and 11.5 GB/s on pages with a share of 0.0
    against 24 and 22.5 at 0.9-1.0 (docs/local-backend.md)."""
    pairs = same = 0
    try:
        with open(pagemap, "rb") as f:
            for page, count in _windows(addr, nbytes, sample_pages):
                f.seek(page * 8)
                got = share_in_frames(np.frombuffer(f.read(count * 8), dtype=np.uint64))
                pairs, same = pairs + got[0], same + got[1]
    except (OSError, ValueError):
        return None
    return same / pairs if pairs >= _MIN_PAIRS else None


def map_resident(addr: int, nbytes: int, sample_pages: int = SAMPLE_PAGES) -> None:
    """Map into this process the pages of ``frame_share``'s windows that the segment
    already holds (``mincore``), so their frames can be read from a process that only
    attached (``ascendstore doctor``); a page not held is left alone, since touching
    it would allocate it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    for page, count in _windows(addr, nbytes, sample_pages):
        vec = (ctypes.c_ubyte * count)()
        if libc.mincore(ctypes.c_void_p(page * 4096), count * 4096, vec):
            return
        held = np.flatnonzero(np.frombuffer(vec, dtype=np.uint8) & 1)
        if held.size:  # one byte read from each held page maps it (numpy's loop, not Python's)
            window = np.ctypeslib.as_array((ctypes.c_ubyte * (count * 4096)).from_address(page * 4096))
            int(window[held * 4096].sum())


def mapping_span(path: str, maps: str = "/proc/self/maps") -> tuple[int, int] | None:
    """(start, length) of this process's largest mapping of ``path`` (its unlinked twin too)."""
    best: tuple[int, int] | None = None
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n").removesuffix(" (deleted)") == path:
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    if best is None or hi - lo > best[1]:
                        best = (lo, hi - lo)
    except OSError:
        return None
    return best


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


#: madvise(2) advice that has the kernel make 2 MiB pages of a range now (Linux 6.1+)
MADV_COLLAPSE = 25
#: mmap(2)'s flag to map at the address given (Python's mmap module does not name it)
_MAP_FIXED = 0x10


def collapse_works(directory: str = "/dev/shm") -> bool:
    """Whether this kernel makes a 2 MiB page of a file under ``directory`` on request
    (``MADV_COLLAPSE``: Linux 6.1+, and tmpfs huge pages not turned off with
    ``shmem_enabled`` ``deny``), asked of a 2 MiB file and a mapping of its own: what a
    pool relies on for 2 MiB pages where the tmpfs is mounted ``huge=never``."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    huge = 2 << 20
    fd, path = tempfile.mkstemp(dir=directory)
    span = None
    try:
        os.ftruncate(fd, huge)
        # 4 MiB reserved, then the file mapped over its 2 MiB-aligned middle (MAP_FIXED)
        span = libc.mmap(None, 2 * huge, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if span in (None, ctypes.c_void_p(-1).value):
            return False
        at = (span + huge - 1) & ~(huge - 1)
        if libc.mmap(at, huge, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd, 0) != at:
            return False
        ctypes.c_char.from_address(at).value = b"x"
        return libc.madvise(at, huge, MADV_COLLAPSE) == 0
    finally:
        if span not in (None, ctypes.c_void_p(-1).value):
            libc.munmap(span, 2 * huge)
        os.close(fd)
        os.unlink(path)


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
    span = mapping_span(path)
    if span is not None:
        map_resident(*span)
    resident, huge = mapped_pages(path)
    # what the mapping holds; with nothing resident yet, what the mount will give
    kind = "thp" if huge or (not resident and option in _GIVES_HUGE) else "small"
    share = frame_share(*span) if span is not None and kind == "small" else None
    return DramPages(kind, path, option, resident, huge, share)
