"""Circuits of neuron-heads as :class:`~transformer_lens.FactoredMatrix` (composition scores:
:mod:`tl_attnonly.analysis.composition`).

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

from typing import cast

import torch
from jaxtyping import Float
from transformer_lens import FactoredMatrix

from tl_attnonly.adapt import analysis_model
from tl_attnonly.mlp_protocol import refuse_expert_layers
from tl_attnonly.protocol import (
    GatedNeuronHeadLayerView,
    ModelLike,
    NeuronHeadLayerView,
    PlainNeuronHeadLayerView,
)


def homogeneous(x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_model_plus_1"]:
    """Append the constant-1 coordinate: ``[x, 1]`` (the coordinates of the QK circuits here)."""
    return torch.cat([x, x.new_ones(x.shape[:-1] + (1,))], dim=-1)


def bias_token_homogeneous(model: ModelLike) -> torch.Tensor:
    """The bias token in homogeneous coordinates: the zero vector (so its key, and score, are 0)."""
    model = analysis_model(model)
    return model.W_E.new_zeros(model.cfg.d_model + 1)


def layer_indices(model: ModelLike, layer: int | None) -> list[int]:
    """``[layer]``, or every layer for ``None``; a ``ValueError`` for a layer out of range."""
    model = analysis_model(model)
    if layer is not None and not 0 <= layer < model.cfg.n_layers:
        raise ValueError(f"layer must be in [0, {model.cfg.n_layers}), got {layer}.")
    layers = list(range(model.cfg.n_layers)) if layer is None else [layer]
    refuse_expert_layers([b.mlp for b in model.blocks], layers, "A neuron-head circuit")
    return layers


def _stacked(tensors: list[torch.Tensor], layer: int | None) -> torch.Tensor:
    return tensors[0] if layer is not None else torch.stack(tensors)


# ------------------------------------------------------------------------------------------------
# OV and QK circuits
# ------------------------------------------------------------------------------------------------
def value_weights(
    mlp: NeuronHeadLayerView, per_unit_u: bool
) -> Float[torch.Tensor, "n_neuron_heads d_model 1"]:
    """``W_V`` of a layer's neuron-heads; for gated layers ``W_V_per_unit_u`` if asked, else a
    ``ValueError`` saying why there is no ``W_V``."""
    if not mlp.gated:
        return cast(PlainNeuronHeadLayerView, mlp).W_V
    if not per_unit_u:
        raise ValueError(
            "Gated neuron-heads have no OV matrix: their value (f_k g + e_k - g_k) * u is the "
            "product of two projections of the residual (g = x W_gate, u = x W_in), so the OV "
            "map scales with the input-dependent u. Pass per_unit_u=True for the OV circuit per "
            "unit of u (W_V_per_unit_u W_O = f_k W_gate[:, i] (x) W_out[i]); multiply by a "
            "prompt's blocks.{l}.mlp.hook_pre_linear[..., i] for the circuit at that prompt."
        )
    return cast(GatedNeuronHeadLayerView, mlp).W_V_per_unit_u


def neuron_ov_circuit(
    model: ModelLike, layer: int | None = None, *, per_unit_u: bool = False
) -> FactoredMatrix:
    """Neuron-heads' OV circuits ``W_V W_O``: rank 1, ``f_k W_in[:, i] (x) W_out[i]``.

    Gated MLPs (SwiGLU, GeGLU): a gated neuron-head's value is ``(f_k g + e_k - g_k) * u`` with
    ``g = x W_gate[:, i]`` and ``u = x W_in[:, i]``, not a linear map of ``x``, so there is no OV
    matrix. With ``per_unit_u=True`` this returns the OV circuit *per unit of u*,
    ``f_k W_gate[:, i] (x) W_out[i]``: what the head moves is that matrix times the head's ``u``
    at each position (``blocks.{l}.mlp.hook_pre_linear``). Without it, gated layers raise.

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` or a ``TransformerBridge``
            converted with :func:`tl_attnonly.convert` (in place).
        layer: One layer, or None for all.
        per_unit_u: For gated layers, give the OV circuit per unit of the linear branch ``u``.

    Returns:
        ``FactoredMatrix`` of shape ``[n_neuron_heads, d_model, d_model]`` (``[n_layers, ...]``
        for all layers), inner dimension 1.

    Raises:
        ValueError: For a gated layer without ``per_unit_u=True``.
    """
    model = analysis_model(model)
    layers = layer_indices(model, layer)
    # [n_neuron_heads, d_model, 1]
    A = [value_weights(model.blocks[li].mlp, per_unit_u) for li in layers]
    B = [model.blocks[li].mlp.W_O for li in layers]  # [n_neuron_heads, 1, d_model]
    return FactoredMatrix(_stacked(A, layer), _stacked(B, layer))


def _query_homogeneous(
    mlp: NeuronHeadLayerView,
) -> Float[torch.Tensor, "n_neuron_heads d_model_plus_1 1"]:
    return torch.cat([mlp.W_Q, mlp.b_Q[:, None, :]], dim=-2)


def key_homogeneous(
    mlp: NeuronHeadLayerView,
) -> Float[torch.Tensor, "n_neuron_heads 1 d_model_plus_1"]:
    return torch.cat([mlp.W_K, mlp.b_K[:, None, :]], dim=-2).transpose(-2, -1)


def neuron_qk_circuit(model: ModelLike, layer: int | None = None) -> FactoredMatrix:
    """Neuron-heads' QK circuits in homogeneous coordinates (module docstring).

    ``homogeneous(x) @ QK @ homogeneous(y).T`` is the score of a query with normalised residual
    ``x`` on a real key with residual ``y`` (``= x W_Q + b_Q``: keys are constant); with
    ``y~ = bias_token_homogeneous(model)`` it is the bias token's score, 0.

    Returns:
        ``FactoredMatrix`` ``[n_neuron_heads, d_model + 1, d_model + 1]`` (``[n_layers, ...]``
        for all layers), inner dimension 1: ``A = [W_Q; b_Q]``, ``B = [W_K; b_K]^T``.
    """
    model = analysis_model(model)
    layers = layer_indices(model, layer)
    A = [_query_homogeneous(model.blocks[li].mlp) for li in layers]
    B = [key_homogeneous(model.blocks[li].mlp) for li in layers]
    return FactoredMatrix(_stacked(A, layer), _stacked(B, layer))


def neuron_attn_scores_from_circuit(
    model: ModelLike, layer: int, mlp_input: Float[torch.Tensor, "batch pos d_model"]
) -> Float[torch.Tensor, "batch n_neuron_heads query_pos 2"]:
    """The neuron-heads' compact scores ``(self, bias)`` computed from :func:`neuron_qk_circuit`.

    A check of the homogeneous representation: equals ``blocks.{layer}.mlp.hook_attn_scores``
    given the MLP's input ``blocks[layer].ln2(resid_mid)`` (``ln2.hook_normalized`` itself only
    when the LayerNorm weights are folded, ``fold_ln=True``).
    """
    model = analysis_model(model)
    qk = neuron_qk_circuit(model, layer)
    x = homogeneous(mlp_input)  # [batch, pos, d_model + 1]
    query = torch.einsum("bpd,hdm->bhpm", x, qk.A)  # [batch, head, pos, 1]
    key_self = torch.einsum("hme,bpe->bhpm", qk.B, x)  # [batch, head, pos, 1]
    key_bias = torch.einsum("hme,e->hm", qk.B, bias_token_homogeneous(model))  # [head, 1]
    score_self = (query * key_self).sum(-1)
    score_bias = (query * key_bias[None, :, None, :]).sum(-1)
    return torch.stack([score_self, score_bias], dim=-1)


def neuron_full_ov_circuit(
    model: ModelLike, layer: int, *, per_unit_u: bool = False
) -> FactoredMatrix:
    """``W_E W_V W_O W_U`` of each neuron-head of ``layer``: ``[n_neuron_heads, d_vocab, d_vocab]``.

    Rank 1: the neuron-head reads token ``s`` with weight ``(W_E W_V)[s]`` and writes
    ``(W_O W_U)[t]`` to the logit of ``t``. As TransformerLens's full circuits, ignores LayerNorm
    and everything between the embedding, the head and the unembedding. Gated layers: per unit of
    ``u`` with ``per_unit_u=True``, else refused (see :func:`neuron_ov_circuit`).
    """
    model = analysis_model(model)
    mlp = model.blocks[layer_indices(model, layer)[0]].mlp
    return FactoredMatrix(model.W_E @ value_weights(mlp, per_unit_u), mlp.W_O @ model.W_U)


def neuron_full_qk_circuit(model: ModelLike, layer: int) -> FactoredMatrix:
    """Neuron-heads' scores by query token and key: ``[n_neuron_heads, d_vocab, 1 + d_vocab]``.

    Rows are query tokens (``homogeneous(W_E)``). Column 0 is the bias token (score 0); column
    ``1 + t`` is a real key token ``t``, scored ``q(query)`` whatever ``t`` is (real keys are
    constant, and a neuron-head sees only its own token among them). Ignores LayerNorm and
    positional embeddings, as TransformerLens's full QK circuits do.
    """
    model = analysis_model(model)
    mlp = model.blocks[layer_indices(model, layer)[0]].mlp
    keys = torch.cat([bias_token_homogeneous(model)[None], homogeneous(model.W_E)])
    return FactoredMatrix(
        homogeneous(model.W_E) @ _query_homogeneous(mlp), key_homogeneous(mlp) @ keys.T
    )


__all__ = [
    "bias_token_homogeneous",
    "homogeneous",
    "key_homogeneous",
    "layer_indices",
    "neuron_attn_scores_from_circuit",
    "neuron_full_ov_circuit",
    "neuron_full_qk_circuit",
    "neuron_ov_circuit",
    "neuron_qk_circuit",
    "value_weights",
]
