"""Command-line options of the by-name form (``--backend NAME ...``)."""

from __future__ import annotations

import pytest

from ascendstore_conformance.factory import BackendFactory, parse_json_option
from ascendstore_conformance.harness import TIMEOUT_MARGIN_S


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("ascendstore-conformance", "AscendStore backend conformance suite")
    group.addoption(
        "--backend",
        dest="ascendstore_backend",
        metavar="NAME",
        help="backend under test: an entry-point name in the 'ascendstore.backends' group, or module:Class",
    )
    group.addoption(
        "--backend-config",
        dest="ascendstore_backend_config",
        metavar="JSON",
        help="backend_config as a JSON object (or @file.json); '{tmp}' and '{unique}' in string values "
        "become a fresh directory and token per test",
    )
    group.addoption(
        "--backend-small-config",
        dest="ascendstore_backend_small_config",
        metavar="JSON",
        help="backend_config of a store of a few MiB, for the capacity-full tests (skipped without it)",
    )
    group.addoption(
        "--backend-timeout",
        dest="ascendstore_backend_timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="timeout_s passed to every backend call (default 5)",
    )
    group.addoption(
        "--backend-timeout-margin",
        dest="ascendstore_backend_timeout_margin",
        type=float,
        default=TIMEOUT_MARGIN_S,
        metavar="SECONDS",
        help=f"how far past its timeout_s a call may return before it fails (default {TIMEOUT_MARGIN_S})",
    )
    group.addoption(
        "--backend-max-test-bytes",
        dest="ascendstore_backend_max_test_bytes",
        type=int,
        default=32 << 20,
        metavar="BYTES",
        help="largest object the suite writes; the maximum-size test is capped here (default 32 MiB)",
    )


def factory_from_options(config: pytest.Config) -> BackendFactory | None:
    name = config.getoption("ascendstore_backend", default=None)
    if not name:
        return None
    try:
        backend_config = parse_json_option(config.getoption("ascendstore_backend_config"), "--backend-config")
        small = parse_json_option(
            config.getoption("ascendstore_backend_small_config"), "--backend-small-config"
        )
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    return BackendFactory(
        target=name,
        config=backend_config or {},
        small_config=small,
        timeout_s=config.getoption("ascendstore_backend_timeout"),
        timeout_margin_s=config.getoption("ascendstore_backend_timeout_margin"),
        max_test_bytes=config.getoption("ascendstore_backend_max_test_bytes"),
    )
