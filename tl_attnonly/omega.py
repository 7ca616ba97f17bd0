"""Moved to :mod:`tl_attnonly.literal.omega`; re-exported here so that old imports keep working."""

from tl_attnonly.literal.omega import (
    COLUMNS,
    DEFAULT_DTYPES,
    DEFAULT_OMEGA,
    DEFAULT_OMEGAS,
    TYPICAL_SCORE_RANGE,
    error_table_markdown,
    max_masked_attention,
    omega_error_table,
    omega_requirement,
    omega_warnings,
    plot_omega_error,
)

__all__ = [
    "COLUMNS",
    "DEFAULT_DTYPES",
    "DEFAULT_OMEGA",
    "DEFAULT_OMEGAS",
    "TYPICAL_SCORE_RANGE",
    "error_table_markdown",
    "max_masked_attention",
    "omega_error_table",
    "omega_requirement",
    "omega_warnings",
    "plot_omega_error",
]
