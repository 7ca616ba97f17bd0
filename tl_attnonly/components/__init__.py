"""TransformerLens-style components, one per file."""

from tl_attnonly.components.factory import NEURON_HEAD_CLASSES, NeuronHeadLayer, neuron_heads_for
from tl_attnonly.components.gated_neuron_heads import GatedNeuronHeadMLP
from tl_attnonly.components.literal_attention import LiteralAttention
from tl_attnonly.components.moe_neuron_heads import GatedNeuronHeadExpert, NeuronHeadMoE
from tl_attnonly.components.neuron_head_base import NeuronHeadBase
from tl_attnonly.components.neuron_heads import NEURON_HEAD_HOOKS, NeuronHeadMLP

__all__ = [
    "NEURON_HEAD_CLASSES",
    "NEURON_HEAD_HOOKS",
    "GatedNeuronHeadExpert",
    "GatedNeuronHeadMLP",
    "LiteralAttention",
    "NeuronHeadBase",
    "NeuronHeadLayer",
    "NeuronHeadMLP",
    "NeuronHeadMoE",
    "neuron_heads_for",
]
