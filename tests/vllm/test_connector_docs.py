"""docs/connector.md lists every configuration key with its current default."""

from pathlib import Path

from ascendstore.config import config_reference
from ascendstore.docgen import render_key_section

DOC = Path(__file__).resolve().parents[2] / "docs" / "connector.md"


def test_key_table_is_current():
    text = DOC.read_text(encoding="utf-8")
    assert render_key_section(text) == text, "run: python -m ascendstore.docgen"
    for key, _, default, _ in config_reference():
        assert f"| `{key}` |" in text and f"`{default}`" in text
