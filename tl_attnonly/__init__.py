"""tl-attnonly: every MLP neuron of a TransformerLens model as an attention head.

After Huben & Morris (2023), "Attention-Only Transformers and Implementing MLPs with Attention
Heads", arXiv 2309.08593.
"""

__version__ = "0.1.0"

from tl_attnonly.activations import (  # noqa: E402
    SUPPORTED_ACTIVATIONS,
    NeuronHeadCoefficients,
    activation_error_table,
    head_coefficients,
)
from tl_attnonly.components.gated_neuron_heads import GatedNeuronHeadMLP  # noqa: E402
from tl_attnonly.components.neuron_heads import NEURON_HEAD_HOOKS, NeuronHeadMLP  # noqa: E402
from tl_attnonly.convert import convert  # noqa: E402
from tl_attnonly.encoder import AttnOnlyEncoder, convert_encoder  # noqa: E402
from tl_attnonly.hooks import dense_neuron_pattern, neuron_act_name  # noqa: E402
from tl_attnonly.literal import LiteralTransformer, to_literal  # noqa: E402
from tl_attnonly.model import AttnOnlyTransformer  # noqa: E402
from tl_attnonly.options import ConversionOptions, LiteralOptions  # noqa: E402

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
