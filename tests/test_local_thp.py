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

from ascendstore.local.pages import collapse_works

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
    from ascendstore.local.pages import collapse_works

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


#: a 1 GiB pool, not prefaulted: its creator puts objects of random bytes while its
#: thread makes 2 MiB pages ahead of the fill, and a second process attached to it puts
#: objects of its own at the same time; every object is then read back in both
_LAZY_PROGRAM = textwrap.dedent("""
    import hashlib, json, subprocess, sys
    import numpy as np
    from ascendstore.contract import BackendContext, Region, Status
    from ascendstore.local.backend import LocalBackend
    from ascendstore.local.options import LocalOptions

    role, lazy = sys.argv[1], sys.argv[2] == "lazy"
    be = LocalBackend.create(LocalOptions(name="thp-lazy", capacity="1GiB", lazy_huge_pages=lazy),
                             BackendContext())
    sizes = [64 << 10, 192 << 10, 4 << 20, 1 << 20]  # whole pages and objects that span stretches

    def objects(seed, n):
        rng = np.random.default_rng(seed)
        return {{f"{{seed}}/{{i}}": rng.integers(0, 256, sizes[i % 4], dtype=np.uint8) for i in range(n)}}

    def put_all(objs):
        for k, v in objs.items():
            assert be.put([k], [[Region(v.ctypes.data, v.size)]], 5.0) == [Status.OK], k

    def read_all(objs):
        bad = []
        for k, v in objs.items():
            out = np.empty_like(v)
            st = be.get([k], [[Region(out.ctypes.data, out.size)]], 5.0)
            if st != [Status.OK] or not np.array_equal(out, v):
                bad.append((k, st[0].name))
        return bad

    mine = objects(1 if role == "create" else 2, {n})
    if role == "create":
        if be.huge_page_filler is not None:  # (its thread took the role before the other process starts)
            assert be.huge_page_filler.caught_up(60.0)
        other = subprocess.Popen([sys.executable, __file__, "attach", sys.argv[2]], stdout=subprocess.PIPE, text=True)
        put_all(mine)
        attached = json.loads(other.communicate(timeout=120)[0])
        filler = be.huge_page_filler
        caught_up = filler.caught_up(60.0) if filler is not None else None
        p = be.dram_pages()
        out = dict(bad=read_all(mine) + read_all(objects(2, {n})), attached=attached, caught_up=caught_up,
                   made=filler.made if filler is not None else 0, collapsed=be._pool.collapsed, kind=p.kind,
                   resident=p.resident_bytes, huge=p.huge_bytes, text=p.describe(),
                   segment=be.stats()["shm_resident_bytes"])
        print(json.dumps(out))
    else:
        put_all(mine)
        f = be.huge_page_filler
        print(json.dumps(dict(bad=read_all(mine), filler=f is not None, filling=f is not None and f.filling,
                              made=f.made if f is not None else 0)))
    be.close()
""")


def _run_lazy(tmp_path, lazy: bool, n: int = 60) -> dict:
    prog = tmp_path / "thp_lazy_program.py"
    prog.write_text(_LAZY_PROGRAM.format(n=n))
    shell = (
        "mount -t tmpfs -o huge=never,size=2G tmpfs /dev/shm && "
        f"exec {sys.executable} {prog} create {'lazy' if lazy else 'off'}"
    )
    out = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_pool_not_prefaulted_is_made_2_mib_pages_as_it_fills_and_every_byte_stays(tmp_path):
    """lazy_huge_pages (the default): the creator's thread has the kernel make 2 MiB
    pages just ahead of the fill while the creator and an attached process put objects;
    every object reads back exact in both, the pool holds little more than it uses (the
    thread does not commit the capacity), and most of it is in 2 MiB pages."""
    r = _run_lazy(tmp_path, lazy=True)
    assert r["bad"] == [] and r["attached"]["bad"] == [], r
    # the attached process runs a thread too, but the creator's did the work (one at a time)
    assert r["attached"]["filler"] and not r["attached"]["filling"] and r["attached"]["made"] == 0, r
    mib = 1 << 20
    used = 2 * 60 * (64 + 192 + 4096 + 1024) // 4 * 1024  # both processes' objects, in bytes
    assert r["segment"] < used + 64 * mib, r  # a 1 GiB pool: memory still taken as used
    if collapse_works():
        assert r["caught_up"] and r["made"] >= used // (2 * mib) // 2 and r["collapsed"], r
        assert r["kind"] == "thp" and r["huge"] >= r["resident"] * 3 // 4, r
        assert "MADV_COLLAPSE" in r["text"], r["text"]
    else:
        assert r["kind"] == "small" and r["huge"] == 0, r


def test_lazy_huge_pages_off_leaves_a_pool_in_4_kib_pages(tmp_path):
    r = _run_lazy(tmp_path, lazy=False, n=12)
    assert r["bad"] == [] and r["attached"]["bad"] == [], r
    assert r["caught_up"] is None and r["made"] == 0 and not r["collapsed"], r
    assert not r["attached"]["filler"], r
    assert r["kind"] == "small" and r["huge"] == 0, r
