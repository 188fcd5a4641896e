"""Registry: stevedore discovery, clear errors for unknown names and broken plugins."""

import sys
import textwrap
from importlib.metadata import EntryPoint

import pytest

from ascendstore import registry
from ascendstore.errors import ConfigError


def test_local_is_registered_through_the_core_entry_point():
    assert registry.installed_backends()["local"] == "ascendstore.local.backend:LocalBackend"


def test_unknown_backend_lists_installed_and_suggests():
    with pytest.raises(registry.UnknownBackendError) as e:
        registry.load_backend_class("locl")
    msg = str(e.value)
    assert "'locl'" in msg and "local" in msg and "Did you mean 'local'" in msg
    assert isinstance(e.value, ConfigError)


def _fake_entry_points(monkeypatch, name, value):
    real = registry.entry_points

    def fake(*, group):
        eps = list(real(group=group))
        if group == registry.GROUP:
            eps.append(EntryPoint(name=name, value=value, group=group))
        return eps

    monkeypatch.setattr(registry, "entry_points", fake)
    import stevedore.extension as ext

    real_find = ext.ExtensionManager.list_entry_points

    def list_eps(self):
        eps = list(real_find(self))
        if self.namespace == registry.GROUP:
            eps.append(EntryPoint(name=name, value=value, group=registry.GROUP))
        return eps

    monkeypatch.setattr(ext.ExtensionManager, "list_entry_points", list_eps)


def test_backend_whose_import_fails_reports_the_import_error(monkeypatch, tmp_path):
    (tmp_path / "brokenbackend.py").write_text("import not_a_real_native_lib\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_entry_points(monkeypatch, "broken", "brokenbackend:Backend")
    with pytest.raises(registry.BackendImportError) as e:
        registry.load_backend_class("broken")
    assert "not_a_real_native_lib" in str(e.value) and "unknown backend" not in str(e.value)
    sys.modules.pop("brokenbackend", None)


def test_entry_point_that_is_not_a_backend_is_rejected(monkeypatch, tmp_path):
    (tmp_path / "notbackend.py").write_text(textwrap.dedent("class Thing:\n    pass\n"))
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_entry_points(monkeypatch, "thing", "notbackend:Thing")
    with pytest.raises(registry.BackendImportError, match="not an ascendstore Backend"):
        registry.load_backend_class("thing")
