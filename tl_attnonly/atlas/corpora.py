"""Offline corpora for an atlas where no dataset hub is reachable: Python's own documentation
(English prose) and its standard library's source.

- ``python-docs``: the topics of Python's interactive help (``pydoc_data.topics``, shipped with
  every CPython: the language reference's sections in English, about 110,000 SmolLM2 tokens),
  one document per paragraph;
- ``python-source``: every module of the standard library (``*.py`` outside ``test``
  directories and ``site-packages``; about 13 MB, 3.5 million SmolLM2 tokens on CPython 3.11),
  in documents of 40 lines, files in sorted order;
- ``python``: the documentation, then the source.

The order is fixed (sorted paths), so a corpus and its rows are the same on every machine with
the same Python version.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path


def python_docs() -> Iterator[str]:
    """The paragraphs of ``pydoc_data.topics`` (topics in sorted order)."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        for paragraph in topics[name].split("\n\n"):
            if paragraph.strip():
                yield paragraph.strip() + "\n"


def python_source(lines_per_doc: int = 40) -> Iterator[str]:
    """Every standard-library module's source, in documents of ``lines_per_doc`` lines."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p for p in stdlib.rglob("*.py")
        if not {"test", "tests", "site-packages", "idle_test"} & set(p.relative_to(stdlib).parts)
    )  # fmt: skip
    for path in paths:
        try:
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        except (UnicodeDecodeError, OSError):
            continue
        for start in range(0, len(lines), lines_per_doc):
            text = "".join(lines[start : start + lines_per_doc])
            if text.strip():
                yield text


def python_corpus() -> Iterator[str]:
    """:func:`python_docs`, then :func:`python_source`."""
    yield from python_docs()
    yield from python_source()


#: The named corpora of ``tl-attnonly atlas --corpus NAME``.
CORPORA: dict[str, Callable[[], Iterator[str]]] = {
    "python-docs": python_docs,
    "python-source": python_source,
    "python": python_corpus,
}

__all__ = ["CORPORA", "python_corpus", "python_docs", "python_source"]
