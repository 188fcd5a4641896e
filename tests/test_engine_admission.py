"""Save admission (ascendstore.engine.admission): seen-N-times and per-step byte budget."""

from __future__ import annotations

import pytest

from ascendstore.config import load_config
from ascendstore.engine.admission import SaveAdmission
from ascendstore.errors import ConfigError


def test_default_admits_everything_and_tracks_nothing():
    a = SaveAdmission()
    assert not a.active
    assert a.admit([f"c{i}" for i in range(100)], 4096)[0] == 100
    assert a.tracked == 0


def test_admit_after_hits_saves_on_the_nth_sighting_prefix_closed():
    a = SaveAdmission(admit_after_hits=2)
    n, st = a.admit(["p0", "p1", "x0"], 10)
    assert n == 0 and st.refused_hits == 3
    # Same prefix, different tail: the shared prefix is admitted, the new tail is not.
    n, st = a.admit(["p0", "p1", "y0"], 10)
    assert n == 2 and st.refused_hits == 1
    # A chunk seen twice behind a chunk seen once is not admitted (useless without its prefix).
    n, _ = a.admit(["z0", "x0"], 10)
    assert n == 0


def test_sightings_are_bounded_lru():
    a = SaveAdmission(admit_after_hits=2, track_chunks=100)
    a.admit(["hot"], 1)
    for i in range(1000):
        a.admit([f"cold{i}"], 1)
        if i % 50 == 0:
            a.admit(["hot"], 1)  # kept recent: remembered
    assert a.tracked == 100
    assert a.admit(["hot"], 1)[0] == 1
    assert a.admit(["cold0"], 1)[0] == 0, "a chunk not seen for long is forgotten (counts from 0)"


def test_byte_budget_per_step():
    a = SaveAdmission(budget_bytes_per_step=25)
    n, st = a.admit(["a", "b", "c", "d"], 10)
    assert n == 2 and st.refused_budget == 2
    assert a.admit(["e"], 10)[0] == 0  # same step: spent
    a.new_step()
    assert a.admit(["e", "f"], 10)[0] == 2


def test_config_keys_validate():
    cfg = load_config({"admit_after_hits": 3, "save_budget_bytes_per_step": "64MiB"})
    assert cfg.admit_after_hits == 3 and cfg.save_budget_bytes_per_step == 64 << 20
    with pytest.raises(ConfigError, match="admit_after_hits"):
        load_config({"admit_after_hits": 0})
    with pytest.raises(ConfigError, match="health_failure_threshold"):
        load_config({"health_failure_threshold": -1})
