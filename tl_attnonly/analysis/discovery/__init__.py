"""Circuit discovery over the graph of attention heads and neuron-heads.

=======================  ======================================================================
:mod:`.graph`            the unified graph: embeddings, attention heads, neuron-heads, logits
:mod:`.sites`            where each node of the graph reads and writes the residual stream
:mod:`.edge_scores`      edge attribution patching (EAP, EAP-IG) over that graph
:mod:`.eap_blocks`       the linear algebra of one block's EAP scores (writers, readers, rows)
:mod:`.scored_edges`     EdgeScores: every edge of a graph with its estimated effect
:mod:`.pruning`          top edges by rank (signed or |score|) to a circuit mask, no dangling edges
:mod:`.streaming`        top-n edges of graphs too large for dense scores, block by block
:mod:`.runs`             exact circuit runs (full or restricted graphs): circuit_metric
:mod:`.exact_run`        one circuit's exact run: hooks that rebuild each input from its edges
:mod:`.run_metrics`      circuit_metrics: several circuits' exact runs, batch by batch
:mod:`.run_reuse`        what exact runs share: each batch's corrupted run, first runs, kept runs
:mod:`.gate_value`       circuit_gate_value_split: a neuron's gate and value edges apart
:mod:`.circuit`          Circuit (a found circuit, its evidence and report), faithfulness
:mod:`.counts`           one vocabulary of counts for a circuit's report and figures
:mod:`.circuit_routing`  which experts a circuit's exact run routed each token to
:mod:`.evaluate`         evaluate_circuit: a found circuit's exact faithfulness on other prompts
:mod:`.node_circuits`    node-level circuits, for encoders too (pair-cosine metric)
:mod:`.relevance`        neuron relevance: RelP / attribution patching / EAP-IG, gate and value
:mod:`.circuit_neurons`  each neuron's attribution along its MLP node's circuit edges
:mod:`.options`          DiscoveryOptions: how discover_circuit searches
:mod:`.search`           discover_circuit: coarse graph, sweep to a faithfulness target, neurons
:mod:`.node_selection`   top_nodes, coarse_nodes, expand_mask, the node-patching baseline
:mod:`.naming`           the coarse circuit's MLP nodes split into named neurons and a remainder
:mod:`.sweep`            the sweep: exact runs of top-n circuits up to the faithfulness target
:mod:`.refine`           pruning by exact runs: the sweep's circuit less what it does not need
:mod:`.neuron_stage`     neurons_per_mlp="auto": named neurons per MLP node chosen by exact runs
:mod:`.scoring`          CPR / CMD side by side, MIB's areas, signed vs absolute ranking
=======================  ======================================================================
"""

from tl_attnonly.analysis.discovery.circuit_neurons import circuit_neuron_scores
from tl_attnonly.analysis.discovery.circuit_routing import circuit_experts_used
from tl_attnonly.analysis.discovery.edge_scores import (
    EdgeScores,
    check_discoverable,
    drop_dangling_edges,
    edge_attribution_scores,
    logit_diff_metric,
    mask_size,
    prune,
)
from tl_attnonly.analysis.discovery.evaluate import CircuitEvaluation, evaluate_circuit
from tl_attnonly.analysis.discovery.graph import (
    ATTN_INPUTS,
    EMBED,
    EXPERTS,
    LOGITS,
    MLP_REST,
    NEURON_INPUTS,
    HeadGraph,
    InputGroup,
    SourceGroup,
    edge_label,
    edges_frame,
    mlp_rest_label,
)
from tl_attnonly.analysis.discovery.node_circuits import (
    ModelInputs,
    NodeCircuit,
    NodeScores,
    discover_node_circuit,
    node_attribution_scores,
    node_circuit_metrics,
    node_labels,
    pair_cosine_metric,
)
from tl_attnonly.analysis.discovery.options import DiscoveryOptions
from tl_attnonly.analysis.discovery.positions import PositionClasses
from tl_attnonly.analysis.discovery.relevance import (
    RELEVANCE_RULES,
    neuron_relevance,
    relp_hooks,
)
from tl_attnonly.analysis.discovery.runs import (
    Circuit,
    circuit_gate_value_split,
    circuit_metric,
    circuit_metrics,
    faithfulness,
    path_gate_value_split,
)
from tl_attnonly.analysis.discovery.scoring import (
    MIB_FRACTIONS,
    CurveScores,
    compare_rankings,
    faithfulness_curve,
    score_curve,
)
from tl_attnonly.analysis.discovery.search import (
    coarse_nodes,
    discover_circuit,
    expand_mask,
    node_patching_metric,
    top_nodes,
)
from tl_attnonly.analysis.discovery.streaming import (
    TopEdges,
    top_edges,
)

__all__ = [
    "ATTN_INPUTS",
    "EXPERTS",
    "check_discoverable",
    "Circuit",
    "CircuitEvaluation",
    "circuit_experts_used",
    "circuit_gate_value_split",
    "circuit_metric",
    "circuit_metrics",
    "coarse_nodes",
    "compare_rankings",
    "CurveScores",
    "discover_circuit",
    "DiscoveryOptions",
    "expand_mask",
    "discover_node_circuit",
    "drop_dangling_edges",
    "edge_attribution_scores",
    "edge_label",
    "edges_frame",
    "EdgeScores",
    "EMBED",
    "evaluate_circuit",
    "faithfulness",
    "faithfulness_curve",
    "HeadGraph",
    "InputGroup",
    "logit_diff_metric",
    "LOGITS",
    "mask_size",
    "MIB_FRACTIONS",
    "MLP_REST",
    "mlp_rest_label",
    "ModelInputs",
    "NEURON_INPUTS",
    "circuit_neuron_scores",
    "neuron_relevance",
    "node_attribution_scores",
    "node_circuit_metrics",
    "node_patching_metric",
    "node_labels",
    "NodeCircuit",
    "NodeScores",
    "pair_cosine_metric",
    "path_gate_value_split",
    "PositionClasses",
    "prune",
    "RELEVANCE_RULES",
    "relp_hooks",
    "score_curve",
    "SourceGroup",
    "top_edges",
    "top_nodes",
    "TopEdges",
]
