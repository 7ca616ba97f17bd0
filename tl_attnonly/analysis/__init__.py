"""TransformerLens's analysis workflow over neuron-heads and attention heads together.

==========================  ======================================================================
:mod:`.cache`               per-head results, residual decomposition, direct logit attribution
:mod:`.patching`            activation patching of neuron-heads (one or many patches per pass)
:mod:`.output_patching`     exact patching of head / neuron outputs, batched from the layer on
:mod:`.path_patching`       path patching between heads (IOI style)
:mod:`.attribution`         attribution patching (gradient estimate for every head)
:mod:`.circuits`            OV / QK / full circuits of neuron-heads, composition scores, top-k
:mod:`.graph`               the unified graph: embeddings, attention heads, neuron-heads, logits
:mod:`.discovery`           edge attribution patching over that graph, pruning
:mod:`.circuit_runs`        exact circuit runs (full or restricted graphs), faithfulness, gate/value
:mod:`.circuit_search`      discover_circuit: score, prune, check; two stages for large models
:mod:`.streaming`           top-n edges of graphs too large for dense scores, block by block
:mod:`.node_circuits`       node-level circuits for encoders too (pair-cosine metric), gate/value
:mod:`.summaries`           dataset-level neuron-head summaries (top contexts, firing, tokens)
:mod:`.ioi`                 IOI prompts, head roles (name mover, S-inhibition, ...) from patterns
==========================  ======================================================================

Heads are labelled ``L{l}H{h}`` (attention heads, TransformerLens's style), ``L{l}N{i}`` or
``L{l}N{i}.{k}`` (neuron-heads, see :func:`tl_attnonly.hooks.neuron_head_label`). Wherever heads
are listed, attention heads of every layer come first, then neuron-heads
(:func:`tl_attnonly.hooks.all_head_refs`), as in TransformerLens's
``get_full_resid_decomposition``. Cache only what you analyse with the presets of
:mod:`tl_attnonly.hooks` (``decomposition_names_filter()``, ``head_names_filter("z")``, ...).
"""

from tl_attnonly.analysis.attribution import (
    AttributionCheck,
    attribute_then_patch,
    attribution_patch,
    pooled_cosine_metric,
    rank_agreement,
)
from tl_attnonly.analysis.cache import (
    get_attn_head_results,
    get_neuron_head_results,
    neuron_head_z,
)
from tl_attnonly.analysis.circuit_runs import (
    Circuit,
    circuit_gate_value_split,
    circuit_metric,
    circuit_metrics,
    faithfulness,
    path_gate_value_split,
)
from tl_attnonly.analysis.circuit_search import discover_circuit, top_nodes
from tl_attnonly.analysis.circuits import (
    CompositionScores,
    bias_token_homogeneous,
    composition_scores,
    homogeneous,
    neuron_attn_scores_from_circuit,
    neuron_full_ov_circuit,
    neuron_full_qk_circuit,
    neuron_ov_circuit,
    neuron_qk_circuit,
    top_k,
)
from tl_attnonly.analysis.decomposition import (
    decompose_resid_heads,
    head_logit_attrs,
    stack_all_head_results,
    stack_neuron_head_results,
)
from tl_attnonly.analysis.discovery import (
    EdgeScores,
    edge_attribution_scores,
    logit_diff_metric,
    mask_size,
    prune,
)
from tl_attnonly.analysis.graph import HeadGraph
from tl_attnonly.analysis.ioi import (
    IOIDataset,
    IOIHeadScores,
    ioi_head_scores,
    make_ioi_dataset,
)
from tl_attnonly.analysis.output_patching import (
    PatchUnit,
    get_act_patch_outputs,
    patch_units,
)
from tl_attnonly.analysis.patching import (
    get_act_patch_all_heads,
    get_act_patch_neuron_heads,
    neuron_head_patch_index,
    run_patches,
)
from tl_attnonly.analysis.path_patching import (
    LOGITS,
    Receiver,
    parse_receiver,
    path_patch,
    path_patch_caches,
    path_patch_grid,
    path_patch_receiver_sweep,
    path_patch_sweep,
    receiver_label,
)
from tl_attnonly.analysis.ranking import composition_top_k, neuron_level, neuron_level_pairs
from tl_attnonly.analysis.streaming import TopEdges, top_edges
from tl_attnonly.analysis.summaries import (
    NeuronHeadSummaries,
    stdlib_corpus,
    summarize_neuron_heads,
)

__all__ = [
    "path_patch_grid",
    "path_patch_receiver_sweep",
    "receiver_label",
    "AttributionCheck",
    "attribute_then_patch",
    "PatchUnit",
    "get_act_patch_outputs",
    "patch_units",
    "IOIDataset",
    "IOIHeadScores",
    "ioi_head_scores",
    "make_ioi_dataset",
    "composition_top_k",
    "neuron_level",
    "neuron_level_pairs",
    "Circuit",
    "EdgeScores",
    "HeadGraph",
    "NeuronHeadSummaries",
    "circuit_gate_value_split",
    "circuit_metric",
    "circuit_metrics",
    "discover_circuit",
    "edge_attribution_scores",
    "faithfulness",
    "logit_diff_metric",
    "mask_size",
    "path_gate_value_split",
    "prune",
    "TopEdges",
    "top_edges",
    "top_nodes",
    "LOGITS",
    "CompositionScores",
    "Receiver",
    "attribution_patch",
    "bias_token_homogeneous",
    "composition_scores",
    "decompose_resid_heads",
    "get_act_patch_all_heads",
    "get_act_patch_neuron_heads",
    "get_attn_head_results",
    "get_neuron_head_results",
    "head_logit_attrs",
    "homogeneous",
    "neuron_attn_scores_from_circuit",
    "neuron_full_ov_circuit",
    "neuron_full_qk_circuit",
    "neuron_head_patch_index",
    "neuron_head_z",
    "neuron_ov_circuit",
    "neuron_qk_circuit",
    "parse_receiver",
    "path_patch",
    "path_patch_caches",
    "path_patch_sweep",
    "pooled_cosine_metric",
    "rank_agreement",
    "run_patches",
    "stack_all_head_results",
    "stack_neuron_head_results",
    "stdlib_corpus",
    "summarize_neuron_heads",
    "top_k",
]
