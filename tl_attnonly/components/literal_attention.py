"""Plain softmax attention: the only kind of sublayer in the literal form.

Every sublayer of :class:`tl_attnonly.literal.LiteralTransformer` (the model's own attention heads,
the neuron-heads, the linear-map heads) is one :class:`LiteralAttention`: per head ``h``

    scores_h = (X W_Q[h]) (X W_K[h])^T,   pattern_h = softmax(scores_h),   z_h = pattern_h X W_V[h],
    out = sum_h z_h W_O[h]

over the augmented sequence (the bias token at position 0, real token ``j`` at position ``1 + j``),
i.e. ``softmax(X W_QK X^T) X W_OV`` as in Huben & Morris (2023). There are no bias parameters:
biases are carried by the constant-1 one-hot position coordinates of the residual stream, so that
every value at the bias token is exactly zero and the bias token's residual never changes. Any
``1/sqrt(d_head)`` scale is folded into ``W_Q``.

Masks are normally absent (``mask_mode="none"``): they are encoded in ``W_Q``/``W_K`` (Theorem 9).
``allowed`` always records which (query, key) pairs each head is meant to see; with
``mask_mode="allowed"`` (or ``"causal"``) it is (or the causal triangle is) also applied as an
ordinary ``-inf`` mask, which gives an exact reference.
"""

from __future__ import annotations

from typing import Literal

import einops
import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Float
from transformer_lens.FactoredMatrix import FactoredMatrix
from transformer_lens.hook_points import HookPoint

MaskMode = Literal["none", "allowed", "causal"]


class LiteralAttention(nn.Module):
    """Multi-head softmax attention with per-head ``W_Q, W_K, W_V, W_O`` and no biases.

    Args:
        n_heads: Number of heads ``H``.
        d_model: Width of the residual stream it reads and writes (the augmented ``D'``).
        d_qk: Query/key dimension per head (real part plus any Omega-mask dimensions).
        d_v: Value dimension per head.
        n_pos: Longest augmented sequence (``1 + max_len``); sizes ``allowed`` and rotary tables.
        n_mask_kinds: Number of distinct ``allowed`` patterns among the heads (``head_kind``
            says which one each head uses).
        mask_mode: ``"none"`` (no mask at all), ``"allowed"`` (apply ``allowed`` as an ordinary
            mask) or ``"causal"`` (apply only the causal triangle as an ordinary mask).
        rotary_dim: Rotate the first ``rotary_dim`` query/key dimensions of every head (0: none).
        rotary_adjacent_pairs: GPT-J style (adjacent) rather than GPT-NeoX style (halves) pairs.
        use_attn_result: Materialise per-head results at ``hook_result`` (memory-hungry).
        dtype: Parameter dtype.
    """

    allowed: torch.Tensor
    head_kind: torch.Tensor
    rotary_cos: torch.Tensor
    rotary_sin: torch.Tensor

    def __init__(
        self,
        n_heads: int,
        d_model: int,
        d_qk: int,
        d_v: int,
        n_pos: int,
        *,
        n_mask_kinds: int = 1,
        mask_mode: MaskMode = "none",
        rotary_dim: int = 0,
        rotary_adjacent_pairs: bool = False,
        use_attn_result: bool = False,
        dtype: torch.dtype = torch.float64,
    ):
        super().__init__()
        if mask_mode not in ("none", "allowed", "causal"):
            raise ValueError(f"mask_mode must be 'none', 'allowed' or 'causal', got {mask_mode!r}")
        if rotary_dim > d_qk or rotary_dim % 2:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and at most d_qk={d_qk}")
        self.n_heads = n_heads
        self.d_model = d_model
        self.d_qk = d_qk
        self.d_v = d_v
        self.n_pos = n_pos
        self.mask_mode: MaskMode = mask_mode
        self.rotary_dim = rotary_dim
        self.rotary_adjacent_pairs = rotary_adjacent_pairs
        self.use_attn_result = use_attn_result

        self.W_Q = nn.Parameter(torch.zeros(n_heads, d_model, d_qk, dtype=dtype))
        self.W_K = nn.Parameter(torch.zeros(n_heads, d_model, d_qk, dtype=dtype))
        self.W_V = nn.Parameter(torch.zeros(n_heads, d_model, d_v, dtype=dtype))
        self.W_O = nn.Parameter(torch.zeros(n_heads, d_v, d_model, dtype=dtype))
        # allowed[kind, query_pos, key_pos]: the pairs a head of that kind is meant to attend.
        self.register_buffer("allowed", torch.ones(n_mask_kinds, n_pos, n_pos, dtype=torch.bool))
        self.register_buffer("head_kind", torch.zeros(n_heads, dtype=torch.long))
        if rotary_dim:
            # Indexed by augmented sequence position: [n_pos, rotary_dim].
            self.register_buffer("rotary_cos", torch.ones(n_pos, rotary_dim, dtype=dtype))
            self.register_buffer("rotary_sin", torch.zeros(n_pos, rotary_dim, dtype=dtype))
            self.hook_rot_q = HookPoint()  # [batch, pos, head_index, d_qk]
            self.hook_rot_k = HookPoint()  # [batch, pos, head_index, d_qk]

        self.hook_q = HookPoint()  # [batch, pos, head_index, d_qk]
        self.hook_k = HookPoint()  # [batch, pos, head_index, d_qk]
        self.hook_v = HookPoint()  # [batch, pos, head_index, d_v]
        self.hook_attn_scores = HookPoint()  # [batch, head_index, query_pos, key_pos]
        self.hook_pattern = HookPoint()  # [batch, head_index, query_pos, key_pos]
        self.hook_z = HookPoint()  # [batch, pos, head_index, d_v]
        self.hook_result = HookPoint()  # [batch, pos, head_index, d_model]

    # ------------------------------------------------------------------ circuits
    @property
    def QK(self) -> FactoredMatrix:
        """``W_QK = W_Q W_K^T`` per head, ``[head, d_model, d_model]`` (factored)."""
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-1, -2))

    @property
    def OV(self) -> FactoredMatrix:
        """``W_OV = W_V W_O`` per head, ``[head, d_model, d_model]`` (factored)."""
        return FactoredMatrix(self.W_V, self.W_O)

    def allowed_pattern(self, n_pos: int | None = None) -> torch.Tensor:
        """Which (query, key) pairs each head is meant to attend.

        Args:
            n_pos: Sequence length (augmented); default ``self.n_pos``.

        Returns:
            Bool ``[head, query_pos, key_pos]``.
        """
        n = self.n_pos if n_pos is None else n_pos
        return self.allowed[:, :n, :n][self.head_kind]

    # ------------------------------------------------------------------ forward
    def _rotate(
        self, x: Float[torch.Tensor, "batch pos head_index d_qk"]
    ) -> Float[torch.Tensor, "batch pos head_index d_qk"]:
        n = x.shape[1]
        x_rot, x_pass = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        flip = torch.empty_like(x_rot)
        if self.rotary_adjacent_pairs:
            flip[..., ::2] = -x_rot[..., 1::2]
            flip[..., 1::2] = x_rot[..., ::2]
        else:
            half = self.rotary_dim // 2
            flip[..., :half] = -x_rot[..., half:]
            flip[..., half:] = x_rot[..., :half]
        cos = self.rotary_cos[None, :n, None, :]
        sin = self.rotary_sin[None, :n, None, :]
        return torch.cat([x_rot * cos + flip * sin, x_pass], dim=-1)

    def attend(
        self, x: Float[torch.Tensor, "batch pos d_model"]
    ) -> Float[torch.Tensor, "batch pos head_index d_v"]:
        """Everything up to ``z``: queries, keys, values, scores, pattern.

        Args:
            x: The (augmented, normalised) residual stream.

        Returns:
            ``z``, the pattern-weighted values of every head.
        """
        n = x.shape[1]
        if n > self.n_pos:
            raise ValueError(f"Sequence of {n} augmented positions > n_pos={self.n_pos}")
        q = self.hook_q(torch.einsum("bpm,hmd->bphd", x, self.W_Q))  # [batch, pos, head, d_qk]
        k = self.hook_k(torch.einsum("bpm,hmd->bphd", x, self.W_K))  # [batch, pos, head, d_qk]
        v = self.hook_v(torch.einsum("bpm,hmd->bphd", x, self.W_V))  # [batch, pos, head, d_v]
        if self.rotary_dim:
            q = self.hook_rot_q(self._rotate(q))
            k = self.hook_rot_k(self._rotate(k))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k)  # [batch, head, query_pos, key_pos]
        if self.mask_mode == "allowed":
            scores = scores.masked_fill(~self.allowed_pattern(n), float("-inf"))
        elif self.mask_mode == "causal":
            causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        scores = self.hook_attn_scores(scores)
        pattern = self.hook_pattern(F.softmax(scores, dim=-1))  # [batch, head, query, key]
        return self.hook_z(torch.einsum("bhqk,bkhd->bqhd", pattern, v))

    def project(
        self, z: Float[torch.Tensor, "batch pos head_index d_v"]
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        """``sum_h z_h W_O[h]``.

        Args:
            z: Per-head outputs before ``W_O``.

        Returns:
            What the sublayer adds to the residual stream.
        """
        if self.use_attn_result:
            result = self.hook_result(torch.einsum("bphd,hdm->bphm", z, self.W_O))
            return result.sum(-2)
        w = einops.rearrange(self.W_O, "head d_v d_model -> d_model (head d_v)")
        return F.linear(z.flatten(-2), w)

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_model"]
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        """One attention sublayer (without the residual connection).

        Args:
            x: The (augmented, normalised) residual stream.

        Returns:
            The sublayer's output, to be added to the residual stream.
        """
        return self.project(self.attend(x))

    def extra_repr(self) -> str:
        return (
            f"n_heads={self.n_heads}, d_model={self.d_model}, d_qk={self.d_qk}, d_v={self.d_v}, "
            f"n_pos={self.n_pos}, mask_mode={self.mask_mode!r}, rotary_dim={self.rotary_dim}"
        )


__all__ = [
    "LiteralAttention",
    "MaskMode",
]
