"""The local pool's DRAM tier on a hugetlbfs mount (``hugetlbfs``): huge pages
instead of /dev/shm's 4 KiB ones. Real huge pages: the module mounts a
hugetlbfs of its own and reserves pages for its tests (root only; skipped
where the host does not allow it), and gives both back at the end."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest
from hugetlbfs_helpers import free_pages as _free_pages
from hugetlbfs_helpers import hugetlbfs_mount

from ascendstore.contract import BackendContext, BackendSetupError, Region, Status
from ascendstore.local.backend import LocalBackend
from ascendstore.local.options import LocalOptions

MiB = 1 << 20
#: pages this module reserves (2 MiB each): room for two 16 MiB pools and their headers
PAGES = 24


@pytest.fixture(scope="module")
def mount(tmp_path_factory):
    with hugetlbfs_mount(tmp_path_factory.mktemp("hugetlbfs"), PAGES) as d:
        yield d


def _options(mount: str, **kw) -> LocalOptions:
    kw.setdefault("name", f"h-{uuid.uuid4().hex[:10]}")
    kw.setdefault("capacity", 16 * MiB)
    return LocalOptions(hugetlbfs=mount, **kw)


def _data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_objects_round_trip_through_huge_pages_and_the_file_goes_with_the_pool(mount):
    o = _options(mount)
    free = _free_pages()
    be = LocalBackend.create(o, BackendContext())
    try:
        path = os.path.join(mount, f"ascendstore-pool.{o.name}")
        assert os.path.exists(path) and not os.path.exists(f"/dev/shm/ascendstore-pool.{o.name}")
        assert free - _free_pages() >= 16 * MiB // (2 * MiB), "the arena is not in huge pages"
        srcs = [_data(n, i) for i, n in enumerate((3 * MiB, 64 << 10, 1))]
        keys = [f"k{i}" for i in range(len(srcs))]
        assert be.put(keys, [[Region(s.ctypes.data, s.size)] for s in srcs], 5.0) == [Status.OK] * 3
        dsts = [np.zeros_like(s) for s in srcs]
        assert be.get(keys, [[Region(d.ctypes.data, d.size)] for d in dsts], 5.0) == [Status.OK] * 3
        assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts, strict=True))
        assert be.stats()["objects"] == 3
    finally:
        be.close()
    assert not os.path.exists(path), "the last close left the hugetlbfs file behind"
    assert _free_pages() == free


def test_another_process_reads_what_one_wrote(mount):
    o = _options(mount)
    be = LocalBackend.create(o, BackendContext())
    try:
        src = _data(2 * MiB, 7)
        assert be.put(["x"], [[Region(src.ctypes.data, src.size)]], 5.0) == [Status.OK]
        child = textwrap.dedent(f"""
            import hashlib, numpy as np
            from ascendstore.contract import BackendContext, Region
            from ascendstore.local.backend import LocalBackend
            from ascendstore.local.options import LocalOptions
            be = LocalBackend.create(LocalOptions(**{o.model_dump()!r}), BackendContext())
            buf = np.zeros({2 * MiB}, dtype=np.uint8)
            print(be.get(["x"], [[Region(buf.ctypes.data, buf.size)]], 5.0)[0].name, hashlib.sha256(buf).hexdigest())
            be.close()
        """)
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60, check=True)
        assert out.stdout.split() == ["OK", hashlib.sha256(src).hexdigest()]
        assert be.stats()["processes"] == 1  # the child detached; the pool stays for us
    finally:
        be.destroy()


def test_bad_mounts_and_too_few_pages_are_clear_errors_and_leave_nothing(mount, tmp_path):
    with pytest.raises(BackendSetupError, match=r"is not a hugetlbfs mount \(mount -t hugetlbfs none"):
        LocalBackend.create(_options(str(tmp_path)), BackendContext())
    with pytest.raises(BackendSetupError, match="No such file"):
        LocalBackend.create(_options(str(tmp_path / "absent")), BackendContext())
    big = _options(mount, capacity=(_free_pages() + 8) * 2 * MiB)
    with pytest.raises(BackendSetupError, match=r"reserve more huge pages \(vm.nr_hugepages"):
        LocalBackend.create(big, BackendContext())
    assert not os.listdir(mount), "a failed start left a file behind"


def test_a_pool_of_that_name_in_dev_shm_is_refused(mount):
    name = f"h-{uuid.uuid4().hex[:10]}"
    shm = LocalBackend.create(LocalOptions(name=name, capacity=4 * MiB), BackendContext())
    try:
        with pytest.raises(BackendSetupError, match="already exists in /dev/shm.*the same hugetlbfs"):
            LocalBackend.create(_options(mount, name=name), BackendContext())
    finally:
        shm.destroy()
