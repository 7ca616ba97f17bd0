"""Deprecated: moved to :mod:`tl_attnonly.cli.demo`; importing this module warns.

Re-exports the moved names so that old imports keep working.
"""

import warnings

from tl_attnonly.cli.demo import DEMO_MODELS, SMOLLM2_PROMPT, demo

warnings.warn(
    "tl_attnonly.cli_demo is deprecated: import from tl_attnonly.cli.demo.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["DEMO_MODELS", "SMOLLM2_PROMPT", "demo"]
