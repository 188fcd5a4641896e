"""Config fuzzing: any kv_connector_extra_config or config file gives a config or a ConfigError."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascendstore.config import AscendStoreConfig, GRConfig, load_config
from ascendstore.errors import ConfigError

KEYS = sorted(set(AscendStoreConfig.model_fields) | {"mooncake_rpc_port"})
GR_KEYS = sorted(GRConfig.model_fields)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=12), st.sampled_from(["True", "false", "4GiB", "-1", "1e9", "", "rpc", "local"]),
)
values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                      max_leaves=6)
gr_dicts = st.dictionaries(st.sampled_from(GR_KEYS) | st.text(max_size=8), values, max_size=4)
extra = st.dictionaries(
    st.sampled_from(KEYS) | st.text(max_size=10),
    values | gr_dicts,
    max_size=6,
).filter(lambda d: "config_file" not in d)


def _outcome(fn):
    try:
        cfg = fn()
    except ConfigError as exc:
        text = str(exc)
        assert text.startswith("invalid AscendStore configuration") or "config_file" in text, text
        return None
    assert isinstance(cfg, AscendStoreConfig)
    return cfg


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(extra)
def test_any_extra_config_is_valid_or_a_clear_error(d):
    cfg = _outcome(lambda: load_config(d))
    if cfg is not None:
        unknown = set(d) - set(KEYS)
        assert not unknown, f"unknown keys accepted: {unknown}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.one_of(st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
                         extra.map(lambda d: json.dumps(d, default=str))),
       suffix=st.sampled_from([".json", ".yaml", ".toml", ".conf"]))
def test_any_config_file_is_valid_or_a_clear_error(tmp_path_factory, content, suffix):
    path = tmp_path_factory.mktemp("cfg") / f"c{suffix}"
    path.write_text(content, encoding="latin-1")
    _outcome(lambda: load_config({"config_file": str(path)}))
