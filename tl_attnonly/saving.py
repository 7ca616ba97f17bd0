"""Deprecated: moved to :mod:`tl_attnonly.hooked.saving`; importing this module warns.

Re-exports the moved names so that old imports keep working.
"""

import warnings

from tl_attnonly.hooked.saving import (
    CONFIG_FILE,
    CONVERSION_FILE,
    TOKENIZER_DIR,
    WEIGHTS_FILE,
    SavableModel,
    get_pending_coefficients,
    load_model,
    pending_coefficients,
    save_model,
)

warnings.warn(
    "tl_attnonly.saving is deprecated: import from tl_attnonly.hooked.saving.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "CONFIG_FILE",
    "CONVERSION_FILE",
    "SavableModel",
    "TOKENIZER_DIR",
    "WEIGHTS_FILE",
    "get_pending_coefficients",
    "load_model",
    "pending_coefficients",
    "save_model",
]
