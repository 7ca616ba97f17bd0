"""A bridge's mixture-of-experts layers with every expert's neurons as gated neuron-heads,
mounted in the ``MoEBridge`` where the Hugging Face experts were, and put back.

The layers and what they compute (the Hugging Face experts module each replaces, the hooks
``blocks.{l}.mlp.experts.{e}.hook_*``, the shared experts):
:mod:`tl_attnonly.bridge.expert_modules`; which experts modules are supported and the checks of
a conversion: :mod:`tl_attnonly.bridge.expert_plan`. Here: :func:`mount_experts` puts the
neuron-head experts in place (and, where TransformerLens has none, the routing hook
:data:`ROUTING_HOOK`; on every version, the hooks of the indices and weights the experts get,
:data:`ROUTING_INDICES_HOOK` and :data:`ROUTING_WEIGHTS_HOOK`), :func:`mounted_experts` finds
them, :func:`unmount_experts` takes them out, and :func:`dense_moe_keys` names the projections of
a dense layer of an interleaved MoE stack. The public names of both modules are importable from
here too.
"""

from __future__ import annotations

from typing import Any, cast

import torch.nn as nn
from transformer_lens.hook_points import HookPoint

from tl_attnonly._compat import child_module, unmount_component_hook
from tl_attnonly.bridge.expert_modules import (
    EXPERT_HOOKS,
    GROUPED_BIASES,
    GROUPED_PARAMETERS,
    LAYOUT_FLAGS,
    ROUTING_HOOK,
    ROUTING_INDICES_HOOK,
    ROUTING_WEIGHTS_HOOK,
    SUPPORTED_LAYOUT,
    BridgeNeuronHeadExpert,
    BridgeNeuronHeadExperts,
    SharedGatedNeuronHeadMLP,
    SharedNeuronHeadMLP,
)
from tl_attnonly.bridge.expert_plan import (
    ExpertsPlan,
    build_experts,
    check_experts,
    check_experts_layout,
    expert_coefficients,
    is_bridge_component,
    plan_experts,
)

#: Attribute of a converted ``MoEBridge`` (in its ``__dict__``) that keeps where the experts
#: were mounted and what: ``(slot, experts)``.
_MOUNTED = "_tl_attnonly_experts"


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
    for name, key in ((ROUTING_INDICES_HOOK, "indices"), (ROUTING_WEIGHTS_HOOK, "weights")):
        hook = child_module(mlp_bridge, name)
        if hook is None:
            hook = HookPoint()  # [tokens, top_k]
            mlp_bridge.add_module(name, hook)
        experts.__dict__[f"routing_{key}_hook"] = hook
    experts.shared_gates = {
        name: f"{name}_gate" for name in experts.shared if child_module(mlp_bridge, f"{name}_gate")
    }


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
    for name, key in ((ROUTING_INDICES_HOOK, "indices"), (ROUTING_WEIGHTS_HOOK, "weights")):
        if experts.__dict__[f"routing_{key}_hook"] is not None:
            unmount_component_hook(mlp_bridge, name)
            experts.__dict__[f"routing_{key}_hook"] = None
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
    "GROUPED_BIASES",
    "GROUPED_PARAMETERS",
    "LAYOUT_FLAGS",
    "ROUTING_HOOK",
    "ROUTING_INDICES_HOOK",
    "ROUTING_WEIGHTS_HOOK",
    "SUPPORTED_LAYOUT",
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
