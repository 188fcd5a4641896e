"""The local pool's /dev/shm segment in transparent huge pages.

The pool asks for huge pages on its mapping (``madvise``); whether it gets them is the
tmpfs's ``huge=`` mount option. Real pages: each test runs its pool in processes of a
private mount namespace (``unshare -m``) with a tmpfs of its own over /dev/shm, mounted
``huge=advise`` (grants huge pages to mappings that ask) or ``huge=never``, so the host's
/dev/shm is never touched. Root only; skipped where the host does not allow it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

MiB = 1 << 20
CAPACITY = 32 * MiB

#: one process creates the pool (prefaulted), writes and reads 4 MiB; a second one
#: attaches to it and reads the same object; each reports what pages it maps
_PROGRAM = textwrap.dedent("""
    import hashlib, json, subprocess, sys
    import numpy as np
    from ascendstore.contract import BackendContext, Region, Status
    from ascendstore.local.backend import LocalBackend
    from ascendstore.local.options import LocalOptions

    def collapse_works():
        # whether this kernel makes a 2 MiB page of a /dev/shm file on request
        # (MADV_COLLAPSE, Linux 6.1+), asked with a file and mapping of its own
        import ctypes, mmap, os, tempfile
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fd, path = tempfile.mkstemp(dir="/dev/shm")
        try:
            os.ftruncate(fd, 2 << 20)
            span = libc.mmap(None, 4 << 20, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
            at = (span + (2 << 20) - 1) & ~((2 << 20) - 1)
            assert libc.mmap(at, 2 << 20, 3, mmap.MAP_SHARED | 0x10, fd, 0) == at  # MAP_FIXED
            ctypes.c_char.from_address(at).value = b"x"
            return libc.madvise(at, 2 << 20, 25) == 0
        finally:
            os.close(fd)
            os.unlink(path)

    prefault = sys.argv[1] == "create" and sys.argv[2] == "prefault"
    o = LocalOptions(name="thp-test", capacity={capacity}, prefault=prefault)
    be = LocalBackend.create(o, BackendContext())
    buf = np.zeros(4 << 20, dtype=np.uint8)
    if sys.argv[1] == "create":
        src = np.random.default_rng(5).integers(0, 256, buf.size, dtype=np.uint8)
        assert be.put(["k"], [[Region(src.ctypes.data, src.size)]], 5.0) == [Status.OK]
        other = json.loads(subprocess.run([sys.executable, __file__, "attach", "-"], capture_output=True,
                                          text=True, check=True).stdout)
    st = be.get(["k"], [[Region(buf.ctypes.data, buf.size)]], 5.0)
    p = be.dram_pages()
    out = dict(kind=p.kind, mount_huge=p.mount_huge, resident=p.resident_bytes, huge=p.huge_bytes,
               get=st[0].name, sha=hashlib.sha256(buf).hexdigest(), text=p.describe())
    if sys.argv[1] == "create":
        out.update(written=hashlib.sha256(src).hexdigest(), attached=other, collapsed=be._pool.collapsed,
                   collapse_works=collapse_works())
    print(json.dumps(out))
    be.close()
""")


def _thp_available() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a private mount namespace with its own /dev/shm)"
    if shutil.which("unshare") is None:
        return "needs unshare(1)"
    if not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        return "the kernel has no transparent huge pages"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False)
    if probe.returncode:
        return f"cannot make a mount namespace: {probe.stderr.decode().strip()}"
    return None


def _run(huge: str, tmp_path, prefault: bool = True) -> dict:
    prog = tmp_path / "thp_program.py"
    prog.write_text(_PROGRAM.format(capacity=CAPACITY))
    shell = (
        f"mount -t tmpfs -o huge={huge},size=256M tmpfs /dev/shm && "
        f"exec {sys.executable} {prog} create {'prefault' if prefault else 'lazy'}"
    )
    out = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", autouse=True)
def _needs_thp():
    why = _thp_available()
    if why:
        pytest.skip(why)


def test_a_tmpfs_that_grants_huge_pages_holds_the_pool_in_them_in_every_process(tmp_path):
    r = _run("advise", tmp_path)
    assert r["get"] == "OK" and r["sha"] == r["written"]
    assert r["kind"] == "thp" and r["mount_huge"] == "advise", r
    # prefaulted: the whole segment (capacity and its index) is resident, in 2 MiB pages (all of
    # it here; the kernel may give a fragmented host's parts in 4 KiB ones, hence half)
    assert r["resident"] >= CAPACITY and r["huge"] >= CAPACITY // 2, r["text"]
    other = r["attached"]  # a process that attached and read the object maps it in huge pages too
    assert other["get"] == "OK" and other["sha"] == r["written"]
    assert other["kind"] == "thp" and other["huge"] >= 2 * MiB, other["text"]


def test_a_tmpfs_mounted_huge_never_gives_a_lazy_pool_small_pages_and_says_how_to_change_it(tmp_path):
    r = _run("never", tmp_path, prefault=False)
    assert r["get"] == "OK" and r["sha"] == r["written"]
    assert not r["collapsed"]
    assert r["kind"] == "small" and r["huge"] == 0, r
    assert "huge=never" in r["text"] and "remount,huge=advise" in r["text"]
    assert r["attached"]["kind"] == "small" and r["attached"]["sha"] == r["written"]


def test_a_prefaulted_pool_on_a_tmpfs_mounted_huge_never_collapses_into_huge_pages_where_the_kernel_can(tmp_path):
    """The creator touches one page per 2 MiB and has the kernel make each such stretch one
    2 MiB page (MADV_COLLAPSE), on a segment mapped on a 2 MiB boundary: no operator
    setting needed. Where the kernel cannot (before 6.1, shmem_enabled=deny), 4 KiB pages."""
    r = _run("never", tmp_path)
    assert r["get"] == "OK" and r["sha"] == r["written"]
    assert r["resident"] >= CAPACITY, r
    if r["collapse_works"]:
        assert r["collapsed"] and r["kind"] == "thp" and r["huge"] >= CAPACITY // 2, r
        assert "huge=never" in r["text"] and "MADV_COLLAPSE" in r["text"], r["text"]
        other = r["attached"]  # a process that attached maps the same 2 MiB pages
        assert other["sha"] == r["written"] and other["kind"] == "thp" and other["huge"] >= 2 * MiB, other
    else:
        assert not r["collapsed"] and r["kind"] == "small" and r["huge"] == 0, r
