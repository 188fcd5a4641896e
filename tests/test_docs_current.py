"""docs/configuration.md is generated from the schema; it must match the code."""

from pathlib import Path

from ascendstore.docgen import render

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_reference_is_current():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(), "docs/configuration.md is stale: run `python -m ascendstore.docgen`"


def test_render_is_stable():
    assert render() == render()
