"""The memcache backend passes the conformance suite against the STAND-IN
(``driver="standin"``): the adapter's translation is the code under test; the
stand-in plays MemCache's documented API and return codes (see
``ascendstore_memcache.standin``). MemCache itself cannot store data here (no
Ascend driver), so nothing in this file runs the real data path."""

import pytest
from ascendstore_conformance import BackendConformance, BackendFactory

COMMON = {"driver": "standin", "standin_path": "{tmp}/mmc", "conf_dir": "{tmp}/conf", "protocol": "host_tcp"}


class TestMemcacheStandin(BackendConformance):
    @pytest.fixture
    def backend_factory(self) -> BackendFactory:
        return BackendFactory(
            "memcache",
            config={**COMMON, "dram_size": "256MiB"},
            small_config={**COMMON, "dram_size": "4MiB"},
        )
