"""tl-attnonly: every MLP neuron of a TransformerLens model as an attention head.

After Huben & Morris (2023), "Attention-Only Transformers and Implementing MLPs with Attention
Heads", arXiv 2309.08593.

The public names below are imported on first use (PEP 562), so that ``import tl_attnonly`` and
the command line's ``--help`` do not import torch or TransformerLens. ``convert`` is bound now:
it shares its name with the module ``tl_attnonly.convert``, which imports its dependencies when
called.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tl_attnonly._version import __version__
from tl_attnonly.convert import convert

#: Public name -> the module that defines it.
_LAZY = {
    "SUPPORTED_ACTIVATIONS": "tl_attnonly.activations",
    "NeuronHeadCoefficients": "tl_attnonly.activations",
    "activation_error_table": "tl_attnonly.activations",
    "head_coefficients": "tl_attnonly.activations",
    "NEURON_HEAD_HOOKS": "tl_attnonly.components.neuron_heads",
    "NeuronHeadMLP": "tl_attnonly.components.neuron_heads",
    "GatedNeuronHeadMLP": "tl_attnonly.components.gated_neuron_heads",
    "AttnOnlyEncoder": "tl_attnonly.encoder",
    "convert_encoder": "tl_attnonly.encoder",
    "dense_neuron_pattern": "tl_attnonly.hooks",
    "neuron_act_name": "tl_attnonly.hooks",
    "LiteralTransformer": "tl_attnonly.literal",
    "to_literal": "tl_attnonly.literal",
    "AttnOnlyTransformer": "tl_attnonly.model",
    "ConversionOptions": "tl_attnonly.options",
    "LiteralOptions": "tl_attnonly.options",
}

if TYPE_CHECKING:
    from tl_attnonly.activations import (
        SUPPORTED_ACTIVATIONS,
        NeuronHeadCoefficients,
        activation_error_table,
        head_coefficients,
    )
    from tl_attnonly.components.gated_neuron_heads import GatedNeuronHeadMLP
    from tl_attnonly.components.neuron_heads import NEURON_HEAD_HOOKS, NeuronHeadMLP
    from tl_attnonly.encoder import AttnOnlyEncoder, convert_encoder
    from tl_attnonly.hooks import dense_neuron_pattern, neuron_act_name
    from tl_attnonly.literal import LiteralTransformer, to_literal
    from tl_attnonly.model import AttnOnlyTransformer
    from tl_attnonly.options import ConversionOptions, LiteralOptions

__all__ = [
    "__version__",
    "AttnOnlyEncoder",
    "AttnOnlyTransformer",
    "ConversionOptions",
    "LiteralOptions",
    "GatedNeuronHeadMLP",
    "NEURON_HEAD_HOOKS",
    "NeuronHeadCoefficients",
    "NeuronHeadMLP",
    "SUPPORTED_ACTIVATIONS",
    "activation_error_table",
    "LiteralTransformer",
    "convert",
    "convert_encoder",
    "dense_neuron_pattern",
    "head_coefficients",
    "neuron_act_name",
    "to_literal",
]


def __getattr__(name: str) -> Any:
    if name == "bridge":  # the subpackage, so tl_attnonly.bridge.* works after import tl_attnonly
        return importlib.import_module("tl_attnonly.bridge")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tl_attnonly' has no attribute {name!r}")
    try:
        imported = importlib.import_module(module)
    except ImportError as error:
        from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER, NO_HOOKED_TRANSFORMER

        if HAS_HOOKED_TRANSFORMER:
            raise
        raise ImportError(f"tl_attnonly.{name} {NO_HOOKED_TRANSFORMER}") from error
    value = getattr(imported, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
