"""Deprecated: moved to :mod:`tl_attnonly.hooked.encoder`; importing this module warns.

Re-exports the moved names so that old imports keep working.
"""

import warnings

from tl_attnonly.hooked.encoder import AttnOnlyEncoder, convert_encoder

warnings.warn(
    "tl_attnonly.encoder is deprecated: import from tl_attnonly.hooked.encoder.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["AttnOnlyEncoder", "convert_encoder"]
