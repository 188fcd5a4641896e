"""Collected by ``pytest --pyargs ascendstore_conformance --backend NAME``."""

from ascendstore_conformance import BackendConformance


class TestBackend(BackendConformance):
    pass
