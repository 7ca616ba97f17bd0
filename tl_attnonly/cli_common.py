"""Deprecated: moved to :mod:`tl_attnonly.cli.common`; importing this module warns.

Re-exports the moved names so that old imports keep working.
"""

import warnings

from tl_attnonly.cli.common import (
    CONVERSION_FILE,
    DEFAULT_PROMPT,
    EXIT_FAIL,
    EXIT_USAGE,
    HUB_TIMEOUT,
    LOCAL_MODELS,
    START,
    CommandError,
    Probes,
    has_hooked_transformer,
    hub_unreachable,
    print_table,
    print_verdicts,
)

warnings.warn(
    "tl_attnonly.cli_common is deprecated: import from tl_attnonly.cli.common.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "CONVERSION_FILE",
    "CommandError",
    "DEFAULT_PROMPT",
    "EXIT_FAIL",
    "EXIT_USAGE",
    "HUB_TIMEOUT",
    "LOCAL_MODELS",
    "Probes",
    "START",
    "has_hooked_transformer",
    "hub_unreachable",
    "print_table",
    "print_verdicts",
]
