"""The paper's theorems, one function each, as the real parts of attention heads.

:func:`theorem3_neuron_head` (one neuron as ``K`` heads of internal dimension 1; defined in
:mod:`tl_attnonly.theorem3`, which imports on TransformerLens 4.x too, and re-exported here),
:func:`theorem6_tweaked_attention_heads` (the model's own heads, kept off the bias token),
:func:`theorem7_linear_map_heads` (a linear map as self-attending heads),
:func:`theorem8_activation_heads` (an entry-wise activation) and :func:`theorem9_mask_qk` (a mask
written into ``W_Q``/``W_K``); the table in :mod:`tl_attnonly.literal` says what each builds.
:func:`neuron_sublayer` and :func:`linear_map_sublayer` place those heads in the augmented
residual stream (:class:`~tl_attnonly.literal.layout.ResidualLayout`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from jaxtyping import Float, Int
from torch import Tensor

from tl_attnonly.literal.layout import ResidualLayout
from tl_attnonly.theorem3 import NeuronHeadWeights, theorem3_neuron_head

if TYPE_CHECKING:
    from tl_attnonly._types import CoefficientsLike


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


def theorem8_activation_heads(coefficients: CoefficientsLike, d_mlp: int) -> NeuronHeadWeights:
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
    # built in float64 directly: -omega may not fit the default dtype (omega = 1e300)
    q_block = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill_(~allowed, -float(omega))
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


def fold_norm(
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
    Wq, bq = fold_norm(W_Q, b_Q, norm_w, norm_b)
    Wk, bk = fold_norm(W_K, b_K, norm_w, norm_b)
    Wv, bv = fold_norm(W_V, b_V, norm_w, norm_b)
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
    kinds: tuple[str, ...] = ("self_bias",)
    head_kind = [0] * n_neuron_heads
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


__all__ = [
    "NeuronHeadWeights",
    "SublayerHeads",
    "allowed_pattern",
    "linear_map_sublayer",
    "neuron_sublayer",
    "theorem3_neuron_head",
    "theorem6_tweaked_attention_heads",
    "theorem7_linear_map_heads",
    "theorem8_activation_heads",
    "theorem9_mask_qk",
]
