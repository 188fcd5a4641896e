"""Reading which pages hold the local pool (ascendstore.local.pages) from /proc-format text;
the real pages are tested in test_local_thp.py (root) and test_local_hugetlbfs.py."""

from __future__ import annotations

import uuid

from ascendstore.contract import BackendContext
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions
from ascendstore.local.pages import mapped_pages, mount_option

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
    finally:
        be.close()


def test_a_large_pool_in_small_pages_says_at_start_up_how_to_get_huge_ones(monkeypatch, caplog):
    import ascendstore.local.backend as local_backend

    def opened(huge: str, capacity: str) -> list[str]:
        monkeypatch.setattr(local_backend, "tmpfs_huge", lambda path: huge)
        caplog.clear()
        with caplog.at_level("INFO", logger="ascendstore.local.backend"):
            be = LocalBackend.create(LocalOptions(name=f"pg-{uuid.uuid4().hex[:8]}", capacity=capacity),
                                     BackendContext())
            be.close()
        return [r.getMessage() for r in caplog.records if "4 KiB pages" in r.getMessage()]

    (hint,) = opened("never", "1GiB")  # sparse: nothing is touched but the index
    assert "mount -o remount,huge=advise /dev/shm" in hint and "hugetlbfs" in hint
    assert opened("advise", "1GiB") == []  # huge pages granted: nothing to say
    assert opened("never", "64MiB") == []  # a small pool: not worth a line
