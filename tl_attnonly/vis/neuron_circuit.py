"""A plotly figure of a neuron circuit: the circuit's heads, named neurons and their edges by layer.

The vertical axis is the residual stream's order (the embeddings at the bottom, then each layer's
attention and MLP, the logits on top); attention heads are circles, named neurons diamonds, an MLP
layer's remainder (its neurons not named, ``L{l}MLP``) an open diamond, the embeddings and logits
squares. Edges are the circuit's (:meth:`~tl_attnonly.analysis.Circuit.edges`, largest
``|score|`` first), coloured by the input they feed as in
:func:`~tl_attnonly.vis.circuit.circuit_figure` (gate edges dashed), three widths by ``|score|``.
Given :class:`~tl_attnonly.analysis.discovery.profiles.NeuronProfiles`, each neuron's hover text
holds its profile: gate/value split, firing fraction, top tokens, best context and, for a gated
neuron, its sign quadrants.
"""

from __future__ import annotations

import plotly.graph_objects as go

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
    NODE_STYLES,
    kind_layer,
    node_trace,
)

#: Marker symbol and colour of each node kind (``"rest"``: an MLP layer's remainder ``L{l}MLP``).
NEURON_CIRCUIT_NODES = {
    **NODE_STYLES,
    "rest": ("diamond-open", "#ff7f0e"),
}
_NODE_NAMES = {
    EMBED: "embeddings",
    "attn": "attention head",
    "neuron": "named neuron",
    "rest": "MLP remainder (neurons not named)",
    LOGITS: "logits",
}
#: Edge widths, by ``|score|`` relative to the largest drawn: below 1/3, below 2/3, above.
EDGE_WIDTHS = (1.0, 2.5, 4.5)


def node_kind(label: str) -> str:
    """``"embed"``, ``"attn"``, ``"neuron"``, ``"rest"`` (``L{l}MLP``) or ``"logits"``."""
    if label in (EMBED, LOGITS):
        return label
    kind, _ = kind_layer(label)
    return "rest" if label.endswith("MLP") else kind


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
) -> go.Figure:
    """Draw a circuit's heads and named neurons by layer (module docstring).

    Args:
        circuit: A :class:`~tl_attnonly.analysis.Circuit`, or the
            :class:`~tl_attnonly.analysis.discovery.profiles.NeuronProfiles` of one (its neurons'
            profiles go into their hover text).
        max_edges: Draw at most this many edges (largest ``|score|`` first).
        named_only: Draw only the edges into or out of a named neuron.
        title: Figure title; default states the counts and the faithfulness.

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
    n_layers = circuit.graph.n_layers
    labels = list(dict.fromkeys([EMBED, *edges.source, *edges.target, *named, LOGITS]))
    rows: dict[float, list[str]] = {}
    for label in labels:
        rows.setdefault(node_level(label, n_layers), []).append(label)
    pos = {}
    for level, members in rows.items():
        members.sort(key=lambda s: (node_kind(s) != "attn", len(s), s))
        for i, label in enumerate(members):
            pos[label] = (i - (len(members) - 1) / 2, level)
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
            for row in picked.itertuples():
                (x0, y0), (x1, y1) = pos[row.source], pos[row.target]
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
    for kind, (symbol, colour) in NEURON_CIRCUIT_NODES.items():
        members = [label for label in labels if node_kind(label) == kind]
        if not members:
            continue
        fig.add_trace(
            node_trace(
                [pos[m][0] for m in members],
                [pos[m][1] for m in members],
                members,
                symbol,
                colour,
                _NODE_NAMES[kind],
                [_hover(m, profiles) for m in members],
                customdata=members,
            )
        )
    levels = [-1.0] + [li + s for li in range(n_layers) for s in (0.0, 0.5)] + [float(n_layers)]
    level_text = ["embed"] + [t for li in range(n_layers) for t in (f"L{li} attn", f"L{li} MLP")]
    widest = max(len(m) for m in rows.values())
    fig.update_layout(
        title=title
        or (
            f"Neuron circuit: {len(named)} named neurons, "
            f"{sum(node_kind(x) == 'attn' for x in labels)} attention heads, {len(edges)} of "
            f"{len(circuit.edges())} edges drawn, faithfulness {circuit.faithfulness:.3f} "
            "(dashed: gate edges)"
        ),
        yaxis=dict(tickvals=levels, ticktext=[*level_text, "logits"], zeroline=False),
        xaxis=dict(visible=False),
        plot_bgcolor="white",
        height=max(450, 70 * (2 * n_layers + 2)),
        width=max(700, 60 * widest),
    )
    return fig


# NeuronProfiles.figure() draws with this (analysis/ imports nothing from vis/; vis/ plugs in).
register_profiles_figure_builder(neuron_circuit_figure)

__all__ = [
    "EDGE_WIDTHS",
    "NEURON_CIRCUIT_NODES",
    "neuron_circuit_figure",
    "node_kind",
    "node_level",
]
