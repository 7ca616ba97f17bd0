"""Deprecated: moved to :mod:`tl_attnonly.hooked.model`; importing this module warns.

Re-exports the moved names so that old imports keep working.
"""

import warnings

from tl_attnonly.hooked.model import AttnOnlyTransformer

warnings.warn(
    "tl_attnonly.model is deprecated: import from tl_attnonly.hooked.model.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["AttnOnlyTransformer"]
