"""TransformerLens-style components, one per file."""

from tl_attnonly.components.factory import NEURON_HEAD_CLASSES, neuron_heads_for
from tl_attnonly.components.gated_neuron_heads import GatedNeuronHeadMLP
from tl_attnonly.components.literal_attention import LiteralAttention
from tl_attnonly.components.neuron_head_base import NeuronHeadBase
from tl_attnonly.components.neuron_heads import NEURON_HEAD_HOOKS, NeuronHeadMLP

__all__ = [
    "NEURON_HEAD_CLASSES",
    "NEURON_HEAD_HOOKS",
    "GatedNeuronHeadMLP",
    "LiteralAttention",
    "NeuronHeadBase",
    "NeuronHeadMLP",
    "neuron_heads_for",
]
