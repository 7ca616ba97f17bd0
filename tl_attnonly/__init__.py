"""tl-attnonly: every MLP neuron of a TransformerLens model as an attention head.

After Huben & Morris (2023), "Attention-Only Transformers and Implementing MLPs with Attention
Heads", arXiv 2309.08593.

The public names below, and every public submodule (``tl_attnonly.hooks``, ``.analysis``,
``.vis``, ``.bridge``, ...), are imported on first use (PEP 562), so that ``import tl_attnonly``
and the command line's ``--help`` do not import torch or TransformerLens, and
``import tl_attnonly; tl_attnonly.hooks.attn_names_filter("pattern")`` works. ``convert`` is
bound now: it shares its name with the module ``tl_attnonly.convert``, which imports its
dependencies when called.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
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
    "AttnOnlyEncoder": "tl_attnonly.hooked.encoder",
    "convert_encoder": "tl_attnonly.hooked.encoder",
    "neuron_head_cache": "tl_attnonly.hooked.derived_cache",
    "dense_neuron_pattern": "tl_attnonly.hooks",
    "neuron_act_name": "tl_attnonly.hooks",
    "LiteralTransformer": "tl_attnonly.literal",
    "to_literal": "tl_attnonly.literal",
    "AttnOnlyTransformer": "tl_attnonly.hooked.model",
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
    from tl_attnonly.hooked.derived_cache import neuron_head_cache
    from tl_attnonly.hooked.encoder import AttnOnlyEncoder, convert_encoder
    from tl_attnonly.hooked.model import AttnOnlyTransformer
    from tl_attnonly.hooks import dense_neuron_pattern, neuron_act_name
    from tl_attnonly.literal import LiteralTransformer, to_literal
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
    "neuron_head_cache",
    "to_literal",
]


#: What an import error on TransformerLens 4.x names when it wants TL 3.x: ``HookedTransformer``,
#: ``HookedEncoder``, ``HookedTransformerConfig``, or a TL module 4.x removed.
_TL3_ONLY = ("Hooked", "transformer_lens")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(_import(module, name), name)
    elif _is_submodule(name):
        value = _import(f"tl_attnonly.{name}", name)
    else:
        raise AttributeError(f"module 'tl_attnonly' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def _is_submodule(name: str) -> bool:
    """Whether ``tl_attnonly.{name}`` is a public submodule (found without importing it)."""
    return (
        name.isidentifier()
        and not name.startswith("_")
        and importlib.util.find_spec(f"tl_attnonly.{name}") is not None
    )


def _import(module: str, name: str) -> Any:
    """``module``, imported; on TransformerLens 4.x an import that fails for want of
    ``HookedTransformer`` (or TL 3.x's other removed names and modules) fails naming the bridge
    route, and any other import error is raised as it is."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER, NO_HOOKED_TRANSFORMER

        if HAS_HOOKED_TRANSFORMER or not (error.name or "").startswith(_TL3_ONLY):
            raise
        raise ImportError(f"tl_attnonly.{name} {NO_HOOKED_TRANSFORMER}") from error


def __dir__() -> list[str]:
    submodules = {
        info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_")
    }
    return sorted(set(globals()) | set(_LAZY) | submodules)
