"""Neuron-heads for a containerless bridge MLP: projections that live in the layer itself.

BERT (``intermediate.dense`` -> ``intermediate.intermediate_act_fn`` -> ``output.dense``), OPT and
XGLM (``fc1`` -> ``activation_fn`` -> ``fc2`` on the decoder layer) have no MLP module around
their projections. TransformerLens maps such an MLP as a *containerless* ``MLPBridge``
(``name=None``): its ``in`` and ``out`` components are the layer's projections (``hook_pre`` =
``in.hook_out``, ``hook_post`` = ``out.hook_in``; ``hook_mlp_out`` is aliased to
``mlp.out.hook_out``), its wrapped module is the whole Hugging Face layer, and nothing calls the
component: the Hugging Face layer calls the projections and its activation module itself.

:class:`BridgeContainerlessNeuronHeadMLP` is :class:`~tl_attnonly.bridge.BridgeNeuronHeadMLP` on
those ``in`` / ``out`` components. Mounted, an :class:`~tl_attnonly.bridge.sites.ActivationSite`
takes the activation module's place in the Hugging Face module that holds it, so the layer calls
the neuron-heads between its projections and everything around them (attention, residual adds,
BERT's post-norm ``LayerNorm(h + out)``, OPT's flattening, dropout) stays as Hugging Face wrote it.
The conversion first checks, by running the layer once on random hidden states, that the
activation module is called once, on the ``in`` projection's output, and that its output is what
the ``out`` projection receives (:func:`tl_attnonly.bridge.layouts.plan_layout`).

OPT runs its MLP on ``[batch * pos, d_model]`` rows; the neuron-heads view them as ``[batch, pos,
...]`` (the shape of the hidden states entering the layer, recorded by a forward pre-hook on it),
so their hooks have the shapes they have everywhere else.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
from jaxtyping import Float

from tl_attnonly.activations import NeuronHeadCoefficients
from tl_attnonly.bridge.modules import BridgeNeuronHeadMLP
from tl_attnonly.bridge.sites import ActivationSite, OutputSiteMixin


def _hidden_states(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("hidden_states")


class BridgeContainerlessNeuronHeadMLP(OutputSiteMixin, BridgeNeuronHeadMLP):
    """A containerless plain MLP (BERT, OPT, XGLM) as neuron-heads, run at the activation site of
    its Hugging Face layer (module docstring).

    Args:
        mlp_bridge: The bridge's MLP component (``bridge.blocks[l].mlp``, ``name=None``).
        owner: The Hugging Face module that holds the activation (``BertIntermediate``; the
            decoder layer for OPT and XGLM).
        activation_name: Its attribute (``"intermediate_act_fn"``, ``"activation_fn"``).
        cfg: ``d_model``, ``d_mlp``, ``act_fn``, ``dtype`` of the layer.
        coefficients: Per-head coefficients of ``cfg.act_fn``.
    """

    def __init__(
        self,
        mlp_bridge: nn.Module,
        owner: nn.Module,
        activation_name: str,
        cfg: Any,
        coefficients: NeuronHeadCoefficients,
    ):
        self.__dict__["_owner"] = (owner, activation_name)
        super().__init__(mlp_bridge, {"in": "in", "out": "out"}, cfg, coefficients)

    def _init_parameters_and_hooks(self) -> None:
        super()._init_parameters_and_hooks()
        #: What the Hugging Face layer calls as its activation once mounted.
        self.activation_site = ActivationSite(self)
        #: ``(batch, pos)`` of the hidden states entering the layer (OPT flattens them).
        self._tokens: tuple[int, int] | None = None

    # ------------------------------------------------------------------ mounted path
    def _token_view(
        self, pre: Float[torch.Tensor, "... d_mlp"]
    ) -> Float[torch.Tensor, "batch pos d_mlp"]:
        if pre.dim() == 3:
            return pre
        tokens = self._tokens
        if pre.dim() != 2 or tokens is None or tokens[0] * tokens[1] != pre.shape[0]:
            raise RuntimeError(
                f"The neuron-heads got pre-activations of shape {tuple(pre.shape)}, which are "
                f"not the {tokens} tokens of the hidden states that entered the layer."
            )
        return pre.view(*tokens, pre.shape[-1])

    def activation_step(self, pre: Float[torch.Tensor, "... d_mlp"]) -> torch.Tensor:
        """The layer's ``act(in x)``: the neuron-heads on the ``in`` projection's output
        (``hook_pre``'s value); their sum is what the layer passes to ``out`` (``hook_post``)."""
        self._ran = True
        x = self._token_view(pre)
        if not self._uses_head_path():
            return self._fused_post(x).view(pre.shape)
        z = self._head_z(x)
        self._pending = self._result_edit(z)
        return self._sum_heads(z).reshape(pre.shape)

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook on the Hugging Face layer: record the tokens' shape; the heads have
        not run yet."""
        hidden = _hidden_states(args, kwargs)
        self._tokens = (
            (int(hidden.shape[0]), int(hidden.shape[1]))
            if isinstance(hidden, torch.Tensor)
            else None
        )
        self._ran = False

    def _leave(self, module: nn.Module, args: Any, output: Any, *, index: int) -> None:
        """Forward hook on the Hugging Face layer: raise if it ran without the neuron-heads."""
        if not self._ran:
            raise RuntimeError(
                f"blocks.{index}.mlp: {type(module).__name__} ran without its neuron-heads (its "
                "activation was not the one tl_attnonly.convert mounted). Call "
                "tl_attnonly.convert(bridge) again."
            )

    def mount_in(self, mlp_bridge: Any, hf_layer: nn.Module, index: int) -> list[Any]:
        """Wrap this layer in the component and put its site in the activation's slot of
        ``hf_layer`` (the Hugging Face layer the component wrapped); the torch hook handles to
        remove when unmounting."""
        owner, name = self.__dict__["_owner"]
        self.__dict__["_activation"] = getattr(owner, name)
        mlp_bridge.set_original_component(self)
        setattr(owner, name, self.activation_site)
        return [
            hf_layer.register_forward_pre_hook(self._enter, with_kwargs=True),
            hf_layer.register_forward_hook(functools.partial(self._leave, index=index)),
            *self.output_hooks(),
        ]

    def unmount_from(self, mlp_bridge: Any, hf_mlp: nn.Module) -> None:
        """Put the activation and the Hugging Face layer back."""
        owner, name = self.__dict__["_owner"]
        delattr(owner, name)  # a module slot; the activation may be a plain function
        setattr(owner, name, self.__dict__.pop("_activation"))
        mlp_bridge.set_original_component(hf_mlp)


__all__ = ["BridgeContainerlessNeuronHeadMLP"]
