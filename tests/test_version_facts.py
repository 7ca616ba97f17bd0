"""What the docs say about TransformerLens versions agrees with the package's own requirement.

``pyproject.toml`` requires one range of ``transformer-lens``. Every place the docs or the README
state the package's requirement ("requires" or "pins", then the range in backticks) must quote
that range, and every ``transformer-lens`` range an install command there or in ``.ci/run`` asks
for must lie inside it. Statements that a part of the package does not import on a line, which
were true before TransformerLens 4 was supported, must not come back.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
#: A statement of the package's own requirement: "requires `transformer-lens>=3.0,<5`".
STATED = re.compile(r"(?:requires|pins) `transformer-lens([^`]*)`")
#: A range an install command asks for: "transformer-lens>=3.9,<4" in quotes.
INSTALLED = re.compile(r"[\"']transformer-lens([<>=!~][^\"']*)[\"']")
#: Claims that were true before both lines were supported (each was in the docs once).
STALE = (
    "`tl_attnonly.analysis` does not import",
    "analysis does not import on",
    "pins `transformer-lens>=3.0,<4`",
)


def _required() -> SpecifierSet:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"]:
        requirement = Requirement(line)
        if requirement.name == "transformer-lens":
            return requirement.specifier
    raise AssertionError("pyproject.toml does not require transformer-lens")


def test_stated_requirements_quote_pyproject():
    required = _required()
    stated = [
        (page.name, SpecifierSet(spec))
        for page in PAGES
        for spec in STATED.findall(page.read_text())
    ]
    assert stated, "some page states the requirement"
    assert all(spec == required for _, spec in stated), (required, stated)


def test_install_commands_ask_for_a_range_inside_the_requirement():
    required = _required()
    sources = [*PAGES, ROOT / ".ci" / "run"]
    asked = [(path.name, spec) for path in sources for spec in INSTALLED.findall(path.read_text())]
    assert asked, "some install command names a transformer-lens range"
    for name, spec in asked:
        lowest = min(
            (Version(s.version) for s in SpecifierSet(spec) if s.operator in (">=", "==")),
            default=None,
        )
        assert lowest is not None and lowest in required, (name, spec, str(required))


def test_no_stale_claims_about_what_imports_where():
    found = [(page.name, claim) for page in PAGES for claim in STALE if claim in page.read_text()]
    assert not found, found
