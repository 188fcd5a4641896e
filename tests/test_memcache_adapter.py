"""The memcache adapter's translation, driven against the STAND-IN.

The stand-in (``ascendstore_memcache.standin``) plays memcache_hybrid's API
and return codes (its fidelity to the real library is checked in
test_memcache_real.py where the real library runs). Here: copy directions,
layers, batch limits, leases, error mapping, timeouts, pure clients, sharing
across processes. Every transfer is checked byte for byte.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ascendstore_memcache import conf
from ascendstore_memcache.backend import MemcacheBackend
from ascendstore_memcache.codes import Mmc
from ascendstore_memcache.options import MemcacheOptions
from ascendstore_memcache.standin import G2H, G2L, H2G, L2G, StandinModule

from ascendstore.contract import BackendContext, BackendSetupError, Region, Status
from ascendstore.errors import ConfigError
from ascendstore.registry import create_backend


class Buf:
    """Host memory with a stable address."""

    def __init__(self, data: bytes | int) -> None:
        size = data if isinstance(data, int) else len(data)
        self.raw = ctypes.create_string_buffer(size)
        if not isinstance(data, int):
            ctypes.memmove(self.raw, data, size)
        self.addr = ctypes.addressof(self.raw)
        self.size = size

    def region(self, start: int = 0, length: int | None = None) -> Region:
        return Region(self.addr + start, self.size - start if length is None else length)

    def bytes(self) -> bytes:
        return self.raw.raw[: self.size]


def pattern(tag: int, size: int) -> bytes:
    return bytes((tag * 31 + i * 7) & 0xFF for i in range(size))


def config(tmp: Path, **extra: object) -> dict:
    return {
        "driver": "standin",
        "standin_path": str(tmp / "store"),
        "conf_dir": str(tmp / "conf"),
        "protocol": "host_tcp",
        "dram_size": "64MiB",
        **extra,
    }


def open_backend(tmp: Path, role: str = "worker", device_type: str = "cpu", **extra: object) -> MemcacheBackend:
    ctx = BackendContext(role=role, device_type=device_type, instance_id="t")
    b = create_backend("memcache", config(tmp, **extra), ctx)
    assert isinstance(b, MemcacheBackend)
    return b


@pytest.fixture
def backend(tmp_path: Path):
    b = open_backend(tmp_path)
    yield b
    b.close()


def test_layers_round_trip_byte_exact(backend: MemcacheBackend) -> None:
    # two keys, each with several non-touching regions (per-layer KV)
    srcs = [[Buf(pattern(k * 10 + layer, 1000 + layer)) for layer in range(5)] for k in range(2)]
    keys = ["model@k0", "model@k1"]
    assert backend.put(keys, [[b.region() for b in layers] for layers in srcs], 2) == [Status.OK] * 2
    dsts = [[Buf(b.size) for b in layers] for layers in srcs]
    assert backend.get(keys, [[b.region() for b in layers] for layers in dsts], 2) == [Status.OK] * 2
    for src, dst in zip(srcs, dsts, strict=True):
        assert [b.bytes() for b in dst] == [b.bytes() for b in src]


@pytest.mark.parametrize(
    ("device_type", "memory", "want"),
    [("cpu", "auto", (H2G, G2H)), ("npu", "auto", (L2G, G2L)), ("npu", "host", (H2G, G2H)), ("cpu", "device", (L2G, G2L))],
)
def test_copy_direction_follows_memory_kind(tmp_path: Path, device_type: str, memory: str, want: tuple) -> None:
    b = open_backend(tmp_path, device_type=device_type, memory=memory)
    try:
        src, dst = Buf(pattern(1, 64)), Buf(64)
        assert b.put(["d"], [[src.region()]], 2) == [Status.OK]
        assert b.get(["d"], [[dst.region()]], 2) == [Status.OK]
        st, gva = b.gva_alloc(["g"], [64], 2)[0]
        assert st is Status.OK
        assert b.gva_copy_in([(gva, [src.region()])], 2) is Status.OK
        calls = list(b._store.calls)
        assert ("batch_put_from_layers", want[0]) in calls
        assert ("batch_get_into_layers", want[1]) in calls
        assert ("batch_copy", want[0]) in calls
        assert dst.bytes() == src.bytes()
    finally:
        b.close()


def test_touching_regions_are_merged_and_layer_limit_is_per_key(backend: MemcacheBackend) -> None:
    big = Buf(pattern(3, 300 * 8))
    touching = [big.region(i * 8, 8) for i in range(300)]  # contiguous -> one layer
    separate = [big.region(i * 8, 4) for i in range(300)]  # 300 layers > MemCache's 255
    small = Buf(pattern(4, 16))
    st = backend.put(["touching", "separate", "fine"], [touching, separate, [small.region()]], 2)
    assert st == [Status.OK, Status.INVALID, Status.OK]
    out = Buf(big.size)
    assert backend.get(["touching"], [[out.region()]], 2) == [Status.OK]
    assert out.bytes() == big.bytes()
    assert backend.exists(["separate"], 2) == [Status.NOT_FOUND]


def test_batches_beyond_512_keys_are_split(backend: MemcacheBackend) -> None:
    n = 700
    src = Buf(pattern(5, n * 16))
    keys = [f"k{i}" for i in range(n)]
    assert backend.put(keys, [[src.region(i * 16, 16)] for i in range(n)], 10) == [Status.OK] * n
    dst = Buf(n * 16)
    assert backend.get(keys, [[dst.region(i * 16, 16)] for i in range(n)], 10) == [Status.OK] * n
    assert dst.bytes() == src.bytes()
    assert backend.exists(keys + ["absent"], 10) == [Status.OK] * n + [Status.NOT_FOUND]
    assert backend.remove(keys, 10) == [Status.OK] * n


def test_answers_land_on_their_own_keys_across_batches(backend: MemcacheBackend) -> None:
    # exists and remove take ranges and slices when every key is valid and a pass per
    # key otherwise: 1100 keys (three native batches), present and absent in a
    # pattern no batch boundary lines up with, then the same with bad keys among them
    # (too long, empty, non-ASCII over 256 bytes) and a non-ASCII one MemCache takes.
    n = 1100
    src = Buf(pattern(4, 8))
    keys = [f"land/{i}" for i in range(n)]
    present = [k for i, k in enumerate(keys) if i % 3 != 1 and i % 7 != 5]
    present.append("land/ключ")  # 16 bytes: a key MemCache takes
    put = backend.put(present, [[src.region()]] * len(present), 10)
    assert put == [Status.OK] * len(present)
    stored = set(present)
    want = [Status.OK if k in stored else Status.NOT_FOUND for k in keys]
    assert backend.exists(keys, 10) == want
    native = backend._store.batch_is_exist
    # Each bad key alone in a batch of valid ASCII ones (one would hide another from a
    # check); last, the valid non-ASCII key alone.
    for bad, at in (("x" * 257, 200), ("", 517), ("é" * 200, 1030), (None, 0)):
        mixed = list(keys)
        if bad is not None:
            mixed.insert(at, bad)
        else:
            mixed.insert(640, "land/ключ")
        want_mixed = [Status.INVALID if k == bad else Status.OK if k in stored else Status.NOT_FOUND for k in mixed]
        sent: list[list[str]] = []

        def recorded(ks, _sent=sent):
            _sent.append(list(ks))
            return native(ks)

        backend._store.batch_is_exist = recorded
        assert backend.exists(mixed, 10) == want_mixed, repr(bad)[:20]
        # Only the valid keys reach MemCache, in order, at most 512 a call.
        assert [k for batch in sent for k in batch] == [k for k in mixed if k != bad]
        assert max(map(len, sent)) <= 512
        backend._store.batch_is_exist = native
    assert backend.remove(mixed, 10) == want_mixed
    assert backend.exists(mixed, 10) == [Status.NOT_FOUND] * len(mixed)


def test_bad_keys_fail_alone(backend: MemcacheBackend) -> None:
    src = Buf(pattern(6, 32))
    long_key = "x" * 257  # MemCache fails a whole batch on one key > 256 bytes
    st = backend.put([long_key, "ok", "empty"], [[src.region()], [src.region()], [src.region(0, 0)]], 2)
    assert st == [Status.INVALID, Status.OK, Status.INVALID]
    assert backend.exists([long_key, "ok"], 2) == [Status.INVALID, Status.OK]


def test_duplicate_put_keeps_first_value(backend: MemcacheBackend) -> None:
    first, second = Buf(pattern(7, 64)), Buf(pattern(8, 64))
    assert backend.put(["dup"], [[first.region()]], 2) == [Status.OK]
    assert backend.put(["dup"], [[second.region()]], 2) == [Status.OK]  # skipped, reported OK
    out = Buf(64)
    assert backend.get(["dup"], [[out.region()]], 2) == [Status.OK]
    assert out.bytes() == first.bytes()
    assert backend.capabilities.overwrite_on_put is False


def test_get_statuses(backend: MemcacheBackend) -> None:
    src = Buf(pattern(9, 100))
    assert backend.put(["x"], [[src.region()]], 2) == [Status.OK]
    short, out = Buf(99), Buf(100)
    assert backend.get(["x", "missing"], [[short.region()], [out.region()]], 2) == [Status.INVALID, Status.NOT_FOUND]
    # size check off: the store itself rejects the mismatch (stand-in: INVALID_PARAM)
    backend._options = backend._options.model_copy(update={"check_sizes": False})
    assert backend.get(["x", "missing"], [[short.region()], [out.region()]], 2) == [Status.INVALID, Status.NOT_FOUND]
    assert backend.remove(["x", "missing"], 2) == [Status.OK, Status.NOT_FOUND]


def test_full_pool_evicts_lru_and_oversize_is_no_space(tmp_path: Path) -> None:
    b = open_backend(tmp_path, dram_size="4MiB")  # host protocols align to 2 MiB: 4 MiB
    try:
        chunk = Buf(pattern(10, 1 << 20))
        assert b.put(["old"], [[chunk.region()]], 5) == [Status.OK]
        for i in range(6):
            assert b.put([f"new{i}"], [[chunk.region()]], 5) == [Status.OK]
        assert b.exists(["old", "new5"], 5) == [Status.NOT_FOUND, Status.OK]
        huge = Buf(5 << 20)
        assert b.put(["huge"], [[huge.region()]], 5) == [Status.NO_SPACE]
    finally:
        b.close()


def test_gva_layerwise_write_then_leased_read(backend: MemcacheBackend) -> None:
    layers, layer_bytes = 4, 256
    src = [Buf(pattern(20 + i, layer_bytes)) for i in range(layers)]
    (st, gva), (st2, _) = backend.gva_alloc(["obj", "obj2"], [layers * layer_bytes] * 2, 2)
    assert st is Status.OK and st2 is Status.OK and gva > 0
    # not visible before write-finish
    assert backend.exists(["obj"], 2) == [Status.NOT_FOUND]
    # one copy per layer, at gva + layer offset (as the layerwise saver issues them)
    for i, b in enumerate(src):
        assert backend.gva_copy_in([(gva + i * layer_bytes, [b.region()])], 2) is Status.OK
    assert backend.gva_write_finish(["obj", "obj2"], [Status.OK, Status.UNAVAILABLE], 2) == [Status.OK] * 2
    assert backend.exists(["obj", "obj2"], 2) == [Status.OK, Status.NOT_FOUND]  # failed write dropped
    # an existing key cannot be allocated again
    assert backend.gva_alloc(["obj"], [16], 2)[0][0] is Status.NO_SPACE

    leased = backend.gva_lease(["obj", "absent"], 2)
    assert leased[0][0] is Status.OK and leased[0][1].size == layers * layer_bytes
    assert leased[1] == (Status.NOT_FOUND, None)
    obj = leased[0][1]
    dst = [Buf(layer_bytes) for _ in range(layers)]
    assert backend.gva_copy_out([(obj.gva, [b.region() for b in dst])], 2) is Status.OK
    assert [b.bytes() for b in dst] == [b.bytes() for b in src]
    # a leased object is neither removed nor evicted while the reader holds it
    assert backend.remove(["obj"], 2) == [Status.UNAVAILABLE]
    assert backend.gva_release(["obj"], 2) is Status.OK
    # after release, reading needs a new lease; releasing twice reports it
    assert backend.gva_copy_out([(obj.gva, [dst[0].region()])], 2) is Status.NOT_FOUND
    assert backend.gva_release(["obj"], 2) is Status.NOT_FOUND
    assert backend.remove(["obj"], 2) == [Status.OK]
    # the plain layers API reads objects written through GVA and vice versa
    assert backend.gva_lease(["obj"], 2)[0] == (Status.NOT_FOUND, None)


def test_gva_rejects_writes_into_readable_objects(backend: MemcacheBackend) -> None:
    src = Buf(pattern(30, 64))
    st, gva = backend.gva_alloc(["w"], [64], 2)[0]
    assert backend.gva_copy_in([(gva, [src.region()])], 2) is Status.OK
    assert backend.gva_write_finish(["w"], [Status.OK], 2) == [Status.OK]
    assert backend.gva_copy_in([(gva, [src.region()])], 2) is Status.INVALID  # WRITE_READABLE_BLOB
    assert backend.gva_copy_in([(0, [src.region()])], 2) is Status.INVALID  # GVA 0: INVALID_PARAM
    assert backend.gva_write_finish(["never-allocated"], [Status.OK], 2) == [Status.INVALID]


def test_every_call_honours_its_timeout(backend: MemcacheBackend) -> None:
    hooks = backend.test_hooks()
    assert hooks is not None
    src = Buf(pattern(11, 64))
    hooks.delay(1.5)
    t0 = time.monotonic()
    assert backend.exists(["a", "b"], 0.2) == [Status.TIMEOUT] * 2
    assert backend.put(["a"], [[src.region()]], 0.2) == [Status.TIMEOUT]
    assert backend.health(0.2).status is Status.TIMEOUT
    waited = time.monotonic() - t0
    hooks.delay(0)
    assert waited < 1.5, f"calls waited {waited:.2f}s for a 0.2s timeout"
    assert backend.exists(["a"], 5) in ([Status.OK], [Status.NOT_FOUND])


class _Exploding:
    """A store module whose client raises on data calls (a library bug)."""

    L2G, G2L, G2H, H2G = L2G, G2L, G2H, H2G

    class DistributedObjectStore:
        def init(self, device_id: int, init_bm: bool = True) -> int:
            return 0

        def batch_is_exist(self, keys):
            raise RuntimeError("boom")

        def batch_put_from_layers(self, keys, ptrs, sizes, direct=H2G):
            return []  # what the real pybind layer returns when its client is gone [measured]

        def get_local_service_id(self) -> int:
            return 0

        def close(self) -> int:
            return 0


def test_native_failures_become_statuses(tmp_path: Path) -> None:
    opts = MemcacheOptions(driver="standin", conf_dir=str(tmp_path / "c"))
    b = MemcacheBackend.create(opts, BackendContext(), store_module=_Exploding())
    try:
        src = Buf(8)
        assert b.exists(["a", "b"], 1) == [Status.UNAVAILABLE] * 2
        assert b.put(["a"], [[src.region()]], 1) == [Status.UNAVAILABLE]
        assert b.health(1).status is Status.UNAVAILABLE
    finally:
        b.close()


@pytest.mark.parametrize(
    ("code", "op", "status"),
    [
        (Mmc.OK, "put", Status.OK),
        (Mmc.DUPLICATED_OBJECT, "put", Status.OK),
        (Mmc.ERROR, "put", Status.NO_SPACE),
        (Mmc.ERROR, "get", Status.UNAVAILABLE),
        (Mmc.OBJECT_NOT_EXISTS, "get", Status.NOT_FOUND),
        (Mmc.UNMATCHED_KEY, "remove", Status.NOT_FOUND),
        (Mmc.LEASE_EXPIRED, "gva", Status.NOT_FOUND),
        (Mmc.INVALID_PARAM, "put", Status.INVALID),
        (Mmc.WRITE_READABLE_BLOB, "gva", Status.INVALID),
        (Mmc.TIMEOUT, "get", Status.TIMEOUT),
        (Mmc.LINK_NOT_FOUND, "exists", Status.UNAVAILABLE),
        (Mmc.CLIENT_NOT_INIT, "get", Status.UNAVAILABLE),
        (Mmc.LEASE_NOT_EXPIRED, "remove", Status.UNAVAILABLE),
        (Mmc.NOT_ENOUGH_MEMORY, "put", Status.NO_SPACE),
        (-4242, "get", Status.UNAVAILABLE),
    ],
)
def test_code_mapping(code: int, op: str, status: Status) -> None:
    from ascendstore_memcache.codes import to_status

    assert to_status(int(code), op) is status


def test_pure_client_never_moves_data(tmp_path: Path) -> None:
    writer = open_backend(tmp_path)
    lookup = open_backend(tmp_path, role="scheduler")  # init_bm defaults to False there
    try:
        src = Buf(pattern(12, 32))
        assert writer.put(["p"], [[src.region()]], 2) == [Status.OK]
        assert lookup.exists(["p", "q"], 2) == [Status.OK, Status.NOT_FOUND]
        assert lookup.put(["q"], [[src.region()]], 2) == [Status.INVALID]
        assert lookup.get(["p"], [[src.region()]], 2) == [Status.INVALID]
        # the real register_buffer segfaults on a pure client; the stand-in raises if called
        assert lookup.register([src.region()]) is Status.INVALID
        assert lookup.health(2).ok
    finally:
        lookup.close()
        writer.close()


def test_register_only_when_asked(tmp_path: Path) -> None:
    b = open_backend(tmp_path, register_buffers=True)
    try:
        assert b.register([Buf(64).region()]) is Status.OK
        assert b.unregister([Buf(64).region()]) is Status.OK
    finally:
        b.close()


def test_closed_backend_answers_unavailable(tmp_path: Path) -> None:
    b = open_backend(tmp_path)
    src = Buf(8)
    b.close()
    b.close()
    assert b.exists(["a"], 1) == [Status.UNAVAILABLE]
    assert b.put(["a"], [[src.region()]], 1) == [Status.UNAVAILABLE]
    assert b.get(["a"], [[src.region()]], 1) == [Status.UNAVAILABLE]
    assert b.remove(["a"], 1) == [Status.UNAVAILABLE]
    assert b.health(1).status is Status.UNAVAILABLE
    assert b.gva_alloc(["a"], [8], 1) == [(Status.UNAVAILABLE, 0)]


CHILD = r"""
import ctypes, json, sys
from ascendstore.contract import BackendContext, Region
from ascendstore.registry import create_backend
cfg = json.loads(sys.argv[1])
b = create_backend("memcache", cfg, BackendContext(role="worker", instance_id="child"))
data = bytes(range(256)) * 64
buf = ctypes.create_string_buffer(data, len(data))
print(json.dumps([s.name for s in b.put(["shared"], [[Region(ctypes.addressof(buf), len(data))]], 5)]))
b.close()
"""


def test_objects_are_shared_across_processes(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["OK"]
    b = open_backend(tmp_path)
    try:
        dst = Buf(256 * 64)
        assert b.get(["shared"], [[dst.region()]], 5) == [Status.OK]
        assert dst.bytes() == bytes(range(256)) * 64
    finally:
        b.close()


def test_conf_files_generated_from_options(tmp_path: Path) -> None:
    opts = MemcacheOptions(
        driver="standin",
        conf_dir=str(tmp_path),
        meta_service_url="tcp://10.1.2.3:5100",
        protocol="device_sdma",
        dram_size="2GiB",
        log_path="/var/log/mmc-test",
    )
    r = conf.resolve(opts, "x", env={})
    assert r.generated and r.local_path == tmp_path / "mmc-local.conf"
    local = conf.parse_conf(r.local_path.read_text())
    meta = conf.parse_conf(r.meta_path.read_text())
    assert local["ock.mmc.meta_service_url"] == "tcp://10.1.2.3:5100"
    assert local["ock.mmc.local_service.protocol"] == "device_sdma"
    assert local["ock.mmc.local_service.dram.size"] == str(2 << 30)
    assert meta["ock.mmc.meta_service_url"] == "tcp://10.1.2.3:5100"
    assert meta["ock.mmc.log_path"] == "/var/log/mmc-test"


def test_user_conf_files_win_unless_overridden(tmp_path: Path) -> None:
    user = tmp_path / "user-local.conf"
    user.write_text(
        "# a vllm-ascend user's file\nock.mmc.meta_service_url = tcp://10.0.0.9:5000\n"
        "ock.mmc.local_service.protocol = device_rdma\nock.mmc.local_service.dram.size = 2GB\n"
        "ubsio.mem.size_in_gb = 10\n"
    )
    env = {conf.LOCAL_ENV: str(user)}
    untouched = conf.resolve(MemcacheOptions(conf_dir=str(tmp_path / "gen")), "x", env=env)
    assert untouched.local_path == user and not untouched.generated
    assert untouched.protocol == "device_rdma"
    # an explicit option overrides one key; every other line of the user's file is kept
    over = conf.resolve(
        MemcacheOptions(conf_dir=str(tmp_path / "gen"), protocol="host_tcp"), "x", env=env
    )
    merged = conf.parse_conf(over.local_path.read_text())
    assert over.generated and over.local_path != user
    assert merged["ock.mmc.local_service.protocol"] == "host_tcp"
    assert merged["ock.mmc.meta_service_url"] == "tcp://10.0.0.9:5000"
    assert merged["ubsio.mem.size_in_gb"] == "10"
    # keys the client cannot start without are filled in when the file lacks them
    bare = tmp_path / "bare.conf"
    bare.write_text("ock.mmc.meta_service_url = tcp://10.0.0.9:5000\n")
    filled = conf.resolve(MemcacheOptions(conf_dir=str(tmp_path / "gen3")), "x", env={conf.LOCAL_ENV: str(bare)})
    assert filled.local["ock.mmc.local_service.protocol"] == "host_rdma"
    assert filled.local["ock.mmc.local_service.dram.size"] == str(1 << 30)
    assert "ock.mmc.log_level" not in filled.local  # other defaults stay the library's


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    ctx = BackendContext()
    with pytest.raises(ConfigError, match=r"protocol.*host_tcp"):
        create_backend("memcache", {"driver": "standin", "protocol": "tcp"}, ctx)
    with pytest.raises(ConfigError, match=r"dram_szie.*dram_size"):
        create_backend("memcache", {"driver": "standin", "dram_szie": "1GB"}, ctx)
    bad = tmp_path / "bad.conf"
    bad.write_text("this line has no equals sign\n")
    with pytest.raises(BackendSetupError, match=r"bad.conf:1"):
        create_backend("memcache", {"driver": "standin", "local_config_path": str(bad)}, ctx)
    with pytest.raises(BackendSetupError, match=r"does not exist"):
        create_backend("memcache", {"driver": "standin", "local_config_path": str(tmp_path / "nope")}, ctx)


def test_options_parse_sizes_like_the_core() -> None:
    assert MemcacheOptions(dram_size="512MiB").dram_size == 512 << 20
    assert MemcacheOptions(hbm_size=4096).hbm_size == 4096


def test_standin_module_accepts_a_directory_or_a_file(tmp_path: Path) -> None:
    assert StandinModule(tmp_path / "d").path == tmp_path / "d" / "standin.sqlite"
    assert StandinModule(tmp_path / "x.sqlite").path == tmp_path / "x.sqlite"
    assert os.path.isdir(tmp_path / "d")


def test_missing_library_is_a_setup_error_naming_the_install(tmp_path: Path, monkeypatch) -> None:
    import ascendstore_memcache

    monkeypatch.setitem(sys.modules, "memcache_hybrid", None)  # as if not installed
    assert ascendstore_memcache.MemcacheOptions  # the package itself still imports
    with pytest.raises(BackendSetupError, match=r"pip install memcache-hybrid==1\.3\.0 memfabric-hybrid==1\.3\.0"):
        create_backend("memcache", {"init_bm": False, "conf_dir": str(tmp_path)}, BackendContext(role="scheduler"))
