"""The example third-party backend (docs/examples/dirstore) passes the whole
suite in the subclassing form, as an author would run it in their own tree."""

import pytest
from ascendstore_conformance import BackendConformance, BackendFactory
from ascendstore_dirstore import DirStore


class TestDirStore(BackendConformance):
    @pytest.fixture
    def backend_factory(self) -> BackendFactory:
        return BackendFactory(
            DirStore,
            config={"root": "{tmp}/store"},
            small_config={"root": "{tmp}/store", "capacity_bytes": 2 << 20},
        )
