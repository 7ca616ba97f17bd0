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

Supported experts modules: grouped weights, concatenated ``[gate; up]`` or interleaved (gate,
up, gate, ...) along the ``2 * d_mlp`` axis, stored ``[E, 2 * d_mlp, d_model]`` or transposed
``[E, d_model, 2 * d_mlp]``, with or without biases (``gate_up_proj_bias [E, 2 * d_mlp]``,
``down_proj_bias [E, d_model]``), computing the standard gating ``act(gate) * up``; each expert's
projections are Hugging Face's own arithmetic, so the layout only changes which views the
neuron-heads read. A clamped SwiGLU (GPT-OSS's ``_apply_gate``: ``(clamp(u, -L, L) + 1) * g'
sigmoid(alpha g')``, ``g' = min(g, L)``, recognised by its values:
:func:`~tl_attnonly.components.clamped_gating.find_clamped_gating`) converts only with
``ConversionOptions(clamp="check")``: to neuron-heads of the unclamped activation (one exact head
per neuron, query ``alpha g``, value ``g (u + 1)``), equal to the original wherever the clamp is
inactive; every forward pass counts where it would have acted, records it on the experts
(``clamp_count``, ``clamp_max_change``) and emits a
:class:`~tl_attnonly.components.clamped_gating.ClampActiveWarning` naming the layer, so a
result is never silently wrong. Anything else is refused before any work, naming what differs
(:func:`check_experts_layout`): per-expert module lists, experts without gate rows or with a
post-expert norm, another custom gating, a clamped one without the option.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Float, Int
from transformer_lens.hook_points import HookPoint

from tl_attnonly._compat import child_module, mlp_config, unmount_component_hook
from tl_attnonly.activations import NeuronHeadCoefficients
from tl_attnonly.bridge.modules import (
    BRIDGE_NEURON_HEAD_HOOKS,
    BridgeGatedNeuronHeadMLP,
    BridgeNeuronHeadMLP,
    GatedWeightViews,
)
from tl_attnonly.components.clamped_gating import (
    ClampActiveWarning,
    ClampedSwiGLU,
    ClampRecord,
    find_clamped_gating,
    warn_clamp,
)
from tl_attnonly.components.expert_facts import ExpertFacts, ExpertHookPoints, routed_slots
from tl_attnonly.components.gated_neuron_heads import GatedNeuronHeadMLP
from tl_attnonly.options import ConversionOptions

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

#: What each unsupported layout flag means, for the refusal.
_LAYOUT_MEANING = {
    "has_gate": "its experts are not gated (no gate rows in gate_up_proj)",
    "has_post_expert_norm": "it normalises each expert's output",
}

_SUPPORTED = (
    "Supported: grouped experts (one module with gate_up_proj [E, 2 * d_mlp, d_model] and "
    "down_proj [E, d_model, d_mlp], or both transposed, gate and up rows concatenated or "
    "interleaved, with or without biases) computing down(act(gate x) * up x) per expert, e.g. "
    "Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite-MoE, PhiMoE, DeepSeek-V3 in transformers 5; "
    "a clamped SwiGLU (GPT-OSS) with ConversionOptions(clamp='check')."
)

#: Attribute of a converted ``MoEBridge`` (in its ``__dict__``) that keeps where the experts
#: were mounted and what: ``(slot, experts)``.
_MOUNTED = "_tl_attnonly_experts"

#: The router's top-k expert indices, ``blocks.{l}.mlp.hook_expert_indices`` ``[tokens, top_k]``
#: (tokens: the flattened ``[batch * pos]``): TransformerLens's name on ``HookedTransformer``'s
#: ``MoE`` and on TL 4.x bridges (an alias of the router's hook); where a bridge has none (TL 3.9),
#: conversion mounts a hook point of that name on the ``MoEBridge``, fired by the experts.
ROUTING_HOOK = "hook_expert_indices"


def is_bridge_component(module: object) -> bool:
    """Whether ``module`` is a TransformerLens bridge component (it wraps a module)."""
    return isinstance(getattr(module, "original_component", None), nn.Module)


# ---------------------------------------------------------------------------------- the layers
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
    :attr:`is_mixture_of_experts` marks it for the analysis tools (which refuse it by name), and
    the flags ``use_neuron_result``, ``fused``, ``compiled`` reach every expert and the block's
    shared experts (:attr:`shared`).

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

    #: Marks a mixture of experts for checks that must not import this class
    #: (:func:`tl_attnonly.adapt.analysis_model`).
    is_mixture_of_experts: ClassVar[bool] = True
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
        hook this module mounted (``blocks.{l}.mlp.hook_expert_indices``), if any."""
        names = [f"{prefix}.{e}.hook_{n}" for e in range(len(self)) for n in EXPERT_HOOKS]
        if self.__dict__["routing_hook"] is not None:
            names.append(f"{prefix.rpartition('.')[0]}.{ROUTING_HOOK}")
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


# ---------------------------------------------------------------------------------- planning
@dataclass
class ExpertsPlan:
    """Where a MoE block's experts are and what replaces them.

    Attributes:
        name: The experts' hook prefix, ``blocks.{l}.mlp.experts``.
        layer: The block index (seeds the self-check).
        slot: What holds the experts: the Hugging Face block (attribute ``experts``), or the
            bridge component that wraps them (Qwen2-MoE's ``blocks.{l}.mlp.experts``).
        hf_experts: The Hugging Face grouped experts module.
        act_fn: TransformerLens name of its activation (set by the caller).
        clamp: Its clamped SwiGLU (``None``: the standard gating ``act(gate) * up``).
    """

    name: str
    layer: int
    slot: nn.Module
    hf_experts: nn.Module
    act_fn: str = ""
    clamp: ClampedSwiGLU | None = None


def _unwrapped(module: nn.Module) -> nn.Module:
    """The module a bridge component wraps (and, once converted, the Hugging Face experts that
    :class:`BridgeNeuronHeadExperts` replaced)."""
    inner = module.original_component if is_bridge_component(module) else module
    if isinstance(inner, BridgeNeuronHeadExperts):
        return cast(nn.Module, inner.__dict__["hf_experts"])
    return cast(nn.Module, inner)


def plan_experts(name: str, layer: int, hf_block: nn.Module, clamp: str = "refuse") -> ExpertsPlan:
    """Find a Hugging Face MoE block's experts and check their layout (nothing is changed).

    Args:
        name: The block's name, ``blocks.{l}.mlp``.
        layer: The block index.
        hf_block: The Hugging Face MoE block (the ``MoEBridge``'s wrapped module).
        clamp: ``ConversionOptions.clamp``: ``"check"`` converts a clamped SwiGLU.

    Raises:
        NotImplementedError: For a block without an ``experts`` module, or experts laid out
            otherwise than :func:`check_experts_layout` supports (named).
    """
    slot_module = child_module(hf_block, "experts")
    if slot_module is None:
        children = ", ".join(key for key, _ in hf_block.named_children()) or "none"
        raise NotImplementedError(
            f"{name} ({type(hf_block).__name__}) has no 'experts' submodule (its children: "
            f"{children}); cannot tell which modules are the "
            f"experts. {_SUPPORTED}"
        )
    slot = slot_module if is_bridge_component(slot_module) else hf_block
    hf_experts = _unwrapped(slot_module)
    gating = check_experts_layout(f"{name}.experts", hf_experts, clamp)
    return ExpertsPlan(f"{name}.experts", layer, slot, hf_experts, clamp=gating)


def check_experts_layout(
    name: str, hf_experts: nn.Module, clamp: str = "refuse"
) -> ClampedSwiGLU | None:
    """Refuse an experts module that is not supported, naming what differs.

    Args:
        name: Its name, ``blocks.{l}.mlp.experts``, for the error.
        hf_experts: The Hugging Face experts module.
        clamp: ``ConversionOptions.clamp``: ``"check"`` accepts a clamped SwiGLU.

    Returns:
        The clamped SwiGLU the experts compute (``None``: the standard gating).

    Raises:
        NotImplementedError: Per-expert modules, missing or misshapen grouped weights, a custom
            gating other than a clamped SwiGLU, a clamped SwiGLU without ``clamp="check"``, or
            a layout flag other than :data:`SUPPORTED_LAYOUT`.
    """
    what = f"{name} ({type(hf_experts).__name__})"
    if isinstance(hf_experts, nn.ModuleList):
        kinds = sorted({type(m).__name__ for m in hf_experts})
        raise NotImplementedError(
            f"{what} holds one module per expert ({', '.join(kinds)}), not grouped weights: "
            f"per-expert modules are not supported on a bridge. {_SUPPORTED}"
        )
    shapes = {n: tuple(p.shape) for n, p in hf_experts.named_parameters(recurse=False)}
    if any(len(shapes.get(n, ())) != 3 for n in GROUPED_PARAMETERS):
        raise NotImplementedError(
            f"{what} has no 3-D gate_up_proj and down_proj (its parameters: {shapes or 'none'}). "
            f"{_SUPPORTED}"
        )
    for flag in (*SUPPORTED_LAYOUT, *LAYOUT_FLAGS):
        value = getattr(hf_experts, flag, None)
        if value is None:
            import transformers

            raise NotImplementedError(
                f"{what} does not declare its layout ({flag}): not a transformers grouped "
                "experts module, or one from a transformers without the layout flags (this is "
                f"transformers {transformers.__version__}; 5.17 lacks has_post_expert_norm, 5.24 "
                f"declares them all: pip install -U transformers). {_SUPPORTED}"
            )
        if flag in SUPPORTED_LAYOUT and bool(value) != SUPPORTED_LAYOUT[flag]:
            raise NotImplementedError(
                f"{what}: {_LAYOUT_MEANING[flag]} ({flag}={value}). {_SUPPORTED}"
            )
    _check_grouped_shapes(what, hf_experts, shapes)
    gating = getattr(type(hf_experts), "_apply_gate", None)
    if gating is None or getattr(gating, "__name__", "") == "_default_apply_gate":
        return None
    clamped = find_clamped_gating(what, hf_experts)  # raises for another clamped activation
    if clamped is None:
        raise NotImplementedError(
            f"{what}: its gated activation ({type(hf_experts).__name__}._apply_gate) is not the "
            f"standard act(gate) * up. {_SUPPORTED}"
        )
    if clamp != "check":
        raise NotImplementedError(
            f"{what}: its gated activation ({type(hf_experts).__name__}._apply_gate) is a "
            f"clamped SwiGLU, {clamped.describe()}: it clamps the gate (at most "
            f"{clamped.limit:g}) and the linear branch (within ±{clamped.limit:g}) before the "
            "product, and neuron-heads have no clamp. Pass ConversionOptions(clamp='check') to "
            "convert it to the unclamped activation, exact wherever the clamp is inactive, "
            f"with a ClampActiveWarning on every forward pass where it is not. {_SUPPORTED}"
        )
    return clamped


def _check_grouped_shapes(what: str, hf_experts: nn.Module, shapes: dict[str, tuple]) -> None:
    """Refuse grouped weights (and biases) whose shapes do not fit the declared layout."""
    transposed = bool(hf_experts.is_transposed)
    (n, *gate_up), (n_out, *down) = shapes["gate_up_proj"], shapes["down_proj"]
    (d, two_m), (m, d_out) = (gate_up, down) if transposed else (gate_up[::-1], down[::-1])
    expected = {"gate_up_proj_bias": (n, two_m), "down_proj_bias": (n, d)}
    biases_fit = not hf_experts.has_bias or all(shapes.get(k) == v for k, v in expected.items())
    if (n, two_m, d) != (n_out, 2 * m, d_out) or not biases_fit:
        layout = (
            "[E, d_model, 2 * d_mlp] and [E, d_mlp, d_model]"
            if transposed
            else "[E, 2 * d_mlp, d_model] and [E, d_model, d_mlp]"
        )
        raise NotImplementedError(
            f"{what}: gate_up_proj {shapes['gate_up_proj']} and down_proj {shapes['down_proj']} "
            f"(biases: {[shapes.get(k) for k in GROUPED_BIASES]}) are not {layout} "
            f"(is_transposed={transposed}, has_bias={bool(hf_experts.has_bias)}). {_SUPPORTED}"
        )


def expert_coefficients(plan: ExpertsPlan, options: ConversionOptions) -> NeuronHeadCoefficients:
    """The per-head coefficients of ``plan``'s experts: those of ``options`` for their
    activation, or a clamped SwiGLU's one exact head per neuron (sets ``plan.act_fn``).

    Raises:
        ValueError: Options that do not fit the activation (several heads per neuron for a
            clamped SwiGLU's exact head).
    """
    if plan.clamp is None:
        return options.coefficients(plan.act_fn)
    if options.n_heads_per_neuron not in (None, 1):
        raise ValueError(
            f"{plan.name}: the clamped SwiGLU's unclamped activation g * sigmoid("
            f"{plan.clamp.alpha:g} g) is exact with 1 head per neuron; valid n_heads_per_neuron: "
            f"None or 1, got {options.n_heads_per_neuron!r}."
        )
    coefficients = plan.clamp.coefficients()
    plan.act_fn = coefficients.activation
    return coefficients


def build_experts(
    plan: ExpertsPlan, coefficients: NeuronHeadCoefficients, *, fused: bool, compiled: bool
) -> BridgeNeuronHeadExperts:
    """The neuron-head experts of ``plan`` (nothing is mounted yet)."""
    experts = BridgeNeuronHeadExperts(
        plan.hf_experts, plan.act_fn, coefficients, clamp=plan.clamp, name=plan.name
    )
    experts.fused = fused
    experts.compiled = compiled
    return experts


def _eager_forward(hf_experts: nn.Module) -> Any:
    """The experts class's own eager forward (transformers' ``use_experts_implementation`` keeps
    it as ``forward.__wrapped__``; the grouped kernels compute the same up to rounding and have
    no float64), else the module itself."""
    wrapped = getattr(type(hf_experts).forward, "__wrapped__", None)
    if wrapped is None:
        return hf_experts
    return lambda *args: wrapped(hf_experts, *args)


def check_experts(plan: ExpertsPlan, experts: BridgeNeuronHeadExperts) -> None:
    """Refuse experts whose Hugging Face forward is not ``sum_e w_e down_e(act(gate_e x) * up_e
    x)``: both run on a small random input routed to every expert, and must agree within the
    neuron-heads' error bound plus rounding (a structural difference is far outside it). For a
    clamped SwiGLU the bound adds, where the clamp acts on that input, the exact change of the
    activation through ``|W_out|``; the check's own forward pass is neither warned nor recorded.

    Raises:
        NotImplementedError: Naming the experts, the difference and the bound.
    """
    down = experts.down_proj
    if down.is_meta:
        return  # no values to compare
    dtype, device = down.dtype, down.device
    n_experts = experts.num_experts
    d_model = experts.expert_list()[0].cfg.d_model
    top_k = min(2, n_experts)
    n_tokens = 2 * n_experts
    generator = torch.Generator().manual_seed(plan.layer)
    x = torch.randn(n_tokens, d_model, generator=generator, dtype=torch.float64)
    x = x.to(device=device, dtype=dtype)
    token = torch.arange(n_tokens, device=device)
    index = torch.stack([(token + k) % n_experts for k in range(top_k)], dim=-1)
    weights = torch.rand(n_tokens, top_k, generator=generator, dtype=torch.float64)
    weights = weights.to(device=device, dtype=dtype)
    fused, training = experts.fused, experts.training
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", ClampActiveWarning)
        reference = _eager_forward(plan.hf_experts)(x, index, weights)
        experts.fused = True
        experts.eval()
        ours = experts(x, index, weights)
        experts.fused = fused
        experts.train(training)
        experts.reset_clamp_record()
        # |act_K - act| <= max_err per neuron, times |u|, through W_out, times the weight; plus
        # a clamped SwiGLU's change where its clamp acts
        scale = torch.zeros(n_tokens, d_model, dtype=torch.float64, device=device)
        clamped = torch.zeros_like(scale)
        for e, expert in enumerate(experts.expert_list()):
            slot, rows = routed_slots(index, e)
            gate_up = expert._project(x[rows], "gate_up").to(torch.float64)
            gate, u = (expert._gate_up_part(gate_up, part) for part in (0, 1))
            w = weights[rows, slot, None].abs().to(torch.float64)
            out_matrix = expert._out_matrix.abs().to(torch.float64)
            if experts.clamp is not None:
                change = experts.clamp.unclamped(gate, u) - experts.clamp.clamped(gate, u)
                clamped.index_add_(0, rows, w * (change.abs() @ out_matrix))
                u = u + experts.clamp.linear_offset
            scale.index_add_(0, rows, w * (u.abs() @ out_matrix))
        eps = torch.finfo(dtype).eps
        max_err = experts.coefficients.max_abs_error()
        bound = max_err * scale + 64 * eps * (scale + reference.abs().to(torch.float64) + 1)
        bound = bound + clamped * (1 + 64 * eps)
    error = (ours.to(torch.float64) - reference.to(torch.float64)).abs()
    if not bool((error <= bound).all()):
        raise NotImplementedError(
            f"{plan.name} ({type(plan.hf_experts).__name__}): the neuron-head experts differ "
            f"from the Hugging Face experts by {float(error.max()):.3g} on a random input "
            f"(bound {float(bound.max()):.3g}), so their forward is not the standard "
            f"sum of routing weight * down(act(gate x) * up x). {_SUPPORTED}"
        )


# ---------------------------------------------------------------------------------- mounting
def mount_experts(mlp_bridge: nn.Module, plan: ExpertsPlan, experts: BridgeNeuronHeadExperts):
    """Put ``experts`` where the Hugging Face experts were (the block's ``experts`` attribute,
    or the wrapping bridge component's wrapped module); the block itself is not touched."""
    if is_bridge_component(plan.slot):  # a bridge component wraps them
        cast(Any, plan.slot).set_original_component(experts)
    else:
        plan.slot.experts = experts
    mlp_bridge.__dict__[_MOUNTED] = (plan.slot, experts)
    if ROUTING_HOOK not in getattr(mlp_bridge, "hook_aliases", {}):  # TL 3.9: no routing hook
        hook_point = child_module(mlp_bridge, ROUTING_HOOK)
        if hook_point is None:
            hook_point = HookPoint()  # [tokens, top_k]
            mlp_bridge.add_module(ROUTING_HOOK, hook_point)
        experts.__dict__["routing_hook"] = hook_point


def mounted_experts(mlp_bridge: nn.Module) -> BridgeNeuronHeadExperts | None:
    """The neuron-head experts mounted in a ``MoEBridge`` (``None`` where there are none)."""
    mounted = mlp_bridge.__dict__.get(_MOUNTED)
    return None if mounted is None else mounted[1]


def unmount_experts(mlp_bridge: nn.Module) -> BridgeNeuronHeadExperts | None:
    """Put the Hugging Face experts back (their parameters: the ones the bridge holds now);
    returns the neuron-head experts taken out (``None`` where none were mounted)."""
    mounted = mlp_bridge.__dict__.pop(_MOUNTED, None)
    if mounted is None:
        return None
    slot, experts = mounted
    if experts.__dict__["routing_hook"] is not None:
        unmount_component_hook(mlp_bridge, ROUTING_HOOK)
        experts.__dict__["routing_hook"] = None
    hf_experts = experts.__dict__["hf_experts"]
    for name in GROUPED_PARAMETERS:  # the same objects, unless a cast made new ones
        setattr(hf_experts, name, getattr(experts, name))
    hf_experts.train(experts.training)
    if is_bridge_component(slot):
        slot.set_original_component(hf_experts)
    else:
        slot.experts = hf_experts
    return cast(BridgeNeuronHeadExperts, experts)


def dense_moe_keys(mlp_bridge: nn.Module) -> dict[str, str]:
    """The projections of a ``MoEBridge`` bound to a dense layer of an interleaved MoE stack
    (DeepSeek's first layers), by role: ``{"gate": "dense_gate", "in": "dense_in", "out":
    "dense_out"}`` (no ``gate`` for an ungated dense MLP)."""
    keys = {"gate": "dense_gate", "in": "dense_in", "out": "dense_out"}
    return {role: key for role, key in keys.items() if child_module(mlp_bridge, key) is not None}


__all__ = [
    "EXPERT_HOOKS",
    "ROUTING_HOOK",
    "BridgeNeuronHeadExpert",
    "BridgeNeuronHeadExperts",
    "ExpertsPlan",
    "SharedGatedNeuronHeadMLP",
    "SharedNeuronHeadMLP",
    "build_experts",
    "check_experts",
    "check_experts_layout",
    "dense_moe_keys",
    "expert_coefficients",
    "is_bridge_component",
    "mount_experts",
    "mounted_experts",
    "plan_experts",
    "unmount_experts",
]
