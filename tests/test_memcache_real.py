"""The memcache backend with the REAL memcache-hybrid 1.3.0 library: everything
that runs without an Ascend driver (meta service on loopback, pure client,
failed data-path init, return codes), plus the stand-in's fidelity to it.

Real clients run in child processes: the native client is one per process and
some wrong calls crash it (a segfault must fail a test, not the test run).
The meta service takes a per-host lock file, so one runs at a time.
"""

from __future__ import annotations

import inspect
import json
import re
import time
from pathlib import Path

import pytest
from ascendstore_memcache import conf, fidelity
from ascendstore_memcache.options import MemcacheOptions
from ascendstore_memcache.standin import StandinModule

from ascendstore.contract import BackendContext, BackendSetupError
from ascendstore.registry import create_backend

memcache_hybrid = pytest.importorskip("memcache_hybrid")

from memcache_helpers import meta_options, run_child, start_meta  # noqa: E402


@pytest.fixture(scope="module")
def meta(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("mmc-meta")
    opts = meta_options(tmp)
    proc = start_meta(opts, tmp)
    yield opts, proc
    proc.stop(timeout_s=3)  # SIGTERM, SIGKILL after 3 s
    assert proc.proc is not None and proc.proc.poll() is not None


def backend_config(opts: MemcacheOptions, **extra: object) -> str:
    return json.dumps({**opts.model_dump(mode="json", exclude_none=True), **extra})


def _listening(ports: set[int]) -> dict[int, str]:
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, port = local.split(":")
            if state == "0A" and int(port, 16) in ports:  # 0A: LISTEN
                found[int(port, 16)] = addr
    return found


def test_meta_service_listens_on_loopback_only(meta) -> None:
    opts, _ = meta
    urls = (opts.meta_service_url, opts.config_store_url, opts.metrics_url)
    ports = {conf.tcp_endpoint(u)[1] for u in urls}
    deadline = time.monotonic() + 10  # the metrics listener may come up after the meta port
    while set(listening := _listening(ports)) != ports and time.monotonic() < deadline:
        time.sleep(0.1)
    assert set(listening) == ports
    assert set(listening.values()) == {"0100007F"}, listening  # 127.0.0.1 only


PURE_CLIENT = r"""
import ctypes, json, sys
from ascendstore.contract import BackendContext, BackendSetupError, Region, Status
from ascendstore.registry import create_backend
cfg = json.loads(sys.argv[1])
b = create_backend("memcache", cfg, BackendContext(role="scheduler", instance_id="pure"))
buf = ctypes.create_string_buffer(64); r = Region(ctypes.addressof(buf), 64)
out = {
  "capabilities_layerwise": b.capabilities.layerwise,
  "exists": [s.name for s in b.exists(["a", "b"], 5)],
  "health": b.health(5).status.name,
  "put": [s.name for s in b.put(["a"], [[r]], 5)],
  "register": b.register([r]).name,
  "remove": [s.name for s in b.remove(["a"], 5)],
  "gva_alloc": [(s.name, g) for s, g in b.gva_alloc(["g"], [64], 5)],
  "gva_lease": [s.name for s, _ in b.gva_lease(["g"], 5)],
  "gva_release": b.gva_release(["g"], 5).name,
  "gva_write_finish": [s.name for s in b.gva_write_finish(["g"], [Status.OK], 5)],
  "local_service_id": b.stats()["local_service_id"],
  "local_config_path": b.stats()["local_config_path"],
}
try:
    create_backend("memcache", cfg, BackendContext(role="scheduler", instance_id="pure2"))
    out["second"] = "opened"
except BackendSetupError as exc:
    out["second"] = str(exc)
b.close()
out["after_close"] = [s.name for s in b.exists(["a"], 5)]
print(json.dumps(out))
"""


def test_pure_client_through_the_backend(meta) -> None:
    opts, _ = meta
    got = run_child(PURE_CLIENT, backend_config(opts))
    assert got["capabilities_layerwise"] is True
    assert got["exists"] == ["NOT_FOUND", "NOT_FOUND"]  # batch_is_exist -> 0
    assert got["health"] == "OK"
    assert got["put"] == ["INVALID"] and got["register"] == "INVALID"  # never reaches native
    assert got["remove"] == ["NOT_FOUND"]  # remove_batch -> -3102
    assert got["gva_alloc"] == [["NO_SPACE", 0]]  # no memory in the pool -> GVA 0
    assert got["gva_lease"] == ["NOT_FOUND"]  # key info size 0
    assert got["gva_release"] == "NOT_FOUND"  # batch_remove_lease -> -3106
    assert got["gva_write_finish"] == ["INVALID"]  # -3000 for a key not allocated here
    assert got["local_service_id"] == 0
    assert "one per process" in got["second"]
    assert got["after_close"] == ["UNAVAILABLE"]


USER_FILE = r"""
import json, sys
from ascendstore.contract import BackendContext
from ascendstore.registry import create_backend
b = create_backend("memcache", json.loads(sys.argv[1]), BackendContext(role="scheduler"))
print(json.dumps({"health": b.health(5).status.name, "conf": b.stats()["local_config_path"],
                  "exists": [s.name for s in b.exists(["k"], 5)]}))
b.close()
"""


def test_vllm_ascend_conf_file_via_env_is_used(meta, tmp_path: Path) -> None:
    opts, _ = meta
    user = tmp_path / "mmc-local.conf"
    user.write_text(
        f"ock.mmc.meta_service_url = {opts.meta_service_url}\n"
        f"ock.mmc.local_service.config_store_url = {opts.config_store_url}\n"
        "ock.mmc.local_service.protocol = host_tcp\nock.mmc.local_service.dram.size = 64MB\n"
        "ock.mmc.log_level = error\n"
    )
    got = run_child(USER_FILE, json.dumps({"conf_dir": str(tmp_path / "gen")}), env={conf.LOCAL_ENV: str(user)})
    assert got == {"health": "OK", "conf": str(user), "exists": ["NOT_FOUND"]}
    # an explicit option overrides the file: the generated file reaches the same meta service
    wrong = tmp_path / "wrong.conf"
    wrong.write_text("ock.mmc.meta_service_url = tcp://127.0.0.1:1\nock.mmc.log_level = error\n")
    cfg = {"conf_dir": str(tmp_path / "gen2"), "meta_service_url": opts.meta_service_url,
           "config_store_url": opts.config_store_url, "local_config_path": str(wrong)}
    got = run_child(USER_FILE, json.dumps(cfg))
    assert got["health"] == "OK" and got["conf"] == str(tmp_path / "gen2" / "mmc-local.conf")


SETUP_PATH = r"""
import json, sys
import memcache_hybrid  # loaded before AscendStore could point it at the file
from ascendstore.contract import BackendContext
from ascendstore.registry import create_backend
b = create_backend("memcache", json.loads(sys.argv[1]), BackendContext(role="scheduler"))
print(json.dumps({"health": b.health(5).status.name, "exists": [s.name for s in b.exists(["k"], 5)]}))
b.close()
"""


def test_library_loaded_early_is_configured_through_setup(meta) -> None:
    # the real library snapshots the environment when loaded: the adapter falls
    # back to setup(LocalConfig) with the same values and still reaches the meta service
    opts, _ = meta
    assert run_child(SETUP_PATH, backend_config(opts)) == {"health": "OK", "exists": ["NOT_FOUND"]}


def test_data_path_without_ascend_fails_fast_with_what_to_install(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(BackendSetupError) as info:
        create_backend("memcache", {"conf_dir": str(tmp_path)}, BackendContext(role="worker"))
    msg = str(info.value)
    assert time.monotonic() - t0 < 5  # preflight, not a native timeout
    for part in ("Ascend driver", "CANN", "/usr/local/Ascend/driver/version.info", "ASCEND_HOME_PATH",
                 "libascendcl.so", "standin"):
        assert part in msg, (part, msg)


NATIVE_INIT = r"""
import json, sys
from ascendstore.contract import BackendContext, BackendSetupError
from ascendstore.registry import create_backend
try:
    create_backend("memcache", json.loads(sys.argv[1]), BackendContext(role="worker"))
    print(json.dumps({"error": None}))
except BackendSetupError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def test_native_data_path_init_failure_is_reported_not_crashed(meta) -> None:
    opts, _ = meta
    got = run_child(NATIVE_INIT, backend_config(opts, preflight=False, setup_timeout_s=30))
    assert got["error"] is not None
    assert "init(device_id=0, init_bm=True) failed with ERROR(-1)" in got["error"]
    assert "Ascend driver" in got["error"]


def test_no_meta_service_is_a_clear_setup_error(tmp_path: Path) -> None:
    opts = meta_options(tmp_path, init_bm=False)  # nothing listens on these ports
    t0 = time.monotonic()
    with pytest.raises(BackendSetupError, match=r"no MemCache meta service at tcp://127\.0\.0\.1:\d+.*ascendstore-memcache-meta"):
        create_backend("memcache", json.loads(backend_config(opts)), BackendContext(role="scheduler"))
    assert time.monotonic() - t0 < 5  # the native client would retry for ~5 s


def _real_signature(method: object) -> list[tuple[str, str | None]]:
    """(name, default) of a pybind11 method from its docstring signature."""
    line = method.__doc__.strip().splitlines()[0]
    inner = line[line.index("(") + 1 : line.rindex(") ->")]
    params, depth, cur = [], 0, ""
    for ch in inner:
        depth += ch in "[(<"
        depth -= ch in "])>"
        if ch == "," and depth == 0:
            params.append(cur.strip())
            cur = ""
        else:
            cur += ch
    params.append(cur.strip())
    out = []
    for p in params[1:]:  # drop self
        name = p.split(":")[0].strip()
        default = p.split("=", 1)[1].strip() if "=" in p else None
        out.append((name, default))
    return out


ADAPTER_METHODS = [
    "init", "close", "batch_is_exist", "batch_put_from_layers", "batch_get_into_layers",
    "remove_batch", "batch_get_key_info", "get_key_info", "batch_alloc", "batch_copy",
    "batch_copy_layers", "batch_write_finish", "batch_add_lease", "batch_remove_lease",
    "register_buffer", "unregister_buffer", "get_local_service_id", "is_exist", "remove",
]


@pytest.mark.parametrize("name", ADAPTER_METHODS)
def test_standin_signatures_match_the_real_pybind_ones(name: str) -> None:
    from ascendstore_memcache.standin import StandinObjectStore

    real = _real_signature(getattr(memcache_hybrid.DistributedObjectStore, name))
    params = list(inspect.signature(getattr(StandinObjectStore, name)).parameters.values())[1:]
    assert len(params) == len(real), (real, params)
    for (rname, rdefault), p in zip(real, params, strict=True):
        if not rname.startswith("arg"):  # argN: positional-only in pybind, any name works
            assert p.name == rname
        assert (rdefault is None) == (p.default is inspect.Parameter.empty), (name, rname)
        if rdefault is not None and re.fullmatch(r"-?\d+|True|False", rdefault):
            assert repr(p.default) == rdefault, (name, rname)


def test_copy_directions_match_memfabric() -> None:
    from ascendstore_memcache import standin

    for d in ("L2G", "G2L", "G2H", "H2G", "AUTO"):
        assert int(getattr(memcache_hybrid, d)) == getattr(standin, d)


def test_standin_matches_real_on_an_uninitialised_client(tmp_path: Path) -> None:
    real = run_child("from ascendstore_memcache.fidelity import main; main(['real', 'uninit'])")
    assert real == fidelity.probe(StandinModule(tmp_path), "uninit")


def test_standin_matches_real_on_a_pure_client(meta, tmp_path: Path) -> None:
    opts, _ = meta
    local = conf.resolve(opts, "fidelity").local_path
    env = {conf.LOCAL_ENV: str(local)}
    real = run_child("from ascendstore_memcache.fidelity import main; main(['real', 'pure'])", env=env)
    standin = run_child(
        "from ascendstore_memcache.fidelity import main; import sys; main(['standin', 'pure', sys.argv[1]])",
        str(tmp_path / "fresh"), env=env,
    )
    assert real["init"] == 0
    assert standin == real
