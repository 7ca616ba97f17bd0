"""Deprecated: moved to :mod:`tl_attnonly.hooked.conversion_record`; importing this module warns.

Re-exports the moved names so that old imports keep working.
"""

import warnings

from tl_attnonly.hooked.conversion_record import (
    CHECKSUM_ALGORITHM,
    ERROR_ATOL,
    ERROR_RTOL,
    FORMAT_VERSION,
    SavedModelError,
    check_coefficients,
    checksums,
    coefficients_record,
    read_json,
    saved_coefficients,
    validate_record,
    verify_checksums,
    warn_unversioned,
)

warnings.warn(
    "tl_attnonly.conversion_record is deprecated: import from "
    "tl_attnonly.hooked.conversion_record.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "CHECKSUM_ALGORITHM",
    "ERROR_ATOL",
    "ERROR_RTOL",
    "FORMAT_VERSION",
    "SavedModelError",
    "check_coefficients",
    "checksums",
    "coefficients_record",
    "read_json",
    "saved_coefficients",
    "validate_record",
    "verify_checksums",
    "warn_unversioned",
]
