"""The suite's entry points: run by name through the stevedore registry (the
example dirstore, installed with pip, passes all of it), ``run()`` for the CLI,
clear usage errors, and skips that name what is missing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = Path(__file__).parent
DIRSTORE = {"root": "{tmp}/store"}
DIRSTORE_SMALL = {"root": "{tmp}/store", "capacity_bytes": 2 << 20}


def by_name(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rA", "--pyargs", "ascendstore_conformance", *args
    )


def test_dirstore_by_name_passes_the_whole_suite(pytester: pytest.Pytester) -> None:
    result = by_name(
        pytester,
        "--backend",
        "dirstore",
        "--backend-config",
        json.dumps(DIRSTORE),
        "--backend-small-config",
        json.dumps(DIRSTORE_SMALL),
    )
    out = result.stdout.str()
    outcomes = result.parseoutcomes()
    assert result.ret == pytest.ExitCode.OK, out
    # dirstore declares every capability the suite gates on except eviction (and so pins).
    assert outcomes.get("skipped", 0) == 1 and outcomes["passed"] >= 30, outcomes
    assert "SKIPPED" in out and "capability evicts=False declared by dirstore" in out, out[-3000:]
    assert "backend 'dirstore'" in out
    assert "ascendstore backend performance (informational" in out
    report = out[out.index("ascendstore backend performance") :]
    assert "backend dirstore" in report
    for op in ("put", "get", "exists"):
        assert f"\n  {op} " in report, report


def test_run_function_for_the_cli(tmp_path: Path) -> None:
    code = (
        "import ascendstore_conformance as c, sys;"
        f"sys.exit(c.run('dirstore', {DIRSTORE!r}, ['-q', '-p', 'no:cacheprovider', '-k', 'byte_exact or absent']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 passed" in done.stdout


def test_run_function_reports_failure(tmp_path: Path) -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); import ascendstore_conformance as c;"
        "sys.exit(c.run('test_conformance_planted:TruncatedGet', {}, ['-q', '-p', 'no:cacheprovider', '-k', 'byte_exact']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "bytes differ from what was written" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "ascendstore_conformance needs a backend: --backend NAME"),
        (("--backend", "dirstor"), "Did you mean 'dirstore'?"),
        (("--backend", "dirstore", "--backend-config", "{root"), "--backend-config: not valid JSON"),
        (("--backend", "dirstore", "--backend-config", '{"rot": "/x"}'), "Did you mean 'root'?"),
    ],
    ids=["no-backend", "unknown-name", "bad-json", "unknown-option"],
)
def test_usage_errors_are_one_clear_message(pytester: pytest.Pytester, args, message) -> None:
    result = by_name(pytester, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()
    assert "passed" not in result.stdout.str()


def test_skips_name_the_missing_capability_or_hook(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_skips=textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(TESTS)!r})
            import pytest
            from ascendstore_conformance import BackendConformance, BackendFactory
            import test_conformance_planted as planted

            class NoHooks(planted.MemStore):
                def test_hooks(self):
                    return None

            class TestNoHooks(BackendConformance):
                @pytest.fixture
                def backend_factory(self):
                    return BackendFactory(NoHooks)
            """
        )
    )
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "-rs",
        "-k",
        "persistence or visible or timeout_surfaces or corruption or capacity",
    )
    out = result.stdout.str()
    result.assert_outcomes(skipped=5)
    assert "capability persistent=False declared by" in out
    assert "capability shared_across_processes=False declared by" in out
    assert "test hook delay() not offered" in out
    assert "test hook corrupt() not offered" in out
    assert "no small_config for" in out


def test_dirstore_example_builds_as_a_wheel_with_its_entry_point(tmp_path: Path) -> None:
    example = tmp_path / "dirstore"  # a copy: building writes into the source tree
    shutil.copytree(
        TESTS.parent / "docs" / "examples" / "dirstore",
        example,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"),
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(example),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("ascendstore_dirstore-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert "ascendstore_dirstore.py" in names
        entry_points = zf.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "[ascendstore.backends]" in entry_points
    assert "dirstore = ascendstore_dirstore:DirStore" in entry_points
