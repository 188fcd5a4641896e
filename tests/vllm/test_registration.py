"""vLLM plugin registration: the plain name and the alias, whatever the load order."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
from ascendstore_vllm import plugin
from ascendstore_vllm.testing import load_plugins, run_in_subprocess
from scenarios import registration_when_vllm_ascend_registers_first

OURS = "ascendstore_vllm.connector"


def test_general_plugin_entry_point_is_installed():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("ascendstore") == "ascendstore_vllm.plugin:register"


@pytest.fixture
def factory(monkeypatch):
    load_plugins()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    saved = plugin._other_loader
    yield KVConnectorFactory
    plugin._other_loader = saved


def test_plain_name_and_alias_reach_ours_without_vllm_ascend(factory, monkeypatch):
    monkeypatch.setenv(plugin.OWNER_ENV, "auto")
    monkeypatch.setattr(plugin, "_other_loader", None)
    assert factory.get_connector_class_by_name("AscendStoreConnector").__module__ == OURS
    assert factory.get_connector_class_by_name("AscendStorePoolConnector").__module__ == OURS


def test_vllm_ascend_registering_later_neither_fails_nor_steals(factory, monkeypatch):
    monkeypatch.setattr(plugin, "_other_loader", None)
    # vllm-ascend's plugin runs after ours: must not raise "already registered".
    factory.register_connector("AscendStoreConnector", "fake_vllm_ascend", "AscendStoreConnector")
    monkeypatch.setenv(plugin.OWNER_ENV, "ascendstore")
    assert factory.get_connector_class_by_name("AscendStoreConnector").__module__ == OURS
    monkeypatch.setenv(plugin.OWNER_ENV, "vllm-ascend")
    assert factory.get_connector_class_by_name("AscendStoreConnector").__module__ == "fake_vllm_ascend"
    monkeypatch.setenv(plugin.OWNER_ENV, "auto")  # vllm-ascend present -> it keeps its name
    assert factory.get_connector_class_by_name("AscendStoreConnector").__module__ == "fake_vllm_ascend"
    assert factory.get_connector_class_by_name("AscendStorePoolConnector").__module__ == OURS
    # Other names still register normally (and duplicates still fail as vLLM intends).
    with pytest.raises(ValueError):
        factory.register_connector("ExampleConnector", "x", "y")


def test_vllm_ascend_registering_first():
    got = run_in_subprocess(registration_when_vllm_ascend_registers_first, timeout_s=120)
    assert got == {
        "ascendstore": {"plain": OURS, "alias": OURS},
        "vllm-ascend": {"plain": "fake_vllm_ascend", "alias": OURS},
        "auto": {"plain": "fake_vllm_ascend", "alias": OURS},
    }


def test_gr_connector_is_registered_by_name():
    from ascendstore_vllm.plugin import register
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    register()
    cls = KVConnectorFactory.get_connector_class_by_name("AscendStoreGRConnector")
    assert cls.__name__ == "AscendStoreGRConnector"
