"""docs/backend-authors.md cannot drift from the code: its call table is
generated from ascendstore/contract.py, and it (and docs/cli.md) name every
option of the suite."""

from pathlib import Path

from ascendstore_conformance.options import add_options

from ascendstore.contractdoc import GUIDE, render

ROOT = Path(__file__).resolve().parents[1]


def test_guide_signatures_are_current():
    committed = GUIDE.read_text()
    assert committed == render(committed), "docs/backend-authors.md is stale: run `python -m ascendstore.contractdoc`"


def test_guide_shows_the_signatures_authors_tripped_on():
    guide = GUIDE.read_text()
    assert "| `capabilities -> Capabilities` | **required**, a `@property` |" in guide
    assert "`health(timeout_s: float) -> Health`" in guide
    assert "`list_keys(prefix: str = '', limit: int = 1000) -> Iterator[str]`" in guide
    assert "`break_store() -> None`" in guide


class _Recorder:
    def __init__(self) -> None:
        self.names: set[str] = set()

    def getgroup(self, *_):
        return self

    def addoption(self, *names, **_):
        self.names.update(names)


def test_docs_name_every_suite_option_and_the_test_tool():
    rec = _Recorder()
    add_options(rec)
    guide, cli = GUIDE.read_text(), (ROOT / "docs" / "cli.md").read_text()
    readme = (ROOT / "conformance" / "README.md").read_text()
    for name in rec.names:
        assert f"`{name}" in guide, f"docs/backend-authors.md does not describe {name}"
        assert name in readme, f"conformance/README.md does not mention {name}"
        if name != "--backend":
            assert name in cli, f"docs/cli.md does not mention {name}"
    assert "faulty" in guide and "test tool" in guide
