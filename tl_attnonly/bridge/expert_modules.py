"""A bridge's mixture-of-experts layers with every expert's neurons as gated neuron-heads.

A ``TransformerBridge`` wraps a Hugging Face sparse MoE block (``MixtralSparseMoeBlock``,
``Qwen2MoeSparseMoeBlock``, ``DeepseekV3MoE``, ...) in a ``MoEBridge``. The block routes each
token (its router: ``gate`` / ``router``, wrapped by the bridge so that its hooks fire) to
``top_k`` of ``num_experts`` experts, calls its experts module as ``experts(hidden_states
[tokens, d_model], top_k_index [tokens, top_k], top_k_weights [tokens, top_k])`` and adds what a
shared expert writes, if it has one. In transformers 5 the experts are one module of *grouped*
3-D weights: ``gate_up_proj [E, 2 * d_mlp, d_model]`` (the gate rows, then the up rows) and
``down_proj [E, d_model, d_mlp]``; expert ``e`` computes ``down_e(act(gate_e x) * up_e x)``.

:class:`BridgeNeuronHeadExperts` takes the place of that experts module inside the block; the
block's own forward runs unchanged (router, routing weights, shared expert and its gate, the
sum), so every router hook of the bridge keeps firing with the same values. It registers the
Hugging Face module's own ``gate_up_proj`` and ``down_proj`` parameters under the same names
(shared, never copied: ``state_dict`` keys are unchanged) and holds one
:class:`BridgeNeuronHeadExpert` per expert, which reads its weights as views of them
(``gate_up_proj[e, :d_mlp]``, ...), so it follows edits and weight processing.

Each expert's neurons are gated neuron-heads exactly as in
:class:`~tl_attnonly.components.GatedNeuronHeadMLP` (``docs/gated_mlps.md``): exact for SwiGLU
experts, within the activation's stated bound otherwise. The hooks are named as on
:class:`~tl_attnonly.AttnOnlyTransformer`'s mixture of experts
(:class:`~tl_attnonly.components.NeuronHeadMoE`): ``blocks.{l}.mlp.experts.{e}.hook_gate`` (gate
``g``), ``hook_pre`` (linear branch ``u``), ``hook_q, hook_k, hook_v, hook_attn_scores,
hook_pattern, hook_z, hook_result`` and ``hook_post``. An expert sees only the tokens routed to
it: its positions are those tokens in the order the Hugging Face experts gather them (by top-k
slot, then by token of the flattened ``[batch * pos]``), after a leading batch axis of 1, e.g. the
pattern is ``[1, n_neuron_heads, n_routed_tokens, 2]``. Every expert runs in every forward pass
(as TransformerLens's ``MoE`` does), so its hooks fire even when no token is routed to it (with
0 positions); the output is the Hugging Face eager loop's, bit for bit on the fused path.

A shared expert (Qwen2-MoE's ``shared_expert``, DeepSeek's ``shared_experts``) is an ordinary
bridge MLP inside the ``MoEBridge`` and is converted like every other bridge MLP
(:mod:`tl_attnonly.bridge.convert`), with its hooks at ``blocks.{l}.mlp.{name}.hook_pattern``, ...

Which experts modules are supported, and the checks before and after they are built:
:mod:`tl_attnonly.bridge.expert_plan`; putting them in the block and back:
:mod:`tl_attnonly.bridge.experts`.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Float, Int

from tl_attnonly._compat import mlp_config
from tl_attnonly.activations import NeuronHeadCoefficients
from tl_attnonly.bridge.modules import (
    BRIDGE_NEURON_HEAD_HOOKS,
    BridgeGatedNeuronHeadMLP,
    BridgeNeuronHeadMLP,
    GatedWeightViews,
)
from tl_attnonly.components.clamped_gating import ClampedSwiGLU, ClampRecord, warn_clamp
from tl_attnonly.components.expert_facts import ExpertFacts, ExpertHookPoints, routed_slots
from tl_attnonly.components.gated_neuron_heads import GatedNeuronHeadMLP

#: The hook points of every expert (``blocks.{l}.mlp.experts.{e}.hook_{name}``): those of
#: :class:`~tl_attnonly.components.GatedNeuronHeadExpert`, in its order.
EXPERT_HOOKS = ("gate", "pre", *BRIDGE_NEURON_HEAD_HOOKS, "post")

#: The grouped experts' weights, ``[num_experts, 2 * d_mlp, d_model]`` and ``[num_experts,
#: d_model, d_mlp]`` (transposed: ``[num_experts, d_model, 2 * d_mlp]`` and ``[num_experts,
#: d_mlp, d_model]``).
GROUPED_PARAMETERS = ("gate_up_proj", "down_proj")
#: Their biases (``has_bias``), ``[num_experts, 2 * d_mlp]`` and ``[num_experts, d_model]``.
GROUPED_BIASES = ("gate_up_proj_bias", "down_proj_bias")

#: transformers' layout flags of a grouped experts module that must have one value here.
SUPPORTED_LAYOUT = {
    "has_gate": True,
    "has_post_expert_norm": False,
}
#: The layout flags that may take either value (each changes only which views are read).
LAYOUT_FLAGS = ("is_concatenated", "is_transposed", "has_bias")

#: The router's top-k expert indices, ``blocks.{l}.mlp.hook_expert_indices`` ``[tokens, top_k]``
#: (tokens: the flattened ``[batch * pos]``): TransformerLens's name on ``HookedTransformer``'s
#: ``MoE`` and on TL 4.x bridges (an alias of the router's hook); where a bridge has none (TL 3.9),
#: conversion mounts a hook point of that name on the ``MoEBridge``, fired by the experts.
ROUTING_HOOK = "hook_expert_indices"
#: The routing weights the block passes to its experts with those indices,
#: ``blocks.{l}.mlp.hook_routing_weights`` ``[tokens, top_k]`` (after the model's own top-k
#: normalisation, if any): expert ``e``'s contribution to token ``t`` is ``weights[t, slot] *
#: expert_e(x_t)`` where ``indices[t, slot] == e``. TransformerLens has no hook of these (its
#: ``hook_expert_weights`` is the router's softmax over every expert); conversion mounts it on the
#: ``MoEBridge`` on every version, fired by the experts.
ROUTING_WEIGHTS_HOOK = "hook_routing_weights"
#: The top-k indices the block passes to its experts, ``blocks.{l}.mlp.hook_routing_indices``
#: ``[tokens, top_k]``, mounted beside :data:`ROUTING_WEIGHTS_HOOK` on every version: the same
#: values as :data:`ROUTING_HOOK` where that hook is the router's top-k (Mixtral, Qwen-MoE, ...),
#: but also where TransformerLens's alias is not (Granite-MoE on TL 4: its router returns a
#: different tuple).
ROUTING_INDICES_HOOK = "hook_routing_indices"


class BridgeNeuronHeadExpert(  # type: ignore[misc,override]
    ClampRecord, ExpertHookPoints, GatedWeightViews, GatedNeuronHeadMLP
):
    """One routed expert as gated neuron-heads, its weights views of the grouped parameters.

    The maths of :class:`~tl_attnonly.components.GatedNeuronHeadMLP`; the hooks of
    :class:`~tl_attnonly.components.GatedNeuronHeadExpert` (``hook_gate`` = gate ``g``,
    ``hook_pre`` = linear branch ``u``, ``hook_post``, plus the neuron-head hooks). No parameters:
    ``W_gate``, ``W_in``, ``W_out`` (TransformerLens orientation) are views of the experts
    module's ``gate_up_proj[index]`` and ``down_proj[index]`` (their biases, where the module has
    them, of ``gate_up_proj_bias[index]`` and ``down_proj_bias[index]``).

    A clamped SwiGLU's expert (:attr:`clamp` set) has ``hook_gate`` and ``hook_pre`` before the
    clamp (as TransformerLens's ``GptOssExpert``); its neuron-heads' value is ``g (u + 1)``, and
    every forward pass records where the clamp would have acted (:class:`ClampRecord`).

    Args:
        experts: The :class:`BridgeNeuronHeadExperts` that holds the grouped weights.
        index: This expert's index ``e``.
        cfg: ``d_model``, ``d_mlp`` (per expert), ``act_fn``, ``dtype``.
        coefficients: Per-head coefficients of ``cfg.act_fn``.
    """

    def __init__(
        self,
        experts: BridgeNeuronHeadExperts,
        index: int,
        cfg: Any,
        coefficients: NeuronHeadCoefficients,
    ):
        super().__init__(cfg, coefficients)
        self.index = index
        # a plain reference (not a submodule: the experts module is this expert's parent)
        self.__dict__["_group"] = experts

    def _init_parameters_and_hooks(self) -> None:
        """No parameters (the experts module holds them); the hooks of TL's MoE experts."""
        self.add_expert_hook_points()  # hook_gate, hook_pre, the heads' hooks, hook_post

    # ------------------------------------------------------------------ weights (views)
    @property
    def _gate_up(self) -> torch.Tensor:
        """This expert's ``gate_up_proj`` (a view): ``[2 * d_mlp, d_model]``, or ``[d_model, 2 *
        d_mlp]`` where the experts are transposed."""
        return self.__dict__["_group"].gate_up_proj[self.index]

    @property
    def _down(self) -> torch.Tensor:
        """This expert's ``down_proj`` (a view): ``[d_model, d_mlp]``, or ``[d_mlp, d_model]``
        where the experts are transposed."""
        return self.__dict__["_group"].down_proj[self.index]

    def _bias(self, name: str) -> torch.Tensor | None:
        """This expert's row of the grouped bias ``name`` (``None`` without biases)."""
        group = self.__dict__["_group"]
        return group.get_parameter(name)[self.index] if group.has_bias else None

    def _gate_up_part(self, tensor: torch.Tensor, part: int) -> torch.Tensor:
        """The gate (``part`` 0) or linear (1) half of ``tensor``'s last axis (``2 * d_mlp``)."""
        if self.__dict__["_group"].is_concatenated:
            return tensor[..., part * self.d_mlp : (part + 1) * self.d_mlp]
        return tensor[..., part::2]

    def _gate_up_matrix(self, part: int) -> Float[torch.Tensor, "d_model d_mlp"]:
        gate_up = self._gate_up
        transposed = self.__dict__["_group"].is_transposed
        return self._gate_up_part(gate_up if transposed else gate_up.T, part)

    @property
    def _gate_matrix(self) -> Float[torch.Tensor, "d_model d_mlp"]:
        return self._gate_up_matrix(0)

    @property
    def _linear_matrix(self) -> Float[torch.Tensor, "d_model d_mlp"]:
        return self._gate_up_matrix(1)

    @property
    def _out_matrix(self) -> Float[torch.Tensor, "d_mlp d_model"]:
        return self._down if self.__dict__["_group"].is_transposed else self._down.T

    @property
    def b_gate_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The biases of the gate and of the linear branch, ``[d_mlp]`` each (zero without)."""
        bias = self._bias("gate_up_proj_bias")
        if bias is None:
            zero = self._down.new_zeros(self.d_mlp)
            return zero, zero
        return self._gate_up_part(bias, 0), self._gate_up_part(bias, 1)

    @property
    def b_in(self) -> Float[torch.Tensor, " d_mlp"]:  # type: ignore[override]
        """Zero: what TransformerLens's ``GatedMLP`` adds after the product (the grouped experts'
        biases act before it: :attr:`b_gate_up`)."""
        return self._down.new_zeros(self.d_mlp)

    @property
    def b_out(self) -> Float[torch.Tensor, " d_model"]:  # type: ignore[override]
        """``down_proj_bias[index]`` (zero without biases)."""
        bias = self._bias("down_proj_bias")
        return self._down.new_zeros(self.cfg.d_model) if bias is None else bias

    @property
    def device(self) -> torch.device:
        """The device of the expert's weights (where it computes)."""
        return self._down.device

    # ------------------------------------------------------------------ forward
    def _project(self, x: torch.Tensor, which: str, *, bias: bool = True) -> torch.Tensor:
        """Hugging Face's own product with ``gate_up_proj`` (``which="gate_up"``, ``x`` [pos,
        d_model] -> [pos, 2 * d_mlp]) or ``down_proj`` (``"down"``, [pos, d_mlp] -> [pos,
        d_model]), its bias included unless ``bias`` is unset: ``x @ W + b`` where transposed,
        else ``F.linear(x, W) + b``."""
        weight = self._gate_up if which == "gate_up" else self._down
        out = x @ weight if self.__dict__["_group"].is_transposed else F.linear(x, weight)
        b = self._bias(f"{which}_proj_bias") if bias else None
        return out if b is None else out + b

    def forward(self, x: Float[torch.Tensor, "pos d_model"]) -> Float[torch.Tensor, "pos d_model"]:
        """The expert on the tokens routed to it (before the routing weight)."""
        # Hugging Face's own products (one over the gate and up rows, then split), so hook_gate
        # and hook_pre and the fused path's output are its values bit for bit.
        gate_up = self._project(x, "gate_up")
        gate = self.hook_gate(self._gate_up_part(gate_up, 0))  # [pos, d_mlp]
        linear = self.hook_pre(self._gate_up_part(gate_up, 1))  # [pos, d_mlp]
        linear = self._checked_linear(gate, linear)  # u + 1 for a clamped SwiGLU (recorded)
        if not self._uses_head_path():
            return self._project(self.hook_post(self._fused_sum(gate, linear)), "down")
        z = self._head_z(gate.unsqueeze(0), linear.unsqueeze(0))  # [1, pos, n_neuron_heads, 1]
        post = self._sum_heads(z).squeeze(0)  # [pos, d_mlp]
        if not self.use_neuron_result:
            return self._project(self.hook_post(post), "down")
        # [1, pos, n_neuron_heads, d_model]
        out = self.hook_result(z * self.W_O.squeeze(1)).sum(-2).squeeze(0) + self.b_out
        correction = self._post_correction(post)  # an edit of post still reaches the output
        return out if correction is None else out + self._project(correction, "down", bias=False)


class _FlatTokens:
    """A bridge neuron-head layer that also takes ``[tokens, d_model]``: a MoE block flattens
    batch and position before it calls its shared expert (Qwen2-MoE). The projections, and so
    the bridge's hooks, see the input as it is (``hook_pre``: ``[tokens, d_mlp]``); the heads
    see one batch of tokens, as an expert's do (``hook_pattern``: ``[1, n_neuron_heads, tokens,
    2]``). A ``[batch, pos, d_model]`` input is the base class's. A mixin of the layers of
    :mod:`tl_attnonly.bridge.modules`."""

    def _pre_activations(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _fused(self, *pre: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self, hidden_states: Float[torch.Tensor, "... d_model"], *args: Any, **kwargs: Any
    ) -> Float[torch.Tensor, "... d_model"]:
        layer = cast(Any, self)
        if hidden_states.dim() != 2:
            return cast(torch.Tensor, super().forward(hidden_states, *args, **kwargs))  # type: ignore[misc]
        layer._ran = True
        pre = self._pre_activations(hidden_states)  # [tokens, d_mlp] each, through the hooks
        if not layer._uses_head_path():
            return cast(torch.Tensor, layer._output(self._fused(*pre), None))
        z = layer._head_z(*(t.unsqueeze(0) for t in pre))  # [1, tokens, n_neuron_heads, 1]
        out = layer._output(layer._sum_heads(z).squeeze(0), z)
        return cast(torch.Tensor, out).reshape(hidden_states.shape)


# (mypy: the bridge layers' forward takes the Hugging Face MLP's arguments, not NeuronHeadMLP's)
class SharedNeuronHeadMLP(_FlatTokens, BridgeNeuronHeadMLP):  # type: ignore[misc]
    """A MoE block's plain shared expert: :class:`~tl_attnonly.bridge.BridgeNeuronHeadMLP`
    that also takes the block's flattened ``[tokens, d_model]``."""

    def _pre_activations(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self._projection("in")(hidden_states),)

    def _fused(self, *pre: torch.Tensor) -> torch.Tensor:
        return self._fused_post(*pre)


class SharedGatedNeuronHeadMLP(_FlatTokens, BridgeGatedNeuronHeadMLP):  # type: ignore[misc,override]
    """A MoE block's gated shared expert (Qwen2-MoE's ``shared_expert``, DeepSeek's
    ``shared_experts``): :class:`~tl_attnonly.bridge.BridgeGatedNeuronHeadMLP` that also takes
    the block's flattened ``[tokens, d_model]``."""

    def _pre_activations(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._projection("gate")(hidden_states), self._projection("in")(hidden_states)

    def _fused(self, *pre: torch.Tensor) -> torch.Tensor:
        return self._fused_sum(*pre)


class BridgeNeuronHeadExperts(ExpertFacts, nn.ModuleList):
    """A Hugging Face grouped experts module with every expert's neurons as gated neuron-heads.

    Same forward contract as the module it replaces (``hidden_states [tokens, d_model],
    top_k_index [tokens, top_k], top_k_weights [tokens, top_k] -> [tokens, d_model]``), the same
    parameters (the Hugging Face ``gate_up_proj`` and ``down_proj``, registered again, not
    copied) and the same arithmetic (its eager loop) on the fused path. A ``ModuleList`` of the
    :class:`BridgeNeuronHeadExpert` s: ``experts[e]`` is expert ``e``, and its hooks are
    ``blocks.{l}.mlp.experts.{e}.hook_*``.

    It is what :func:`tl_attnonly.bridge.neuron_head_layers` gives for a mixture-of-experts layer:
    :attr:`is_mixture_of_experts` (:class:`~tl_attnonly.components.expert_facts.ExpertFacts`)
    marks it for the analysis tools (which refuse it by name), and the flags ``use_neuron_result``,
    ``fused``, ``compiled`` reach every expert and the block's shared experts (:attr:`shared`).

    A clamped SwiGLU's experts (``clamp`` given) record where the clamp would have acted
    (:attr:`clamp_count`, :attr:`clamp_max_change`, per expert and summed here) and emit one
    :class:`~tl_attnonly.components.clamped_gating.ClampActiveWarning` per forward pass in
    which it would have.

    Args:
        hf_experts: The Hugging Face experts module (checked by :func:`check_experts_layout`).
        act_fn: TransformerLens name of its activation.
        coefficients: Per-head coefficients of ``act_fn``.
        clamp: The clamped SwiGLU the experts compute (``None``: the standard gating).
        name: The experts' hook prefix, ``blocks.{l}.mlp.experts`` (for the warning).
    """

    #: Marks a bridge's neuron-head layer (see :class:`~tl_attnonly.bridge.BridgeNeuronHeadMLP`).
    is_bridge_neuron_heads: ClassVar[bool] = True

    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter

    def __init__(
        self,
        hf_experts: nn.Module,
        act_fn: str,
        coefficients: NeuronHeadCoefficients,
        clamp: ClampedSwiGLU | None = None,
        name: str = "experts",
    ):
        super().__init__()
        for flag, value in SUPPORTED_LAYOUT.items():  # read by TL's weight processing
            setattr(self, flag, value)
        for flag in LAYOUT_FLAGS:
            setattr(self, flag, bool(getattr(hf_experts, flag)))
        parameters = GROUPED_PARAMETERS + (GROUPED_BIASES if self.has_bias else ())
        for key in parameters:  # the same Parameter objects, under the same names
            self.register_parameter(key, getattr(hf_experts, key))
        n_experts, *dims = self.down_proj.shape
        d_mlp, d_model = dims if self.is_transposed else dims[::-1]
        self.num_experts = int(n_experts)
        self.name = name
        #: The Hugging Face module replaced (put back by :func:`unmount_experts`).
        self.__dict__["hf_experts"] = hf_experts
        #: The block's shared experts' neuron-head layers, by the bridge's name (converted and
        #: mounted on their own bridge components, so not submodules here).
        self.shared: dict[str, nn.Module] = {}
        #: The routing hook point this module fires (:data:`ROUTING_HOOK`, mounted on the
        #: ``MoEBridge`` where TransformerLens has none), else ``None`` (not a submodule).
        self.__dict__["routing_hook"] = None
        #: The routing-weights hook point (:data:`ROUTING_WEIGHTS_HOOK`, mounted on the
        #: ``MoEBridge``), else ``None`` (not a submodule).
        self.__dict__["routing_weights_hook"] = None
        #: The routing-indices hook point (:data:`ROUTING_INDICES_HOOK`), else ``None``.
        self.__dict__["routing_indices_hook"] = None
        #: Shared experts whose output the block scales by the sigmoid of a gate's output
        #: (Qwen2-MoE: ``shared_expert_gate``): ``{shared expert name: gate component name}``.
        self.shared_gates: dict[str, str] = {}
        # (TransformerLens's config knows no clamped SwiGLU: its act_fn is the nearest, silu
        # (alpha = 1); the coefficients are the activation)
        cfg_act_fn = "silu" if clamp is not None else act_fn
        cfg = mlp_config(int(d_model), int(d_mlp), cfg_act_fn, self.down_proj.dtype)
        self.extend(
            BridgeNeuronHeadExpert(self, e, cfg, coefficients) for e in range(self.num_experts)
        )
        for expert in self.expert_list():
            expert.clamp = clamp
        self.train(hf_experts.training)

    @property
    def clamp(self) -> ClampedSwiGLU | None:
        """The clamped SwiGLU the experts compute without its clamp (``None``: standard)."""
        return self.expert_list()[0].clamp

    @property
    def clamp_count(self) -> int:
        """Activations (routed token x neuron) where the clamp acted, over every expert and
        every forward pass since conversion or :meth:`reset_clamp_record`."""
        return sum(expert.clamp_count for expert in self.expert_list())

    @property
    def clamp_max_change(self) -> float:
        """The largest ``|unclamped - clamped|`` activation there (0 where it never acted)."""
        return max(expert.clamp_max_change for expert in self.expert_list())

    def reset_clamp_record(self) -> None:
        """Forget what earlier forward passes recorded, on every expert."""
        for expert in self.expert_list():
            expert.reset_clamp_record()

    def expert_list(self) -> list[BridgeNeuronHeadExpert]:
        """The routed experts, in order."""
        return cast(list[BridgeNeuronHeadExpert], list(self))

    def neuron_head_layers(self) -> list[nn.Module]:
        """Every neuron-head layer of the block: the routed experts, then the shared ones."""
        return [*self.expert_list(), *self.shared.values()]

    def flag_layers(self) -> list[Any]:
        """A flag is set on every neuron-head layer of the block, shared experts included."""
        return self.neuron_head_layers()

    @property
    def d_mlp(self) -> int:
        """Neurons per routed expert."""
        return self.expert_list()[0].d_mlp

    def hook_names(self, prefix: str) -> list[str]:
        """The experts' hook names under ``prefix`` (``blocks.{l}.mlp.experts``), and the routing
        hooks this module mounted (``blocks.{l}.mlp.hook_expert_indices`` where TransformerLens
        has none, ``blocks.{l}.mlp.hook_routing_indices`` and ``hook_routing_weights``)."""
        names = [f"{prefix}.{e}.hook_{n}" for e in range(len(self)) for n in EXPERT_HOOKS]
        block = prefix.rpartition(".")[0]
        if self.__dict__["routing_hook"] is not None:
            names.append(f"{block}.{ROUTING_HOOK}")
        if self.__dict__["routing_weights_hook"] is not None:
            names.append(f"{block}.{ROUTING_WEIGHTS_HOOK}")
        if self.__dict__["routing_indices_hook"] is not None:
            names.append(f"{block}.{ROUTING_INDICES_HOOK}")
        return names

    def forward(
        self,
        hidden_states: Float[torch.Tensor, "tokens d_model"],
        top_k_index: Int[torch.Tensor, "tokens top_k"],
        top_k_weights: Float[torch.Tensor, "tokens top_k"],
    ) -> Float[torch.Tensor, "tokens d_model"]:
        """Hugging Face's eager experts loop, each expert as neuron-heads; every expert runs."""
        routing_hook = self.__dict__["routing_hook"]
        if routing_hook is not None:
            top_k_index = routing_hook(top_k_index)  # [tokens, top_k]
        indices_hook = self.__dict__["routing_indices_hook"]
        if indices_hook is not None:
            top_k_index = indices_hook(top_k_index)  # [tokens, top_k]
        weights_hook = self.__dict__["routing_weights_hook"]
        if weights_hook is not None:
            top_k_weights = weights_hook(top_k_weights)  # [tokens, top_k]
        out = torch.zeros_like(hidden_states)
        n_routed = 0
        for index, expert in enumerate(self.expert_list()):
            slot, token = routed_slots(top_k_index, index)  # by slot, then token
            routed = expert(hidden_states[token]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, routed.to(out.dtype))
            n_routed += token.numel()
        if self.clamp is not None:
            warn_clamp(self.name, self.expert_list(), n_routed * self.d_mlp)
        return out

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, d_mlp={self.d_mlp}, "
            f"heads_per_neuron={self.n_heads_per_neuron}, shared={list(self.shared)}"
        )


__all__ = [
    "EXPERT_HOOKS",
    "GROUPED_BIASES",
    "GROUPED_PARAMETERS",
    "LAYOUT_FLAGS",
    "ROUTING_HOOK",
    "ROUTING_INDICES_HOOK",
    "ROUTING_WEIGHTS_HOOK",
    "SUPPORTED_LAYOUT",
    "BridgeNeuronHeadExpert",
    "BridgeNeuronHeadExperts",
    "SharedGatedNeuronHeadMLP",
    "SharedNeuronHeadMLP",
]
