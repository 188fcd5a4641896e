"""The embedded ``local`` backend passes the conformance suite, opened by its
entry-point name through the stevedore registry, as the connector opens it."""

import pytest
from ascendstore_conformance import BackendConformance, BackendFactory
from hugetlbfs_helpers import hugetlbfs_mount

#: a private pool per test ("{unique}"), small enough that max_object_bytes
#: (= capacity) is within the suite's write cap, so the over-maximum test runs too.
CONFIG = {"name": "{unique}", "capacity": "16MiB", "page_size": "64KiB"}
SMALL = {"name": "{unique}", "capacity": "2MiB", "page_size": "64KiB"}


class TestLocalBackend(BackendConformance):
    @pytest.fixture
    def backend_factory(self) -> BackendFactory:
        return BackendFactory("local", config=CONFIG, small_config=SMALL)


class TestLocalBackendWithDiskTierAndChecksums(BackendConformance):
    @pytest.fixture
    def backend_factory(self) -> BackendFactory:
        disk = {"disk_path": "{tmp}/disk", "disk_capacity": "64MiB", "checksum": True}
        small_disk = {"disk_path": "{tmp}/disk", "disk_capacity": "4MiB", "checksum": True}
        return BackendFactory("local", config=CONFIG | disk, small_config=SMALL | small_disk)


@pytest.fixture(scope="module")
def huge_mount(tmp_path_factory):
    with hugetlbfs_mount(tmp_path_factory.mktemp("hugetlbfs"), 64) as d:
        yield d


class TestLocalBackendOnHugePages(BackendConformance):
    """The DRAM tier on a hugetlbfs mount (``hugetlbfs``: real huge pages, root only)."""

    @pytest.fixture
    def backend_factory(self, huge_mount) -> BackendFactory:
        huge = {"hugetlbfs": huge_mount}
        return BackendFactory("local", config=CONFIG | huge, small_config=SMALL | huge)
