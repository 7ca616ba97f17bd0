"""Mixture-of-experts (Mixtral / OLMoE style) with every expert's neurons as gated neuron-heads.

TransformerLens's :class:`~transformer_lens.components.mlps.moe.MoE` routes each token to
``experts_per_token`` of ``num_experts`` gated experts (``MoEGatedMLP``) and sums their outputs
scaled by the router's weights. :class:`NeuronHeadMoE` *is* that class (a subclass; TL's own
``forward``), with each expert replaced by a :class:`GatedNeuronHeadExpert`: the router,
``hook_expert_weights`` and ``hook_expert_indices`` are TransformerLens's, untouched, and the
experts keep TL's parameter names (``experts.{e}.W_gate / W_in / W_out``, ``nn.Linear``) and hooks
(``experts.{e}.hook_gate`` = gate ``g``, ``hook_pre`` = linear branch ``u``, ``hook_post``).

Each expert's neurons are gated neuron-heads exactly as in
:class:`~tl_attnonly.components.GatedNeuronHeadMLP` (``docs/gated_mlps.md``), with their hooks at
``blocks.{l}.mlp.experts.{e}.hook_{q,k,v,attn_scores,pattern,z,result}``. An expert only sees the
tokens routed to it, so its "positions" are those tokens, in the order TL's ``MoE`` gathers them
(``torch.where`` over the routing mask), with a leading batch axis of 1: e.g. the pattern is
``[1, n_neuron_heads, n_routed_tokens, 2]``.
"""

from __future__ import annotations

from typing import Dict, cast

import torch
import torch.nn as nn
from jaxtyping import Float
from transformer_lens import HookedTransformerConfig
from transformer_lens.components import MoE

from tl_attnonly.activations import NeuronHeadCoefficients
from tl_attnonly.components.expert_facts import ExpertFacts, ExpertHookPoints
from tl_attnonly.components.gated_neuron_heads import GatedNeuronHeadMLP


class GatedNeuronHeadExpert(ExpertHookPoints, GatedNeuronHeadMLP):
    """One expert of TL's ``MoE`` (``MoEGatedMLP``: no biases) as gated neuron-heads.

    Same parameters (``W_gate, W_in, W_out`` as ``nn.Linear`` without bias) and hooks
    (``hook_gate``, ``hook_pre``, ``hook_post``) as TL's expert, plus the neuron-head hooks.

    Args:
        cfg: The model config.
        coefficients: Per-head coefficients; default: from ``cfg.act_fn``.
    """

    def _init_parameters_and_hooks(self) -> None:
        """TL's ``MoEGatedMLP`` layers and hooks, in its order, plus the neuron-head hooks."""
        d_model, dtype = self.cfg.d_model, self.cfg.dtype
        self.W_in = nn.Linear(d_model, self.d_mlp, bias=False, dtype=dtype)  # type: ignore[assignment]
        self.W_out = nn.Linear(self.d_mlp, d_model, bias=False, dtype=dtype)  # type: ignore[assignment]
        self.W_gate = nn.Linear(d_model, self.d_mlp, bias=False, dtype=dtype)  # type: ignore[assignment]

        self.add_expert_hook_points()  # hook_gate, hook_pre, the heads' hooks, hook_post

    @property
    def _gate_matrix(self) -> Float[torch.Tensor, "d_model d_mlp"]:
        return self.W_gate.weight.T  # type: ignore[attr-defined]

    @property
    def _linear_matrix(self) -> Float[torch.Tensor, "d_model d_mlp"]:
        return self.W_in.weight.T  # type: ignore[attr-defined]

    @property
    def _out_matrix(self) -> Float[torch.Tensor, "d_mlp d_model"]:
        return self.W_out.weight.T  # type: ignore[attr-defined]

    def forward(self, x: Float[torch.Tensor, "pos d_model"]) -> Float[torch.Tensor, "pos d_model"]:
        # TL's own projections (nn.Linear), so hook_gate and hook_pre are bit-identical to TL's.
        W_gate, W_in, W_out = (cast(nn.Linear, m) for m in (self.W_gate, self.W_in, self.W_out))
        gate = self.hook_gate(W_gate(x))  # [pos, d_mlp]
        linear = self.hook_pre(W_in(x))  # [pos, d_mlp]
        if not self._uses_head_path():
            return W_out(self.hook_post(self._fused_sum(gate, linear)))
        z = self._head_z(gate.unsqueeze(0), linear.unsqueeze(0))  # [1, pos, n_neuron_heads, 1]
        post = self._sum_heads(z).squeeze(0)
        hooked_post = self.hook_post(post)  # [pos, d_mlp]
        if not self.use_neuron_result:
            return W_out(hooked_post)
        # [1, pos, n_neuron_heads, d_model]
        out = self.hook_result(z * self.W_O.squeeze(1)).sum(-2).squeeze(0)
        if hooked_post is not post:  # a hook edited post: its edit still reaches the output
            out = out + (hooked_post - post) @ self._out_matrix
        return out

    @property
    def b_in(self) -> torch.Tensor:  # type: ignore[override]
        """TL's MoE experts have no ``b_in``: zero."""
        return self._out_matrix.new_zeros(self.d_mlp)

    @property
    def b_O(self) -> torch.Tensor:
        """TL's MoE experts have no output bias: zero."""
        return self._out_matrix.new_zeros(self.cfg.d_model)


class NeuronHeadMoE(ExpertFacts, MoE):
    """TransformerLens's ``MoE`` with every expert's neurons as gated neuron-heads.

    The router and the combination of the experts are TL's ``MoE.forward``, unchanged; only the
    experts are :class:`GatedNeuronHeadExpert`. Same parameters, same outputs (exactly for SwiGLU
    experts), same ``hook_expert_weights`` / ``hook_expert_indices``.

    Args:
        cfg: The model config (``num_experts``, ``experts_per_token``, ``act_fn``, ...).
        coefficients: Per-head coefficients of every expert's neurons.
    """

    experts: nn.ModuleList

    def __init__(
        self,
        cfg: Dict | HookedTransformerConfig,
        coefficients: NeuronHeadCoefficients | None = None,
    ):
        super().__init__(cfg)
        # TL builds the router without a dtype (float32); build it in the model's dtype.
        self.W_gate.to(self.cfg.dtype)
        # Replaces TL's experts in place: the module keeps its position (parameter order).
        self.experts = nn.ModuleList(
            GatedNeuronHeadExpert(self.cfg, coefficients) for _ in range(self.num_experts)
        )

    def expert_list(self) -> list[GatedNeuronHeadExpert]:
        """The experts, in order."""
        return list(self.experts)  # type: ignore[arg-type]


__all__ = [
    "GatedNeuronHeadExpert",
    "NeuronHeadMoE",
]
