"""Circuits of neuron-heads as :class:`~transformer_lens.FactoredMatrix`, and composition scores.

Elhage et al. (2021), "A Mathematical Framework for Transformer Circuits": a head is its OV circuit
``W_V W_O`` (what it moves) and its QK circuit ``W_Q W_K^T`` (where it looks). For a neuron-head
(neuron ``i``, head ``k``):

* **OV** is rank 1: ``W_V W_O = f_k W_in[:, i] W_out[i]`` (``d_model x d_model``). The value
  bias ``b_V`` and the bias token's value ``g_k`` are constants, not part of the matrix.
* **QK** is affine: the query is ``x W_Q + b_Q`` (``x``: the normalised residual stream at the
  query), every real token's key is the constant ``b_K = 1`` (``W_K = 0``) and the bias token's
  key is 0. So ``W_Q W_K^T = 0`` and the whole circuit lives in the biases. It is written in
  **homogeneous coordinates**: residual vectors get a constant-1 coordinate appended,
  ``x~ = [x, 1]``, and

      ``QK~ = [W_Q; b_Q] [W_K; b_K]^T``   (``(d_model + 1) x (d_model + 1)``, rank 1),

  so that ``score(query x, key y) = x~ QK~ y~^T = (x W_Q + b_Q) * 1``. The bias token is the
  homogeneous vector :data:`BIAS_TOKEN_HOMOGENEOUS` ``= 0`` (its key ``k_bias_token = 0``), so
  its score is 0, as in the model. The full QK circuit (:func:`neuron_full_qk_circuit`) lists the
  bias token as key 0, as :func:`tl_attnonly.hooks.dense_neuron_pattern` does.

Composition scores (:func:`composition_scores`) use TransformerLens's definition
(``transformer_lens.utils.composition_scores``: ``||L R||_F / (||L||_F ||R||_F)``) on these
matrices: the sender's OV on the left; on the right the receiver's QK (Q-composition), QK^T
(K-composition) or OV (V-composition). A neuron-head's query reads the residual stream through
``W_Q`` and its keys read nothing: its Q-composition uses the rows of ``QK~`` that read the residual
stream (``W_Q [W_K; b_K]^T``) and its K-composition is 0.

LayerNorm between heads is ignored, as in TransformerLens's ``all_composition_scores`` and full
circuits: use a model loaded with ``fold_ln=True`` (or converted from one).

**Gated MLPs** (SwiGLU, GeGLU; ``docs/gated_mlps.md``): the QK circuit is as above with ``W_Q =
b_k W_gate[:, i]`` and ``b_Q = d_k``. The value ``(f_k g + e_k - g_k) u`` is a product of two
projections of the residual, so there is no OV matrix: the OV functions and V-composition refuse
gated layers unless asked for ``per_unit_u=True``, the OV circuit per unit of the linear branch
``u = x W_in[:, i]`` (``f_k W_gate[:, i] (x) W_out[i]``), which at a given prompt is scaled by
that position's ``u`` (``hook_pre_linear``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pandas as pd
import torch
from jaxtyping import Float
from tqdm.auto import tqdm
from transformer_lens import FactoredMatrix

from tl_attnonly._types import require_neuron_heads
from tl_attnonly.analysis.levels import top_k
from tl_attnonly.components.gated_neuron_heads import GatedNeuronHeadMLP
from tl_attnonly.hooks import HeadRef, all_head_refs, head_labels, parse_head_label
from tl_attnonly.neuron_head_model import NeuronHeadModelMixin

#: Default memory budget (bytes) for a matrix of pairwise scores.
SCORES_BUDGET = 2 * 2**30

#: Elements of one ``[chunk * d_head_sender, n_receivers * d_head_receiver]`` product block.
_BLOCK_ELEMENTS = 2**25


def homogeneous(x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_model_plus_1"]:
    """Append the constant-1 coordinate: ``[x, 1]`` (the coordinates of the QK circuits here)."""
    return torch.cat([x, x.new_ones(x.shape[:-1] + (1,))], dim=-1)


def bias_token_homogeneous(model: NeuronHeadModelMixin) -> torch.Tensor:
    """The bias token in homogeneous coordinates: the zero vector (so its key, and score, are 0)."""
    return model.W_E.new_zeros(model.cfg.d_model + 1)


def layer_indices(model: NeuronHeadModelMixin, layer: int | None) -> list[int]:
    """``[layer]``, or every layer for ``None``; a ``ValueError`` for a layer out of range.

    """
    require_neuron_heads(model)
    if layer is None:
        return list(range(model.cfg.n_layers))
    if not 0 <= layer < model.cfg.n_layers:
        raise ValueError(f"layer must be in [0, {model.cfg.n_layers}), got {layer}.")
    return [layer]


def _stacked(tensors: list[torch.Tensor], layer: int | None) -> torch.Tensor:
    return tensors[0] if layer is not None else torch.stack(tensors)


# ------------------------------------------------------------------------------------------------
# OV and QK circuits
# ------------------------------------------------------------------------------------------------
def _value_weights(mlp: Any, per_unit_u: bool) -> Float[torch.Tensor, "n_neuron_heads d_model 1"]:
    """``W_V`` of a layer's neuron-heads; for gated layers ``W_V_per_unit_u`` if asked, else a
    ``ValueError`` saying why there is no ``W_V``."""
    if not isinstance(mlp, GatedNeuronHeadMLP):
        return mlp.W_V
    if not per_unit_u:
        raise ValueError(
            "Gated neuron-heads have no OV matrix: their value (f_k g + e_k - g_k) * u is the "
            "product of two projections of the residual (g = x W_gate, u = x W_in), so the OV "
            "map scales with the input-dependent u. Pass per_unit_u=True for the OV circuit per "
            "unit of u (W_V_per_unit_u W_O = f_k W_gate[:, i] (x) W_out[i]); multiply by a "
            "prompt's blocks.{l}.mlp.hook_pre_linear[..., i] for the circuit at that prompt."
        )
    return mlp.W_V_per_unit_u


def neuron_ov_circuit(
    model: NeuronHeadModelMixin, layer: int | None = None, *, per_unit_u: bool = False
) -> FactoredMatrix:
    """Neuron-heads' OV circuits ``W_V W_O``: rank 1, ``f_k W_in[:, i] (x) W_out[i]``.

    Gated MLPs (SwiGLU, GeGLU): a gated neuron-head's value is ``(f_k g + e_k - g_k) * u`` with
    ``g = x W_gate[:, i]`` and ``u = x W_in[:, i]``, not a linear map of ``x``, so there is no OV
    matrix. With ``per_unit_u=True`` this returns the OV circuit *per unit of u*,
    ``f_k W_gate[:, i] (x) W_out[i]``: what the head moves is that matrix times the head's ``u``
    at each position (``blocks.{l}.mlp.hook_pre_linear``). Without it, gated layers raise.

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer`.
        layer: One layer, or None for all.
        per_unit_u: For gated layers, give the OV circuit per unit of the linear branch ``u``.

    Returns:
        ``FactoredMatrix`` of shape ``[n_neuron_heads, d_model, d_model]`` (``[n_layers, ...]``
        for all layers), inner dimension 1.

    Raises:
        ValueError: For a gated layer without ``per_unit_u=True``.
    """
    layers = layer_indices(model, layer)
    # [n_neuron_heads, d_model, 1]
    A = [_value_weights(model.blocks[li].mlp, per_unit_u) for li in layers]
    B = [model.blocks[li].mlp.W_O for li in layers]  # [n_neuron_heads, 1, d_model]
    return FactoredMatrix(_stacked(A, layer), _stacked(B, layer))


def _query_homogeneous(mlp) -> Float[torch.Tensor, "n_neuron_heads d_model_plus_1 1"]:
    return torch.cat([mlp.W_Q, mlp.b_Q[:, None, :]], dim=-2)


def _key_homogeneous(mlp) -> Float[torch.Tensor, "n_neuron_heads 1 d_model_plus_1"]:
    return torch.cat([mlp.W_K, mlp.b_K[:, None, :]], dim=-2).transpose(-2, -1)


def neuron_qk_circuit(model: NeuronHeadModelMixin, layer: int | None = None) -> FactoredMatrix:
    """Neuron-heads' QK circuits in homogeneous coordinates (module docstring).

    ``homogeneous(x) @ QK @ homogeneous(y).T`` is the score of a query with normalised residual
    ``x`` on a real key with residual ``y`` (``= x W_Q + b_Q``: keys are constant); with
    ``y~ = bias_token_homogeneous(model)`` it is the bias token's score, 0.

    Returns:
        ``FactoredMatrix`` ``[n_neuron_heads, d_model + 1, d_model + 1]`` (``[n_layers, ...]``
        for all layers), inner dimension 1: ``A = [W_Q; b_Q]``, ``B = [W_K; b_K]^T``.
    """
    layers = layer_indices(model, layer)
    A = [_query_homogeneous(model.blocks[li].mlp) for li in layers]
    B = [_key_homogeneous(model.blocks[li].mlp) for li in layers]
    return FactoredMatrix(_stacked(A, layer), _stacked(B, layer))


def neuron_attn_scores_from_circuit(
    model: NeuronHeadModelMixin, layer: int, mlp_input: Float[torch.Tensor, "batch pos d_model"]
) -> Float[torch.Tensor, "batch n_neuron_heads query_pos 2"]:
    """The neuron-heads' compact scores ``(self, bias)`` computed from :func:`neuron_qk_circuit`.

    A check of the homogeneous representation: equals ``blocks.{layer}.mlp.hook_attn_scores``
    given the MLP's input ``blocks[layer].ln2(resid_mid)`` (``ln2.hook_normalized`` itself only
    when the LayerNorm weights are folded, ``fold_ln=True``).
    """
    qk = neuron_qk_circuit(model, layer)
    x = homogeneous(mlp_input)  # [batch, pos, d_model + 1]
    query = torch.einsum("bpd,hdm->bhpm", x, qk.A)  # [batch, head, pos, 1]
    key_self = torch.einsum("hme,bpe->bhpm", qk.B, x)  # [batch, head, pos, 1]
    key_bias = torch.einsum("hme,e->hm", qk.B, bias_token_homogeneous(model))  # [head, 1]
    score_self = (query * key_self).sum(-1)
    score_bias = (query * key_bias[None, :, None, :]).sum(-1)
    return torch.stack([score_self, score_bias], dim=-1)


def neuron_full_ov_circuit(
    model: NeuronHeadModelMixin, layer: int, *, per_unit_u: bool = False
) -> FactoredMatrix:
    """``W_E W_V W_O W_U`` of each neuron-head of ``layer``: ``[n_neuron_heads, d_vocab, d_vocab]``.

    Rank 1: the neuron-head reads token ``s`` with weight ``(W_E W_V)[s]`` and writes
    ``(W_O W_U)[t]`` to the logit of ``t``. As TransformerLens's full circuits, ignores LayerNorm
    and everything between the embedding, the head and the unembedding. Gated layers: per unit of
    ``u`` with ``per_unit_u=True``, else refused (see :func:`neuron_ov_circuit`).
    """
    mlp = model.blocks[layer_indices(model, layer)[0]].mlp
    return FactoredMatrix(model.W_E @ _value_weights(mlp, per_unit_u), mlp.W_O @ model.W_U)


def neuron_full_qk_circuit(model: NeuronHeadModelMixin, layer: int) -> FactoredMatrix:
    """Neuron-heads' scores by query token and key: ``[n_neuron_heads, d_vocab, 1 + d_vocab]``.

    Rows are query tokens (``homogeneous(W_E)``). Column 0 is the bias token (score 0); column
    ``1 + t`` is a real key token ``t``, scored ``q(query)`` whatever ``t`` is (real keys are
    constant, and a neuron-head sees only its own token among them). Ignores LayerNorm and
    positional embeddings, as TransformerLens's full QK circuits do.
    """
    mlp = model.blocks[layer_indices(model, layer)[0]].mlp
    keys = torch.cat([bias_token_homogeneous(model)[None], homogeneous(model.W_E)])
    return FactoredMatrix(
        homogeneous(model.W_E) @ _query_homogeneous(mlp), _key_homogeneous(mlp) @ keys.T
    )


# ------------------------------------------------------------------------------------------------
# composition scores
# ------------------------------------------------------------------------------------------------
def _right_matrix(
    model: NeuronHeadModelMixin, kind: str, layer: int, mode: str, per_unit_u: bool = False
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
        return FactoredMatrix(mlp.W_Q, _key_homogeneous(mlp))
    if mode == "K":
        return None  # keys are constant: a neuron-head's key reads nothing
    return FactoredMatrix(_value_weights(mlp, per_unit_u), mlp.W_O)


def _left_matrix(
    model: NeuronHeadModelMixin, kind: str, layer: int, per_unit_u: bool = False
) -> FactoredMatrix:
    if kind == "attn":
        attn = model.blocks[layer].attn
        return FactoredMatrix(attn.W_V, attn.W_O)
    return neuron_ov_circuit(model, layer, per_unit_u=per_unit_u)


#: Senders per streamed block of composition scores (bounds one block's memory).
_SENDERS_PER_BLOCK = 4096


def _stage(model: NeuronHeadModelMixin, kind: str, layer: int) -> int:
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
    model: NeuronHeadModelMixin,
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
        senders: Heads that write (labels or :class:`HeadRef`); default every head.
        receivers: Heads that read; default every head.
        max_bytes: Refuse to build a larger score matrix; narrow senders/receivers instead.
        progress: Show a progress bar over sender groups.
        per_unit_u: Gated MLPs: use each gated neuron-head's OV circuit per unit of its linear
            branch ``u`` (:func:`neuron_ov_circuit`) where a score needs one (any sender; V
            receivers). Without it such scores raise. Q-composition into gated neuron-heads needs
            nothing (their queries are linear in the residual).

    Returns:
        :class:`CompositionScores` (``.scores``, ``.senders``, ``.receivers``, ``.top_k()``).
    """
    if mode not in ("Q", "K", "V"):
        raise ValueError(f"mode must be one of ['Q', 'K', 'V'], not {mode!r}.")
    layer_indices(model, None)
    with torch.no_grad():
        return _composition_scores(model, mode, senders, receivers, max_bytes, progress, per_unit_u)


def _composition_scores(
    model: NeuronHeadModelMixin, mode, senders, receivers, max_bytes, progress, per_unit_u
) -> CompositionScores:
    K = model.n_heads_per_neuron
    send = all_head_refs(model) if senders is None else [parse_head_label(s, K) for s in senders]
    recv = (
        all_head_refs(model) if receivers is None else [parse_head_label(r, K) for r in receivers]
    )
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


def composition_blocks(
    model: NeuronHeadModelMixin,
    mode: str,
    send: list[HeadRef],
    recv: list[HeadRef],
    progress: bool,
    per_unit_u: bool,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(sender rows, receiver columns, scores)`` for every block of pairs in which the receiver
    reads after the sender writes; a block holds at most :data:`_SENDERS_PER_BLOCK` senders.

    Used by :func:`composition_scores` and :func:`composition_top_k`."""
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
    model: NeuronHeadModelMixin,
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
    layer_indices(model, None)
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
    model: NeuronHeadModelMixin, specs: Sequence[str | HeadRef] | None, mode: str | None
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


__all__ = [
    "SCORES_BUDGET",
    "CompositionScores",
    "bias_token_homogeneous",
    "composition_scores",
    "composition_top_k",
    "homogeneous",
    "neuron_attn_scores_from_circuit",
    "neuron_full_ov_circuit",
    "neuron_full_qk_circuit",
    "neuron_ov_circuit",
    "neuron_qk_circuit",
]
