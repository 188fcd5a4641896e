"""The author's path around the suite: `ascendstore conformance NAME` takes the
same options as the pytest form, `ascendstore backends` marks test tools, and a
backend installed a moment ago is seen at once (stevedore's entry-point cache
would hide it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ascendstore_conformance.options import add_options
from typer.main import get_command

from ascendstore.cli import get_app

DIRSTORE = {"root": "{tmp}/store"}
DIRSTORE_SMALL = {"root": "{tmp}/store", "capacity_bytes": 2 << 20}


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ascendstore.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "250", **(env or {})},
    )


class _Recorder:
    """Stands in for pytest's parser: records the options the plugin adds."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def getgroup(self, *_: object) -> _Recorder:
        return self

    def addoption(self, *names: str, **_: object) -> None:
        self.names.update(names)


def test_cli_takes_every_option_of_the_pytest_form() -> None:
    plugin = _Recorder()
    add_options(plugin)  # type: ignore[arg-type]
    command = get_command(get_app()).commands["conformance"]  # type: ignore[attr-defined]
    cli_options = {o for p in command.params for o in p.opts if o.startswith("--")}
    # --backend is the CLI's positional BACKEND.
    assert plugin.names - {"--backend"} == cli_options - {"--help"}, (plugin.names, cli_options)


def test_cli_small_config_runs_the_capacity_test(tmp_path: Path) -> None:
    done = cli(
        "conformance", "dirstore",
        "--backend-config", json.dumps(DIRSTORE),
        "--backend-small-config", json.dumps(DIRSTORE_SMALL),
        "--backend-timeout", "4",
        "--backend-timeout-margin", "0.5",
        "-p", "no:cacheprovider", "-rs", "-k", "capacity_full or stats",
        cwd=tmp_path,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "2 passed" in out and "skipped" not in out, out[-2000:]


def test_cli_bad_option_value_is_a_usage_error(tmp_path: Path) -> None:
    done = cli("conformance", "dirstore", "--backend-config", json.dumps(DIRSTORE),
               "--backend-small-config", "{root", cwd=tmp_path)
    assert done.returncode == 4, done.stdout + done.stderr  # pytest's usage error
    assert "--backend-small-config: not valid JSON" in done.stderr


def test_backends_marks_faulty_as_a_test_tool(tmp_path: Path) -> None:
    done = cli("backends", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    faulty = next(line for line in lines if " faulty " in line)
    local = next(line for line in lines if " local " in line)
    assert "test tool" in faulty and "not for serving" in faulty, faulty
    assert "test tool" not in local and "storage" in local, local


# -- a backend installed a moment ago ---------------------------------------------------

PROBE_STEVEDORE = """
import sys, stevedore
try:
    stevedore.DriverManager("ascendstore.backends", sys.argv[1])
    print("found")
except stevedore.exception.NoMatches:
    print("missing")
"""

PROBE_REGISTRY = """
import sys
from ascendstore.registry import create_backend
b = create_backend(sys.argv[1], {"root": sys.argv[2]})
print(type(b).__name__, b.health(5).status.name)
b.close()
"""


def _install(site: Path, names: list[str]) -> Path:
    """A throwaway distribution registering ``names`` as backends (DirStore)."""
    info = site / "throwaway_backend-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: throwaway-backend\nVersion: 0.1\n")
    lines = "".join(f"{n} = ascendstore_dirstore:DirStore\n" for n in names)
    (info / "entry_points.txt").write_text(f"[ascendstore.backends]\n{lines}")
    return info


def test_a_freshly_installed_backend_is_seen_at_once(tmp_path: Path) -> None:
    if sys.executable.startswith("/tmp"):
        # stevedore turns its cache off for an interpreter under /tmp (its check for
        # ansible): there is no stale cache to reproduce, nor one to get wrong
        pytest.skip("stevedore caches nothing for a Python under /tmp (e.g. a checkout in /tmp)")
    site, cache = tmp_path / "site", tmp_path / "cache"
    env = {
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "XDG_CACHE_HOME": str(cache),  # a private stevedore cache
    }

    def python(code: str, *args: str) -> str:
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                              timeout=120, env={**os.environ, **env}, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip()

    info = _install(site, ["tmpone"])
    assert python(PROBE_STEVEDORE, "tmpone") == "found"  # stevedore's cache now holds the group
    # Reinstall with a new entry point within stevedore's time resolution (its cache
    # key packs file times as 32-bit floats: about two minutes apart), simulated by
    # putting the old file times back.
    stamps = {p: os.stat(p) for p in (site, info, info / "entry_points.txt")}
    _install(site, ["tmpone", "tmptwo"])
    for p, st in stamps.items():
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert python(PROBE_STEVEDORE, "tmptwo") == "missing", "the simulation no longer reproduces a stale cache"

    assert python(PROBE_REGISTRY, "tmptwo", str(tmp_path / "store")) == "DirStore OK"
    done = cli("backends", cwd=tmp_path, env=env)
    line = next((x for x in done.stdout.splitlines() if " tmptwo " in x), "")
    assert "ascendstore_dirstore:DirStore" in line and "yes" in line, done.stdout


def test_an_unknown_backend_says_what_to_do() -> None:
    from ascendstore.registry import UnknownBackendError, load_backend_class

    with pytest.raises(UnknownBackendError) as info:
        load_backend_class("no-such-backend-zq")
    msg = str(info.value)
    assert "install its package into this Python environment" in msg and sys.executable in msg
    assert "ascendstore backends" in msg


def test_cli_says_why_a_test_was_skipped(tmp_path: Path) -> None:
    done = cli("conformance", "dirstore", "--backend-config", json.dumps(DIRSTORE),
               "-p", "no:cacheprovider", "-k", "capacity_full", cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "1 skipped" in out and "no small_config for dirstore: give --backend-small-config" in out, out[-2000:]
