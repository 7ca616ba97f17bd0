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
the same Python version. :func:`hf_dataset` streams a Hugging Face dataset's text column
(``--corpus hf:NAME[:CONFIG][@SPLIT]``) where the hub (or a local dataset folder) is there.
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


def python_source() -> Iterator[str]:
    """Every standard-library module's source, one document per file."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p for p in stdlib.rglob("*.py")
        if not {"test", "tests", "site-packages", "idle_test"} & set(p.relative_to(stdlib).parts)
    )  # fmt: skip
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield text


def python_corpus() -> Iterator[str]:
    """:func:`python_docs`, then :func:`python_source`."""
    yield from python_docs()
    yield from python_source()


def hf_dataset(spec: str, column: str = "text") -> Iterator[str]:
    """The ``column`` strings of a Hugging Face dataset, streamed: ``spec`` is
    ``NAME[:CONFIG][@SPLIT]`` (split ``train`` by default), ``NAME`` a hub id or a local folder.

    Raises:
        ImportError: Without the ``datasets`` package.
        ValueError: If the dataset cannot be loaded (offline, unknown) or has no ``column``.
    """
    try:
        import datasets
    except ImportError as err:
        raise ImportError("Reading a Hugging Face dataset needs `pip install datasets`.") from err
    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    try:
        data = datasets.load_dataset(name, config or None, split=split or "train",
                                     streaming=True)  # fmt: skip
        first = next(iter(data), None)
    except Exception as err:  # noqa: BLE001 - the hub's errors are many; all mean "cannot read"
        raise ValueError(
            f"Cannot load the dataset {spec!r} ({type(err).__name__}: {err}). Offline, pass a "
            "local dataset folder, a text or JSONL file, or python-docs / python-source."
        ) from err
    if first is None:
        return
    if column not in first:
        raise ValueError(f"The dataset {spec!r} has no {column!r} column (it has {list(first)}).")
    for item in data:
        if isinstance(item[column], str) and item[column].strip():
            yield item[column]


#: The named corpora of ``tl-attnonly atlas --corpus NAME``.
CORPORA: dict[str, Callable[[], Iterator[str]]] = {
    "python-docs": python_docs,
    "python-source": python_source,
    "python": python_corpus,
}

__all__ = ["CORPORA", "hf_dataset", "python_corpus", "python_docs", "python_source"]
