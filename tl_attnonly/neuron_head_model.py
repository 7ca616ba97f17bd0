"""Deprecated: moved to :mod:`tl_attnonly.hooked.neuron_head_model`; importing this module warns.

Re-exports the moved names so that old imports keep working.
"""

import warnings

from tl_attnonly.hooked.neuron_head_model import (
    CONFIG_FILE,
    CONVERSION_FILE,
    TOKENIZER_DIR,
    WEIGHTS_FILE,
    NeuronHeadModelMixin,
    pending_options,
    resolve_options,
)

warnings.warn(
    "tl_attnonly.neuron_head_model is deprecated: import from "
    "tl_attnonly.hooked.neuron_head_model.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "CONFIG_FILE",
    "CONVERSION_FILE",
    "TOKENIZER_DIR",
    "WEIGHTS_FILE",
    "NeuronHeadModelMixin",
    "pending_options",
    "resolve_options",
]
