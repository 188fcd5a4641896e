"""The pytest plugin (entry point ``pytest11``): command-line options, early
checks of the backend named on the command line, the report header and the
performance summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from ascendstore.contract import BackendSetupError
from ascendstore.errors import ConfigError
from ascendstore.registry import parse_options
from ascendstore_conformance.factory import substitute_placeholders
from ascendstore_conformance.options import add_options, factory_from_options
from ascendstore_conformance.perf import RECORDS, render

#: the module ``--pyargs ascendstore_conformance`` collects.
BY_NAME_TESTS = Path(__file__).with_name("test_backend.py")


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    # A wrong name or config is one clear usage error, not an error per test.
    factory = factory_from_options(config)
    if factory is not None:
        try:
            cls = factory.backend_class()
            for cfg in (factory.config, factory.small_config):
                if cfg is not None:  # placeholders filled with a stand-in: only validating here
                    parse_options(cls, substitute_placeholders(cfg, "/nonexistent/tmp", "check"))
        except (ConfigError, BackendSetupError, ImportError, AttributeError, TypeError) as exc:
            raise pytest.UsageError(f"--backend {factory.name}: {exc}") from None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    by_name = any(item.path == BY_NAME_TESTS for item in items)
    if by_name and factory_from_options(config) is None:
        raise pytest.UsageError(
            "ascendstore_conformance needs a backend: --backend NAME [--backend-config JSON] "
            "(NAME is an entry point in the 'ascendstore.backends' group, or module:Class)"
        )


def pytest_report_header(config: pytest.Config) -> str | None:
    name = config.getoption("ascendstore_backend", default=None)
    return f"ascendstore conformance: backend {name!r}" if name else None


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    records = config.stash.get(RECORDS, [])
    if not records:
        return
    terminalreporter.write_sep("-", "ascendstore backend performance (informational, not pass/fail)")
    for line in render(records):
        terminalreporter.write_line(line)
