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

    For additive per-head quantities: direct logit attribution, per-head results, attribution
    scores, the effect of patching ``z`` (a neuron's ``hook_post`` is the sum of its heads'
    ``z``). Other rows (attention heads, one-head neurons) are kept; rows keep the order of their
    first head.

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
) -> pd.DataFrame:
    """The ``k`` strongest (or weakest) composition pairs, streamed block by block: the full score
    matrix is never built, so every head of a large model fits (memory: one block at a time).

    The same pairs and scores as ``composition_scores(model, mode, senders, receivers).top_k(k)``
    (tested); pairs whose receiver reads before the sender writes are left out.

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer`.
        mode: ``"Q"``, ``"K"`` or ``"V"``.
        k: How many pairs.
        senders: Heads that write (labels or :class:`HeadRef`); default every head.
        receivers: Heads that read; default every head.
        largest: Strongest (default) or weakest pairs.
        progress: Show a progress bar over sender groups.
        per_unit_u: As for :func:`~tl_attnonly.analysis.composition_scores` (gated models).

    Returns:
        A DataFrame with columns ``sender, receiver, score``.
    """
    if mode not in ("Q", "K", "V"):
        raise ValueError(f"mode must be one of ['Q', 'K', 'V'], not {mode!r}.")
    _layers(model, None)
    K = model.n_heads_per_neuron
    send = all_head_refs(model) if senders is None else [parse_head_label(s, K) for s in senders]
    recv = (
        all_head_refs(model) if receivers is None else [parse_head_label(r, K) for r in receivers]
    )
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
    send_labels, recv_labels = head_labels(send, K), head_labels(recv, K)
    return pd.DataFrame(
        {
            "sender": [send_labels[i] for i in pairs[order, 0].tolist()],
            "receiver": [recv_labels[j] for j in pairs[order, 1].tolist()],
            "score": best[order].cpu().numpy(),
        }
    )


__all__ = ["composition_top_k", "neuron_level"]
