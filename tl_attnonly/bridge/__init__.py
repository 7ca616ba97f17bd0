"""TransformerBridge support: a bridge's MLPs as neuron-heads (TransformerLens 3.x and 4.x).

``tl_attnonly.convert(bridge)`` calls :func:`convert_bridge`. See ``docs/bridge.md``.
"""

from tl_attnonly.bridge.convert import (
    convert_bridge,
    identify_activation,
    is_converted_bridge,
    neuron_head_layers,
    set_use_neuron_result,
    unconvert_bridge,
)
from tl_attnonly.bridge.modules import (
    BRIDGE_NEURON_HEAD_HOOKS,
    BridgeGatedNeuronHeadMLP,
    BridgeNeuronHeadMLP,
)

__all__ = [
    "BRIDGE_NEURON_HEAD_HOOKS",
    "BridgeGatedNeuronHeadMLP",
    "BridgeNeuronHeadMLP",
    "convert_bridge",
    "identify_activation",
    "is_converted_bridge",
    "neuron_head_layers",
    "set_use_neuron_result",
    "unconvert_bridge",
]
