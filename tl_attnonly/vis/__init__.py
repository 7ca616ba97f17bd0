"""Views of neuron-heads: circuitsvis attention patterns and plotly figures.

Every function returns an object: a :class:`NeuronHeadView` (a circuitsvis
:class:`~circuitsvis.utils.render.RenderedHTML`, shown inline by Jupyter) or a
:class:`plotly.graph_objects.Figure`. :func:`save_figure` writes either to HTML (self-contained,
works offline) or PNG.

A neuron-head sees two keys: its own token and the *bias token*. The views draw the bias token as a
real first token, ``"<bias>"``, so a neuron-head's pattern looks like any attention pattern: each
query row puts ``sigmoid(q)`` on itself (the diagonal) and the rest on ``"<bias>"`` (column 0).
For a SiLU neuron, weight on self is ``sigmoid(pre)``: "attends to itself" means "the neuron
fires", "attends to the bias token" means "the neuron is off".

Modules: :mod:`~tl_attnonly.vis.patterns` (square patterns, head selection, circuitsvis views:
best for a few heads), :mod:`~tl_attnonly.vis.strips` (per-token (self, bias) strips: many heads
at a glance), :mod:`~tl_attnonly.vis.figures` (plotly figures), :mod:`~tl_attnonly.vis.circuit`
(circuits over attention heads and neuron-heads), :mod:`~tl_attnonly.vis.neuron_circuit` (a
circuit's heads and named neurons by layer, with their profiles),
:mod:`~tl_attnonly.vis.curves` (a circuit's faithfulness against its size),
:mod:`~tl_attnonly.vis.summaries` (dataset summaries) and :mod:`~tl_attnonly.vis.export`
(:func:`save_figure`, standalone HTML, text safe inside ``<script>``).

Example:
    >>> converted = tl_attnonly.convert(model)
    >>> neuron_head_attention_view(converted, layer=0, tokens="def f(x):", top_k=16)
    >>> logits, cache = converted.run_with_cache("def f(x):")
    >>> neuron_activity_heatmap(cache, layer=0, str_tokens=converted.to_str_tokens("def f(x):"))
"""

from tl_attnonly.vis.circuit import circuit_figure
from tl_attnonly.vis.curves import faithfulness_curve_figure
from tl_attnonly.vis.export import (
    circuitsvis_js,
    find_chromium,
    save_figure,
    script_safe,
    script_safe_json,
)
from tl_attnonly.vis.figures import (
    error_table_figure,
    expert_routing_heatmap,
    gelu_fit_error_figure,
    neuron_activity_heatmap,
    neuron_head_activation,
    omega_error_figure,
    patching_heatmap,
)
from tl_attnonly.vis.neuron_circuit import neuron_circuit_figure
from tl_attnonly.vis.patterns import (
    BIAS_TOKEN,
    DEFAULT_PAGE_SIZE,
    MAX_HEADS_PER_VIEW,
    RANK_BY,
    HeadSelection,
    HeadsLike,
    NeuronHeadView,
    TokensLike,
    circuitsvis_pattern_args,
    neuron_head_attention_view,
    neuron_head_scores,
    rank_neuron_heads,
    select_neuron_heads,
    square_neuron_pattern,
)
from tl_attnonly.vis.strips import neuron_head_strips
from tl_attnonly.vis.summaries import SummaryView, summary_html

__all__ = [
    "BIAS_TOKEN",
    "DEFAULT_PAGE_SIZE",
    "MAX_HEADS_PER_VIEW",
    "RANK_BY",
    "SummaryView",
    "HeadSelection",
    "HeadsLike",
    "NeuronHeadView",
    "TokensLike",
    "circuit_figure",
    "circuitsvis_pattern_args",
    "circuitsvis_js",
    "error_table_figure",
    "expert_routing_heatmap",
    "faithfulness_curve_figure",
    "find_chromium",
    "gelu_fit_error_figure",
    "neuron_activity_heatmap",
    "neuron_circuit_figure",
    "neuron_head_activation",
    "neuron_head_attention_view",
    "neuron_head_scores",
    "rank_neuron_heads",
    "neuron_head_strips",
    "omega_error_figure",
    "patching_heatmap",
    "save_figure",
    "script_safe",
    "script_safe_json",
    "select_neuron_heads",
    "square_neuron_pattern",
    "summary_html",
]
