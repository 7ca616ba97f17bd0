"""Neuron-heads: an MLP layer written as attention heads of internal dimension 1 (Theorem 3).

Huben & Morris (2023, arXiv 2309.08593), Theorem 3: a neuron with activation a1 * SiLU(a2 x) is a
masked attention head in which each token attends only to itself and to an extra "bias token".
This module generalises the head slightly (affine value, shifted sigmoid, constant bias-token
value) so that K heads per neuron can approximate GELU; see :mod:`tl_attnonly.activations`.

For neuron ``i`` and head ``k`` (global head index ``h = i * K + k``), with ``x = pre[..., i]``:

=============================  ================================================================
query                          ``q = b_k * x + d_k``  (reads the residual through ``W_in[:, i]``)
key of the token itself        ``1``
key of the bias token          ``0``
scores (self, bias)            ``(q, 0)``
pattern (self, bias)           ``softmax(scores) = (sigmoid(q), sigmoid(-q))``
value of the token itself      ``v = f_k * x + e_k``
value of the bias token        ``g_k``
z                              ``pattern_self * v + pattern_bias * g_k``
result                         ``z * W_out[i]``
=============================  ================================================================

``hook_post[..., i] = sum_k z[..., i*K + k]`` is what the neuron writes before ``W_out``, exactly as
in TransformerLens's :class:`~transformer_lens.components.MLP`. For SiLU (K = 1, b = f = 1,
d = e = g = 0) the head is exact: weight on self = sigmoid(pre), value = pre, z = SiLU(pre).

The module keeps TL's parameter names (``W_in, b_in, W_out, b_out``) so weight processing and
state-dict loading work unchanged; the per-head weights (``W_Q, W_K, W_V, W_O``, the bias token's
key and value) are derived properties.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict

import torch
import torch.nn as nn
from jaxtyping import Float
from transformer_lens.hook_points import HookPoint

from tl_attnonly._compat import batch_addmm
from tl_attnonly.activations import NeuronHeadCoefficients
from tl_attnonly.components.neuron_head_base import (
    DERIVABLE_HOOKS,
    FUSED_CHUNK_ELEMENTS,
    FUSED_ERROR_ULPS,
    NeuronHeadBase,
)

if TYPE_CHECKING:
    from transformer_lens import HookedTransformerConfig

__all__ = [
    "DERIVABLE_HOOKS",
    "FUSED_CHUNK_ELEMENTS",
    "FUSED_ERROR_ULPS",
    "NEURON_HEAD_HOOKS",
    "NeuronHeadMLP",
]

#: Hook points of the neuron-heads, in the order the forward pass reaches them.
NEURON_HEAD_HOOKS = ("q", "k", "v", "attn_scores", "pattern", "z", "result")


class NeuronHeadMLP(NeuronHeadBase):
    """An MLP layer whose every neuron is ``K`` attention heads of internal dimension 1.

    Drop-in replacement for :class:`transformer_lens.components.MLP` (same parameters, same
    ``hook_pre``/``hook_post``, same output), adding attention-head hooks for the
    ``n_neuron_heads = d_mlp * K`` neuron-heads. Patterns are compact: over the two keys a
    neuron-head can see, ``(self, bias)``; :func:`tl_attnonly.hooks.dense_neuron_pattern` expands
    them to TransformerLens's ``[batch, head, query_pos, 1 + key_pos]``.

    Args:
        cfg: The model config (``d_model``, ``d_mlp``, ``act_fn``, ``dtype``).
        coefficients: Per-head coefficients; default: :func:`head_coefficients` of ``cfg.act_fn``.
    """

    def __init__(
        self,
        cfg: Dict | HookedTransformerConfig,
        coefficients: NeuronHeadCoefficients | None = None,
    ):
        super().__init__(cfg, coefficients)
        self._init_parameters_and_hooks()

    def _init_parameters_and_hooks(self) -> None:
        """TL's ``MLP`` parameters (in its order) and hook points, plus the neuron-head hook
        points."""
        self.W_in = nn.Parameter(torch.empty(self.cfg.d_model, self.d_mlp, dtype=self.cfg.dtype))
        self.b_in = nn.Parameter(torch.zeros(self.d_mlp, dtype=self.cfg.dtype))
        self.W_out = nn.Parameter(torch.empty(self.d_mlp, self.cfg.d_model, dtype=self.cfg.dtype))
        self.b_out = nn.Parameter(torch.zeros(self.cfg.d_model, dtype=self.cfg.dtype))

        self.hook_pre = HookPoint()  # [batch, pos, d_mlp]
        self.hook_q = HookPoint()  # [batch, pos, n_neuron_heads, 1]
        self.hook_k = HookPoint()  # [batch, pos, n_neuron_heads, 1] (keys of the real tokens)
        self.hook_v = HookPoint()  # [batch, pos, n_neuron_heads, 1] (values of the real tokens)
        self.hook_attn_scores = HookPoint()  # [batch, n_neuron_heads, query_pos, 2] (self, bias)
        self.hook_pattern = HookPoint()  # [batch, n_neuron_heads, query_pos, 2] (self, bias)
        self.hook_z = HookPoint()  # [batch, pos, n_neuron_heads, 1]
        self.hook_result = HookPoint()  # [batch, pos, n_neuron_heads, d_model]
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    # ------------------------------------------------------------------ derived head weights
    @property
    def W_Q(self) -> Float[torch.Tensor, "n_neuron_heads d_model 1"]:
        """Query weights: ``b_k * W_in[:, i]``."""
        b = self._coefs(self.W_in)[0]
        return self._per_head(self.W_in, b).T.unsqueeze(-1)

    @property
    def b_Q(self) -> Float[torch.Tensor, "n_neuron_heads 1"]:
        """Query biases: ``b_k * b_in[i] + d_k``."""
        b, d = self._coefs(self.b_in)[:2]
        return (self.b_in.unsqueeze(-1) * b + d).flatten().unsqueeze(-1)

    @property
    def W_V(self) -> Float[torch.Tensor, "n_neuron_heads d_model 1"]:
        """Value weights of the real tokens: ``f_k * W_in[:, i]``."""
        f = self._coefs(self.W_in)[2]
        return self._per_head(self.W_in, f).T.unsqueeze(-1)

    @property
    def b_V(self) -> Float[torch.Tensor, "n_neuron_heads 1"]:
        """Value biases of the real tokens: ``f_k * b_in[i] + e_k``."""
        _, _, f, e, _ = self._coefs(self.b_in)
        return (self.b_in.unsqueeze(-1) * f + e).flatten().unsqueeze(-1)

    @property
    def v_bias_token(self) -> Float[torch.Tensor, "n_neuron_heads 1"]:
        """The bias token's value: ``g_k`` (0 for SiLU and ReLU)."""
        g = self._coefs(self.W_in)[4]
        return g.repeat(self.d_mlp).unsqueeze(-1)

    # ------------------------------------------------------------------ forward
    def _query_value(
        self, pre: Float[torch.Tensor, "batch pos d_mlp"]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``b_k x + d_k`` and values ``f_k x + e_k``, ``[batch, pos, d_mlp, K or 1]``.

        Multiplications by 1 and additions of 0 are skipped (same result, less work); a trailing
        axis of size 1 broadcasts over the K heads.
        """
        c = self.coefficients
        b, d, f, e, _ = self._coefs(pre)
        x = pre.unsqueeze(-1)  # [batch, pos, d_mlp, 1]
        q = x if all(val == 1 for val in c.b) else x * b
        if any(val != 0 for val in c.d):
            q = q.add_(d) if q is not x else q + d
        v = x if all(val == 1 for val in c.f) else x * f
        if any(val != 0 for val in c.e):
            v = v.add_(e) if v is not x else v + e
        return q, v

    def _fused_post(
        self, pre: Float[torch.Tensor, "batch pos d_mlp"]
    ) -> Float[torch.Tensor, "batch pos d_mlp"]:
        """``sum_k z`` as one scalar function of ``pre`` (see :meth:`_fused_activation`)."""
        return self._fused_activation(pre)

    def _head_z(
        self, pre: Float[torch.Tensor, "batch pos d_mlp"]
    ) -> Float[torch.Tensor, "batch pos n_neuron_heads 1"]:
        """The neuron-heads as attention heads, every hook point on the way; returns ``z``."""
        batch, pos, _ = pre.shape
        q, v = self._query_value(pre)
        g = self._coefs(pre)[4]
        shape = (batch, pos, self.n_neuron_heads, 1)
        expanded = (batch, pos, self.d_mlp, self.n_heads_per_neuron)
        # With trivial coefficients q and v are views of pre: a hook that could hold or edit
        # them gets its own copy, so an in-place edit in one hook cannot leak into the others.
        q = self._hook("q", self._own("q", q.expand(expanded).reshape(shape), pre))
        k = self._keys(q)
        v = self._hook("v", self._own("v", v.expand(expanded).reshape(shape), pre))
        bias_value = g.repeat(self.d_mlp).unsqueeze(-1) if any(self.coefficients.g) else None
        # [2, batch, pos, n_neuron_heads]: (self, bias) planes
        p = self._attend(q, k, bias_plane=bias_value is not None)
        return self._hook("z", self._mix_values(p, v, bias_value))  # [b, pos, n_neuron_heads, 1]

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_model"]
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        pre = self.hook_pre(batch_addmm(self.b_in, self.W_in, x))  # [batch, pos, d_mlp]
        if not self._uses_head_path():
            return batch_addmm(self.b_out, self.W_out, self.hook_post(self._fused_post(pre)))
        z = self._head_z(pre)
        post = self._sum_heads(z)
        if not self.use_neuron_result:
            return batch_addmm(self.b_out, self.W_out, self.hook_post(post))  # [batch, pos, d_mlp]
        # [batch, pos, n_neuron_heads, d_model]
        result = self.hook_result(z * self.W_O.squeeze(1))
        out = result.sum(-2) + self.b_out
        correction = self._post_correction(post)  # an edit of post still reaches the output
        return out if correction is None else out + correction @ self.W_out

    def extra_repr(self) -> str:
        c = self.coefficients
        return (
            f"d_mlp={self.d_mlp}, heads_per_neuron={self.n_heads_per_neuron}, "
            f"n_neuron_heads={self.n_neuron_heads}, activation={c.activation!r}, "
            f"method={c.method!r}"
        )
