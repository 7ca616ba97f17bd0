"""Neuron-heads for an MLP whose forward adds the residual stream itself (MPT, BLOOM).

``MptMLP.forward(hidden_states, residual)`` and ``BloomMLP.forward(hidden_states, residual)``
return ``residual + dropout(out(act(in hidden_states)))`` (dropout probability: the module's
``hidden_dropout``; identity in eval mode). Their bridge components (MPT: ``MLPBridge``, BLOOM:
``BloomMLPBridge``) call the module with both arguments, and TransformerLens aliases
``hook_mlp_out`` to ``mlp.out.hook_out`` (the additive contribution; ``mlp.hook_out`` is the
residual stream after the MLP).

:class:`BridgeResidualNeuronHeadMLP` is :class:`~tl_attnonly.bridge.BridgeNeuronHeadMLP` with that
forward contract; it is mounted like every bridge layer (the component's wrapped module). The
conversion checks the contract by calling the Hugging Face module and this layer on the same
random hidden states and residual.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from jaxtyping import Float

from tl_attnonly.bridge.modules import BridgeNeuronHeadMLP
from tl_attnonly.bridge.sites import OutputSiteMixin


class BridgeResidualNeuronHeadMLP(OutputSiteMixin, BridgeNeuronHeadMLP):
    """A plain MLP that adds the residual stream in its forward (MPT, BLOOM) as neuron-heads.

    Args:
        mlp_bridge: The bridge's MLP component (``bridge.blocks[l].mlp``).
        projections: Hugging Face attribute name of each projection: ``{"in": "up_proj",
            "out": "down_proj"}``.
        cfg: ``d_model``, ``d_mlp``, ``act_fn``, ``dtype`` of the layer.
        coefficients: Per-head coefficients of ``cfg.act_fn``.
    """

    #: Dropout probability on the MLP's output before the residual is added (the Hugging Face
    #: module's ``hidden_dropout``; set by the conversion).
    hidden_dropout: float = 0.0

    def forward(  # type: ignore[override]
        self,
        hidden_states: Float[torch.Tensor, "batch pos d_model"],
        residual: Float[torch.Tensor, "batch pos d_model"],
        *args: Any,
        **kwargs: Any,
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        out = super().forward(hidden_states)  # [batch, pos, d_model]: hook_mlp_out's value
        return F.dropout(out, p=self.hidden_dropout, training=self.training) + residual

    def mount_in(self, mlp_bridge: Any, hf_mlp: nn.Module, index: int) -> list[Any]:
        """Wrap this layer in the component; the torch hook handles to remove when unmounting."""
        mlp_bridge.set_original_component(self)
        return self.output_hooks()

    def unmount_from(self, mlp_bridge: Any, hf_mlp: nn.Module) -> None:
        """Put the Hugging Face module back."""
        mlp_bridge.set_original_component(hf_mlp)


__all__ = ["BridgeResidualNeuronHeadMLP"]
