"""Offline corpora for an atlas where no dataset hub is reachable: Python's own documentation
(English prose) and its standard library's source.

- ``python-docs``: the topics of Python's interactive help (``pydoc_data.topics``, shipped with
  every CPython: the language reference's sections in English, about 110,000 SmolLM2 tokens),
  one document per topic (long documents: rows of ``max_len`` tokens, few of them short);
- ``python-source``: every module of the standard library (``*.py`` outside ``test``
  directories and ``site-packages``; about 13 MB, 3.5 million SmolLM2 tokens on CPython 3.11),
  one document per file, files in sorted order;
- ``python``: the documentation, then the source.

The order is fixed (sorted paths), so a corpus and its rows are the same on every machine with
the same Python version.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path


def python_docs() -> Iterator[str]:
    """The topics of ``pydoc_data.topics``, in sorted order."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        if topics[name].strip():
            yield topics[name]


def python_source(lines_per_doc: int | None = None) -> Iterator[str]:
    """Every standard-library module's source, one document per file (or per
    ``lines_per_doc`` lines)."""
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
        step = lines_per_doc or max(len(lines), 1)
        for start in range(0, len(lines), step):
            text = "".join(lines[start : start + step])
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
