"""Moved to :mod:`tl_attnonly.literal.omega`; re-exported here so that old imports keep working."""

from tl_attnonly.literal.error_tables import omega_error_table
from tl_attnonly.literal.omega import *  # noqa: F403
from tl_attnonly.literal.omega import __all__ as _omega_all

__all__ = [*_omega_all, "omega_error_table"]
