"""Deprecated alias of :mod:`tl_attnonly.cli.common` (importing it warns)."""

from tl_attnonly._deprecated import warn_moved
from tl_attnonly.cli.common import *  # noqa: F403
from tl_attnonly.cli.common import __all__ as __all__  # its public names

warn_moved(__name__, "tl_attnonly.cli.common")
