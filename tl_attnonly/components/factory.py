"""The neuron-head layer that replaces each TransformerLens MLP class."""

from __future__ import annotations

from transformer_lens.components import MLP, GatedMLP, MoE

from tl_attnonly._compat import CanBeUsedAsMLP
from tl_attnonly.activations import NeuronHeadCoefficients
from tl_attnonly.components.gated_neuron_heads import GatedNeuronHeadMLP
from tl_attnonly.components.moe_neuron_heads import NeuronHeadMoE
from tl_attnonly.components.neuron_head_base import NeuronHeadBase
from tl_attnonly.components.neuron_heads import NeuronHeadMLP

#: A neuron-head layer: one that replaces a TransformerLens MLP module.
NeuronHeadLayer = NeuronHeadBase | NeuronHeadMoE

#: TransformerLens MLP class -> its neuron-head replacement (same parameters and hooks).
NEURON_HEAD_CLASSES: dict[type[CanBeUsedAsMLP], type[NeuronHeadLayer]] = {
    MLP: NeuronHeadMLP,
    GatedMLP: GatedNeuronHeadMLP,
    MoE: NeuronHeadMoE,
}


def neuron_heads_for(
    mlp: CanBeUsedAsMLP, coefficients: NeuronHeadCoefficients | None = None
) -> NeuronHeadLayer:
    """A new (uninitialised) neuron-head layer for a TransformerLens MLP module, same config.

    Args:
        mlp: ``blocks[l].mlp`` of a TransformerLens model.
        coefficients: Per-head coefficients (default: from ``mlp.cfg.act_fn``).

    Raises:
        NotImplementedError: For an MLP class with no neuron-head form (named).
    """
    if isinstance(mlp, (NeuronHeadBase, NeuronHeadMoE)):
        return type(mlp)(mlp.cfg, coefficients)
    cls = NEURON_HEAD_CLASSES.get(type(mlp))
    if cls is None:
        supported = ", ".join(c.__name__ for c in NEURON_HEAD_CLASSES)
        raise NotImplementedError(
            f"{type(mlp).__name__} has no neuron-head form. Supported TransformerLens MLP classes: "
            f"{supported}."
        )
    return cls(mlp.cfg, coefficients)


__all__ = [
    "NEURON_HEAD_CLASSES",
    "NeuronHeadLayer",
    "neuron_heads_for",
]
