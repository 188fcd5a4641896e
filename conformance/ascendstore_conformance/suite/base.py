"""Fixtures shared by every behaviour class, and the capability gates.

Override ``backend_factory`` in a subclass to test a backend from your own
test tree; the default reads ``--backend``/``--backend-config``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from ascendstore.contract import BackendTestHooks, Capabilities
from ascendstore_conformance.factory import BackendFactory
from ascendstore_conformance.harness import Harness, guarded
from ascendstore_conformance.options import factory_from_options

OpenClient = Callable[..., Harness]


class ConformanceFixtures:
    @pytest.fixture
    def backend_factory(self, request: pytest.FixtureRequest) -> BackendFactory:
        """The backend under test. Override in your subclass."""
        factory = factory_from_options(request.config)
        if factory is None:
            pytest.fail(
                "no backend under test: run with --backend NAME [--backend-config JSON], or subclass "
                "BackendConformance and override the backend_factory fixture",
                pytrace=False,
            )
        return factory

    @pytest.fixture
    def bound_factory(self, backend_factory: BackendFactory, tmp_path) -> BackendFactory:
        if not isinstance(backend_factory, BackendFactory):
            pytest.fail(
                f"backend_factory must return a BackendFactory, got {backend_factory!r}", pytrace=False
            )
        return backend_factory.bound(tmp_path, f"cf{uuid.uuid4().hex[:10]}")

    @pytest.fixture
    def open_client(self, bound_factory: BackendFactory) -> Iterator[OpenClient]:
        """Opens more clients of the test's store; all are closed at teardown."""
        opened: list[Harness] = []

        def open_(*, small: bool = False, rank: int = 0, existing_only: bool = False) -> Harness:
            if small and bound_factory.small_config is None:
                pytest.skip(
                    f"no small_config for {bound_factory.name}: give --backend-small-config JSON (or "
                    "BackendFactory.small_config), a store of a few MiB, to test a full store"
                )
            backend = guarded(
                f"{bound_factory.name}.create()",
                bound_factory.timeout_s,
                lambda: bound_factory.open(small=small, rank=rank, existing_only=existing_only),
            )
            h = Harness(backend, bound_factory.timeout_s, bound_factory.name, bound_factory.timeout_margin_s)
            opened.append(h)
            return h

        yield open_
        for h in reversed(opened):
            h.close()

    @pytest.fixture
    def harness(self, open_client: OpenClient) -> Harness:
        return open_client()


def require(h: Harness, capability: str) -> None:
    """Skip, naming the capability, unless the backend declares it."""
    value = getattr(h.caps, capability)
    assert capability in Capabilities.__dataclass_fields__
    if not value:
        pytest.skip(f"capability {capability}=False declared by {h.name}: behaviour not promised, not tested")


def require_hook(h: Harness, hook: str) -> Callable[..., object]:
    """The named test hook of the backend, or skip naming it."""
    hooks: BackendTestHooks | None = h.backend.test_hooks()
    fn = getattr(hooks, hook, None) if hooks is not None else None
    if fn is None:
        pytest.skip(
            f"test hook {hook}() not offered by {h.name} (Backend.test_hooks() -> BackendTestHooks): "
            "behaviour not tested"
        )
    return fn


def object_size(h: Harness, want: int) -> int:
    """``want`` capped by the declared object size limit."""
    return max(1, min(want, h.caps.max_object_bytes))
