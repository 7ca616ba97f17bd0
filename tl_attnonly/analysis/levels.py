"""Rankings for many heads: neuron-level aggregation and streamed composition top-k.

GPT-2-small at K = 4 has 147,456 neuron-heads. Rankings list neurons, not their ``K`` sub-heads,
by default (:func:`neuron_level`; ``top_k(..., level="head")`` for heads), and the strongest
composition pairs are found without building the ``n_senders x n_receivers`` matrix
(:func:`composition_top_k`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

import pandas as pd
import torch
from jaxtyping import Float

from tl_attnonly.analysis.circuits import _composition_blocks, _layers
from tl_attnonly.hooks import HeadRef, all_head_refs, head_labels, parse_head_label

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


def composition_top_k(
    model,
    mode: Literal["Q", "K", "V"],
    k: int = 10,
    senders: Sequence[str | HeadRef] | None = None,
    receivers: Sequence[str | HeadRef] | None = None,
    *,
    largest: bool = True,
    progress: bool = False,
    per_unit_u: bool = False,
    level: Literal["neuron", "head"] = "neuron",
) -> pd.DataFrame:
    """The ``k`` strongest (or weakest) composition pairs, streamed block by block: the full score
    matrix is never built, so every head of a large model fits (memory: one block at a time).

    The same pairs and scores as ``composition_scores(model, mode, senders, receivers).top_k(k,
    level=level)`` (tested); pairs whose receiver reads before the sender writes are left out.

    At ``level="neuron"`` (the default) a neuron is one entry, ``L{l}N{i}``, not ``K``: its heads
    write the same ``W_out[i]`` and read multiples of one column of ``W_in`` (``b_k``, ``f_k``
    times it), and composition scores are scale-free, so every head of a neuron has the neuron's
    score; one head per neuron is scored (``K^2`` times fewer pairs).

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer`.
        mode: ``"Q"``, ``"K"`` or ``"V"``.
        k: How many pairs.
        senders: Heads that write (labels or :class:`HeadRef`); default every head.
        receivers: Heads that read; default every head.
        largest: Strongest (default) or weakest pairs.
        progress: Show a progress bar over sender groups.
        per_unit_u: As for :func:`~tl_attnonly.analysis.composition_scores` (gated models).
        level: ``"neuron"`` (default; labels ``L{l}N{i}``) or ``"head"`` (``L{l}N{i}.{k}``).
            At neuron level a head in ``senders``/``receivers`` stands for its neuron.

    Returns:
        A DataFrame with columns ``sender, receiver, score``.
    """
    if mode not in ("Q", "K", "V"):
        raise ValueError(f"mode must be one of ['Q', 'K', 'V'], not {mode!r}.")
    if level not in ("neuron", "head"):
        raise ValueError(f"level must be 'neuron' or 'head', got {level!r}.")
    _layers(model, None)
    K = model.n_heads_per_neuron
    if level == "neuron" and K > 1:
        send, send_labels = _representatives(model, senders, None)
        recv, recv_labels = _representatives(model, receivers, mode)
    else:
        send = (
            all_head_refs(model) if senders is None else [parse_head_label(s, K) for s in senders]
        )
        recv = (
            all_head_refs(model)
            if receivers is None
            else [parse_head_label(r, K) for r in receivers]
        )
        send_labels, recv_labels = head_labels(send, K), head_labels(recv, K)
    dtype = model.W_E.dtype
    best = torch.empty(0, dtype=dtype)
    pairs = torch.empty(0, 2, dtype=torch.long)
    with torch.no_grad():
        for rows, cols, block in _composition_blocks(model, mode, send, recv, progress, per_unit_u):
            block = block.to(dtype).flatten()
            top = block.topk(min(k, block.numel()), largest=largest)
            found = torch.stack((rows[top.indices // len(cols)], cols[top.indices % len(cols)]), 1)
            best, pairs = torch.cat((best, top.values)), torch.cat((pairs, found))
            keep = best.topk(min(k, best.numel()), largest=largest).indices
            best, pairs = best[keep], pairs[keep]
    order = best.sort(descending=largest, stable=True).indices
    return pd.DataFrame(
        {
            "sender": [send_labels[i] for i in pairs[order, 0].tolist()],
            "receiver": [recv_labels[j] for j in pairs[order, 1].tolist()],
            "score": best[order].cpu().numpy(),
        }
    )


def _head_refs(model, specs: Sequence[str | HeadRef] | None) -> list[HeadRef]:
    if specs is None:
        return all_head_refs(model)
    return [parse_head_label(spec, model.n_heads_per_neuron) for spec in specs]


def _representatives(
    model, specs: Sequence[str | HeadRef] | None, mode: str | None
) -> tuple[list[HeadRef], list[str]]:
    """One head per unit (attention head or neuron) and the units' labels.

    A neuron's representative is the head whose coefficient scales the neuron's read the most
    (``|b_k|`` for queries, ``|f_k|`` for values: never 0 for a head that reads), or head 0 as a
    sender (all ``K`` heads write ``W_out[i]``) and for keys (constant).
    """
    from tl_attnonly.analysis.patching.outputs import patch_units

    refs: list[HeadRef] = []
    labels: list[str] = []
    for unit in patch_units(model, specs, level="neuron"):
        pick = 0
        if unit.kind == "neuron" and mode in ("Q", "V"):
            coefficients = model.neuron_heads[unit.layer].coefficients
            values = coefficients.b if mode == "Q" else coefficients.f
            pick = max(range(len(values)), key=lambda k: abs(values[k]))
        refs.append(HeadRef(unit.kind, unit.layer, unit.heads[pick]))
        labels.append(unit.label)
    return refs, labels


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


__all__ = ["composition_top_k", "neuron_level", "neuron_level_pairs"]
