"""Patching: activations, outputs, paths between heads, and attribution patching.

=====================  ======================================================================
:mod:`.activations`    activation patching of neuron-heads (one or many patches per pass)
:mod:`.outputs`        exact patching of head / neuron outputs, batched from the layer on
:mod:`.paths`          path patching between heads (IOI style)
:mod:`.sweeps`         path patching sweeps over senders or receivers, and grids
:mod:`.attribution`    attribution patching (gradient estimate for every head), then exact checks
:mod:`.options`        :class:`PatchingOptions`: batching, memory budget, progress, positions
:mod:`.resume`         internal: resume a forward pass from a layer, many patches per pass
=====================  ======================================================================
"""

from tl_attnonly.analysis.patching.activations import (
    PATTERN_KINDS,
    VECTOR_KINDS,
    PatchFn,
    get_act_patch_all_heads,
    get_act_patch_neuron_heads,
    neuron_head_patch_index,
    run_patches,
)
from tl_attnonly.analysis.patching.attribution import (
    ATTRIBUTION_KINDS,
    AttributionCheck,
    attribute_then_patch,
    attribution_patch,
    pooled_cosine_metric,
    rank_agreement,
)
from tl_attnonly.analysis.patching.options import PatchingOptions
from tl_attnonly.analysis.patching.outputs import (
    PatchUnit,
    get_act_patch_outputs,
    patch_units,
)
from tl_attnonly.analysis.patching.paths import (
    LOGITS,
    Receiver,
    parse_receiver,
    path_patch,
    path_patch_caches,
    receiver_label,
)
from tl_attnonly.analysis.patching.sweeps import (
    path_patch_grid,
    path_patch_receiver_sweep,
    path_patch_sweep,
)

__all__ = [
    "attribute_then_patch",
    "ATTRIBUTION_KINDS",
    "attribution_patch",
    "AttributionCheck",
    "get_act_patch_all_heads",
    "get_act_patch_neuron_heads",
    "get_act_patch_outputs",
    "LOGITS",
    "neuron_head_patch_index",
    "parse_receiver",
    "patch_units",
    "PatchFn",
    "PatchingOptions",
    "PatchUnit",
    "path_patch",
    "path_patch_caches",
    "path_patch_grid",
    "path_patch_receiver_sweep",
    "path_patch_sweep",
    "PATTERN_KINDS",
    "pooled_cosine_metric",
    "rank_agreement",
    "Receiver",
    "receiver_label",
    "run_patches",
    "VECTOR_KINDS",
]
