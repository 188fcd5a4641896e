"""Config fuzzing of every installed backend's ``backend_config`` (the core's
tests/test_config_fuzz.py covers the top-level keys): any mapping gives valid
options or a ConfigError naming the key; nothing else escapes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascendstore.errors import ConfigError
from ascendstore.registry import installed_backends, load_backend_class, parse_options

BACKENDS = sorted(n for n in installed_backends() if n in {"local", "faulty", "mooncake", "memcache", "dirstore"})

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=12),
    st.sampled_from(["True", "0", "4GiB", "16MB", "-1", "", "tcp", "rdma", "127.0.0.1:1", "get", "UNAVAILABLE"]),
)
values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6
)


@pytest.mark.parametrize("name", BACKENDS)
def test_any_backend_config_is_valid_or_a_clear_error(name, monkeypatch):
    for var in ("MOONCAKE_CONFIG_PATH", "MOONCAKE_MASTER", "MMC_LOCAL_CONFIG_PATH"):
        monkeypatch.delenv(var, raising=False)
    cls = load_backend_class(name)
    keys = sorted(cls.Options.model_fields)
    configs = st.dictionaries(st.sampled_from(keys) | st.text(max_size=10), values, max_size=5)

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(configs)
    def check(d):
        try:
            opts = parse_options(cls, d)
        except ConfigError as exc:
            text = str(exc)
            assert "backend_config" in text or name in text, text
            return
        assert isinstance(opts, cls.Options)
        assert not set(d) - set(keys) - _aliases(cls), f"unknown keys accepted: {set(d) - set(keys)}"

    check()


def _aliases(cls) -> set[str]:
    out: set[str] = set()
    for info in cls.Options.model_fields.values():
        va = info.validation_alias
        out.update(c for c in getattr(va, "choices", [va]) if isinstance(c, str))
        if isinstance(info.alias, str):
            out.add(info.alias)
    return out
