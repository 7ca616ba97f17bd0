"""Rankings: :func:`top_k` of labelled scores, and neuron-level aggregation.

GPT-2-small at K = 4 has 147,456 neuron-heads. Rankings list neurons, not their ``K`` sub-heads,
by default (:func:`neuron_level`; ``top_k(..., level="head")`` for heads). The strongest
composition pairs, found without building the ``n_senders x n_receivers`` matrix, are
:func:`tl_attnonly.analysis.circuits.composition_top_k`. This module imports nothing else of
:mod:`tl_attnonly.analysis`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

import pandas as pd
import torch
from jaxtyping import Float

_HEAD_OF_NEURON = re.compile(r"^(L\d+N\d+)\.\d+$")


def neuron_level(
    scores: Float[torch.Tensor, "n_heads ..."], labels: Sequence[str]
) -> tuple[Float[torch.Tensor, "n_units ..."], list[str]]:
    """Sum the ``K`` heads of each neuron: rows ``L{l}N{i}.{k}`` become one row ``L{l}N{i}``.

    For additive per-head quantities: direct logit attribution, per-head results, ``z`` (a
    neuron's ``hook_post`` is the sum of its heads' ``z``), attribution-patching estimates (the
    neuron's estimate is the sum of its heads'). Not for exact patching effects, which do not add
    up: patch the neuron's heads together instead
    (:func:`~tl_attnonly.analysis.get_act_patch_outputs`, ``level="neuron"``). Other rows
    (attention heads, one-head neurons) are kept; rows keep the order of their first head.

    Args:
        scores: ``[n_heads, ...]`` per-head values.
        labels: The rows' labels.

    Returns:
        ``(scores, labels)`` at neuron level.
    """
    if scores.shape[0] != len(labels):
        raise ValueError(f"{len(labels)} labels for {scores.shape[0]} rows.")
    units: dict[str, int] = {}
    group = []
    for label in labels:
        match = _HEAD_OF_NEURON.match(label)
        group.append(units.setdefault(match.group(1) if match else label, len(units)))
    if len(units) == len(labels):
        return scores, list(labels)
    index = torch.tensor(group, device=scores.device)
    out = scores.new_zeros(len(units), *scores.shape[1:]).index_add_(0, index, scores)
    return out, list(units)


def neuron_level_pairs(
    scores: Float[torch.Tensor, "n_rows n_cols"],
    row_labels: Sequence[str],
    col_labels: Sequence[str],
) -> tuple[Float[torch.Tensor, "n_row_units n_col_units"], list[str], list[str]]:
    """Pairwise head scores (composition scores) at neuron level: the maximum over each pair of
    units' heads. For composition scores every head of a neuron has the neuron's score (see
    :func:`composition_top_k`), so this keeps it and drops the ``K^2 - 1`` copies.

    Args:
        scores: ``[n_rows, n_cols]`` per-head-pair scores.
        row_labels, col_labels: The heads' labels.

    Returns:
        ``(scores, row unit labels, column unit labels)``.
    """
    rows, row_units = _groups(row_labels, scores.device)
    cols, col_units = _groups(col_labels, scores.device)
    fill = torch.finfo(scores.dtype).min if scores.is_floating_point() else 0
    out = scores.new_full((len(row_units), scores.shape[1]), fill)
    out = out.scatter_reduce(0, rows[:, None].expand_as(scores), scores, "amax")
    final = scores.new_full((len(row_units), len(col_units)), fill)
    final = final.scatter_reduce(1, cols[None, :].expand_as(out), out, "amax")
    return final, row_units, col_units


def _groups(labels: Sequence[str], device: torch.device) -> tuple[torch.Tensor, list[str]]:
    units: dict[str, int] = {}
    group = []
    for label in labels:
        match = _HEAD_OF_NEURON.match(label)
        group.append(units.setdefault(match.group(1) if match else label, len(units)))
    return torch.tensor(group, device=device, dtype=torch.long), list(units)


def top_k(
    scores: torch.Tensor,
    row_labels: Sequence[str],
    col_labels: Sequence[str] | None = None,
    k: int = 10,
    largest: bool = True,
    absolute: bool = False,
    level: Literal["neuron", "head"] = "neuron",
) -> pd.DataFrame:
    """The ``k`` largest (or smallest) entries of a labelled score vector or matrix.

    Ranked per neuron by default. A vector of additive per-head scores (attribution estimates, DLA,
    ``z``) sums the ``K`` heads ``L{l}N{i}.{k}`` of a neuron into ``L{l}N{i}``
    (:func:`neuron_level`); exact patching effects do not add up
    (patch neurons with ``get_act_patch_outputs(level="neuron")``). A matrix of pair scores
    (composition scores, where a neuron's ``K`` heads all have the neuron's score) keeps the
    maximum over each pair of units' heads
    (:func:`neuron_level_pairs`).

    Args:
        scores: ``[n]`` (e.g. per-head attributions) or ``[n_rows, n_cols]`` (e.g. composition
            scores).
        row_labels: Labels of the first axis.
        col_labels: Labels of the second axis (2-d scores only).
        k: How many entries.
        largest: Largest (default) or smallest first.
        absolute: Rank by ``|score|`` (the table still shows the signed score).
        level: ``"neuron"`` (default) ranks units (neurons and attention heads): sums of heads
            for vectors, the maximum over heads for matrices; ``"head"`` ranks the heads.

    Returns:
        A DataFrame with columns ``label, score`` (1-d) or ``sender, receiver, score`` (2-d).
    """
    if scores.ndim not in (1, 2):
        raise ValueError(f"scores must be 1-d or 2-d, got shape {tuple(scores.shape)}.")
    if scores.shape[0] != len(row_labels) or (
        scores.ndim == 2 and (col_labels is None or scores.shape[1] != len(col_labels))
    ):
        raise ValueError("Labels must match the scores' shape (col_labels for 2-d scores).")
    if level not in ("neuron", "head"):
        raise ValueError(f"level must be 'neuron' or 'head', got {level!r}.")
    if scores.ndim == 1 and level == "neuron":
        scores, row_labels = neuron_level(scores, row_labels)
    elif level == "neuron" and col_labels is not None:
        scores, row_labels, col_labels = neuron_level_pairs(scores, row_labels, col_labels)
    flat = scores.detach().flatten()
    key = flat.abs() if absolute else flat
    idx = key.topk(min(k, flat.numel()), largest=largest).indices
    if scores.ndim == 1:
        return pd.DataFrame(
            {"label": [row_labels[i] for i in idx.tolist()], "score": flat[idx].cpu().numpy()}
        )
    n_cols = scores.shape[1]
    return pd.DataFrame(
        {
            "sender": [row_labels[i // n_cols] for i in idx.tolist()],
            "receiver": [col_labels[i % n_cols] for i in idx.tolist()],  # type: ignore[index]
            "score": flat[idx].cpu().numpy(),
        }
    )


__all__ = ["neuron_level", "neuron_level_pairs", "top_k"]
