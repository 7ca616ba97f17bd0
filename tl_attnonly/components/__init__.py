"""TransformerLens-style components, one per file."""

from tl_attnonly.components.literal_attention import LiteralAttention
from tl_attnonly.components.neuron_heads import NEURON_HEAD_HOOKS, NeuronHeadMLP

__all__ = ["NEURON_HEAD_HOOKS", "LiteralAttention", "NeuronHeadMLP"]
