"""The bundled text: fidelity sentences and prompts (``tl_attnonly/data``), read without torch.

:func:`load_sentences` and :func:`load_prompts` are also importable from
:mod:`tl_attnonly.fidelity` and :mod:`tl_attnonly.fidelity_lm`, which measure models on them; the
analysis tools (induction token pools) read them from here, on any TransformerLens line.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def load_sentences(path: str | Path | None = None) -> list[str]:
    """The bundled fidelity sentences (``tl_attnonly/data/sentences.txt``), or those of ``path``.

    One sentence per line; blank lines are skipped.
    """
    if path is None:
        text = resources.files("tl_attnonly").joinpath("data/sentences.txt").read_text("utf-8")
    else:
        text = Path(path).read_text("utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def load_prompts(path: str | Path | None = None) -> list[str]:
    """The bundled fidelity prompts (300), or the lines of ``path``; ``\\n`` becomes a newline.

    Args:
        path: A text file with one prompt per line; default: ``data/sentences.txt`` followed by
            ``data/prompts.txt``.
    """
    if path is not None:
        lines = Path(path).read_text("utf-8").splitlines()
    else:
        text = resources.files("tl_attnonly").joinpath("data/prompts.txt").read_text("utf-8")
        lines = load_sentences() + text.splitlines()
    return [line.strip().replace("\\n", "\n") for line in lines if line.strip()]


__all__ = ["load_prompts", "load_sentences"]
