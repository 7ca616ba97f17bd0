"""Gated neuron-heads for a fused gate/up projection (TransformerLens's ``JointGateUpMLPBridge``).

Phi-3 (and Phi-4), GLM and GLM-4 keep the gate and up projections as one ``nn.Linear``,
``gate_up_proj`` (``[2 * d_mlp, d_model]``: the gate's rows, then the up projection's). Their
bridge component, ``JointGateUpMLPBridge``, splits it at load into two ``LinearBridge``\\ s,
``gate`` and ``in``, whose weights are **views** of the fused weight (its two halves, no copy),
and runs ``out(act(gate x) * in x)`` itself: it never calls the Hugging Face MLP. Its hooks are
those of a gated MLP: ``hook_pre`` = ``gate.hook_out``, ``hook_pre_linear`` = ``in.hook_out``,
``hook_post`` = ``out.hook_in``.

:class:`BridgeJointGateUpNeuronHeadMLP` is :class:`~tl_attnonly.bridge.BridgeGatedNeuronHeadMLP`
(the same gated neuron-heads, reading (a) of ``docs/gated_mlps.md``) on those components: its
``W_gate`` / ``W_in`` are the ``gate`` / ``in`` weights, i.e. views of the two halves of
``gate_up_proj`` (an in-place edit of the fused weight shows in the heads). The bridge runs it
where it reads its activation:

1. the component's activation slot holds an :class:`~tl_attnonly.bridge.sites.ActivationSite`;
   the bridge calls it on the gate (``hook_pre`` has fired), and :meth:`activation_step` keeps
   the gate and returns the scalar 1, so the bridge's product ``1 * up`` is the up projection's
   output (``hook_pre_linear`` has fired) unchanged;
2. a forward pre-hook on the ``out`` projection takes that product as the linear branch ``u``,
   runs the neuron-heads on ``(g, u)`` and gives ``out`` their sum instead (``hook_post`` fires on
   it). With SiLU and default options this is ``F.silu(g) * u``, TransformerLens's own arithmetic,
   so the logits are the unconverted bridge's bit for bit.

The Hugging Face MLP is set aside as on every bridge; its fused ``gate_up_proj`` and ``down_proj``
(the bridge's ``out``) are this layer's submodules under those names, so the module tree, state
dict and device moves still reach the fused weight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from jaxtyping import Float

from tl_attnonly._compat import child_module
from tl_attnonly.activations import NeuronHeadCoefficients
from tl_attnonly.bridge.modules import BridgeGatedNeuronHeadMLP
from tl_attnonly.bridge.sites import ActivationSite, OutputSiteMixin, class_in_mro

#: The TransformerLens component class this layer runs in.
JOINT_GATE_UP_BRIDGE = "JointGateUpMLPBridge"


def _wrap(mlp_bridge: Any, module: nn.Module) -> None:
    """Make ``module`` the component's wrapped module with TransformerLens's base
    ``set_original_component``, skipping ``JointGateUpMLPBridge``'s override, which re-splits the
    fused projection of the module it is given (that would put the raw weights back over
    processed ones in compatibility mode)."""
    joint: Any = class_in_mro(mlp_bridge, JOINT_GATE_UP_BRIDGE)
    assert joint is not None, type(mlp_bridge).__name__
    super(joint, mlp_bridge).set_original_component(module)


def _set_activation_slot(mlp_bridge: Any, fn: Any) -> None:
    """Set the activation ``JointGateUpMLPBridge.forward`` calls (TransformerLens's private
    ``_activation_fn``, filled from the Hugging Face module by its ``set_original_component``)."""
    mlp_bridge._activation_fn = fn


class BridgeJointGateUpNeuronHeadMLP(OutputSiteMixin, BridgeGatedNeuronHeadMLP):  # type: ignore[misc,override]
    """A fused gate/up MLP (``JointGateUpMLPBridge``: Phi-3, GLM, GLM-4) as gated neuron-heads.

    The maths and hook points of :class:`~tl_attnonly.bridge.BridgeGatedNeuronHeadMLP` (and so of
    :class:`~tl_attnonly.GatedNeuronHeadMLP`); the gate and up projections are the bridge's
    ``gate`` and ``in`` components, whose weights are views of the fused ``gate_up_proj``.
    Called directly it runs ``out(heads(gate x, in x))`` like its parent; mounted
    (:meth:`mount`), the bridge's own forward runs it at its activation slot (module docstring).

    Args:
        mlp_bridge: The bridge's MLP component (``bridge.blocks[l].mlp``).
        fused_name: The Hugging Face MLP's fused attribute (``"gate_up_proj"``).
        fused: That module (registered here under ``fused_name``).
        out_name: The Hugging Face name of the ``out`` projection (``"down_proj"``).
        cfg: ``d_model``, ``d_mlp``, ``act_fn``, ``dtype`` of the layer.
        coefficients: Per-head coefficients of ``cfg.act_fn``.
    """

    def __init__(
        self,
        mlp_bridge: nn.Module,
        fused_name: str,
        fused: nn.Module,
        out_name: str,
        cfg: Any,
        coefficients: NeuronHeadCoefficients,
    ):
        # the gate and up components are the bridge's (registered there); held, not registered
        self.__dict__["_split"] = {"gate": mlp_bridge.gate, "in": getattr(mlp_bridge, "in")}
        self.__dict__["_fused"] = (fused_name, fused)
        super().__init__(mlp_bridge, {"out": out_name}, cfg, coefficients)

    def _init_parameters_and_hooks(self) -> None:
        super()._init_parameters_and_hooks()
        name, fused = self.__dict__.pop("_fused")
        self.add_module(name, fused)
        #: What the bridge calls as its activation once mounted.
        self.activation_fn = ActivationSite(self)
        self._gate: torch.Tensor | None = None

    def _projection(self, role: str) -> Any:
        split = self.__dict__["_split"]
        return split[role] if role in split else super()._projection(role)

    # ------------------------------------------------------------------ mounted path
    def activation_step(
        self, gate: Float[torch.Tensor, "batch pos d_mlp"]
    ) -> Float[torch.Tensor, ""]:
        """The bridge's ``act_fn(gate)``: keep the gate (``hook_pre``'s value) for the ``out``
        pre-hook, and return 1, so that the bridge's ``act_fn(gate) * up`` is ``up``."""
        self._gate = gate
        return gate.new_ones(())

    def _heads_into_out(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """Forward pre-hook on the ``out`` projection: its input is the up projection's output
        (times 1); replace it by the neuron-heads' ``hook_post`` from the kept gate. ``out``
        called outside the bridge's forward (no gate kept) is left alone."""
        gate, self._gate = self._gate, None
        if gate is None:
            return None
        self._ran = True
        linear = args[0]  # [batch, pos, d_mlp]: hook_pre_linear's value
        if not self._uses_head_path():
            return (self._fused_sum(gate, linear), *args[1:])
        z = self._head_z(gate, linear)
        self._pending = self._result_edit(z)
        return (self._sum_heads(z), *args[1:])

    def mount_in(self, mlp_bridge: Any, hf_mlp: nn.Module, index: int) -> list[Any]:
        """Make this layer the component's wrapped module and its activation; the torch hook
        handles to remove when unmounting."""
        self.__dict__["_bridge_activation"] = mlp_bridge.__dict__.get(
            "_activation_fn", child_module(mlp_bridge, "_activation_fn")
        )
        _wrap(mlp_bridge, self)
        _set_activation_slot(mlp_bridge, self.activation_fn)
        out = self._projection("out")
        return [out.register_forward_pre_hook(self._heads_into_out), *self.output_hooks()]

    def unmount_from(self, mlp_bridge: Any, hf_mlp: nn.Module) -> None:
        """Put the Hugging Face module and the bridge's activation back."""
        _wrap(mlp_bridge, hf_mlp)
        _set_activation_slot(mlp_bridge, self.__dict__.pop("_bridge_activation", None))
        self._gate = None


__all__ = ["JOINT_GATE_UP_BRIDGE", "BridgeJointGateUpNeuronHeadMLP"]
