"""Deprecated alias of :mod:`tl_attnonly.hooked.encoder` (importing it warns)."""

from tl_attnonly._deprecated import warn_moved
from tl_attnonly.hooked.encoder import *  # noqa: F403
from tl_attnonly.hooked.encoder import __all__ as __all__  # its public names

warn_moved(__name__, "tl_attnonly.hooked.encoder")
