"""What a process holds: threads, open files, sockets, shared memory, RSS.

Used by the chaos suite to check that shutdown releases everything and that a
soak at constant load does not grow. Linux only (reads /proc and /dev/shm).
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from dataclasses import dataclass, field

import psutil

SHM_DIR = "/dev/shm"


def shm_entries(prefix: str = "") -> set[str]:
    """Names in /dev/shm starting with prefix (segments, semaphores)."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


def _fd_targets(pid: int) -> list[str]:
    base = f"/proc/{pid}/fd"
    out = []
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for n in names:
        try:
            out.append(os.readlink(f"{base}/{n}"))
        except OSError:
            continue  # closed while listing (the listing's own fd, a racing close)
    return out


def _kind(target: str) -> str:
    if target.startswith("socket:"):
        return "socket"
    if target.startswith(SHM_DIR + "/"):
        return "shm"
    if target.startswith("pipe:"):
        return "pipe"
    if target.startswith("anon_inode:"):
        return target.split(":", 1)[1].strip("[]")
    if target.startswith("/"):
        return "file"
    return "other"


@dataclass(frozen=True)
class ResourceSnapshot:
    pid: int
    rss_bytes: int
    threads: int  # OS threads (includes native ones: C++ clients, torch pools)
    thread_names: tuple[str, ...]  # Python threads alive
    fds: int
    fd_kinds: dict[str, int] = field(default_factory=dict)
    shm_maps: int = 0  # /dev/shm files mapped into the process
    shm_files: tuple[str, ...] = ()  # /dev/shm entries matching the watched prefix

    def growth(self, later: ResourceSnapshot) -> dict[str, int]:
        """later - self for the countable resources."""
        out = {
            "rss_bytes": later.rss_bytes - self.rss_bytes,
            "threads": later.threads - self.threads,
            "fds": later.fds - self.fds,
            "shm_maps": later.shm_maps - self.shm_maps,
            "shm_files": len(later.shm_files) - len(self.shm_files),
        }
        for k in set(self.fd_kinds) | set(later.fd_kinds):
            out[f"fd_{k}"] = later.fd_kinds.get(k, 0) - self.fd_kinds.get(k, 0)
        return out

    def new_threads(self, later: ResourceSnapshot) -> list[str]:
        """Python threads alive in later that were not in self (by name, with counts)."""
        before = Counter(self.thread_names)
        after = Counter(later.thread_names)
        return sorted((after - before).elements())

    def summary(self) -> str:
        kinds = " ".join(f"{k}={v}" for k, v in sorted(self.fd_kinds.items()))
        return (
            f"rss={self.rss_bytes / 2**20:.1f}MiB threads={self.threads} fds={self.fds} ({kinds}) "
            f"shm_maps={self.shm_maps} shm_files={len(self.shm_files)}"
        )


def _shm_maps(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            return len({line.split(None, 5)[5].strip() for line in f
                        if len(line.split(None, 5)) == 6 and SHM_DIR in line})
    except OSError:
        return 0


def snapshot(pid: int | None = None, shm_prefix: str = "ascendstore") -> ResourceSnapshot:
    """Resources held by ``pid`` (default: this process) right now."""
    pid = os.getpid() if pid is None else pid
    proc = psutil.Process(pid)
    targets = _fd_targets(pid)
    names: tuple[str, ...] = ()
    if pid == os.getpid():
        names = tuple(sorted(t.name for t in threading.enumerate()))
    return ResourceSnapshot(
        pid=pid,
        rss_bytes=proc.memory_info().rss,
        threads=proc.num_threads(),
        thread_names=names,
        fds=len(targets),
        fd_kinds=dict(Counter(_kind(t) for t in targets)),
        shm_maps=_shm_maps(pid),
        shm_files=tuple(sorted(shm_entries(shm_prefix))),
    )


def wait_for_threads(prefix: str, timeout_s: float = 5.0) -> list[str]:
    """Wait (bounded) until no Python thread named ``prefix*`` is alive; returns those left."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        left = [t.name for t in threading.enumerate() if t.name.startswith(prefix)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)
