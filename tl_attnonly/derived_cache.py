"""Deprecated: moved to :mod:`tl_attnonly.hooked.derived_cache`; importing this module warns.

Re-exports the moved names so that old imports keep working.
"""

import warnings

from tl_attnonly.hooked.derived_cache import (
    NEURON_TUPLE_KINDS,
    CacheBatchDimError,
    CacheRunOptions,
    DerivingDict,
    NeuronHeadActivationCache,
    Transform,
    as_names_filter,
    neuron_head_cache,
    run_with_derived_cache,
)

warnings.warn(
    "tl_attnonly.derived_cache is deprecated: import from tl_attnonly.hooked.derived_cache.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "NEURON_TUPLE_KINDS",
    "CacheBatchDimError",
    "CacheRunOptions",
    "DerivingDict",
    "NeuronHeadActivationCache",
    "Transform",
    "as_names_filter",
    "neuron_head_cache",
    "run_with_derived_cache",
]
