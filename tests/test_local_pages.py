"""Reading which pages hold the local pool (ascendstore.local.pages) from /proc-format text;
the real pages are tested in test_local_thp.py (root) and test_local_hugetlbfs.py."""

from __future__ import annotations

import mmap
import os
import tempfile
import uuid

import numpy as np
import pytest

from ascendstore.contract import BackendContext
from ascendstore.local import pages
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions
from ascendstore.local.pages import (
    DramPages,
    dram_pages,
    frame_share,
    frames_visible,
    mapped_pages,
    mapping_span,
    mount_option,
    share_in_frames,
)

MOUNTS = """\
proc /proc proc rw,nosuid 0 0
tmpfs /dev tmpfs rw,size=65536k 0 0
tmpfs /dev/shm tmpfs rw,relatime,size=24683664k,huge=within_size 0 0
tmpfs /dev/shmx tmpfs rw,huge=always 0 0
tmpfs /mnt/my\\040pool tmpfs rw,huge=advise 0 0
"""

SMAPS = """\
7f0000000000-7f0004000000 rw-s 00000000 00:1a 12 /dev/shm/ascendstore-pool.a
Size:              65536 kB
Rss:               8192 kB
ShmemPmdMapped:     6144 kB
7f1000000000-7f1000200000 rw-s 00000000 00:1a 13 /dev/shm/ascendstore-pool.ab
Rss:               2048 kB
ShmemPmdMapped:     2048 kB
7f2000000000-7f2000400000 rw-s 00000000 00:1a 12 /dev/shm/ascendstore-pool.a (deleted)
Rss:               4096 kB
ShmemPmdMapped:        0 kB
7f3000000000-7f3000001000 r--p 00000000 00:00 0
Rss:                  4 kB
"""


def test_the_innermost_mount_holding_a_path_gives_the_option(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(MOUNTS)
    assert mount_option("/dev/shm/ascendstore-pool.a", "huge", str(mounts)) == "within_size"
    assert mount_option("/dev/shmx/p", "huge", str(mounts)) == "always"  # not /dev/shm's
    assert mount_option("/dev/other", "huge", str(mounts)) is None  # /dev: no huge= given
    assert mount_option("/mnt/my pool/x", "huge", str(mounts)) == "advise"  # escaped blank
    assert mount_option("/dev/shm/x", "size", str(mounts)) == "24683664k"
    assert mount_option("/dev/shm/x", "huge", str(tmp_path / "absent")) is None


def test_only_the_mappings_of_that_file_are_counted(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    # the ".a" mapping and its unlinked twin; not ".ab", not the anonymous one
    assert mapped_pages("/dev/shm/ascendstore-pool.a", str(smaps)) == (12288 << 10, 6144 << 10)
    assert mapped_pages("/dev/shm/none", str(smaps)) == (0, 0)


def test_a_pool_in_this_process_is_found_in_its_own_smaps():
    be = LocalBackend.create(
        LocalOptions(name=f"pg-{uuid.uuid4().hex[:8]}", capacity="8MiB", prefault=True), BackendContext()
    )
    try:
        p = be.dram_pages()
        assert p.path == "/dev/shm/" + be.shm_name
        assert p.resident_bytes >= 8 << 20  # prefaulted: the whole arena is resident
        assert p.kind in ("small", "thp") and p.describe()
        # mapped on a 2 MiB boundary, so the kernel can back it with 2 MiB pages (MADV_COLLAPSE)
        span = mapping_span(p.path)
        assert span is not None and span[0] % (2 << 20) == 0
    finally:
        be.close()


def test_a_large_pool_in_small_pages_says_at_start_up_how_to_get_huge_ones(monkeypatch, caplog):
    import ascendstore.local.backend as local_backend

    def opened(huge: str, capacity: str, **kw) -> list[str]:
        monkeypatch.setattr(local_backend, "tmpfs_huge", lambda path: huge)
        caplog.clear()
        with caplog.at_level("INFO", logger="ascendstore.local.backend"):
            be = LocalBackend.create(LocalOptions(name=f"pg-{uuid.uuid4().hex[:8]}", capacity=capacity, **kw),
                                     BackendContext())
            filler = be.huge_page_filler
            be.close()
        assert (filler is not None) == (huge == "never" and capacity == "1GiB" and kw.get("lazy_huge_pages", True))
        return [r.getMessage() for r in caplog.records if "4 KiB pages" in r.getMessage()]

    # sparse: nothing is touched but the index
    (hint,) = opened("never", "1GiB", lazy_huge_pages=False)
    assert "mount -o remount,huge=advise /dev/shm" in hint and "hugetlbfs" in hint
    assert "lazy_huge_pages: true" in hint
    assert opened("never", "1GiB") == []  # its creator makes 2 MiB pages as it fills (test_local_hugefill.py)
    assert opened("advise", "1GiB") == []  # huge pages granted: nothing to say
    assert opened("never", "64MiB") == []  # a small pool: not worth a line


def _entries(pfns: list[int | None]) -> np.ndarray:
    """pagemap entries: a frame number with bit 63 (present) set, or 0 for a page not resident."""
    return np.array([0 if p is None else (1 << 63) | p for p in pfns], dtype=np.uint64)


def test_neighbours_in_one_2mib_frame_are_counted():
    assert share_in_frames(_entries(list(range(512 * 7, 512 * 7 + 64)))) == (63, 63)  # contiguous
    # every page from another frame: what a fragmented host hands a fresh mapping
    assert share_in_frames(_entries([512 * i + 3 for i in range(64)])) == (63, 0)
    # two contiguous halves in frames far apart: one pair of 63 crosses
    assert share_in_frames(_entries(list(range(512, 544)) + list(range(512 * 40, 512 * 40 + 32)))) == (63, 62)
    # every other page of one frame (the rest held by another process) still shares it
    assert share_in_frames(_entries(list(range(0, 128, 2)))) == (63, 63)
    # pages not resident are left out, neither a break nor a neighbour
    assert share_in_frames(_entries([1024, 1025, None, 9000, 9001])) == (2, 2)
    # frame numbers hidden (not root): every resident page reads frame 0
    assert share_in_frames(_entries([0, 0, 0])) == (0, 0)


def _pagemap(tmp_path, pfns: list[int | None]) -> str:
    path = tmp_path / "pagemap"
    path.write_bytes(_entries(pfns).tobytes())
    return str(path)


def test_frame_share_reads_a_mapping_whole_or_in_windows(tmp_path):
    scattered = [512 * i for i in range(4096)]
    assert frame_share(0, 4096 * 4096, pagemap=_pagemap(tmp_path, scattered)) == 0.0
    contiguous = _pagemap(tmp_path, list(range(4096)))
    assert frame_share(0, 4096 * 4096, pagemap=contiguous) == pytest.approx(1 - 7 / 4095)  # 8 frames
    # a larger mapping is read in windows of a frame's pages: pairs across windows are not counted
    assert frame_share(0, 4096 * 4096, sample_pages=1024, pagemap=contiguous) == 1.0
    assert pages._windows(0, 4096 * 4096, 1024) == [(0, 512), (2048, 512)]
    assert pages._windows(4096 * 3, 100, 1024) == [(3, 1)]
    # too few resident pages to tell, or hidden frame numbers: no figure
    assert frame_share(0, 4096 * 64, pagemap=contiguous) is None
    assert frame_share(0, 4096 * 4096, pagemap=_pagemap(tmp_path, [0] * 4096)) is None
    assert frame_share(0, 4096, pagemap=str(tmp_path / "absent")) is None


def test_the_mapping_of_a_segment_is_found_by_its_path(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(SMAPS)
    assert mapping_span("/dev/shm/ascendstore-pool.a", str(maps)) == (0x7F0000000000, 0x4000000)  # the largest
    assert mapping_span("/dev/shm/ascendstore-pool.ab", str(maps)) == (0x7F1000000000, 0x200000)
    assert mapping_span("/dev/shm/none", str(maps)) is None


def test_scattered_pages_are_named_with_what_to_do():
    def said(share: float | None) -> str:
        return DramPages("small", "/dev/shm/ascendstore-pool.a", "never", 8 << 20, 0, share).describe()

    assert "scattered" in said(0.1) and "compact_memory" in said(0.1) and "0.10 of neighbouring" in said(0.1)
    assert "scattered" not in said(0.95) and "0.95 of neighbouring" in said(0.95)
    assert "neighbouring" not in said(None)


def test_attaching_maps_only_pages_the_segment_holds(tmp_path):
    """``dram_pages`` in a process that only attached (doctor) maps in the pages the
    segment already holds, to read their frames, and allocates none."""
    fd, path = tempfile.mkstemp(prefix="ascendstore-test-pages-", dir="/dev/shm")
    try:
        os.ftruncate(fd, 16 << 20)
        with mmap.mmap(fd, 16 << 20) as writer:
            writer[: 6 << 20] = b"\1" * (6 << 20)  # the first 6 MiB held by the segment
        held = os.fstat(fd).st_blocks
        with mmap.mmap(fd, 16 << 20) as m:
            assert mapped_pages(path)[0] == 0  # attached: nothing mapped in yet
            p = dram_pages(path, on_hugetlbfs=False)
            assert os.fstat(fd).st_blocks == held  # nothing allocated
            assert mapped_pages(path)[0] == 6 << 20 == p.resident_bytes
            if frames_visible():
                assert p.frame_share is not None and 0.0 <= p.frame_share <= 1.0
            else:  # frame numbers hidden (not root, or a container without CAP_SYS_ADMIN)
                assert p.frame_share is None
            del m
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_pool_whose_pages_scattered_says_so_at_start_up(monkeypatch, caplog):
    import ascendstore.local.backend as local_backend

    def warned(share: float | None, lazy: bool = False) -> list[str]:
        # a pool in 4 KiB pages whose frames read ``share`` (a fragmented host: docs/local-backend.md)
        monkeypatch.setattr(local_backend, "dram_pages",
                            lambda path, on_hugetlbfs: DramPages("small", path, "never", 8 << 20, 0, share))
        monkeypatch.setattr(local_backend, "tmpfs_huge", lambda path: "never")
        monkeypatch.setattr(local_backend, "_PAGE_HINT_BYTES", 4 << 20)
        caplog.clear()
        with caplog.at_level("WARNING", logger="ascendstore.local.backend"):
            be = LocalBackend.create(LocalOptions(name=f"pg-{uuid.uuid4().hex[:8]}", capacity="8MiB",
                                                  lazy_huge_pages=lazy), BackendContext())
            be.destroy()
        return [r.getMessage() for r in caplog.records if "2 MiB frame" in r.getMessage()]

    (line,) = warned(0.05)
    assert "0.05" in line and "compact_memory" in line and "huge pages" in line
    assert warned(0.9) == [] and warned(None) == []
    # the creator's thread makes the pool 2 MiB pages as it fills: what it holds now says nothing
    assert warned(0.05, lazy=True) == []


def test_frame_numbers_are_seen_by_root_only(tmp_path):
    visible = frames_visible()
    if os.geteuid() != 0:
        assert not visible  # the kernel hides them from other users
    fake = tmp_path / "pagemap"
    fake.write_bytes(b"")  # nothing to read: not visible, no error
    assert frames_visible(str(fake)) is False


def test_no_small_pages_hint_for_a_pool_its_creator_had_made_of_2mib_pages(monkeypatch, caplog):
    """A prefaulted pool on /dev/shm mounted huge=never is in 2 MiB pages where the kernel
    collapses shmem (tests/test_local_thp.py): neither its creator nor a process that
    attaches says it is in 4 KiB pages."""
    import ascendstore.local.backend as local_backend

    if local_backend.tmpfs_huge("/dev/shm") != "never":
        pytest.skip("this host's /dev/shm grants huge pages itself")
    monkeypatch.setattr(local_backend, "_PAGE_HINT_BYTES", 4 << 20)
    name = f"pg-{uuid.uuid4().hex[:8]}"
    with caplog.at_level("INFO", logger="ascendstore.local.backend"):
        creator = LocalBackend.create(LocalOptions(name=name, capacity="8MiB", prefault=True), BackendContext())
        try:
            attached = LocalBackend.create(LocalOptions(name=name, capacity="8MiB", prefault=True), BackendContext())
            attached.close()
        finally:
            collapsed = creator._pool.collapsed
            creator.destroy()
    hints = [r.getMessage() for r in caplog.records if "4 KiB pages" in r.getMessage()]
    if collapsed:
        assert hints == []
    else:  # a kernel that cannot (before 6.1, or shmem_enabled=deny): both say so
        assert len(hints) == 2 and all("could not make 2 MiB pages" in h for h in hints)
