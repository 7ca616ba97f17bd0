"""Moved to :mod:`tl_attnonly.literal.omega`; re-exported here so that old imports keep working."""

from tl_attnonly.literal.omega import *  # noqa: F403
from tl_attnonly.literal.omega import __all__  # noqa: F401
