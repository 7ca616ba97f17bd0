"""Deprecated: moved to :mod:`tl_attnonly.cli.convert`; importing this module warns.

Re-exports the moved names so that old imports keep working.
"""

import warnings

from tl_attnonly.cli.convert import convert_cmd, verify_cmd

warnings.warn(
    "tl_attnonly.cli_convert is deprecated: import from tl_attnonly.cli.convert.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["convert_cmd", "verify_cmd"]
