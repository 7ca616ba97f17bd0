"""Composition scores between heads (Elhage et al. 2021) on the neuron-head circuits.

:func:`composition_scores` uses TransformerLens's definition (``||L R||_F / (||L||_F ||R||_F)``) on
the circuits of :mod:`tl_attnonly.analysis.circuits`: the sender's OV on the left; on the right the
receiver's QK (Q-composition), QK^T (K-composition) or OV (V-composition); a neuron-head's
K-composition is 0 (its keys read nothing). :func:`composition_top_k` streams the strongest pairs
without building the ``n_senders x n_receivers`` matrix. See :mod:`tl_attnonly.analysis.circuits`
for the homogeneous QK circuit, LayerNorm and gated MLPs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import pandas as pd
import torch
from jaxtyping import Float
from tqdm.auto import tqdm
from transformer_lens import FactoredMatrix

from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.circuits import (
    key_homogeneous,
    neuron_ov_circuit,
    value_weights,
)
from tl_attnonly.analysis.levels import top_k
from tl_attnonly.analysis.patching.dense_layers import head_refs, refuse_expert_refs
from tl_attnonly.hooks import HeadRef, head_labels, parse_head_label
from tl_attnonly.protocol import AttnOnlyModel, ModelLike

#: Default memory budget (bytes) for a matrix of pairwise scores.
SCORES_BUDGET = 2 * 2**30


#: Elements of one ``[chunk * d_head_sender, n_receivers * d_head_receiver]`` product block.
_BLOCK_ELEMENTS = 2**25


# ------------------------------------------------------------------------------------------------
# composition scores
# ------------------------------------------------------------------------------------------------
def _right_matrix(
    model: AttnOnlyModel, kind: str, layer: int, mode: str, per_unit_u: bool = False
) -> FactoredMatrix | None:
    """The receiver-side FactoredMatrix of one layer's heads (None: reads nothing)."""
    if kind == "attn":
        attn = model.blocks[layer].attn
        if mode == "Q":
            return FactoredMatrix(attn.W_Q, attn.W_K.transpose(-2, -1))
        if mode == "K":
            return FactoredMatrix(attn.W_Q, attn.W_K.transpose(-2, -1)).T
        return FactoredMatrix(attn.W_V, attn.W_O)
    mlp = model.blocks[layer].mlp
    if mode == "Q":
        # The rows of the homogeneous QK circuit that read the residual stream.
        return FactoredMatrix(mlp.W_Q, key_homogeneous(mlp))
    if mode == "K":
        return None  # keys are constant: a neuron-head's key reads nothing
    return FactoredMatrix(value_weights(mlp, per_unit_u), mlp.W_O)


def _left_matrix(
    model: AttnOnlyModel, kind: str, layer: int, per_unit_u: bool = False
) -> FactoredMatrix:
    if kind == "attn":
        attn = model.blocks[layer].attn
        return FactoredMatrix(attn.W_V, attn.W_O)
    return neuron_ov_circuit(model, layer, per_unit_u=per_unit_u)


#: Senders per streamed block of composition scores (bounds one block's memory).
_SENDERS_PER_BLOCK = 4096


def _stage(model: AttnOnlyModel, kind: str, layer: int) -> int:
    """Order of sublayers in the residual stream: a head can compose with later stages only."""
    if kind == "attn" or model.cfg.parallel_attn_mlp:
        return 2 * layer
    return 2 * layer + 1


@dataclass
class CompositionScores:
    """Composition scores between sender heads (rows) and receiver heads (columns).

    Attributes:
        scores: ``[n_senders, n_receivers]``; 0 where the receiver cannot read the sender (same or
            earlier sublayer), as in TransformerLens's ``all_composition_scores``.
        senders: Row labels.
        receivers: Column labels.
        mode: ``"Q"``, ``"K"`` or ``"V"``.
    """

    scores: Float[torch.Tensor, "n_senders n_receivers"]
    senders: list[str]
    receivers: list[str]
    mode: str

    def top_k(
        self, k: int = 10, largest: bool = True, level: Literal["neuron", "head"] = "neuron"
    ) -> pd.DataFrame:
        """The ``k`` strongest (``largest``) or weakest pairs: sender, receiver, score; per neuron
        by default (``level="head"``: per head; see :func:`top_k`)."""
        return top_k(self.scores, self.senders, self.receivers, k=k, largest=largest, level=level)

    def to_frame(self) -> pd.DataFrame:
        """The scores as a labelled DataFrame (rows: senders, columns: receivers)."""
        return pd.DataFrame(
            self.scores.detach().cpu().numpy(), index=self.senders, columns=self.receivers
        )


def composition_scores(
    model: ModelLike,
    mode: Literal["Q", "K", "V"],
    senders: Sequence[str | HeadRef] | None = None,
    receivers: Sequence[str | HeadRef] | None = None,
    *,
    max_bytes: int = SCORES_BUDGET,
    progress: bool = False,
    per_unit_u: bool = False,
) -> CompositionScores:
    """Q-, K- or V-composition scores between any heads: attention heads and neuron-heads.

    TransformerLens's ``utils.composition_scores`` evaluated for every (sender, receiver) pair,
    from each head's collapsed factors (``FactoredMatrix.collapse_l`` / ``collapse_r``), so that a
    pair costs a ``[rank_sender, d_model] x [d_model, rank_receiver]`` product; neuron-heads have
    rank 1. For attention-head pairs this is ``model.all_composition_scores(mode)``.

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` (``fold_ln=True`` recommended).
        mode: ``"Q"``, ``"K"`` or ``"V"`` composition.
        senders: Heads that write (labels or :class:`HeadRef`); default every head (on a
            mixture of experts: the attention heads and the dense layers' neuron-heads; an
            expert layer's neuron-heads refuse, naming :mod:`tl_attnonly.analysis.experts`).
        receivers: Heads that read; default every head (as for ``senders``).
        max_bytes: Refuse to build a larger score matrix; narrow senders/receivers instead.
        progress: Show a progress bar over sender groups.
        per_unit_u: Gated MLPs: use each gated neuron-head's OV circuit per unit of its linear
            branch ``u`` (:func:`neuron_ov_circuit`) where a score needs one (any sender; V
            receivers). Without it such scores raise. Q-composition into gated neuron-heads needs
            nothing (their queries are linear in the residual).

    Returns:
        :class:`CompositionScores` (``.scores``, ``.senders``, ``.receivers``, ``.top_k()``).
    """
    model = analysis_model(model)
    if mode not in ("Q", "K", "V"):
        raise ValueError(f"mode must be one of ['Q', 'K', 'V'], not {mode!r}.")
    with torch.no_grad():
        return _composition_scores(model, mode, senders, receivers, max_bytes, progress, per_unit_u)


def _composition_scores(
    model: AttnOnlyModel, mode, senders, receivers, max_bytes, progress, per_unit_u
) -> CompositionScores:
    K = model.n_heads_per_neuron
    send, recv = _head_refs(model, senders), _head_refs(model, receivers)
    dtype = model.W_E.dtype
    size = len(send) * len(recv) * torch.empty((), dtype=dtype).element_size()
    if size > max_bytes:
        raise MemoryError(
            f"{len(send)} x {len(recv)} scores need {size / 2**30:.2f} GiB (budget "
            f"{max_bytes / 2**30:.2f} GiB). Use tl_attnonly.analysis.composition_top_k (streams "
            "the top pairs, no matrix), pass senders=[...] / receivers=[...] (e.g. "
            "all_head_refs(model, layers=[3])) or raise max_bytes."
        )
    scores = model.W_E.new_zeros(len(send), len(recv))
    for rows, cols, block in composition_blocks(model, mode, send, recv, progress, per_unit_u):
        scores[rows[:, None], cols[None, :]] = block.to(scores.dtype)
    return CompositionScores(scores, head_labels(send, K), head_labels(recv, K), mode)


def _head_refs(model: AttnOnlyModel, specs: Sequence[str | HeadRef] | None) -> list[HeadRef]:
    """The heads ``specs`` names, or by default every head with weights of its own: the attention
    heads and the neuron-heads of dense layers (a mixture of experts' layer has no neuron-heads of
    its own: each expert sees only the tokens routed to it). Neuron-heads named in such a layer
    are refused before any work, naming what works."""
    if specs is None:
        return head_refs(model)
    refs = [parse_head_label(spec, model.n_heads_per_neuron) for spec in specs]
    refuse_expert_refs(model, refs, "Composition scores of neuron-heads")
    return refs


def composition_blocks(
    model: ModelLike,
    mode: str,
    send: list[HeadRef],
    recv: list[HeadRef],
    progress: bool,
    per_unit_u: bool,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(sender rows, receiver columns, scores)`` for every block of pairs in which the receiver
    reads after the sender writes; a block holds at most :data:`_SENDERS_PER_BLOCK` senders.

    Used by :func:`composition_scores` and :func:`composition_top_k`."""
    model = analysis_model(model)
    # Receiver side: collapsed [d_model, rank] per head and its norm, grouped by (kind, layer).
    recv_groups: dict[tuple[str, int], list[int]] = {}
    for j, ref in enumerate(recv):
        recv_groups.setdefault((ref.kind, ref.layer), []).append(j)
    right: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for (kind, layer), cols in recv_groups.items():
        heads = torch.tensor([recv[j].head for j in cols])
        fm = _right_matrix(model, kind, layer, mode, per_unit_u)
        if fm is None:
            continue
        fm = fm[(heads,)]
        collapsed = fm.collapse_r()  # [n, d_model, rank]
        right[(kind, layer)] = (collapsed, collapsed.norm(dim=(-2, -1)), torch.tensor(cols))

    send_groups: dict[tuple[str, int], list[int]] = {}
    for i, ref in enumerate(send):
        send_groups.setdefault((ref.kind, ref.layer), []).append(i)
    for (kind, layer), rows in tqdm(
        list(send_groups.items()), desc="composition", disable=not progress
    ):
        heads = torch.tensor([send[i].head for i in rows])
        sender_ov = _left_matrix(model, kind, layer, per_unit_u)
        left = sender_ov[(heads,)].collapse_l()  # [n, rank, d_model]
        l_norms = left.norm(dim=(-2, -1))
        stage = _stage(model, kind, layer)
        for (r_kind, r_layer), (r_coll, r_norms, col_index) in right.items():
            if _stage(model, r_kind, r_layer) <= stage:
                continue  # the receiver reads before the sender writes: score 0, as in TL
            for start in range(0, len(rows), _SENDERS_PER_BLOCK):
                part = slice(start, start + _SENDERS_PER_BLOCK)
                block = _pair_norms(left[part], r_coll) / l_norms[part, None] / r_norms[None, :]
                yield torch.tensor(rows[part]), col_index, block


def composition_top_k(
    model: ModelLike,
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
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` or a ``TransformerBridge``
            converted with :func:`tl_attnonly.convert` (in place).
        mode: ``"Q"``, ``"K"`` or ``"V"``.
        k: How many pairs.
        senders: Heads that write (labels or :class:`HeadRef`); default every head (on a
            mixture of experts: the attention heads and the dense layers' neuron-heads; an
            expert layer's neuron-heads refuse, naming :mod:`tl_attnonly.analysis.experts`).
        receivers: Heads that read; default every head (as for ``senders``).
        largest: Strongest (default) or weakest pairs.
        progress: Show a progress bar over sender groups.
        per_unit_u: As for :func:`~tl_attnonly.analysis.composition_scores` (gated models).
        level: ``"neuron"`` (default; labels ``L{l}N{i}``) or ``"head"`` (``L{l}N{i}.{k}``).
            At neuron level a head in ``senders``/``receivers`` stands for its neuron.

    Returns:
        A DataFrame with columns ``sender, receiver, score``.
    """
    model = analysis_model(model)
    if mode not in ("Q", "K", "V"):
        raise ValueError(f"mode must be one of ['Q', 'K', 'V'], not {mode!r}.")
    if level not in ("neuron", "head"):
        raise ValueError(f"level must be 'neuron' or 'head', got {level!r}.")
    K = model.n_heads_per_neuron
    if level == "neuron" and K > 1:
        send, send_labels = _representatives(model, senders, None)
        recv, recv_labels = _representatives(model, receivers, mode)
    else:
        send, recv = _head_refs(model, senders), _head_refs(model, receivers)
        send_labels, recv_labels = head_labels(send, K), head_labels(recv, K)
    dtype = model.W_E.dtype
    best = torch.empty(0, dtype=dtype)
    pairs = torch.empty(0, 2, dtype=torch.long)
    with torch.no_grad():
        for rows, cols, block in composition_blocks(model, mode, send, recv, progress, per_unit_u):
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


def _representatives(
    model: AttnOnlyModel, specs: Sequence[str | HeadRef] | None, mode: str | None
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


def _pair_norms(
    left: Float[torch.Tensor, "n_s r_s d_model"], right: Float[torch.Tensor, "n_r d_model r_r"]
) -> Float[torch.Tensor, "n_s n_r"]:
    """``||left[s] @ right[r]||_F`` for every pair, in chunks of senders."""
    n_s, r_s, d = left.shape
    n_r, _, r_r = right.shape
    right_flat = right.permute(1, 0, 2).reshape(d, n_r * r_r)
    chunk = max(1, _BLOCK_ELEMENTS // max(1, r_s * n_r * r_r))
    out = []
    for start in range(0, n_s, chunk):
        prod = left[start : start + chunk].reshape(-1, d) @ right_flat
        prod = prod.reshape(-1, r_s, n_r, r_r)
        out.append(prod.pow(2).sum(dim=(1, 3)).sqrt())
    return torch.cat(out)


__all__ = ["SCORES_BUDGET", "CompositionScores", "composition_scores", "composition_top_k"]
