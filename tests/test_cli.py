"""The ``ascendstore`` CLI against the real embedded ``local`` backend (no mocks)."""

from __future__ import annotations

import importlib.util
import json
import os
import uuid
from importlib.metadata import EntryPoint

import numpy as np
import pytest
import typer
from health_helpers import private_health_dir  # noqa: F401 (autouse fixture)
from typer.testing import CliRunner

from ascendstore.bench.cost import PrefillCostModel
from ascendstore.bench.report import RequestRecord, build_report
from ascendstore.cli import common as cli_common
from ascendstore.cli import get_app, parse_params
from ascendstore.cli import plugins as cli_plugins
from ascendstore.contract import Region, Status
from ascendstore.keys import PoolKey, RankPart, UserKey, tenant_id
from ascendstore.registry import create_backend

runner = CliRunner()


@pytest.fixture(autouse=True)
def wide_console():
    # Rich wraps at the terminal width; keep lines whole so assertions see them.
    old = cli_common.console.width
    cli_common.console.width = 250
    yield
    cli_common.console.width = old


def run(*args: str, input: str | None = None):
    return runner.invoke(get_app(), list(args), input=input)


@pytest.fixture
def pool():
    """A fresh named local pool, held open by the test so CLI invocations see it."""
    opts = {"name": f"clitest-{uuid.uuid4().hex[:10]}", "capacity": "8MiB", "page_size": "4KiB"}
    backend = create_backend("local", opts)
    yield backend, json.dumps(opts)
    backend.close()


def _put(backend, keys: list[str], size: int = 1000) -> None:
    buf = np.arange(size, dtype=np.uint8)
    st = backend.put(keys, [[Region(buf.ctypes.data, size)]] * len(keys), 2.0)
    assert all(s is Status.OK for s in st)


def _chunk_key(salt: str | None, i: int) -> str:
    return PoolKey(tenant_id(salt), "ab" * 8, RankPart(), f"{i:064x}").text()


# -- backends / config -----------------------------------------------------------------


def test_backends_lists_local():
    res = run("backends")
    assert res.exit_code == 0, res.output
    line = next(line for line in res.output.splitlines() if " local " in line)
    assert "ascendstore.local.backend:LocalBackend" in line and "yes" in line


def test_config_show_reads_kv_transfer_config():
    ktc = {
        "kv_connector": "AscendStoreConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "backend": "local",
            "chunk_size": 256,
            "backend_config": {"capacity": "64MiB"},
        },
    }
    res = run("config", "show", "--kv-transfer-config", json.dumps(ktc), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["chunk_size"] == 256
    assert data["backend_config"]["capacity"] == 64 << 20  # the backend's own options, validated
    assert data["timeout_ms"] == 5000  # defaults filled in


def test_config_file_and_overrides(tmp_path):
    f = tmp_path / "as.yaml"
    f.write_text("backend: local\nlookup_timeout_ms: 300\n")
    res = run("config", "show", "--config", str(f), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["lookup_timeout_ms"] == 300
    res = run("config", "show", "--config", str(f))
    assert "lookup_timeout_ms" in res.output and "set" in res.output


def test_config_errors_name_the_key():
    res = run("config", "show", "--kv-transfer-config", '{"kv_connector_extra_config": {"chunk_sise": 256}}')
    assert res.exit_code == 2
    assert "unknown config key 'chunk_sise'" in res.output and "Did you mean 'chunk_size'" in res.output
    res = run("config", "show", "--backend", "local", "--backend-config", '{"capacity": "lots"}')
    assert res.exit_code == 2 and "backend_config.capacity" in res.output
    res = run("config", "show", "--kv-transfer-config", "{not json")
    assert res.exit_code == 2 and "not valid JSON" in res.output


# -- doctor ----------------------------------------------------------------------------


def test_doctor_round_trip_on_local(pool):
    _, opts = pool
    res = run("doctor", "--backend", "local", "--backend-config", opts)
    assert res.exit_code == 0, res.output
    for needle in (
        "ok   installed backends",
        "local",
        "ok   put",
        "ok   exists",
        "bytes read back equal bytes written",
        "all checks passed",
    ):
        assert needle in res.output, needle
    # which pages hold the pool (4 KiB ones here unless this host's /dev/shm grants huge pages)
    assert "DRAM tier in " in res.output and "pages" in res.output
    # what a hand-off to another thread costs here (measured) and, in a guest that halts idle vCPUs at once, the fix
    assert "ok   thread hand-off: " in res.output and " us per round trip to another thread" in res.output


def test_doctor_says_how_to_cheapen_hand_offs_in_a_guest_that_halts_at_once(pool, monkeypatch):
    from ascendstore.cli import doctor
    from ascendstore.handoff import HaltPolling

    _, opts = pool
    monkeypatch.setattr(doctor, "halt_polling", lambda: HaltPolling("haltpoll", 0))
    monkeypatch.setattr(doctor, "round_trip_us", lambda: 80.0)
    res = run("doctor", "--backend", "local", "--backend-config", opts)
    assert res.exit_code == 0, res.output  # advice, not a failure
    assert "thread hand-off: 80 us per round trip" in res.output
    assert "guest_halt_poll_ns" in res.output and "echo 200000 >" in res.output
    monkeypatch.setattr(doctor, "halt_polling", lambda: HaltPolling("haltpoll", 200_000))
    res = run("doctor", "--backend", "local", "--backend-config", opts)
    assert res.exit_code == 0 and "echo 200000 >" not in res.output


def test_doctor_says_what_is_wrong(tmp_path):
    res = run("doctor", "--backend", "locall")
    assert res.exit_code == 1
    assert "'locall' is not installed (installed:" in res.output and "local" in res.output
    res = run("doctor", "--backend", "local", "--backend-config", '{"capacity": "1KiB"}')
    assert res.exit_code == 1 and "FAIL backend_config" in res.output and "capacity" in res.output
    # The example third-party backend (real files): a root that is a file cannot be opened ...
    afile = tmp_path / "not-a-dir"
    afile.write_text("x")
    res = run("doctor", "--backend", "dirstore", "--backend-config", json.dumps({"root": str(afile)}))
    assert res.exit_code == 1
    assert "FAIL connect to 'dirstore': BackendSetupError" in res.output and "cannot use root" in res.output
    # ... and a store too small for the test object refuses the put, with the reason spelled out.
    small = json.dumps({"root": str(tmp_path / "store"), "capacity_bytes": 1000})
    res = run("doctor", "--backend", "dirstore", "--backend-config", small)
    assert res.exit_code == 1
    assert "FAIL put: NO_SPACE" in res.output and "raise the backend's capacity" in res.output
    assert "1 problem(s)" in res.output


def test_doctor_fits_the_object_to_a_small_pool():
    """No pool of that name is open: the checks run on one made for them, removed after."""
    name = f"clitest-{uuid.uuid4().hex[:10]}"
    tiny = json.dumps({"name": name, "capacity": "16KiB", "page_size": "4KiB"})
    res = run("doctor", "--backend", "local", "--backend-config", tiny)
    assert res.exit_code == 0, res.output
    assert "ok   put: 16384 bytes" in res.output
    assert "the checks run on a store made for them" in " ".join(res.output.split())
    assert not [f for f in os.listdir("/dev/shm") if f.endswith(name)]


def test_doctor_checks_the_pool_its_engines_made_given_only_its_name(pool):
    """The engines' pool (8 MiB of 4 KiB pages) is checked as made, not refused for the
    defaults' options, and is left as it was."""
    backend, opts = pool
    _put(backend, ["a.1"])
    res = run("doctor", "--backend", "local", "--backend-config", json.dumps({"name": json.loads(opts)["name"]}))
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "capacity_bytes=8388608" in out and "page_size=4096" in out and "all checks passed" in out
    assert "made for them" not in out
    stats = backend.stats()
    assert stats["objects"] == 1 and stats["processes"] == 1


# -- pool ------------------------------------------------------------------------------


def test_pool_stats(pool):
    backend, opts = pool
    _put(backend, ["a.1", "a.2"])
    res = run("pool", "stats", "--backend", "local", "--backend-config", opts)
    assert res.exit_code == 0, res.output
    assert "health" in res.output and "OK" in res.output
    assert any(
        line.split("│")[1:3] and "objects" in line and " 2 " in line for line in res.output.splitlines()
    )


def test_pool_commands_read_the_pool_as_its_engines_made_it(pool):
    """Given only the pool's name, the commands read the pool the engines made (8 MiB
    of 4 KiB pages here), not one of the defaults' size, and are not refused for it."""
    backend, opts = pool
    _put(backend, ["a.1", "a.2"])
    name_only = json.dumps({"name": json.loads(opts)["name"]})
    res = run("pool", "stats", "--backend", "local", "--backend-config", name_only)
    assert res.exit_code == 0, res.output
    rows = {cells[1].strip(): cells[2].strip() for line in res.output.splitlines() if len(cells := line.split("│")) == 4}
    assert rows["capacity_bytes"] == str(8 << 20) and rows["page_size"] == "4096" and rows["objects"] == "2"
    res = run("pool", "rm", "a.1", "--backend", "local", "--backend-config", name_only)
    assert res.exit_code == 0 and "removed 1 key(s)" in res.output
    assert backend.exists(["a.1", "a.2"], 1.0) == [Status.NOT_FOUND, Status.OK]


@pytest.mark.parametrize("command", [["stats"], ["ls"], ["rm", "a.1"]])
def test_pool_commands_name_a_pool_no_process_has_and_make_none(command):
    name = f"clitest-{uuid.uuid4().hex[:10]}"
    res = run("pool", *command, "--backend", "local", "--backend-config", json.dumps({"name": name}))
    assert res.exit_code == 1
    assert f"/dev/shm/ascendstore-pool.{name} does not exist" in " ".join(res.output.split())
    assert not [f for f in os.listdir("/dev/shm") if f.endswith(name)]


def test_pool_ls_and_rm_by_user_tenant_prefix_and_key(pool):
    backend, opts = pool
    users = [UserKey(u, "m", 1, 0, vt).text() for u in ("u1", "u2") for vt in ("token_id", "kv_cache")]
    chunks = [_chunk_key("acme", i) for i in range(3)] + [_chunk_key("other", i) for i in range(2)]
    _put(backend, users + chunks + ["misc.1"])
    common = ("--backend", "local", "--backend-config", opts)

    res = run("pool", "ls", "--user", "u1", *common)
    assert res.exit_code == 0, res.output
    assert sorted(line for line in res.output.splitlines() if line.startswith("u")) == sorted(users[:2])
    res = run("pool", "ls", "--tenant", "acme", *common)
    assert sum(line.startswith("as1@") for line in res.output.splitlines()) == 3
    res = run("pool", "ls", "--prefix", "as1@", "-n", "2", *common)
    assert "2 key(s) (limit reached)" in res.output

    res = run("pool", "rm", "--user", "u1", "--yes", *common)
    assert res.exit_code == 0 and "removed 2 key(s)" in res.output
    assert backend.exists(users, 1.0) == [Status.NOT_FOUND] * 2 + [Status.OK] * 2
    res = run("pool", "rm", "--tenant", "acme", *common, input="y\n")  # confirmed interactively
    assert res.exit_code == 0 and "removed 3 key(s)" in res.output
    assert backend.exists(chunks, 1.0) == [Status.NOT_FOUND] * 3 + [Status.OK] * 2
    res = run("pool", "rm", "--tenant", "other", *common, input="n\n")  # declined: nothing removed
    assert res.exit_code != 0 and backend.exists(chunks[3:], 1.0) == [Status.OK] * 2
    res = run("pool", "rm", "misc.1", "nope.1", *common)
    assert res.exit_code == 0 and "removed 1 key(s), 1 not found" in res.output
    assert backend.exists(["misc.1"], 1.0) == [Status.NOT_FOUND]


def test_pool_rm_refuses_unclear_selections(pool):
    _, opts = pool
    common = ("--backend", "local", "--backend-config", opts)
    assert run("pool", "rm", "--prefix", "", "--yes", *common).exit_code == 2
    res = run("pool", "rm", "--user", "u1", "--prefix", "u", *common)
    assert res.exit_code == 2 and "only one of" in res.output
    res = run("pool", "rm", *common)
    assert res.exit_code == 2 and "either KEYS or one of" in res.output
    res = run("pool", "ls", "--user", "as1", *common)
    assert res.exit_code == 2 and "every chunk key" in res.output


# -- conformance, plugins, workload, report -----------------------------------------------


def test_conformance_wrapper_reaches_the_suite(pool):
    _, opts = pool
    if importlib.util.find_spec("ascendstore_conformance") is None:
        res = run("conformance", "local")
        assert res.exit_code == 2 and "pip install -e conformance" in res.output
        return
    # Collect only: proves the wrapper hands backend, options and pytest args through.
    res = run("conformance", "local", "--backend-config", opts, "--collect-only", "-q")
    assert res.exit_code == 0, res.output


def test_plugins_add_commands_and_explain_failures(monkeypatch):
    app = typer.Typer()

    @app.command()
    def core() -> None:
        """a core command"""

    eps = {
        "broken": EntryPoint("broken", "ascendstore_no_such_module:cmd", cli_plugins.GROUP),
        "params": EntryPoint("params", "ascendstore.cli:parse_params", cli_plugins.GROUP),
        "core": EntryPoint("core", "ascendstore_no_such_module:cmd", cli_plugins.GROUP),
    }
    monkeypatch.setattr(cli_plugins, "plugin_entry_points", lambda: eps)
    cli_plugins.add_plugins(app, reserved={"core"})
    res = runner.invoke(app, ["broken", "x"])
    assert (
        res.exit_code == 2 and "failed to import" in res.output and "ascendstore_no_such_module" in res.output
    )
    res = runner.invoke(app, ["bench", "--workload", "gr"])  # expected but not registered here
    assert res.exit_code == 2 and "ascendstore-vllm" in res.output
    res = runner.invoke(app, ["--help"])
    assert "params" in res.output and "core" in res.output


def test_parse_params():
    assert parse_params(["users=8", "zipf_s=1.2", "path=x.jsonl", "flag=true"]) == {
        "users": 8,
        "zipf_s": 1.2,
        "path": "x.jsonl",
        "flag": True,
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_params(["users"])


def test_workload_command():
    res = run("workload", "gr", "-p", "users=4", "-p", "requests=20", "-p", "history_tokens=64")
    assert res.exit_code == 0, res.output
    assert "requests" in res.output and "20" in res.output and "infinite-cache bound" in res.output
    res = run("workload", "nope")
    assert res.exit_code == 2 and "choose one of: gr, chat, docqa, trace" in res.output


def test_report_command(tmp_path):
    recs = [
        RequestRecord(req_id="a", arrival_s=0, prompt_tokens=100, device_hit=16, pool_hit=48, bound_hit=80)
    ]
    rep = build_report(
        workload="gr",
        backend="local",
        records=recs,
        block_size=16,
        chunk_size=16,
        lookup_latency_us=[10.0, 20.0],
        bytes_loaded=1,
        bytes_saved=1,
        load_wall_s=1,
        save_wall_s=1,
        kv_bytes_verified=1,
        kv_mismatches=0,
        connector_s=0.0,
        wall_s=1.0,
        cost_model=PrefillCostModel(),
    )
    path = tmp_path / "r.json"
    rep.to_json(path)
    res = run("report", str(path), "--plot", str(tmp_path / "plots"))
    assert res.exit_code == 0, res.output
    assert "hit tokens: pool" in res.output and "48" in res.output
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "hit_rate.png",
        "lookup_cdf.png",
        "tiers.png",
    ]
    # A sweep file (what `bench --pool-capacity a,b --json` writes) is read too.
    other = rep.model_copy(update={"pool_capacity_fraction": 0.5, "granularity": "user"})
    sweep = {"sweep": [rep.model_dump(mode="json"), other.model_dump(mode="json")], "simulation": []}
    (tmp_path / "s.json").write_text(json.dumps(sweep))
    res = run("report", str(tmp_path / "s.json"), "--plot", str(tmp_path / "sp"))
    assert res.exit_code == 0, res.output
    assert "pool granularity x capacity" in res.output and (tmp_path / "sp" / "granularity_sweep.png").is_file()
    assert (tmp_path / "sp" / "user-0.5" / "tiers.png").is_file()
    (tmp_path / "bad.json").write_text("{}")
    assert run("report", str(tmp_path / "bad.json")).exit_code == 2
