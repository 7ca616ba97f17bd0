"""Gated neuron-heads: a gated MLP (SwiGLU, GeGLU, ReGLU) written as neuron-heads.

TransformerLens's :class:`~transformer_lens.components.mlps.gated_mlp.GatedMLP` computes, per
neuron ``i``, ``post = act(g) * u + b_in`` with the gate ``g = x W_gate[:, i]`` (``hook_pre``) and
the linear branch ``u = x W_in[:, i]`` (``hook_pre_linear``); ``b_in`` is added after the product.

Here every neuron is ``K`` heads of internal dimension 1 over two keys, the token itself and a
bias token, exactly as for plain MLPs (:mod:`tl_attnonly.components.neuron_heads`), with the gate
in the query and the product in the value (reading (a) of ``docs/gated_mlps.md``). For neuron
``i`` and head ``k`` (global head index ``h = i * K + k``):

=============================  ================================================================
query                          ``q = b_k * g + d_k``  (reads the residual through ``W_gate``)
key of the token itself        ``1``
key of the bias token          ``0``
scores (self, bias)            ``(q, 0)``
pattern (self, bias)           ``(sigmoid(q), sigmoid(-q))``: standard softmax attention
value of the token itself      ``v = (f_k * g + e_k - g_k) * u``: bilinear in the residual,
                               *not* a linear map of it
value of the bias token        ``0``
z                              ``pattern_self * v``
result                         ``z * W_out[i]``
hook_post                      ``sum_k z[..., i*K + k] + b_in[i]``
=============================  ================================================================

Because the fitted coefficients satisfy ``sum_k g_k = 0``, the plain head's bias-token term
``g_k (1 - s_k) u`` moves onto the token itself (``-g_k s_k u``, summing to ``g_k u - g_k u``
overall), so the bias token's value is the constant 0 and ``sum_k z = act_K(g) * u`` where
``act_K`` is the plain neuron-heads' approximation of ``act``. Hence:

* SwiGLU (``silu``, K = 1): exact; ``z = sigmoid(g) * (g * u) = SiLU(g) * u``.
* ReGLU (``relu``): ``|post - TL| <= |u| * 0.2785 / relu_k``.
* GeGLU (the GELU family): ``|post - TL| <= |u| * max_abs_error(K)`` for ``|g| <= 20`` (the
  plain-GELU bound of :func:`tl_attnonly.activation_error_table`, scaled by ``|u|``).

An all-bias pattern (``(0, 1)``) gives ``z = 0``: the neuron's gated product is off and
``hook_post`` is TL's ``b_in``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict

import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Float
from transformer_lens.hook_points import HookPoint

from tl_attnonly.activations import NeuronHeadCoefficients
from tl_attnonly.components.neuron_head_base import NeuronHeadBase, records_grad

if TYPE_CHECKING:
    from transformer_lens import HookedTransformerConfig


class GatedNeuronHeadMLP(NeuronHeadBase):
    """A gated MLP layer whose every neuron is ``K`` attention heads of internal dimension 1.

    Drop-in replacement for TransformerLens's ``GatedMLP``: the same parameters (``W_gate, W_in,
    b_in, W_out, b_out``), the same ``hook_pre`` (gate), ``hook_pre_linear`` (linear branch) and
    ``hook_post``, the same output (exactly for SwiGLU), plus the neuron-head hooks of
    :class:`~tl_attnonly.components.NeuronHeadMLP` with the same names and compact shapes.

    The pattern is standard softmax attention over (self, bias token); the value of the token
    itself, ``(f_k g + e_k - g_k) * u``, is a product of two projections of the residual, so these
    heads are *generalised* attention heads: their OV map scales with the input-dependent ``u``.
    :attr:`W_V_per_unit_u` gives the value per unit of ``u``; :attr:`W_V` refuses.

    Args:
        cfg: The model config (``d_model``, ``d_mlp``, ``act_fn``, ``gated_mlp=True``, ``dtype``).
        coefficients: Per-head coefficients; default: :func:`head_coefficients` of ``cfg.act_fn``.

    Raises:
        ValueError: If the coefficients' bias-token values do not sum to 0 (the bias token's
            value could then not be a constant).
    """

    derive_inputs = ("hook_pre", "hook_pre_linear")
    gated = True

    def __init__(
        self,
        cfg: Dict | HookedTransformerConfig,
        coefficients: NeuronHeadCoefficients | None = None,
    ):
        super().__init__(cfg, coefficients)
        if sum(self.coefficients.g) != 0:
            raise ValueError(
                f"Gated neuron-heads need coefficients whose bias-token values g sum to 0 (got "
                f"sum(g) = {sum(self.coefficients.g)!r}); every built-in fit satisfies this."
            )
        self._init_parameters_and_hooks()

    def _init_parameters_and_hooks(self) -> None:
        """TL's ``GatedMLP`` parameters (in its order: initialisation draws them in this order)
        and hook points, plus the neuron-head hook points."""
        self.W_in = nn.Parameter(torch.empty(self.cfg.d_model, self.d_mlp, dtype=self.cfg.dtype))
        self.W_out = nn.Parameter(torch.empty(self.d_mlp, self.cfg.d_model, dtype=self.cfg.dtype))
        self.W_gate = nn.Parameter(torch.empty(self.cfg.d_model, self.d_mlp, dtype=self.cfg.dtype))
        self.b_in = nn.Parameter(torch.zeros(self.d_mlp, dtype=self.cfg.dtype))
        self.b_out = nn.Parameter(torch.zeros(self.cfg.d_model, dtype=self.cfg.dtype))

        self.hook_pre = HookPoint()  # [batch, pos, d_mlp] (gate g = x W_gate)
        self.hook_pre_linear = HookPoint()  # [batch, pos, d_mlp] (linear branch u = x W_in)
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
    def _gate_matrix(self) -> Float[torch.Tensor, "d_model d_mlp"]:
        """``W_gate`` as a ``[d_model, d_mlp]`` tensor."""
        return self.W_gate

    @property
    def _linear_matrix(self) -> Float[torch.Tensor, "d_model d_mlp"]:
        """``W_in`` (the linear branch) as a ``[d_model, d_mlp]`` tensor."""
        return self.W_in

    @property
    def W_Q(self) -> Float[torch.Tensor, "n_neuron_heads d_model 1"]:
        """Query weights: ``b_k * W_gate[:, i]``."""
        b = self._coefs(self._gate_matrix)[0]
        return self._per_head(self._gate_matrix, b).T.unsqueeze(-1)

    @property
    def b_Q(self) -> Float[torch.Tensor, "n_neuron_heads 1"]:
        """Query biases: ``d_k`` (TL's gate has no bias)."""
        d = self._coefs(self._gate_matrix)[1]
        return d.repeat(self.d_mlp).unsqueeze(-1)

    @property
    def W_V_per_unit_u(self) -> Float[torch.Tensor, "n_neuron_heads d_model 1"]:
        """Value weights per unit of the linear branch: ``v = (x W_V_per_unit_u + b) * u``.

        ``f_k * W_gate[:, i]``; the value itself is this times ``u = x W_in[:, i]``.
        """
        f = self._coefs(self._gate_matrix)[2]
        return self._per_head(self._gate_matrix, f).T.unsqueeze(-1)

    @property
    def b_V_per_unit_u(self) -> Float[torch.Tensor, "n_neuron_heads 1"]:
        """Value biases per unit of the linear branch: ``e_k - g_k``."""
        _, _, _, e, g = self._coefs(self._gate_matrix)
        return (e - g).repeat(self.d_mlp).unsqueeze(-1)

    @property
    def W_U_linear(self) -> Float[torch.Tensor, "n_neuron_heads d_model"]:
        """The linear branch read by each head: ``u = x W_U_linear[h]`` (``W_in[:, i]``)."""
        return self._linear_matrix.repeat_interleave(self.n_heads_per_neuron, dim=1).T

    @property
    def W_V(self) -> torch.Tensor:
        """Refuses: a gated neuron-head's value ``(f_k g + e_k - g_k) * u`` is not linear in x."""
        raise TypeError(
            "A gated neuron-head's value (f_k * x W_gate + e_k - g_k) * (x W_in) is bilinear in "
            "the residual, so it has no W_V matrix. Use W_V_per_unit_u / b_V_per_unit_u (the "
            "value per unit of the linear branch u = hook_pre_linear), or "
            "tl_attnonly.analysis.neuron_ov_circuit(model, layer, per_unit_u=True); times a "
            "prompt's u it is the circuit at that prompt."
        )

    @property
    def b_V(self) -> torch.Tensor:
        """Refuses, like :attr:`W_V`."""
        return self.W_V

    @property
    def v_bias_token(self) -> Float[torch.Tensor, "n_neuron_heads 1"]:
        """The bias token's value: zero (the bias-token terms of the fits sit on the token)."""
        return self._out_matrix.new_zeros(self.n_neuron_heads, 1)

    @property
    def b_O(self) -> Float[torch.Tensor, " d_model"]:
        """Output bias of the layer: ``b_in @ W_out + b_out`` (``b_in`` is added after the
        product, outside every head), so ``out = sum_h result[h] + b_O``."""
        return self.b_post @ self._out_matrix + self.b_out

    @property
    def b_post(self) -> Float[torch.Tensor, " d_mlp"]:
        """What ``hook_post`` adds to the sum of each neuron's head outputs: TL's ``b_in``."""
        return self.b_in

    # ------------------------------------------------------------------ forward
    def _query_value(
        self,
        gate: Float[torch.Tensor, "batch pos d_mlp"],
        linear: Float[torch.Tensor, "batch pos d_mlp"],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``b_k g + d_k`` and values ``(f_k g + e_k - g_k) u``, ``[b, p, d_mlp, K|1]``.

        Multiplications by 1 and additions of 0 are skipped (same result, less work); a trailing
        axis of size 1 broadcasts over the K heads.
        """
        c = self.coefficients
        b, d, f, e, g = self._coefs(gate)
        x = gate.unsqueeze(-1)  # [batch, pos, d_mlp, 1]
        q = x if all(val == 1 for val in c.b) else x * b
        if any(val != 0 for val in c.d):
            q = q + d
        v = x if all(val == 1 for val in c.f) else x * f
        if any(val_e != val_g for val_e, val_g in zip(c.e, c.g)):
            v = v + (e - g)
        return q, v * linear.unsqueeze(-1)

    def _fused_sum(
        self,
        gate: Float[torch.Tensor, "batch pos d_mlp"],
        linear: Float[torch.Tensor, "batch pos d_mlp"],
    ) -> Float[torch.Tensor, "batch pos d_mlp"]:
        """``sum_k z = act_K(g) * u`` without keys, scores, patterns or per-head tensors.

        ``sum_k sigmoid(b_k g + d_k) (f_k g + e_k - g_k) u`` is the plain neuron-heads' fused
        activation of the gate (:meth:`_fused_activation`, evaluated in cache-sized chunks, no
        ``[..., d_mlp, K]`` temporary) times the linear branch. SwiGLU heads thus compute
        ``F.silu(g) * u``, TransformerLens's own arithmetic (the original's output bit for bit).
        Other heads with ``compiled`` set use one compiled kernel for ``act_K(g) * u``.
        Against the head path the sum agrees to rounding: ``|fused - head path| <=
        FUSED_ERROR_ULPS * eps(dtype) * |u| * sum_k (|f_k g| + |e_k| + 2 |g_k|)`` (tested in
        ``tests/components/test_fused_heads.py``).
        """
        out = self._run_compiled(gate, linear)  # act_K(g) * u in one pass
        if out is not None:
            return out
        activation = self._fused_activation(gate)
        if records_grad(activation, linear):
            return activation * linear
        return activation.mul_(linear)  # a new tensor: no one else holds it

    def _head_z(
        self,
        gate: Float[torch.Tensor, "batch pos d_mlp"],
        linear: Float[torch.Tensor, "batch pos d_mlp"],
    ) -> Float[torch.Tensor, "batch pos n_neuron_heads 1"]:
        """The neuron-heads as attention heads, every hook point on the way; returns ``z``."""
        batch, pos, _ = gate.shape
        q, v = self._query_value(gate, linear)
        shape = (batch, pos, self.n_neuron_heads, 1)
        expanded = (batch, pos, self.d_mlp, self.n_heads_per_neuron)
        # q may be a view of the gate: a hook that could hold or edit it gets its own copy.
        q = self._hook("q", self._own("q", q.expand(expanded).reshape(shape), gate))
        k = self._keys(q)
        v = self._hook("v", v.expand(expanded).reshape(shape))
        # [2, batch, pos, n_neuron_heads]: (self, bias) planes; the bias value is 0
        p = self._attend(q, k, bias_plane=False)
        # The bias token's value is 0: the bias plane of the pattern contributes nothing.
        return self._hook("z", self._mix_values(p, v))  # [batch, pos, n_neuron_heads, 1]

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_model"]
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        # The same projections as TL's GatedMLP (F.linear with contiguous transposed weights), so
        # hook_pre and hook_pre_linear are bit-identical to the original's.
        if self.W_gate.device != x.device:
            x = x.to(self.W_gate.device)
        gate = self.hook_pre(F.linear(x, self.W_gate.T.contiguous()))  # [batch, pos, d_mlp]
        linear = self.hook_pre_linear(F.linear(x, self.W_in.T.contiguous()))  # [batch, pos, d_mlp]
        W_out = self.W_out.T.contiguous()
        if not self._uses_head_path():
            post = self.hook_post(self._fused_sum(gate, linear) + self.b_in)  # [batch, pos, d_mlp]
            return F.linear(post, W_out, self.b_out)
        z = self._head_z(gate, linear)
        post = self._sum_heads(z) + self.b_in
        if not self.use_neuron_result:
            return F.linear(self.hook_post(post), W_out, self.b_out)  # [batch, pos, d_mlp]
        # [batch, pos, n_neuron_heads, d_model]
        result = self.hook_result(z * self.W_O.squeeze(1))
        out = result.sum(-2) + (self.b_in @ self.W_out + self.b_out)
        correction = self._post_correction(post)  # an edit of post still reaches the output
        return out if correction is None else out + correction @ self.W_out

    def extra_repr(self) -> str:
        c = self.coefficients
        return (
            f"d_mlp={self.d_mlp}, heads_per_neuron={self.n_heads_per_neuron}, "
            f"n_neuron_heads={self.n_neuron_heads}, gated activation={c.activation!r}, "
            f"method={c.method!r}"
        )


__all__ = [
    "GatedNeuronHeadMLP",
]
