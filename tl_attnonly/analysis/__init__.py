"""TransformerLens's analysis workflow over neuron-heads and attention heads together.

Four rooms, each one idea:

==============================  ==================================================================
:mod:`.cache`                   per-head results, residual decomposition, direct logit attribution
:mod:`.patching`                activation, output and path patching; attribution patching
:mod:`.discovery`               the head graph, edge scores, exact circuit runs, discover_circuit
:mod:`.circuits`                OV / QK / full circuits of neuron-heads
:mod:`.composition`             composition scores, streamed composition top-k
:mod:`.levels`                  top_k of labelled scores, neuron-level aggregation
:mod:`.ioi`                     IOI prompts, head roles (name mover, S-inhibition, ...)
:mod:`.sva`                     subject-verb agreement prompts (attractors), their metric
:mod:`.induction`               induction prompts: random tokens repeated, corrupted twins
:mod:`.summaries`               dataset-level neuron-head summaries (top contexts, firing, tokens)
:mod:`.discovery.profiles`      a circuit's named neurons: gate/value, top contexts, sign quadrants
==============================  ==================================================================

The derived cache (what ``run_with_cache`` derives rather than stores) lives beside the model, in
:mod:`tl_attnonly.hooked.derived_cache`.

Heads are labelled ``L{l}H{h}`` (attention heads, TransformerLens's style), ``L{l}N{i}`` or
``L{l}N{i}.{k}`` (neuron-heads, see :func:`tl_attnonly.hooks.neuron_head_label`). Wherever heads
are listed, attention heads of every layer come first, then neuron-heads
(:func:`tl_attnonly.hooks.all_head_refs`), as in TransformerLens's
``get_full_resid_decomposition``. Cache only what you analyse with the presets of
:mod:`tl_attnonly.hooks` (``decomposition_names_filter()``, ``head_names_filter("z")``, ...).
"""

from tl_attnonly.analysis.cache import (
    StackOptions,
    decompose_resid_heads,
    get_attn_head_results,
    get_neuron_head_results,
    head_logit_attrs,
    neuron_head_z,
    stack_all_head_results,
    stack_neuron_head_results,
)
from tl_attnonly.analysis.circuits import (
    bias_token_homogeneous,
    homogeneous,
    neuron_attn_scores_from_circuit,
    neuron_full_ov_circuit,
    neuron_full_qk_circuit,
    neuron_ov_circuit,
    neuron_qk_circuit,
)
from tl_attnonly.analysis.composition import (
    CompositionScores,
    composition_scores,
    composition_top_k,
)
from tl_attnonly.analysis.discovery import (
    MIB_FRACTIONS,
    Circuit,
    CircuitEvaluation,
    CurveScores,
    DiscoveryOptions,
    EdgeScores,
    HeadGraph,
    ModelInputs,
    NodeCircuit,
    NodeScores,
    PositionClasses,
    TopEdges,
    circuit_gate_value_split,
    circuit_metric,
    circuit_metrics,
    compare_rankings,
    discover_circuit,
    discover_node_circuit,
    edge_attribution_scores,
    evaluate_circuit,
    faithfulness,
    faithfulness_curve,
    logit_diff_metric,
    mask_size,
    node_attribution_scores,
    node_circuit_metrics,
    node_labels,
    pair_cosine_metric,
    path_gate_value_split,
    prune,
    score_curve,
    top_edges,
    top_nodes,
)
from tl_attnonly.analysis.discovery.profiles import (
    NeuronProfiles,
    named_neurons,
    neuron_profiles,
)
from tl_attnonly.analysis.experts import (
    ExpertNeuronHeadSummaries,
    expert_activation,
    get_act_patch_expert_neuron_heads,
    summarize_expert_neuron_heads,
)
from tl_attnonly.analysis.induction import (
    InductionDataset,
    induction_token_pool,
    make_induction_dataset,
)
from tl_attnonly.analysis.ioi import (
    IOIDataset,
    IOIHeadScores,
    IOIWords,
    ioi_head_scores,
    make_ioi_dataset,
)
from tl_attnonly.analysis.levels import (
    neuron_level,
    neuron_level_pairs,
    top_k,
)
from tl_attnonly.analysis.patching import (
    LOGITS,
    AttributionCheck,
    PatchingOptions,
    PatchUnit,
    Receiver,
    attribute_then_patch,
    attribution_patch,
    get_act_patch_all_heads,
    get_act_patch_neuron_heads,
    get_act_patch_outputs,
    neuron_head_patch_index,
    parse_receiver,
    patch_units,
    path_patch,
    path_patch_caches,
    path_patch_grid,
    path_patch_receiver_sweep,
    path_patch_sweep,
    pooled_cosine_metric,
    rank_agreement,
    receiver_label,
    run_patches,
)
from tl_attnonly.analysis.summaries import (
    NeuronHeadSummaries,
    SummaryOptions,
    stdlib_corpus,
    summarize_neuron_heads,
)
from tl_attnonly.analysis.sva import (
    SVA_TEMPLATES,
    SVA_TEMPLATES_HELDOUT,
    SVADataset,
    SVAWords,
    aligned_pairs,
    make_sva_dataset,
    sva_word_lists,
)

__all__ = [
    # cache
    "decompose_resid_heads",
    "get_attn_head_results",
    "get_neuron_head_results",
    "head_logit_attrs",
    "neuron_head_z",
    "stack_all_head_results",
    "stack_neuron_head_results",
    # patching
    "attribute_then_patch",
    "attribution_patch",
    "AttributionCheck",
    "get_act_patch_all_heads",
    "get_act_patch_neuron_heads",
    "get_act_patch_outputs",
    "LOGITS",
    "neuron_head_patch_index",
    "parse_receiver",
    "patch_units",
    "PatchingOptions",
    "StackOptions",
    "PatchUnit",
    "path_patch",
    "path_patch_caches",
    "path_patch_grid",
    "path_patch_receiver_sweep",
    "path_patch_sweep",
    "pooled_cosine_metric",
    "rank_agreement",
    "Receiver",
    "receiver_label",
    "run_patches",
    # discovery
    "Circuit",
    "CircuitEvaluation",
    "circuit_gate_value_split",
    "circuit_metric",
    "circuit_metrics",
    "compare_rankings",
    "CurveScores",
    "discover_circuit",
    "DiscoveryOptions",
    "discover_node_circuit",
    "edge_attribution_scores",
    "EdgeScores",
    "evaluate_circuit",
    "ExpertNeuronHeadSummaries",
    "faithfulness",
    "faithfulness_curve",
    "HeadGraph",
    "logit_diff_metric",
    "mask_size",
    "MIB_FRACTIONS",
    "ModelInputs",
    "node_attribution_scores",
    "node_circuit_metrics",
    "node_labels",
    "NodeCircuit",
    "NodeScores",
    "pair_cosine_metric",
    "path_gate_value_split",
    "PositionClasses",
    "prune",
    "score_curve",
    "top_edges",
    "top_nodes",
    "TopEdges",
    # circuits
    "bias_token_homogeneous",
    "composition_scores",
    "CompositionScores",
    "homogeneous",
    "neuron_attn_scores_from_circuit",
    "neuron_full_ov_circuit",
    "neuron_full_qk_circuit",
    "neuron_ov_circuit",
    "neuron_qk_circuit",
    "top_k",
    # levels
    "composition_top_k",
    "neuron_level",
    "neuron_level_pairs",
    # induction
    "InductionDataset",
    "induction_token_pool",
    "make_induction_dataset",
    # ioi
    "ioi_head_scores",
    "IOIDataset",
    "IOIWords",
    "IOIHeadScores",
    "make_ioi_dataset",
    # sva
    "aligned_pairs",
    "make_sva_dataset",
    "SVA_TEMPLATES",
    "SVA_TEMPLATES_HELDOUT",
    "SVADataset",
    "SVAWords",
    "sva_word_lists",
    # neuron profiles
    "named_neurons",
    "neuron_profiles",
    "expert_activation",
    "get_act_patch_expert_neuron_heads",
    "summarize_expert_neuron_heads",
    "NeuronProfiles",
    # summaries
    "NeuronHeadSummaries",
    "SummaryOptions",
    "stdlib_corpus",
    "summarize_neuron_heads",
]
