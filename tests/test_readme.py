"""The README is the front door: its links lead somewhere, and its commands are what CI runs.

``mkdocs build --strict`` (``scripts/build_docs.sh``) checks the links of the pages in ``docs/``;
the README is not one of them, so its links are checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
#: Link targets that another branch adds (the TransformerBridge page); drop once it has landed.
NOT_YET: set[str] = set()


def _relative_links(text: str) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and t.split("#")[0]]


def test_readme_links_and_images_resolve():
    links = _relative_links(README)
    assert "docs/assets/neuron_head_pattern.png" in links  # the picture
    missing = [t for t in links if not (ROOT / t).exists() and t not in NOT_YET]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_is_a_front_door():
    assert len(README.splitlines()) <= 250


def test_the_readme_test_command_is_what_ci_runs():
    command = (
        'python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 "transformer-lens>=3.9,<4" '
        '&& .venv/bin/pip install -e ".[test]" && .venv/bin/python -m pytest -q'
    )
    assert command in README
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "# The README's test command:\n.venv/bin/python -m pytest -q\n" in ci
    assert '.venv/bin/pip install -q "transformer-lens>=3.9,<4"\n' in ci  # the same line
    demo = (
        "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install -e "
        ". && .venv/bin/tl-attnonly demo"
    )
    assert demo in README
