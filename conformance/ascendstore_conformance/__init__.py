"""AscendStore backend conformance suite.

Run by name: ``pytest --pyargs ascendstore_conformance --backend NAME --backend-config JSON``;
or subclass :class:`BackendConformance` in your own tests and override ``backend_factory``.
"""

import pytest

# The behaviour modules hold the assertions; rewrite them for readable failures.
pytest.register_assert_rewrite("ascendstore_conformance.suite", "ascendstore_conformance.harness")

from ascendstore_conformance.factory import BackendFactory  # noqa: E402
from ascendstore_conformance.runner import run  # noqa: E402
from ascendstore_conformance.suite import BackendConformance, require, require_hook  # noqa: E402

__all__ = ["BackendConformance", "BackendFactory", "require", "require_hook", "run"]
