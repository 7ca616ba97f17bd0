"""The literal form: a model made of nothing but plain softmax attention sublayers.

Huben & Morris (2023, arXiv 2309.08593) prove that an MLP-and-attention transformer can be
rewritten as an attention-only one. The structured form (:class:`tl_attnonly.AttnOnlyTransformer`)
computes each neuron-head's two-key softmax directly. This module builds the construction as the
paper states it, so that the theorems can be checked on a whole model:

* the sequence gets a real **bias token** at position 0 (real token ``j`` sits at ``1 + j``);
* the residual stream is augmented to width ``D'``: the original ``D`` coordinates, (for the
  ``"split"`` layout) ``2 * d_mlp`` hidden coordinates, and ``1 + max_len`` one-hot position
  coordinates (the bias token's embedding is its own one-hot coordinate);
* every sublayer is a :class:`~tl_attnonly.components.LiteralAttention`,
  ``softmax(X W_QK X^T) X W_OV`` with no bias parameters and **no mask**: which keys a head may
  see is encoded in ``W_Q``/``W_K`` through the one-hot position coordinates and ``-omega``
  entries (Theorem 9).

Where each theorem lives:

==========================================  ====================================================
:func:`theorem3_neuron_head`                one neuron -> ``K`` heads of internal dimension 1
:func:`theorem6_tweaked_attention_heads`    the model's own heads, tweaked to ignore the bias token
:func:`theorem7_linear_map_heads`           a linear map as self-attending heads
:func:`theorem8_activation_heads`           an entry-wise activation, one head per coordinate
:func:`theorem9_mask_qk`                    a mask written into ``W_Q``/``W_K``
:func:`to_literal`                          the whole model (Theorem 6 with 3, or 7 + 8; with 9)
==========================================  ====================================================

Conventions that keep the construction exact:

* Every bias (``b_Q, b_K, b_V, b_in``, LayerNorm biases) is carried by the one-hot position
  coordinates of the real tokens (each real token has exactly one of them equal to 1; the post's
  "use the 1s in the position encoding dimensions for the bias terms"). Output biases (``b_O``,
  ``b_out``) are written by one extra *bias head* per sublayer that attends only to its own token
  and whose value is 1 on real tokens. Hence every value vector at the bias token is exactly 0,
  every sublayer writes exactly 0 at the bias token, and the bias token's residual stays its
  one-hot embedding through the whole model.
* ``-omega`` is added only to the scores of *disallowed* (query, key) pairs, never ``+omega`` to
  allowed ones: allowed scores are computed without any ``omega``-sized intermediate, so they carry
  no rounding at omega's scale, and the only error is the attention mass leaking to disallowed
  keys, at most ``n_keys * exp(score_range - omega)``.
* A neuron-head's constant bias-token value ``g_k`` is moved into the layer's output bias
  (``v - g_k`` on the token, 0 on the bias token); for SiLU and ReLU ``g_k = 0`` anyway.

LayerNorm is not in the paper. Here a sublayer that reads the original coordinates first applies
``LNPre``/``RMSPre`` to those ``D`` coordinates only (the hidden and position coordinates pass
through unchanged), and the norm's weight and bias are folded into the heads' ``W_Q, W_K, W_V``.
See ``docs/literal_form.md`` for exactly what is and is not standard attention in that case.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens import HookedRootModule, HookedTransformer
from transformer_lens.components import (
    LayerNorm,
    LayerNormPre,
    RMSNorm,
    RMSNormPre,
    Unembed,
)
from transformer_lens.hook_points import HookPoint
from transformer_lens.utilities import lm_cross_entropy_loss
from transformer_lens.utilities.activation_functions import softcap_enabled

from tl_attnonly.components.literal_attention import LiteralAttention

#: Default omega. Penalties go only on disallowed pairs, so a large omega costs no accuracy on the
#: allowed ones; 1e4 makes the leak ``n_keys * exp(score_range - omega)`` underflow to exactly 0 in
#: every float dtype for score ranges up to ~9000, and stays 6.5x below float16's largest finite
#: value (65504), where ``-omega`` would become ``-inf`` and ``-inf * 0 = NaN`` every score.
DEFAULT_OMEGA = 1e4
#: Spread of real attention scores assumed when judging whether an omega is large enough.
TYPICAL_SCORE_RANGE = 32.0
#: Default memory budget (bytes) for the literal model's weights and for one input's patterns.
DEFAULT_BUDGET_BYTES = 2**30

LayoutName = Literal["neuron", "split"]
MaskOption = Literal["omega", "ordinary", "causal_ordinary"]

#: Hooks of ``blocks.{l}.mlp`` shared, by name, with the structured form's neuron-heads.
SHARED_NEURON_HOOKS = ("hook_pre", "hook_q", "hook_k", "hook_v", "hook_attn_scores",
                       "hook_pattern", "hook_z", "hook_result", "hook_post")  # fmt: skip


class LiteralBudgetError(MemoryError):
    """The literal form would need more memory than its configured budget."""


# ============================================================================ layout


@dataclass(frozen=True)
class ResidualLayout:
    """Coordinates of the augmented residual stream (width ``d_resid = D'``).

    ``[0, D)`` the original residual stream; for the split layout ``[D, D + M)`` the MLP's
    pre-activations and ``[D + M, D + 2M)`` its post-activations; then ``n_pos = 1 + max_len``
    one-hot position coordinates, the first of which is the bias token's.

    Attributes:
        d_model: ``D``, the original residual width.
        d_mlp: ``M``, neurons per MLP layer.
        n_pos: ``N' = 1 + max_len`` augmented positions.
        hidden: Whether there are hidden (pre/post-activation) coordinates (split layout).
    """

    d_model: int
    d_mlp: int
    n_pos: int
    hidden: bool

    @property
    def model_dims(self) -> slice:
        """The original ``D`` coordinates."""
        return slice(0, self.d_model)

    @property
    def pre_dims(self) -> slice:
        """Hidden pre-activation coordinates (split layout)."""
        return slice(self.d_model, self.d_model + self.d_mlp)

    @property
    def post_dims(self) -> slice:
        """Hidden post-activation coordinates (split layout)."""
        return slice(self.d_model + self.d_mlp, self.d_model + 2 * self.d_mlp)

    @property
    def pos_start(self) -> int:
        """First one-hot position coordinate (the bias token's)."""
        return self.d_model + (2 * self.d_mlp if self.hidden else 0)

    @property
    def pos_dims(self) -> slice:
        """All one-hot position coordinates."""
        return slice(self.pos_start, self.pos_start + self.n_pos)

    @property
    def bias_row(self) -> int:
        """The bias token's coordinate (its embedding)."""
        return self.pos_start

    @property
    def real_rows(self) -> slice:
        """The real positions' one-hot coordinates: exactly one of them is 1 on a real token."""
        return slice(self.pos_start + 1, self.pos_start + self.n_pos)

    @property
    def d_resid(self) -> int:
        """``D'``, the augmented residual width."""
        return self.pos_start + self.n_pos


# ============================================================================ heads


@dataclass
class SublayerHeads:
    """The heads of one sublayer before the masks are written in (real part only).

    Attributes:
        W_Q: ``[head, d_resid, d_r]`` (any ``1/sqrt(d_head)`` already folded in).
        W_K: ``[head, d_resid, d_r]``.
        W_V: ``[head, d_resid, d_v]``.
        W_O: ``[head, d_v, d_resid]``.
        kinds: Names of the masks used (see :func:`allowed_pattern`).
        head_kind: ``[head]`` index into ``kinds``.
        rotary_dim: Rotary dimensions of the real part (0: none).
    """

    W_Q: Tensor
    W_K: Tensor
    W_V: Tensor
    W_O: Tensor
    kinds: tuple[str, ...]
    head_kind: Tensor
    rotary_dim: int = 0

    @property
    def n_heads(self) -> int:
        return self.W_Q.shape[0]


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


def _coef_tensors(coefficients: Any) -> tuple[Tensor, ...]:
    return tuple(torch.tensor(getattr(coefficients, name), dtype=torch.float64) for name in "bdfeg")


def theorem3_neuron_head(
    w_in: Float[Tensor, "... d_in"],
    b_in: Float[Tensor, "..."],
    w_out: Float[Tensor, "... d_out"],
    coefficients: Any,
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
        :func:`theorem9_mask_qk`.
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


def theorem8_activation_heads(coefficients: Any, d_mlp: int) -> NeuronHeadWeights:
    """Theorem 8: an entry-wise activation on ``d_mlp`` coordinates, ``K`` heads per coordinate.

    Theorem 3 with the identity as input and output weights: head ``(i, k)`` reads hidden
    pre-activation coordinate ``i`` and writes post-activation coordinate ``i``.

    Args:
        coefficients: Per-head ``b, d, f, e, g``.
        d_mlp: Number of coordinates (neurons).

    Returns:
        Heads for every coordinate, ``[d_mlp, K, ...]``.
    """
    eye = torch.eye(d_mlp, dtype=torch.float64)
    return theorem3_neuron_head(eye, torch.zeros(d_mlp, dtype=torch.float64), eye, coefficients)


def theorem7_linear_map_heads(
    W: Float[Tensor, "d_src d_dst"], d_head: int
) -> tuple[Float[Tensor, "head d_src d_head"], Float[Tensor, "head d_head d_dst"]]:
    """Theorem 7: a row-wise linear map ``X -> X W`` as attention heads.

    Each head attends only to its own token (mask: self only), so its output is ``X W_V W_O``
    exactly. A map of rank above ``d_head`` is split over ``ceil(d_dst / d_head)`` heads: head
    ``h`` computes output columns ``[h d_head, (h + 1) d_head)``.

    Args:
        W: The map (rows: the coordinates read, columns: the coordinates written).
        d_head: Internal dimension of each head.

    Returns:
        ``(W_V, W_O)`` with ``sum_h W_V[h] W_O[h] = W``.
    """
    d_src, d_dst = W.shape
    n_heads = max(1, math.ceil(d_dst / d_head))
    W_V = W.new_zeros(n_heads, d_src, d_head)
    W_O = W.new_zeros(n_heads, d_head, d_dst)
    for h in range(n_heads):
        cols = range(h * d_head, min((h + 1) * d_head, d_dst))
        W_V[h, :, : len(cols)] = W[:, cols.start : cols.stop]
        W_O[h, torch.arange(len(cols)), torch.tensor(list(cols), dtype=torch.long)] = 1.0
    return W_V, W_O


def theorem9_mask_qk(
    allowed: Int[Tensor, "query_pos key_pos"], omega: float
) -> tuple[Float[Tensor, "query_pos key_pos"], Float[Tensor, "key_pos key_pos"]]:
    """Theorem 9: a mask written into ``W_Q``/``W_K`` through one-hot position coordinates.

    Query position ``t`` reads row ``t`` of the returned query block (its one-hot coordinate
    selects it), key position ``s`` reads row ``s`` of the identity, so the score gains exactly
    ``Q_block[t, s]``: 0 where ``allowed[t, s]`` and ``-omega`` elsewhere. Each product in the dot
    product is ``0 * x`` or ``1 * (0 or -omega)``, so allowed scores are untouched bit for bit.
    (The paper adds ``+omega`` to allowed pairs; that form rounds allowed scores at omega's scale,
    so it is not used.)

    Args:
        allowed: Bool ``[n_pos, n_pos]``.
        omega: The penalty.

    Returns:
        ``(Q_block, K_block)``, to be placed in the rows of the position coordinates.
    """
    allowed = allowed.bool()
    q_block = torch.where(allowed, 0.0, -float(omega)).double()
    k_block = torch.eye(allowed.shape[-1], dtype=torch.float64)
    return q_block, k_block


def allowed_pattern(kind: str, n_pos: int, causal: bool) -> Int[Tensor, "query_pos key_pos"]:
    """Which keys a head of a given kind may attend, over the augmented sequence.

    Kinds: ``"attn"`` (the model's own heads: real queries see real keys, causally if ``causal``,
    never the bias token; the bias token sees only itself), ``"self"`` (every token sees only
    itself: linear-map and bias heads) and ``"self_bias"`` (every token sees itself and the bias
    token: neuron-heads).

    Args:
        kind: ``"attn"``, ``"self"`` or ``"self_bias"``.
        n_pos: Augmented sequence length (bias token at 0).
        causal: Whether ``"attn"`` is causal.

    Returns:
        Bool ``[query_pos, key_pos]``.
    """
    eye = torch.eye(n_pos, dtype=torch.bool)
    if kind == "self":
        return eye
    if kind == "self_bias":
        out = eye.clone()
        out[:, 0] = True
        return out
    if kind == "attn":
        out = torch.zeros(n_pos, n_pos, dtype=torch.bool)
        real = torch.ones(n_pos - 1, n_pos - 1, dtype=torch.bool)
        out[1:, 1:] = real.tril() if causal else real
        out[0, 0] = True
        return out
    raise ValueError(f"Unknown mask kind {kind!r}")


def _folded(
    W: Float[Tensor, "... d_model c"],
    bias: Float[Tensor, "... c"] | None,
    norm_w: Tensor | None,
    norm_b: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """``(norm(x) W + bias)`` as ``(core(x) W' + bias')``: the norm's weight and bias folded in."""
    W = W.double()
    bias_out = W.new_zeros(W.shape[:-2] + W.shape[-1:]) if bias is None else bias.double().clone()
    if norm_b is not None:
        bias_out = bias_out + torch.einsum("m,...mc->...c", norm_b.double(), W)
    if norm_w is not None:
        W = W * norm_w.double()[:, None]
    return W, bias_out


def theorem6_tweaked_attention_heads(
    W_Q: Float[Tensor, "head d_model d_head"],
    b_Q: Float[Tensor, "head d_head"],
    W_K: Float[Tensor, "head d_model d_head"],
    b_K: Float[Tensor, "head d_head"],
    W_V: Float[Tensor, "head d_model d_head"],
    b_V: Float[Tensor, "head d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    b_O: Float[Tensor, " d_model"],
    layout: ResidualLayout,
    attn_scale: float = 1.0,
    norm_w: Float[Tensor, " d_model"] | None = None,
    norm_b: Float[Tensor, " d_model"] | None = None,
    rotary_dim: int = 0,
) -> SublayerHeads:
    """Theorem 6's tweak: the model's own heads, unchanged in behaviour, next to a bias token.

    The heads read the original coordinates (norm folded in, ``1/attn_scale`` folded into the
    queries; biases via the real positions' one-hot coordinates, so every query, key and value of
    the bias token is 0). Their mask (kind ``"attn"``) keeps real tokens off the bias token and
    the bias token on itself: the post's tweak ("the bias vector strongly avoids attending to the
    non-bias vectors, and strongly attends to itself"), written in by :func:`theorem9_mask_qk`. A
    last *bias head* (mask ``"self"``, value 1 on real tokens) writes ``b_O``.

    Args:
        W_Q: Query weights of the original heads (TransformerLens layout).
        b_Q: Query biases.
        W_K: Key weights.
        b_K: Key biases.
        W_V: Value weights.
        b_V: Value biases.
        W_O: Output weights.
        b_O: Output bias.
        layout: The augmented residual stream.
        attn_scale: The scores' divisor (``sqrt(d_head)`` in most models).
        norm_w: Weight of the norm before the attention (``None``: no norm or already folded).
        norm_b: Bias of that norm.
        rotary_dim: Rotary dimensions (kept first in each head's query/key).

    Returns:
        ``n_heads + 1`` heads (the last writes ``b_O``).
    """
    Wq, bq = _folded(W_Q, b_Q, norm_w, norm_b)
    Wk, bk = _folded(W_K, b_K, norm_w, norm_b)
    Wv, bv = _folded(W_V, b_V, norm_w, norm_b)
    n_heads, _, d_head = Wq.shape
    H, R = n_heads + 1, layout.d_resid
    q = torch.zeros(H, R, d_head, dtype=torch.float64)
    k, v = torch.zeros_like(q), torch.zeros_like(q)
    o = torch.zeros(H, d_head, R, dtype=torch.float64)
    m, real = layout.model_dims, layout.real_rows
    q[:n_heads, m], q[:n_heads, real] = Wq / attn_scale, (bq / attn_scale)[:, None, :]
    k[:n_heads, m], k[:n_heads, real] = Wk, bk[:, None, :]
    v[:n_heads, m], v[:n_heads, real] = Wv, bv[:, None, :]
    o[:n_heads, :, m] = W_O.double()
    v[n_heads, real, 0] = 1.0  # the bias head: value 1 on real tokens ...
    o[n_heads, 0, m] = b_O.double()  # ... times b_O
    head_kind = torch.tensor([0] * n_heads + [1])
    return SublayerHeads(q, k, v, o, ("attn", "self"), head_kind, rotary_dim)


def neuron_sublayer(
    heads: NeuronHeadWeights,
    layout: ResidualLayout,
    read: slice,
    write: slice,
    b_out: Tensor | None,
) -> SublayerHeads:
    """Place neuron-heads (Theorem 3 or 8) in the augmented residual stream.

    Args:
        heads: From :func:`theorem3_neuron_head` or :func:`theorem8_activation_heads`.
        layout: The augmented residual stream.
        read: Coordinates the heads' ``w_in`` reads.
        write: Coordinates their ``w_out`` writes.
        b_out: If given, a last bias head writes ``b_out + sum_i out_shift[i]`` (Theorem 3 layout).

    Returns:
        ``d_mlp * K`` heads (head ``i * K + k``), plus the bias head; masks: self + bias token
        (neuron-heads), self only (bias head).
    """
    M, K, d_in = heads.q_in.shape
    n_neuron_heads = M * K
    H = n_neuron_heads + (b_out is not None)
    R, real = layout.d_resid, layout.real_rows
    W_Q = torch.zeros(H, R, 1, dtype=torch.float64)
    W_K, W_V = torch.zeros_like(W_Q), torch.zeros_like(W_Q)
    W_O = torch.zeros(H, 1, R, dtype=torch.float64)
    nh = slice(0, n_neuron_heads)
    W_Q[nh, read, 0] = heads.q_in.reshape(n_neuron_heads, d_in)
    W_Q[nh, real, 0] = heads.q_real.reshape(n_neuron_heads, 1)
    W_K[nh, real, 0] = 1.0  # key 1 on every real token, 0 on the bias token
    W_V[nh, read, 0] = heads.v_in.reshape(n_neuron_heads, d_in)
    W_V[nh, real, 0] = heads.v_real.reshape(n_neuron_heads, 1)
    W_O[nh, 0, write] = heads.w_out.reshape(n_neuron_heads, -1)
    kinds, head_kind = ("self_bias",), [0] * n_neuron_heads
    if b_out is not None:
        W_V[n_neuron_heads, real, 0] = 1.0
        W_O[n_neuron_heads, 0, write] = b_out.double() + heads.out_shift.sum(0)
        kinds, head_kind = ("self_bias", "self"), head_kind + [1]
    return SublayerHeads(W_Q, W_K, W_V, W_O, kinds, torch.tensor(head_kind))


def linear_map_sublayer(
    maps: list[tuple[Tensor, slice]], layout: ResidualLayout, d_head: int
) -> SublayerHeads:
    """Theorem 7 heads for several linear maps of the augmented residual stream.

    Args:
        maps: ``(W, write)`` pairs: ``W`` ``[d_resid, width]`` maps the whole residual stream to
            ``width`` coordinates, written at ``write``.
        layout: The augmented residual stream.
        d_head: Internal dimension of each head.

    Returns:
        ``sum(ceil(width / d_head))`` heads, each attending only to its own token.
    """
    R = layout.d_resid
    Vs, Os = [], []
    for W, write in maps:
        W_V, W_O_block = theorem7_linear_map_heads(W.double(), d_head)
        W_O = W_O_block.new_zeros(W_O_block.shape[0], d_head, R)
        W_O[..., write] = W_O_block
        Vs.append(W_V)
        Os.append(W_O)
    W_V, W_O = torch.cat(Vs), torch.cat(Os)
    H = W_V.shape[0]
    empty = torch.zeros(H, R, 0, dtype=torch.float64)  # no real query/key part: mask only
    return SublayerHeads(
        empty, empty.clone(), W_V, W_O, ("self",), torch.zeros(H, dtype=torch.long)
    )


# ============================================================================ modules


class PartialNorm(nn.Module):
    """``LNPre``/``RMSPre`` on the first ``d_norm`` coordinates; the rest pass through unchanged.

    The one part of a literal sublayer that is not attention: the original model normalises its
    ``D`` coordinates before each sublayer, and so must the literal form (weights and biases of
    the norm are folded into the heads). On the bias token (original coordinates all 0) it
    returns 0.

    Args:
        d_norm: Number of leading coordinates normalised (``D``).
        eps: As in TransformerLens.
        center: Subtract the mean first (LayerNorm) or not (RMSNorm).
    """

    def __init__(self, d_norm: int, eps: float, center: bool):
        super().__init__()
        self.d_norm = d_norm
        self.eps = eps
        self.center = center
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_norm]

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_resid"]
    ) -> Float[torch.Tensor, "batch pos d_resid"]:
        head, tail = x[..., : self.d_norm], x[..., self.d_norm :]
        if head.dtype not in (torch.float32, torch.float64):
            head = head.float()  # as TransformerLens: half precision norms in float32
        if self.center:
            head = head - head.mean(-1, keepdim=True)
        scale = self.hook_scale((head.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        head = self.hook_normalized(head / scale).to(x.dtype)
        return torch.cat([head, tail], dim=-1)

    def extra_repr(self) -> str:
        return f"d_norm={self.d_norm}, eps={self.eps}, center={self.center}"


class LiteralNeuronLayer(LiteralAttention):
    """The neuron-heads of one MLP layer, as plain attention, plus ``hook_pre``/``hook_post``.

    Head ``h = i * K + k`` is head ``k`` of neuron ``i`` (as in the structured form); in the
    ``"neuron"`` layout a last bias head writes ``b_out``. The two MLP hooks are read off the real
    positions:

    * ``hook_pre`` ``[batch, pos, d_mlp]``: in the split layout the hidden pre-activation
      coordinates of the input (editing it edits what the heads read); in the neuron layout no
      pre-activation exists in the computation, so it is computed beside it for inspection and
      editing it raises ``NotImplementedError`` (edit ``hook_q``/``hook_v`` instead).
    * ``hook_post`` ``[batch, pos, d_mlp]``: ``sum_k z`` plus the bias-token constants ``sum_k
      g_k``, i.e. the activation. An edit reaches the output (its difference is written through
      the neuron's output weights), as in TransformerLens.

    Args:
        *args: As for :class:`LiteralAttention`.
        d_mlp: Neurons ``M``.
        n_heads_per_neuron: ``K``.
        pre_start: First hidden pre-activation coordinate (split layout), else ``None``.
        **kwargs: As for :class:`LiteralAttention`.
    """

    pre_read: torch.Tensor
    post_offset: torch.Tensor
    post_write: torch.Tensor

    def __init__(
        self, *args: Any, d_mlp: int, n_heads_per_neuron: int, pre_start: int | None, **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.d_mlp = d_mlp
        self.n_heads_per_neuron = n_heads_per_neuron
        self.n_neuron_heads = d_mlp * n_heads_per_neuron
        self.pre_start = pre_start
        dtype = self.W_Q.dtype
        # [d_resid, d_mlp]: how the neuron layout reads pre-activations (for hook_pre only).
        self.register_buffer("pre_read", torch.zeros(self.d_model, d_mlp, dtype=dtype))
        # [d_mlp]: sum_k g_k, added to sum_k z to give the activation.
        self.register_buffer("post_offset", torch.zeros(d_mlp, dtype=dtype))
        # [d_mlp, d_resid]: where each neuron's activation is written (for hook_post edits).
        self.register_buffer("post_write", torch.zeros(d_mlp, self.d_model, dtype=dtype))
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_resid"]
    ) -> Float[torch.Tensor, "batch pos d_resid"]:
        real = x[:, 1:]
        if self.pre_start is not None:
            pre = real[..., self.pre_start : self.pre_start + self.d_mlp]
        else:
            pre = real @ self.pre_read
        hooked_pre = self.hook_pre(pre)  # [batch, pos, d_mlp]
        if hooked_pre is not pre:
            if self.pre_start is None:
                raise NotImplementedError(
                    "hook_pre is read-only in the literal 'neuron' layout (there the neuron-heads "
                    "read the residual stream directly); edit hook_q / hook_v, or use "
                    "layout='split' where pre-activations are residual coordinates."
                )
            x = x.clone()
            x[:, 1:, self.pre_start : self.pre_start + self.d_mlp] = hooked_pre
        z = self.attend(x)
        batch, n = z.shape[0], z.shape[1] - 1
        per_head = z[:, 1:, : self.n_neuron_heads, 0]
        post = per_head.reshape(batch, n, self.d_mlp, self.n_heads_per_neuron).sum(-1)
        post = post + self.post_offset
        hooked_post = self.hook_post(post)  # [batch, pos, d_mlp]
        out = self.project(z)
        if hooked_post is not post:
            delta = _pad_bias_row((hooked_post - post) @ self.post_write)
            out = out + delta
        return out


def _pad_bias_row(x: Float[Tensor, "batch pos d"]) -> Float[Tensor, "batch pos_plus_1 d"]:
    """Prepend a zero row for the bias token: ``[batch, pos, d] -> [batch, 1 + pos, d]``."""
    return torch.cat([x.new_zeros(x.shape[0], 1, x.shape[2]), x], dim=1)


class LiteralBlock(nn.Module):
    """One layer of the literal form: 2 sublayers (neuron layout) or 4 (split layout).

    Hooks (all over the augmented sequence and residual, ``[batch, 1 + pos, d_resid]``):
    ``hook_resid_pre``, ``hook_attn_out``, ``hook_resid_mid``, ``hook_mlp_out`` (everything the MLP
    sublayers add), ``hook_resid_post``; split layout also ``hook_resid_hidden`` (after ``mlp_in``)
    and ``hook_resid_act`` (after ``mlp``).

    Args:
        ln1: Norm before ``attn`` (:class:`PartialNorm` or identity).
        attn: The model's own heads (Theorem 6 tweak) and the ``b_O`` head.
        ln2: Norm before the MLP's first sublayer.
        mlp: The neuron-heads (Theorem 3) or the activation heads (Theorem 8).
        mlp_in: Split layout: the ``W_in`` heads (Theorem 7).
        mlp_out: Split layout: the ``W_out`` heads (Theorem 7), which also clear the hidden
            coordinates.
    """

    def __init__(
        self,
        ln1: nn.Module,
        attn: LiteralAttention,
        ln2: nn.Module,
        mlp: LiteralNeuronLayer,
        mlp_in: LiteralAttention | None = None,
        mlp_out: LiteralAttention | None = None,
    ):
        super().__init__()
        self.ln1, self.attn, self.ln2 = ln1, attn, ln2
        if mlp_in is not None:
            self.mlp_in = mlp_in
        self.mlp = mlp
        if mlp_out is not None:
            self.mlp_out = mlp_out
        self.split = mlp_in is not None
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_resid]
        self.hook_attn_out = HookPoint()  # [batch, pos, d_resid]
        self.hook_resid_mid = HookPoint()  # [batch, pos, d_resid]
        if self.split:
            self.hook_resid_hidden = HookPoint()  # [batch, pos, d_resid]
            self.hook_resid_act = HookPoint()  # [batch, pos, d_resid]
        self.hook_mlp_out = HookPoint()  # [batch, pos, d_resid]
        self.hook_resid_post = HookPoint()  # [batch, pos, d_resid]

    def sublayers(self) -> list[tuple[str, LiteralAttention]]:
        """``(name, module)`` of every attention sublayer, in order."""
        names = ["attn", "mlp_in", "mlp", "mlp_out"] if self.split else ["attn", "mlp"]
        return [(name, getattr(self, name)) for name in names]

    def forward(
        self, resid: Float[torch.Tensor, "batch pos d_resid"]
    ) -> Float[torch.Tensor, "batch pos d_resid"]:
        resid_pre = self.hook_resid_pre(resid)
        attn_out = self.hook_attn_out(self.attn(self.ln1(resid_pre)))
        resid_mid = self.hook_resid_mid(resid_pre + attn_out)
        if not self.split:
            mlp_out = self.mlp(self.ln2(resid_mid))
        else:
            written_in = self.mlp_in(self.ln2(resid_mid))
            resid_hidden = self.hook_resid_hidden(resid_mid + written_in)
            written_act = self.mlp(resid_hidden)
            resid_act = self.hook_resid_act(resid_hidden + written_act)
            mlp_out = written_in + written_act + self.mlp_out(resid_act)
        mlp_out = self.hook_mlp_out(mlp_out)
        return self.hook_resid_post(resid_mid + mlp_out)


class LiteralTransformer(HookedRootModule):
    """A transformer whose every sublayer is plain softmax attention (built by :func:`to_literal`).

    ``forward(tokens)`` returns logits ``[batch, pos, d_vocab]`` for the real positions. Inside,
    the sequence is ``[bias token, tokens...]`` and the residual stream has width ``d_resid``
    (see :class:`ResidualLayout`); activation hooks follow TransformerLens's names
    (``blocks.{l}.attn.hook_pattern``, ``blocks.{l}.mlp.hook_post``, ...) but cover the augmented
    sequence: index ``[:, 1:]`` for the real positions and ``[..., :d_model]`` for the original
    coordinates. ``run_with_cache`` / ``run_with_hooks`` work as usual.

    Attributes:
        cfg: The original model's config (a copy).
        layout: The augmented residual stream.
        layout_name: ``"neuron"`` (Theorem 3/6) or ``"split"`` (Theorems 7/8).
        omega: The mask penalty (``None`` for ``mask="ordinary"``).
        mask: ``"omega"``, ``"ordinary"`` or ``"causal_ordinary"``.
        budget_bytes: Refuse inputs whose patterns (all sublayers) would exceed this.
    """

    cfg: Any
    layout: ResidualLayout
    layout_name: str
    omega: float | None
    mask: str
    budget_bytes: int

    def __init__(
        self,
        cfg: Any,
        layout: ResidualLayout,
        layout_name: str,
        blocks: list[LiteralBlock],
        W_E: Tensor,
        W_pos: Tensor | None,
        ln_final: nn.Module,
        unembed: Unembed,
        omega: float | None,
        mask: str,
        budget_bytes: int,
    ):
        super().__init__()
        self.cfg = cfg
        self.layout = layout
        self.layout_name = layout_name
        self.omega = omega
        self.mask = mask
        self.budget_bytes = budget_bytes
        self.W_E = nn.Parameter(W_E)
        self.W_pos = nn.Parameter(W_pos) if W_pos is not None else None
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        self.hook_pos_embed = HookPoint()  # [batch, pos, d_model]
        self.blocks = nn.ModuleList(blocks)
        self.ln_final = ln_final
        self.unembed = unembed
        self.setup()

    # ------------------------------------------------------------------ sizes
    @property
    def d_resid(self) -> int:
        """``D'``, the width of the augmented residual stream."""
        return self.layout.d_resid

    @property
    def max_len(self) -> int:
        """Longest input (real tokens) the one-hot position coordinates cover."""
        return self.layout.n_pos - 1

    def sublayers(self) -> list[tuple[str, LiteralAttention]]:
        """``("blocks.{l}.{name}", module)`` for every attention sublayer, in order."""
        return [
            (f"blocks.{i}.{name}", module)
            for i, block in enumerate(self.blocks)
            for name, module in block.sublayers()
        ]

    def summary(self) -> dict[str, Any]:
        """Sizes of the construction: residual width, sublayers and heads per layer.

        Returns:
            A dict with ``D, M, N`` (original width, neurons per layer, ``max_len``), ``D_prime``
            (this model's residual width), ``D_prime_post`` (the post's ``D + M + N + 1``, i.e.
            ``D + 4D + N + 1`` when ``M = 4D``), ``sublayers_per_layer`` and ``heads`` (per
            sublayer name, in layer 0).
        """
        lay = self.layout
        return {
            "layout": self.layout_name,
            "D": lay.d_model,
            "M": lay.d_mlp,
            "N": self.max_len,
            "D_prime": lay.d_resid,
            "D_prime_post": lay.d_model + lay.d_mlp + self.max_len + 1,
            "sublayers_per_layer": len(self.blocks[0].sublayers()),
            "heads": {name: mod.n_heads for name, mod in self.blocks[0].sublayers()},
        }

    def pattern_bytes(self, batch: int, n_tokens: int) -> int:
        """Bytes of every sublayer's pattern for one input (what ``run_with_cache`` stores).

        Args:
            batch: Batch size.
            n_tokens: Real tokens per sequence.
        """
        n = n_tokens + 1
        itemsize = self.W_E.element_size()
        return batch * n * n * itemsize * sum(m.n_heads for _, m in self.sublayers())

    def _check_budget(self, batch: int, n_tokens: int) -> None:
        size = self.pattern_bytes(batch, n_tokens)
        if size > self.budget_bytes:
            heads = sum(m.n_heads for _, m in self.sublayers())
            raise LiteralBudgetError(
                f"The literal form would materialise {size / 2**30:.2f} GiB of attention patterns "
                f"for this input (batch {batch} x {heads} heads in all sublayers x "
                f"{n_tokens + 1}^2 positions x {self.W_E.element_size()} bytes): above "
                f"budget_bytes={self.budget_bytes} ({self.budget_bytes / 2**30:.2f} GiB). Memory "
                "and time grow as O(d_mlp * N^2). Shorten the input, use the structured form "
                "(tl_attnonly.convert(model)), or raise the budget: "
                "to_literal(..., budget_bytes=...) or model.budget_bytes = ...."
            )

    # ------------------------------------------------------------------ forward
    def embed_augmented(
        self, tokens: Int[torch.Tensor, "batch pos"]
    ) -> Float[torch.Tensor, "batch pos_plus_1 d_resid"]:
        """The augmented residual stream before the first layer.

        Args:
            tokens: Real tokens.

        Returns:
            Bias token at position 0 (its one-hot coordinate only), real token ``j`` at ``1 + j``
            (token + position embedding in the original coordinates, plus its one-hot coordinate).
        """
        batch, n = tokens.shape
        if n > self.max_len:
            raise ValueError(
                f"Input of {n} tokens is longer than max_len={self.max_len} (the one-hot position "
                "coordinates); rebuild with to_literal(..., max_len=...)."
            )
        embed = self.hook_embed(self.W_E[tokens])  # [batch, pos, d_model]
        if self.W_pos is not None:
            pos_embed = self.hook_pos_embed(self.W_pos[:n].expand(batch, n, -1))
            embed = embed + pos_embed  # [batch, pos, d_model]
        lay = self.layout
        resid = embed.new_zeros(batch, n + 1, lay.d_resid)
        resid[:, 1:, lay.model_dims] = embed
        idx = torch.arange(n + 1, device=tokens.device)
        resid[:, idx, lay.pos_start + idx] = 1.0
        return resid

    def forward(
        self,
        tokens: Int[torch.Tensor, "batch pos"],
        return_type: str | None = "logits",
        loss_per_token: bool = False,
    ) -> None | Tensor | tuple[Tensor, Tensor]:
        """Run the literal model.

        Args:
            tokens: ``[batch, pos]`` token ids (strings are not accepted: tokenise first).
            return_type: ``"logits"``, ``"loss"``, ``"both"`` or ``None``.
            loss_per_token: As in TransformerLens.

        Returns:
            Logits ``[batch, pos, d_vocab]`` of the real positions, and/or the loss.

        Raises:
            LiteralBudgetError: If the patterns would exceed ``budget_bytes``.
        """
        if tokens.ndim == 1:
            tokens = tokens[None]
        self._check_budget(tokens.shape[0], tokens.shape[1])
        resid = self.embed_augmented(tokens)
        for block in self.blocks:
            resid = block(resid)
        if return_type is None:
            return None
        real = resid[:, 1:, self.layout.model_dims]
        logits = self.unembed(self.ln_final(real))  # [batch, pos, d_vocab]
        if return_type == "logits":
            return logits
        loss = lm_cross_entropy_loss(logits, tokens, per_token=loss_per_token)
        if return_type == "loss":
            return loss
        if return_type == "both":
            return logits, loss
        raise ValueError(f"Invalid return_type {return_type!r}")


# ============================================================================ helpers


def neuron_pattern_compact(
    pattern: Float[Tensor, "batch head query_pos key_pos"], n_neuron_heads: int
) -> Float[Tensor, "batch n_neuron_heads pos 2"]:
    """A literal neuron sublayer's dense pattern (or scores) in the structured form's layout.

    Args:
        pattern: ``blocks.{l}.mlp.hook_pattern`` (or ``hook_attn_scores``) of the literal model,
            over the augmented sequence.
        n_neuron_heads: ``d_mlp * K`` (drops the bias head, if any).

    Returns:
        ``[batch, n_neuron_heads, pos, 2]`` with last axis (self, bias token), real queries only.
    """
    p = pattern[:, :n_neuron_heads, 1:]  # real queries
    self_part = torch.diagonal(p[..., 1:], dim1=-2, dim2=-1)
    return torch.stack([self_part, p[..., 0]], dim=-1)


def omega_requirement(
    dtype: torch.dtype,
    n_keys: int,
    tol: float | None = None,
    score_range: float = TYPICAL_SCORE_RANGE,
) -> float:
    """Smallest omega for which masked keys keep less than ``tol`` of the attention.

    A query with ``n_keys`` keys leaks at most ``n_keys * exp(score_range - omega)`` to masked
    keys, where ``score_range`` bounds how far a masked key's real score may exceed the best
    allowed one.

    Args:
        dtype: Dtype of the model; ``tol`` defaults to its rounding unit ``eps / 2``.
        n_keys: Keys per query (``1 + max_len``).
        tol: Acceptable leaked mass.
        score_range: Assumed spread of real scores.

    Returns:
        ``score_range + log(n_keys / tol)``.
    """
    if tol is None:
        tol = torch.finfo(dtype).eps / 2
    return score_range + math.log(n_keys / tol)


def omega_warnings(
    omega: float, dtype: torch.dtype, n_keys: int, tol: float | None = None
) -> list[str]:
    """Why ``omega`` is a bad choice for ``dtype`` (empty if it is fine).

    Args:
        omega: The penalty.
        dtype: Dtype the literal model will run in.
        n_keys: Keys per query.
        tol: Acceptable leaked attention mass (default: the dtype's rounding unit).

    Returns:
        Messages: overflow (omega is ``inf`` in ``dtype``) and/or too small for ``tol``.
    """
    out = []
    finfo = torch.finfo(dtype)
    if not math.isfinite(torch.tensor(float(omega), dtype=dtype).item()):
        out.append(
            f"omega={omega:g} overflows {dtype} (largest finite value {finfo.max:g}): -omega "
            "becomes -inf, -inf * 0 = NaN enters every score and every output is NaN. Use "
            f"omega <= {finfo.max / 4:g} (default {DEFAULT_OMEGA:g})."
        )
    need = omega_requirement(dtype, n_keys, tol)
    if omega < need:
        shown_tol = tol if tol is not None else finfo.eps / 2
        out.append(
            f"omega={omega:g} may be too small for a tolerance of {shown_tol:.2g} in {dtype} with "
            f"{n_keys} keys: masked keys can keep up to n_keys * exp({TYPICAL_SCORE_RANGE:g} - "
            f"omega) of the attention; omega >= {need:.1f} is needed (default {DEFAULT_OMEGA:g})."
        )
    return out


# ============================================================================ builder


def _norm_parts(norm: nn.Module) -> tuple[Tensor | None, Tensor | None, bool | None]:
    """(weight, bias, center) of a TransformerLens norm; center ``None`` means no norm."""
    if isinstance(norm, LayerNorm):
        return norm.w, norm.b, True
    if isinstance(norm, LayerNormPre):
        return None, None, True
    if isinstance(norm, RMSNorm):
        return norm.w, None, False
    if isinstance(norm, RMSNormPre):
        return None, None, False
    if isinstance(norm, nn.Identity):
        return None, None, None
    raise NotImplementedError(f"Unsupported normalisation module {type(norm).__name__}")


def _partial_norm(norm: nn.Module, d_model: int, eps: float) -> nn.Module:
    center = _norm_parts(norm)[2]
    return nn.Identity() if center is None else PartialNorm(d_model, eps, center)


def check_literal_supported(model: HookedTransformer) -> None:
    """Refuse, before building, a model the literal form cannot represent exactly.

    Supported: LN, LNPre, RMS, RMSPre or no norm; learned ("standard") or rotary positions;
    causal or bidirectional attention; grouped-query attention (expanded to full heads); any
    activation with neuron-head coefficients.

    Raises:
        NotImplementedError: naming the unsupported feature.
        ValueError: For an attention-only model (nothing to convert).
    """
    cfg = model.cfg
    if cfg.attn_only:
        raise ValueError("The model is attention-only already (cfg.attn_only=True).")
    if cfg.positional_embedding_type not in ("standard", "rotary"):
        raise NotImplementedError(
            f"positional_embedding_type={cfg.positional_embedding_type!r} is not supported by the "
            "literal form (supported: 'standard' learned positions and 'rotary')."
        )
    refused = {
        "parallel_attn_mlp": (
            "parallel attention + MLP (GPT-J/NeoX): the literal form's MLP sublayers read the "
            "residual stream after the attention sublayer has written to it"
        ),
        "use_qk_norm": "query/key normalisation is not part of plain attention",
        "use_local_attn": "local (windowed) attention",
        "use_attention_sinks": "learned attention sinks",
        "use_logn_attn": "log-n query scaling",
        "use_dynamic_ntk_rope": "dynamic NTK rotary scaling",
        "use_normalization_before_and_after": "norms after the sublayers",
        "post_embedding_ln": "a norm after the embedding",
    }
    for flag, why in refused.items():
        if getattr(cfg, flag, False):
            raise NotImplementedError(
                f"cfg.{flag}=True is not supported by the literal form: {why}."
            )
    if softcap_enabled(cfg.attn_scores_soft_cap):
        raise NotImplementedError("Attention score soft-capping is not plain softmax attention.")
    if cfg.clip_qkv is not None:
        raise NotImplementedError("cfg.clip_qkv (clamped q/k/v) is not plain attention.")
    if cfg.normalization_type not in ("LN", "LNPre", "RMS", "RMSPre", None):
        raise NotImplementedError(f"normalization_type={cfg.normalization_type!r}")
    if cfg.act_fn is not None and cfg.act_fn.endswith("_ln"):
        raise NotImplementedError(
            f"act_fn={cfg.act_fn!r} (a norm inside the MLP) is not supported."
        )


def sublayer_head_counts(
    cfg: Any, layout: LayoutName, n_heads_per_neuron: int, linear_d_head: int
) -> dict[str, int]:
    """Heads in each sublayer of one literal layer (see also :meth:`LiteralTransformer.summary`).

    Args:
        cfg: The original model's config.
        layout: ``"neuron"`` or ``"split"``.
        n_heads_per_neuron: ``K``.
        linear_d_head: Internal dimension of the linear-map heads.

    Returns:
        ``{"attn": n_heads + 1, "mlp": d_mlp K + 1}`` (neuron layout) or ``{"attn": n_heads + 1,
        "mlp_in": ceil(M / d), "mlp": M K, "mlp_out": ceil(D / d) + 2 ceil(M / d)}`` (split).
    """
    M, D, d = cfg.d_mlp, cfg.d_model, linear_d_head
    if layout == "neuron":
        return {"attn": cfg.n_heads + 1, "mlp": M * n_heads_per_neuron + 1}
    return {
        "attn": cfg.n_heads + 1,
        "mlp_in": math.ceil(M / d),
        "mlp": M * n_heads_per_neuron,
        "mlp_out": math.ceil(D / d) + 2 * math.ceil(M / d),
    }


def _check_weight_budget(
    cfg: Any,
    lay: ResidualLayout,
    K: int,
    layout: LayoutName,
    mask: str,
    linear_d_head: int,
    budget_bytes: int,
) -> None:
    """Refuse before allocating: W_Q, W_K, W_V, W_O of every sublayer, built in float64."""
    counts = sublayer_head_counts(cfg, layout, K, linear_d_head)
    dims = {"attn": (cfg.d_head, cfg.d_head), "mlp": (1, 1)}  # (real q/k dims, value dims)
    extra_qk = 0 if mask == "ordinary" else lay.n_pos
    per_layer = sum(
        h * lay.d_resid * (2 * (dims.get(name, (0, linear_d_head))[0] + extra_qk)
                           + 2 * dims.get(name, (0, linear_d_head))[1])
        for name, h in counts.items()
    )  # fmt: skip
    size = 8 * cfg.n_layers * per_layer
    if size > budget_bytes:
        raise LiteralBudgetError(
            f"The literal form of this model needs about {size / 2**30:.2f} GiB of weights "
            f"(D'={lay.d_resid}, {sum(counts.values())} heads per layer, each with "
            f"{extra_qk} one-hot position dimensions in W_Q/W_K, built in float64): above "
            f"budget_bytes={budget_bytes} ({budget_bytes / 2**30:.2f} GiB). Lower max_len=..., "
            "use mask='ordinary' (no position dimensions in W_Q/W_K), or pass budget_bytes=...."
        )


def assemble_sublayer(
    spec: SublayerHeads,
    layout: ResidualLayout,
    mask: str,
    omega: float,
    causal: bool,
    use_attn_result: bool,
    rotary_adjacent_pairs: bool = False,
    module_cls: type = LiteralAttention,
    **module_kwargs: Any,
) -> LiteralAttention:
    """Turn a sublayer's heads into a :class:`LiteralAttention`, masks included.

    Args:
        spec: The heads' real parts.
        layout: The augmented residual stream.
        mask: ``"omega"`` (masks written into ``W_Q``/``W_K`` by :func:`theorem9_mask_qk`),
            ``"causal_ordinary"`` (only the model's causal mask is an ordinary mask) or
            ``"ordinary"`` (ordinary masks only).
        omega: The penalty.
        causal: Whether the model's own heads are causal.
        use_attn_result: Materialise per-head results.
        rotary_adjacent_pairs: GPT-J style rotary pairs.
        module_cls: :class:`LiteralAttention` or a subclass.
        **module_kwargs: Passed to ``module_cls``.

    Returns:
        The module, in float64.
    """
    n_pos = layout.n_pos
    allowed = torch.stack([allowed_pattern(k, n_pos, causal) for k in spec.kinds])
    if mask == "ordinary":
        W_Q, W_K, mask_mode = spec.W_Q, spec.W_K, "allowed"
    else:
        if mask == "causal_ordinary":
            in_weights = [allowed_pattern(k, n_pos, causal=False) for k in spec.kinds]
            mask_mode = "causal" if causal and "attn" in spec.kinds else "none"
        else:
            in_weights, mask_mode = list(allowed), "none"
        blocks = [theorem9_mask_qk(a, omega) for a in in_weights]
        H, R = spec.n_heads, layout.d_resid
        q_mask = torch.zeros(H, R, n_pos, dtype=torch.float64)
        k_mask = torch.zeros(H, R, n_pos, dtype=torch.float64)
        q_mask[:, layout.pos_dims] = torch.stack([b[0] for b in blocks])[spec.head_kind]
        k_mask[:, layout.pos_dims] = torch.stack([b[1] for b in blocks])[spec.head_kind]
        W_Q = torch.cat([spec.W_Q, q_mask], dim=-1)
        W_K = torch.cat([spec.W_K, k_mask], dim=-1)
    module = module_cls(
        spec.n_heads,
        layout.d_resid,
        W_Q.shape[-1],
        spec.W_V.shape[-1],
        n_pos,
        n_mask_kinds=len(spec.kinds),
        mask_mode=mask_mode,
        rotary_dim=spec.rotary_dim,
        rotary_adjacent_pairs=rotary_adjacent_pairs,
        use_attn_result=use_attn_result,
        dtype=torch.float64,
        **module_kwargs,
    )
    with torch.no_grad():
        module.W_Q.copy_(W_Q)
        module.W_K.copy_(W_K)
        module.W_V.copy_(spec.W_V)
        module.W_O.copy_(spec.W_O)
        module.allowed.copy_(allowed)
        module.head_kind.copy_(spec.head_kind)
    return module


def _rotary_tables(attn: nn.Module, max_len: int) -> tuple[Tensor, Tensor]:
    """TransformerLens's own rotary tables for positions ``0..max_len-1``, in float64."""
    cfg = attn.cfg
    if attn.rotary_cos.shape[0] >= max_len:
        return attn.rotary_cos[:max_len].double(), attn.rotary_sin[:max_len].double()
    sin, cos = attn.calculate_sin_cos_rotary(
        cfg.rotary_dim, max_len, base=attn._rotary_base(), dtype=torch.float64
    )
    return cos, sin


def _coefficients(model: HookedTransformer, conversion: Any, coefficients: Any) -> Any:
    if coefficients is not None:
        return coefficients
    from tl_attnonly.options import ConversionOptions, check_convertible

    options = conversion if conversion is not None else ConversionOptions()
    check_convertible(model.cfg, options)
    return options.coefficients(model.cfg.act_fn)


def to_literal(
    model: HookedTransformer,
    omega: float | None = None,
    layout: LayoutName = "neuron",
    mask: MaskOption = "omega",
    *,
    conversion: Any = None,
    coefficients: Any = None,
    max_len: int | None = None,
    dtype: torch.dtype | None = None,
    tol: float | None = None,
    linear_d_head: int | None = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    use_attn_result: bool = False,
) -> LiteralTransformer:
    """Build the literal attention-only form of ``model`` (Huben & Morris 2023, Thms 3, 6-9).

    Args:
        model: A TransformerLens ``HookedTransformer`` (not modified).
        omega: Penalty for disallowed (query, key) pairs; default :data:`DEFAULT_OMEGA` (1e4,
            see there). Warns if it overflows ``dtype`` or is too small for ``tol``.
        layout: ``"neuron"``: per layer the model's attention sublayer and one sublayer of
            ``d_mlp * K`` neuron-heads (Theorems 3 and 6). ``"split"``: the post's four sublayers
            per layer: attention, ``W_in`` heads (Theorem 7), activation heads (Theorem 8),
            ``W_out`` heads (Theorem 7) that also clear the hidden coordinates.
        mask: ``"omega"``: every mask (causal, self + bias token, self only) written into the
            weights (Theorem 9); the attention has no mask at all. ``"causal_ordinary"``: the
            model's own causal mask is an ordinary mask, the rest as ``"omega"``.
            ``"ordinary"``: every mask an ordinary ``-inf`` mask (exact; no omega).
        conversion: A :class:`tl_attnonly.ConversionOptions` (heads per neuron, ReLU sharpness).
        coefficients: Per-head ``b, d, f, e, g`` to use instead (overrides ``conversion``).
        max_len: Longest input; sets the ``1 + max_len`` one-hot position coordinates
            (default ``cfg.n_ctx``).
        dtype: Dtype of the result (default the model's). Built in float64, then cast.
        tol: Attention mass allowed to leak to masked keys, for the omega warning.
        linear_d_head: Internal dimension of the linear-map heads (split layout; default
            ``cfg.d_head``).
        budget_bytes: Refuse to build weights, or to run inputs whose patterns, exceed this.
        use_attn_result: Materialise per-head results (``hook_result``) in every sublayer.

    Returns:
        A :class:`LiteralTransformer`.

    Raises:
        NotImplementedError, ValueError: For unsupported models or options, before any work.
        LiteralBudgetError: If the weights would exceed ``budget_bytes``.
    """
    if layout not in ("neuron", "split"):
        raise ValueError(f"layout must be 'neuron' or 'split', got {layout!r}")
    if mask not in ("omega", "ordinary", "causal_ordinary"):
        raise ValueError(f"mask must be 'omega', 'ordinary' or 'causal_ordinary', got {mask!r}")
    check_literal_supported(model)
    coefs = _coefficients(model, conversion, coefficients)
    cfg = copy.deepcopy(model.cfg)
    dtype = dtype or cfg.dtype
    omega = DEFAULT_OMEGA if omega is None else float(omega)
    max_len = cfg.n_ctx if max_len is None else int(max_len)
    if not 1 <= max_len <= cfg.n_ctx:
        raise ValueError(f"max_len must be in [1, n_ctx={cfg.n_ctx}], got {max_len}")
    lay = ResidualLayout(cfg.d_model, cfg.d_mlp, max_len + 1, hidden=layout == "split")
    if mask != "ordinary":
        for message in omega_warnings(omega, dtype, lay.n_pos, tol):
            warnings.warn(message, stacklevel=2)
    dh_lin = linear_d_head or cfg.d_head
    _check_weight_budget(cfg, lay, len(coefs.b), layout, mask, dh_lin, budget_bytes)
    build = _Builder(cfg, lay, coefs, mask, omega, use_attn_result, dh_lin)
    with torch.no_grad():
        blocks = [build.block(block, max_len, layout) for block in model.blocks]
        final = model.ln_final if cfg.normalization_type is not None else nn.Identity()
        wf, bf, _ = _norm_parts(final)
        W_U, b_U = _folded(model.unembed.W_U, model.unembed.b_U, wf, bf)
        unembed = copy.deepcopy(model.unembed)
        unembed.W_U = nn.Parameter(W_U)
        unembed.b_U = nn.Parameter(b_U)
        W_pos = None
        if cfg.positional_embedding_type == "standard":
            W_pos = model.pos_embed.W_pos[:max_len].double().clone()
        literal = LiteralTransformer(
            cfg,
            lay,
            layout,
            blocks,
            model.embed.W_E.double().clone(),
            W_pos,
            _partial_norm(final, cfg.d_model, cfg.eps),
            unembed,
            None if mask == "ordinary" else omega,
            mask,
            budget_bytes,
        )
    literal.tokenizer = model.tokenizer
    cfg.dtype = dtype
    return literal.to(dtype)


class _Builder:
    """Builds the literal sublayers of one original layer (state shared by all layers)."""

    def __init__(
        self,
        cfg: Any,
        layout: ResidualLayout,
        coefficients: Any,
        mask: str,
        omega: float,
        use_attn_result: bool,
        linear_d_head: int,
    ):
        self.cfg, self.lay, self.coefs = cfg, layout, coefficients
        self.mask, self.omega, self.use_attn_result = mask, omega, use_attn_result
        self.linear_d_head = linear_d_head
        self.causal = cfg.attention_dir == "causal"
        self.K = len(coefficients.b)
        self.g_sum = float(sum(coefficients.g))

    def assemble(self, spec: SublayerHeads, **kwargs: Any) -> LiteralAttention:
        return assemble_sublayer(
            spec, self.lay, self.mask, self.omega, self.causal, self.use_attn_result, **kwargs
        )

    def block(self, block: nn.Module, max_len: int, layout: str) -> LiteralBlock:
        """The literal form of one TransformerLens block."""
        D, eps = self.cfg.d_model, self.cfg.eps
        ln1, ln2 = _partial_norm(block.ln1, D, eps), _partial_norm(block.ln2, D, eps)
        attn = self.attention(block, max_len)
        w2, b2, _ = _norm_parts(block.ln2)
        W_in, b_in = _folded(block.mlp.W_in, block.mlp.b_in, w2, b2)  # [D, M], [M]
        W_out, b_out = block.mlp.W_out.double(), block.mlp.b_out.double()  # [M, D], [D]
        if layout == "neuron":
            return LiteralBlock(ln1, attn, ln2, self.neuron_heads(W_in, b_in, W_out, b_out))
        mlp_in, activation, mlp_out = self.split_mlp(W_in, b_in, W_out, b_out)
        return LiteralBlock(ln1, attn, ln2, activation, mlp_in=mlp_in, mlp_out=mlp_out)

    def attention(self, block: nn.Module, max_len: int) -> LiteralAttention:
        """The model's own heads, tweaked (Theorem 6), plus the ``b_O`` head."""
        a, cfg = block.attn, self.cfg
        w1, b1, _ = _norm_parts(block.ln1)
        rotary_dim = (cfg.rotary_dim or 0) if cfg.positional_embedding_type == "rotary" else 0
        spec = theorem6_tweaked_attention_heads(
            a.W_Q, a.b_Q, a.W_K, a.b_K, a.W_V, a.b_V, a.W_O, a.b_O, self.lay,
            float(a.attn_scale), w1, b1, rotary_dim,
        )  # fmt: skip
        attn = self.assemble(spec, rotary_adjacent_pairs=bool(cfg.rotary_adjacent_pairs))
        if rotary_dim:
            cos, sin = _rotary_tables(a, max_len)
            # augmented position p uses original position p - 1 (the bias token's is masked)
            attn.rotary_cos.copy_(torch.cat([cos[:1], cos]))
            attn.rotary_sin.copy_(torch.cat([sin[:1], sin]))
        return attn

    def neuron_heads(
        self, W_in: Tensor, b_in: Tensor, W_out: Tensor, b_out: Tensor
    ) -> LiteralNeuronLayer:
        """Neuron layout: one sublayer of ``d_mlp * K`` neuron-heads (Theorem 3) + ``b_out``."""
        lay, M = self.lay, W_in.shape[1]
        heads = theorem3_neuron_head(W_in.T, b_in, W_out, self.coefs)
        spec = neuron_sublayer(heads, lay, lay.model_dims, lay.model_dims, b_out)
        neurons = self.assemble(
            spec, module_cls=LiteralNeuronLayer, d_mlp=M, n_heads_per_neuron=self.K,
            pre_start=None,
        )  # fmt: skip
        neurons.pre_read[lay.model_dims] = W_in
        neurons.pre_read[lay.real_rows] = b_in
        neurons.post_write[:, lay.model_dims] = W_out
        neurons.post_offset.fill_(self.g_sum)
        return neurons

    def split_mlp(
        self, W_in: Tensor, b_in: Tensor, W_out: Tensor, b_out: Tensor
    ) -> tuple[LiteralAttention, LiteralNeuronLayer, LiteralAttention]:
        """Split layout: ``W_in`` heads (Thm 7), activation heads (Thm 8), ``W_out`` heads."""
        lay, M, D = self.lay, W_in.shape[1], W_in.shape[0]
        R, real, dh = lay.d_resid, lay.real_rows, self.linear_d_head
        # 1. pre <- normalised x W_in + b_in
        W_map_in = torch.zeros(R, M, dtype=torch.float64)
        W_map_in[lay.model_dims], W_map_in[real] = W_in, b_in
        mlp_in = self.assemble(linear_map_sublayer([(W_map_in, lay.pre_dims)], lay, dh))
        # 2. post <- act(pre) - sum_k g_k
        spec = neuron_sublayer(
            theorem8_activation_heads(self.coefs, M), lay, lay.pre_dims, lay.post_dims, None
        )
        activation = self.assemble(
            spec, module_cls=LiteralNeuronLayer, d_mlp=M, n_heads_per_neuron=self.K,
            pre_start=lay.pre_dims.start,
        )  # fmt: skip
        activation.post_offset.fill_(self.g_sum)
        activation.post_write[:, lay.post_dims] = torch.eye(M, dtype=torch.float64)
        # 3. x <- post W_out + b_out (+ the g constants); pre, post <- 0
        W_map_out = torch.zeros(R, D, dtype=torch.float64)
        W_map_out[lay.post_dims] = W_out
        W_map_out[real] = b_out + self.g_sum * W_out.sum(0)
        clear_pre = torch.zeros(R, M, dtype=torch.float64)
        clear_pre[lay.pre_dims] = -torch.eye(M, dtype=torch.float64)
        clear_post = torch.zeros(R, M, dtype=torch.float64)
        clear_post[lay.post_dims] = -torch.eye(M, dtype=torch.float64)
        maps = [(W_map_out, lay.model_dims), (clear_pre, lay.pre_dims), (clear_post, lay.post_dims)]
        mlp_out = self.assemble(linear_map_sublayer(maps, lay, dh))
        return mlp_in, activation, mlp_out
