"""What a mixture of neuron-head experts says of itself, for both model kinds.

:class:`~tl_attnonly.components.NeuronHeadMoE` (a ``HookedTransformer``'s MoE layer, TL 3.x) and
:class:`~tl_attnonly.bridge.experts.BridgeNeuronHeadExperts` (a bridge's experts module, TL 3.9
and 4.x) hold one gated neuron-head layer per expert; every expert uses the same coefficients
and flags. :class:`ExpertFacts` reads the facts from the first expert, and :class:`ExpertFlag`
makes a flag of the container the flag of every neuron-head layer it holds. This module imports
on every TransformerLens version.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from jaxtyping import Int
from transformer_lens.hook_points import HookPoint

from tl_attnonly.activations import NeuronHeadCoefficients


def routed_slots(
    top_k_index: Int[torch.Tensor, "tokens top_k"], expert: int
) -> tuple[Int[torch.Tensor, " routed"], Int[torch.Tensor, " routed"]]:
    """``(slot, token)`` of every routing of a token to ``expert``, in the order experts gather
    them: by top-k slot, then by token (Hugging Face's eager loop, ``torch.where`` over the
    one-hot routing mask). Position ``i`` of the expert's hooks is token ``token[i]`` of the
    flattened ``[batch * pos]``, weighted by ``top_k_weights[token[i], slot[i]]``; a masked slot
    (index ``num_experts``) matches no expert."""
    slot, token = torch.where(top_k_index.T == expert)
    return slot, token


class ExpertHookPoints:
    """Mixin of one expert: the hook points of TransformerLens's MoE experts, then the
    neuron-heads'.

    An expert sees only the tokens routed to it: ``pos`` counts those tokens, after a leading
    batch axis of 1 where the neuron-heads are attention-shaped.
    """

    hook_gate: HookPoint

    def add_expert_hook_points(self) -> None:
        """Create the hook points (from the subclass's ``__init__``)."""
        self.hook_gate = HookPoint()  # [pos, d_mlp] (gate g; TL's name in MoE experts)
        self.hook_pre = HookPoint()  # [pos, d_mlp] (linear branch u; TL's name in MoE experts)
        self.hook_q = HookPoint()  # [1, pos, n_neuron_heads, 1]
        self.hook_k = HookPoint()  # [1, pos, n_neuron_heads, 1] (keys of the real tokens)
        self.hook_v = HookPoint()  # [1, pos, n_neuron_heads, 1] (values of the real tokens)
        self.hook_attn_scores = HookPoint()  # [1, n_neuron_heads, query_pos, 2] (self, bias)
        self.hook_pattern = HookPoint()  # [1, n_neuron_heads, query_pos, 2] (self, bias)
        self.hook_z = HookPoint()  # [1, pos, n_neuron_heads, 1]
        self.hook_result = HookPoint()  # [1, pos, n_neuron_heads, d_model]
        self.hook_post = HookPoint()  # [pos, d_mlp]


class ExpertFlag:
    """A flag of an :class:`ExpertFacts` container that is the flag of the same name of every
    neuron-head layer it holds (:meth:`ExpertFacts.flag_layers`): reading gives the first
    expert's, setting sets all."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, moe: ExpertFacts | None, owner: type) -> Any:
        if moe is None:
            return self
        return getattr(moe.expert_list()[0], self.name)

    def __set__(self, moe: ExpertFacts, value: bool) -> None:
        for layer in moe.flag_layers():
            setattr(layer, self.name, value)


class ExpertFacts:
    """Mixin of an experts container: coefficients, heads per neuron and flags of its experts."""

    #: Marks a mixture of experts for checks that must not import its class
    #: (:func:`tl_attnonly.adapt.analysis_model`; :class:`~tl_attnonly.mlp_protocol.MLPLayer`).
    is_mixture_of_experts: ClassVar[bool] = True
    #: Its experts run as neuron-heads (:class:`~tl_attnonly.mlp_protocol.MLPLayer`).
    converted: ClassVar[bool] = True

    def expert_list(self) -> list[Any]:
        """The routed experts, in order (each a gated neuron-head layer)."""
        raise NotImplementedError

    def flag_layers(self) -> list[Any]:
        """The neuron-head layers a flag is set on (default: the routed experts)."""
        return self.expert_list()

    @property
    def coefficients(self) -> NeuronHeadCoefficients:
        """The per-head coefficients every expert's neurons use."""
        return self.expert_list()[0].coefficients

    @property
    def gated(self) -> bool:
        """Whether its experts are gated MLPs (:class:`~tl_attnonly.mlp_protocol.MLPLayer`)."""
        return bool(self.expert_list()[0].gated)

    @property
    def n_heads_per_neuron(self) -> int:
        """Heads per neuron (K)."""
        return self.expert_list()[0].n_heads_per_neuron

    @property
    def n_neuron_heads(self) -> int:
        """Neuron-heads per expert: ``d_mlp * K``."""
        return self.expert_list()[0].n_neuron_heads

    #: Whether the experts compute and hook per-neuron-head results.
    use_neuron_result = ExpertFlag("use_neuron_result")
    #: Whether the experts may use the fused (hook-free) path.
    fused = ExpertFlag("fused")
    #: Whether the experts' fused path uses the compiled kernel (see ``NeuronHeadBase``).
    compiled = ExpertFlag("compiled")


__all__ = ["ExpertFacts", "ExpertFlag", "ExpertHookPoints", "routed_slots"]
