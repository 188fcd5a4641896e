"""The behaviour classes. ``BackendConformance`` is all of them together."""

from ascendstore_conformance.suite.base import ConformanceFixtures, require, require_hook
from ascendstore_conformance.suite.capacity import CapacityTests, PinTests
from ascendstore_conformance.suite.concurrency import ConcurrencyTests
from ascendstore_conformance.suite.datapath import (
    AbsentKeyTests,
    DeclarationTests,
    DuplicatePutTests,
    KeyTests,
    PutGetTests,
)
from ascendstore_conformance.suite.faults import FaultTests
from ascendstore_conformance.suite.lifecycle import CloseReopenTests, RemoveTests
from ascendstore_conformance.suite.performance import PerformanceTests


class BackendConformance(
    ConformanceFixtures,
    DeclarationTests,
    AbsentKeyTests,
    PutGetTests,
    KeyTests,
    DuplicatePutTests,
    RemoveTests,
    CloseReopenTests,
    CapacityTests,
    PinTests,
    ConcurrencyTests,
    FaultTests,
    PerformanceTests,
):
    """Every behaviour test. Subclass it as ``TestMyBackend`` and override the
    ``backend_factory`` fixture, or run it by name with ``--backend``."""


__all__ = [
    "AbsentKeyTests",
    "BackendConformance",
    "CapacityTests",
    "CloseReopenTests",
    "ConcurrencyTests",
    "ConformanceFixtures",
    "DeclarationTests",
    "DuplicatePutTests",
    "FaultTests",
    "KeyTests",
    "PerformanceTests",
    "PinTests",
    "PutGetTests",
    "RemoveTests",
    "require",
    "require_hook",
]
