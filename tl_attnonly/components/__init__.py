"""TransformerLens-style components, one per file.

The names below are imported on first use (PEP 562): the neuron-head layers work on every
TransformerLens version, while the factory and the mixture-of-experts layer subclass or map
TransformerLens 3.x's component classes (absent from 4.x).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Public name -> the module that defines it.
_LAZY = {
    "ClampActiveWarning": "tl_attnonly.components.clamped_gating",
    "NEURON_HEAD_CLASSES": "tl_attnonly.components.factory",
    "NeuronHeadLayer": "tl_attnonly.components.factory",
    "neuron_heads_for": "tl_attnonly.components.factory",
    "GatedNeuronHeadMLP": "tl_attnonly.components.gated_neuron_heads",
    "LiteralAttention": "tl_attnonly.components.literal_attention",
    "GatedNeuronHeadExpert": "tl_attnonly.components.moe_neuron_heads",
    "NeuronHeadMoE": "tl_attnonly.components.moe_neuron_heads",
    "NeuronHeadBase": "tl_attnonly.components.neuron_head_base",
    "NEURON_HEAD_HOOKS": "tl_attnonly.components.neuron_heads",
    "NeuronHeadMLP": "tl_attnonly.components.neuron_heads",
}

if TYPE_CHECKING:
    from tl_attnonly.components.clamped_gating import ClampActiveWarning
    from tl_attnonly.components.factory import (
        NEURON_HEAD_CLASSES,
        NeuronHeadLayer,
        neuron_heads_for,
    )
    from tl_attnonly.components.gated_neuron_heads import GatedNeuronHeadMLP
    from tl_attnonly.components.literal_attention import LiteralAttention
    from tl_attnonly.components.moe_neuron_heads import GatedNeuronHeadExpert, NeuronHeadMoE
    from tl_attnonly.components.neuron_head_base import NeuronHeadBase
    from tl_attnonly.components.neuron_heads import NEURON_HEAD_HOOKS, NeuronHeadMLP

__all__ = [
    "ClampActiveWarning",
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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tl_attnonly.components' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
