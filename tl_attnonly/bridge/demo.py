"""Deprecated: moved to :mod:`tl_attnonly.cli.bridge_demo`; importing this module warns.

The bridge demo uses the tools (verify, report, vis), which sit above the bridge form, so it lives
with the command line. Its names are looked up there on first use (PEP 562), so that the bridge
package imports nothing from above it.
"""

import importlib
from typing import Any

from tl_attnonly._deprecated import warn_moved

#: Where the names now live.
_NEW = "tl_attnonly.cli.bridge_demo"

warn_moved(__name__, _NEW)

#: Defined in :mod:`tl_attnonly.cli.bridge_demo`, reached through ``__getattr__``.
__all__ = [  # noqa: F822 - the names are looked up lazily, below
    "REPORT_TOP_K",
    "self_weight_figure",
    "verify_bridge_conversion",
    "write_bridge_report",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(_NEW), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
