"""A plotly figure of a neuron circuit: the circuit's heads, named neurons and their edges by layer.

The vertical axis is the residual stream's order (the embeddings at the bottom, then each occupied
layer's attention and MLP, the logits on top; a run of layers with no node collapses into half a
row whose tick names them); attention heads are circles, key/value groups of grouped-query
attention (``L{l}KV{j}``) open circles, named neurons diamonds, an MLP layer's remainder (its
neurons not named, ``L{l}MLP``; the whole layer in a circuit that names no neuron, the default
call's) an open diamond, the embeddings and logits squares. MLP nodes are
drawn by what they carry (:func:`~tl_attnonly.vis.circuit.mlp_markers`: size by the ``|score|`` of
their edges out, faded by their group's share of the layer's effect where ``circuit.mlp_split``
measured it), so named neurons that carry little are small and faint. Edges are the circuit's
(:meth:`~tl_attnonly.analysis.Circuit.edges`, largest ``|score|`` first), coloured by the input
they feed as in :func:`~tl_attnonly.vis.circuit.circuit_figure` (gate edges dashed), three widths
by ``|score|``. The layout, labels placed without overlap and the title's counts are
:mod:`tl_attnonly.vis.circuit`'s (:func:`~tl_attnonly.vis.circuit.page_layout`,
:func:`~tl_attnonly.vis.circuit.place_labels`, :func:`~tl_attnonly.vis.circuit.circuit_counts`).
Given :class:`~tl_attnonly.analysis.discovery.profiles.NeuronProfiles`, each neuron's hover text
holds its profile: gate/value split, firing fraction, top tokens, best context and, for a gated
neuron, its sign quadrants. With ``atlas=`` each named neuron's and MLP layer node's label links to
its page in a neuron atlas (:mod:`tl_attnonly.vis.links`).
"""

from __future__ import annotations

import plotly.graph_objects as go

from tl_attnonly.analysis.discovery.atlas_links import AtlasLocation
from tl_attnonly.analysis.discovery.graph import EMBED, LOGITS
from tl_attnonly.analysis.discovery.profiles import (
    QUADRANTS,
    NeuronProfiles,
    named_neurons,
    register_profiles_figure_builder,
)
from tl_attnonly.analysis.discovery.runs import Circuit
from tl_attnonly.vis.circuit import (
    EDGE_STYLES,
    INPUT_NAMES,
    LABEL_FONT,
    LINE_HEIGHT,
    MAX_WIDTH,
    NODE_NAMES,
    NODE_RANK,
    NODE_SIZE,
    NODE_STYLES,
    circuit_counts,
    counts_text,
    kind_layer,
    mlp_carry,
    mlp_markers,
    node_trace,
    occupied_levels,
    page_layout,
    place_labels,
    reader_kind,
    text_size,
)
from tl_attnonly.vis.links import link_nodes, set_links

#: Marker symbol and colour of each node kind (``"rest"``: an MLP layer's remainder ``L{l}MLP``).
NEURON_CIRCUIT_NODES = {
    **NODE_STYLES,
    "rest": ("diamond-open", "#ff7f0e"),
}
_NODE_NAMES = {
    **NODE_NAMES,
    "neuron": "named neuron",
    "rest": "MLP remainder (neurons not named)",
    LOGITS: "logits",
}
#: The legend's name of ``L{l}MLP`` in a circuit that names no neuron (the default call's).
WHOLE_MLP_NAME = "MLP layer (whole; no neuron named)"
#: Edge widths, by ``|score|`` relative to the largest drawn: below 1/3, below 2/3, above.
EDGE_WIDTHS = (1.0, 2.5, 4.5)


def node_kind(label: str) -> str:
    """``"embed"``, ``"attn"``, ``"kv"`` (``L{l}KV{j}``), ``"latent"`` (``L{l}ATTN``),
    ``"expert"`` (``L{l}E{e}``, ``L{l}S``), ``"neuron"``, ``"rest"`` (``L{l}MLP``) or
    ``"logits"``."""
    if label in (EMBED, LOGITS):
        return label
    kind, _ = kind_layer(label)
    return "rest" if label.endswith("MLP") else reader_kind(label) or kind


def node_level(label: str, n_layers: int) -> float:
    """Where ``label`` sits on the layer axis: ``-1`` embeddings, ``l`` layer ``l``'s attention,
    ``l + 0.5`` its MLP, ``n_layers`` the logits."""
    if label == EMBED:
        return -1.0
    if label == LOGITS:
        return float(n_layers)
    kind, layer = kind_layer(label)
    return layer + (0.0 if kind == "attn" else 0.5)


def _hover(label: str, profiles: NeuronProfiles | None) -> str:
    if profiles is None or label not in set(profiles.table.neuron):
        return label
    row = profiles.row(label)
    lines = [
        f"<b>{label}</b>",
        f"gate {row.gate:.3g} / value {row.value:.3g} / both {row.both:.3g} "
        f"({row.gate_value_from})",
        f"fires at {100 * row.firing_fraction:.1f}% of positions; mean output "
        f"{row.mean_output:.3g}",
    ]
    if row.top_tokens:
        lines.append(f"top tokens: {row.top_tokens}")
    if row.top_contexts:
        lines.append(f"best context: {row.top_contexts.split(' | ')[0]}")
    if row.gated:
        lines.append(
            "quadrants (share of positions / of |output|): "
            + ", ".join(
                f"{q} {100 * row[f'share_{q}']:.0f}%/{100 * row[f'abs_share_{q}']:.0f}%"
                for q in QUADRANTS
            )
        )
    return "<br>".join(line.replace("\n", "↵") for line in lines)


def neuron_circuit_figure(
    circuit: Circuit | NeuronProfiles,
    *,
    max_edges: int = 200,
    named_only: bool = False,
    title: str | None = None,
    max_width: int = MAX_WIDTH,
    atlas: AtlasLocation | None = None,
) -> go.Figure:
    """Draw a circuit's heads and named neurons by layer (module docstring).

    Args:
        circuit: A :class:`~tl_attnonly.analysis.Circuit`, or the
            :class:`~tl_attnonly.analysis.discovery.profiles.NeuronProfiles` of one (its neurons'
            profiles go into their hover text).
        max_edges: Draw at most this many edges (largest ``|score|`` first).
        named_only: Draw only the edges into or out of a named neuron.
        title: Figure title; default states the counts
            (:func:`~tl_attnonly.vis.circuit.circuit_counts`) and the faithfulness.
        max_width: The figure's width at most (px); nodes of a level move closer to fit, and
            labels that then have no room are shown on hover only.
        atlas: Where a neuron atlas of the model is (a URL or relative path as a string, a folder
            as a ``Path``): each named neuron's label links to its page and each MLP layer
            node's (``L{l}MLP``) to its layer's, the hover names the page
            (:mod:`tl_attnonly.vis.links`; save with :func:`~tl_attnonly.vis.save_figure` for
            links that open from ``file://``).

    Returns:
        A plotly figure; its node traces are named after :data:`NEURON_CIRCUIT_NODES`'s kinds
        (``"attention head"``, ``"named neuron"``, ...), each point's ``customdata`` its label.

    Raises:
        TypeError: For anything but a circuit or its profiles.
    """
    profiles = circuit if isinstance(circuit, NeuronProfiles) else None
    if profiles is not None:
        circuit = profiles.circuit
    if not isinstance(circuit, Circuit):
        raise TypeError(
            f"neuron_circuit_figure draws a Circuit or its NeuronProfiles, got "
            f"{type(circuit).__name__}."
        )
    named = profiles.neurons if profiles is not None else named_neurons(circuit)
    edges = circuit.edges()
    if named_only:
        keep = set(named)
        edges = edges[edges.source.isin(keep) | edges.target.isin(keep)]
    edges = edges.head(max_edges)
    labels = list(dict.fromkeys([EMBED, *edges.source, *edges.target, *named, LOGITS]))
    levels = occupied_levels(labels, circuit.graph.n_layers)
    widest = max(len(m) for _, _, m in levels)
    col = max(text_size(n)[0] for n in labels) + NODE_SIZE
    col = max(16.0, min(col, (max_width - 140) / (widest + 1)))
    row = 2 * NODE_SIZE + 2 * LINE_HEIGHT * LABEL_FONT + 12
    plot_w, plot_h = (
        max(min(400.0, max_width - 140.0), (widest + 1) * col),
        (levels[-1][0] + 1) * row,
    )
    pos = {}
    for slot, _, members in levels:
        members.sort(key=lambda s: (node_kind(s) != "attn", len(s), s))
        for i, label in enumerate(members):
            pos[label] = (plot_w / 2 + (i - (len(members) - 1) / 2) * col, (slot + 0.5) * row)
    fig = go.Figure()
    top = max(float(edges.score.abs().max()) if len(edges) else 1.0, 1e-12)
    n_bins = len(EDGE_WIDTHS)
    bins = (edges.score.abs() / top * n_bins).astype(int).clip(upper=n_bins - 1)
    shown = set()
    for inp, (colour, dash) in EDGE_STYLES.items():
        for b, width in enumerate(EDGE_WIDTHS):
            picked = edges[(edges.input == inp) & (bins == b)]
            if picked.empty:
                continue
            xs: list[float | None] = []
            ys: list[float | None] = []
            for edge in picked.itertuples():
                (x0, y0), (x1, y1) = pos[edge.source], pos[edge.target]
                xs += [x0, x1, None]
                ys += [y0, y1, None]
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=ys,
                    mode="lines",
                    line=dict(color=colour, dash=dash, width=width),
                    name=INPUT_NAMES[inp],
                    legendgroup=INPUT_NAMES[inp],
                    showlegend=inp not in shown,
                    hoverinfo="skip",
                    meta=dict(input=inp, edges=list(picked.edge)),
                )
            )
            shown.add(inp)
    mlp = [n for n in labels if node_kind(n) in ("neuron", "rest")]
    marker = {n: (float(NODE_SIZE), 1.0, _hover(n, profiles)) for n in labels}
    for n, size, opacity, carry in zip(mlp, *mlp_markers(mlp, mlp_carry(circuit)), strict=True):
        marker[n] = (size, opacity, f"{marker[n][2]}<br>{carry}")
    rank = {**NODE_RANK, "rest": NODE_RANK["neuron"]}
    order = sorted(labels, key=lambda n: (rank[node_kind(n)], -marker[n][0], n))
    placed = dict(zip(order, place_labels(
        [(*pos[n], marker[n][0], [n]) for n in order], plot_w, plot_h
    ), strict=True))  # fmt: skip
    pages = link_nodes(placed, marker, atlas)
    names = _NODE_NAMES if named else {**_NODE_NAMES, "rest": WHOLE_MLP_NAME}
    for kind, (symbol, colour) in NEURON_CIRCUIT_NODES.items():
        members = [label for label in labels if node_kind(label) == kind]
        if not members:
            continue
        fig.add_trace(
            node_trace(
                [pos[m][0] for m in members], [pos[m][1] for m in members],
                [placed[m][0] for m in members], symbol, colour, names[kind],
                [marker[m][2] for m in members], customdata=members,
                textposition=[placed[m][1] for m in members],
                size=[marker[m][0] for m in members], opacity=[marker[m][1] for m in members],
            )
        )  # fmt: skip
    n_all = len(circuit.edges())
    default = (
        f"Neuron circuit: {counts_text(circuit_counts(circuit))}"
        + ("" if len(edges) == n_all else f" ({len(edges)} drawn)")
        + f"; faithfulness {circuit.faithfulness:.3f} (dashed: gate edges; MLP nodes sized by "
        "|score| out, faded by their share of the layer's effect)"
    )
    ticks = [((slot + 0.5) * row, text) for slot, text, _ in levels]
    hidden = sum(not placed[n][0] for n in labels)
    fig = page_layout(fig, title or default, (plot_w, plot_h), ticks, "y", hidden)
    return set_links(fig, pages)


# NeuronProfiles.figure() draws with this (analysis/ imports nothing from vis/; vis/ plugs in).
register_profiles_figure_builder(neuron_circuit_figure)

__all__ = [
    "EDGE_WIDTHS",
    "NEURON_CIRCUIT_NODES",
    "WHOLE_MLP_NAME",
    "neuron_circuit_figure",
    "node_kind",
    "node_level",
]
