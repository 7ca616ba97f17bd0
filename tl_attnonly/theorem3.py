"""Theorem 3 as weights: one MLP neuron as ``K`` attention heads of internal dimension 1.

:func:`theorem3_neuron_head` builds the real parts of the heads (query, value and output weights)
of a neuron, or of every neuron at once; :class:`NeuronHeadWeights` holds them. It is plain torch,
no TransformerLens, so it imports on TransformerLens 3.x and 4.x: notebook 04 checks the theorem
with it on a ``HookedTransformer`` (3.x) and on a ``TransformerBridge`` (4.x). The literal form
(:mod:`tl_attnonly.literal`, TransformerLens 3.x) builds its neuron sublayers from it and
re-exports both names (``from tl_attnonly.literal import theorem3_neuron_head`` keeps working).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from jaxtyping import Float
from torch import Tensor

if TYPE_CHECKING:
    from tl_attnonly._types import CoefficientsLike


@dataclass
class NeuronHeadWeights:
    """The ``K`` heads of each neuron (Theorem 3); leading dims ``[...]`` index neurons.

    For a real token with neuron input ``x = w_in . n + b_in`` (``n`` the normalised residual):
    query ``q_in . n + q_real``; key 1 (0 on the bias token); value ``v_in . n + v_real``
    (0 on the bias token); output ``z * w_out``.

    Attributes:
        q_in: ``[..., K, d_in]`` = ``b_k w_in``.
        q_real: ``[..., K]`` = ``b_k b_in + d_k``.
        v_in: ``[..., K, d_in]`` = ``f_k w_in``.
        v_real: ``[..., K]`` = ``f_k b_in + e_k - g_k``.
        w_out: ``[..., K, d_out]`` = ``w_out`` for every ``k``.
        out_shift: ``[..., d_out]`` = ``(sum_k g_k) w_out``, the constant moved to the output bias.
    """

    q_in: Tensor
    q_real: Tensor
    v_in: Tensor
    v_real: Tensor
    w_out: Tensor
    out_shift: Tensor


def _coef_tensors(coefficients: CoefficientsLike) -> tuple[Tensor, ...]:
    return tuple(torch.tensor(getattr(coefficients, name), dtype=torch.float64) for name in "bdfeg")


def theorem3_neuron_head(
    w_in: Float[Tensor, "... d_in"],
    b_in: Float[Tensor, "..."],
    w_out: Float[Tensor, "... d_out"],
    coefficients: CoefficientsLike,
) -> NeuronHeadWeights:
    """Theorem 3: one MLP neuron as ``K`` attention heads of internal dimension 1.

    The paper's head (``W_QK = a2 [0 -V1; 0 0]``, ``W_OV = a1 a2 V1 V2 (+) [0]``) attends to the
    token itself with score ``a2 x`` and to the bias token with score 0, so its weight on itself is
    ``sigmoid(a2 x)`` and, with value ``a1 x``, it outputs ``a1 SiLU(a2 x)``. Generalised to the
    package's per-head coefficients (:func:`tl_attnonly.activations.head_coefficients`): head
    ``k`` has score ``b_k x + d_k`` on itself, 0 on the bias token, value ``f_k x + e_k`` on itself
    and ``g_k`` on the bias token, and the neuron's activation is the sum over ``k``. Written with
    ``g_k`` moved out (value ``f_k x + e_k - g_k`` on itself, 0 on the bias token; ``sum_k g_k``
    added to the output bias) so that nothing is ever written at the bias token.

    Broadcasts over leading dims: pass ``W_in.T`` (``[d_mlp, d_in]``) to build every neuron.

    Args:
        w_in: The neuron's input weights (norm weight already folded in).
        b_in: Its input bias (norm bias already folded in).
        w_out: Its output weights (the row of ``W_out``).
        coefficients: Per-head ``b, d, f, e, g`` sequences (a ``NeuronHeadCoefficients``).

    Returns:
        The real parts of the ``K`` heads; the mask (self + bias token) is added by
        :func:`tl_attnonly.literal.theorems.theorem9_mask_qk`.
    """
    b, d, f, e, g = _coef_tensors(coefficients)
    w_in, b_in, w_out = w_in.double(), torch.as_tensor(b_in).double(), w_out.double()
    k = b.shape[0]
    return NeuronHeadWeights(
        q_in=b[:, None] * w_in[..., None, :],
        q_real=b * b_in[..., None] + d,
        v_in=f[:, None] * w_in[..., None, :],
        v_real=f * b_in[..., None] + e - g,
        w_out=w_out[..., None, :].expand(*w_out.shape[:-1], k, w_out.shape[-1]),
        out_shift=g.sum() * w_out,
    )


__all__ = ["NeuronHeadWeights", "theorem3_neuron_head"]
