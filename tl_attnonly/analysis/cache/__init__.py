"""Cache views: per-head results and the residual stream decomposed into heads.

=======================  ======================================================================
:mod:`.views`            per-head results (attention heads and neuron-heads) from an ActivationCache
:mod:`.decomposition`    residual stream decomposition into heads, direct logit attribution
:mod:`.options`          StackOptions: how a stack is cut, scaled and bounded
=======================  ======================================================================
"""

from tl_attnonly.analysis.cache.decomposition import (
    decompose_resid_heads,
    head_logit_attrs,
    stack_all_head_results,
    stack_neuron_head_results,
)
from tl_attnonly.analysis.cache.options import StackOptions
from tl_attnonly.analysis.cache.views import (
    DEFAULT_CHUNK,
    STACK_BUDGET,
    get_attn_head_results,
    get_neuron_head_results,
    neuron_head_z,
)

__all__ = [
    "decompose_resid_heads",
    "DEFAULT_CHUNK",
    "get_attn_head_results",
    "get_neuron_head_results",
    "head_logit_attrs",
    "neuron_head_z",
    "stack_all_head_results",
    "STACK_BUDGET",
    "StackOptions",
    "stack_neuron_head_results",
]
