"""A plotly figure of a circuit over attention heads and neuron-heads.

Columns are the residual stream's order (embeddings, then each layer's attention heads and
neurons, then the logits). Attention heads are circles, neuron-heads diamonds; an edge's colour
says which input it feeds (q, k, v of an attention head; gate or value of a neuron-head; the
logits), gate edges are dashed, and its width grows with |score|. Neurons whose gate/value split
was computed carry it in their label (``g``: effect through the pattern alone, ``v``: through the
value alone).
"""

from __future__ import annotations

import re
from typing import Any

import plotly.graph_objects as go

from tl_attnonly.analysis.discovery.circuit import register_figure_builder
from tl_attnonly.analysis.discovery.graph import EMBED, LOGITS

#: Colour and dash of each input kind.
EDGE_STYLES = {
    "q": ("#2ca02c", "solid"),
    "k": ("#9467bd", "solid"),
    "v": ("#1f77b4", "solid"),
    "gate": ("#d62728", "dash"),
    "value": ("#ff7f0e", "solid"),
    "": ("#444444", "solid"),
}
#: Legend name of each input kind.
INPUT_NAMES = {
    "q": "attention q",
    "k": "attention k",
    "v": "attention v",
    "gate": "neuron gate (pattern)",
    "value": "neuron value",
    "": "logits",
}
NODE_STYLES = {
    EMBED: ("square", "#7f7f7f"),
    "attn": ("circle", "#1f77b4"),
    "neuron": ("diamond", "#ff7f0e"),
    LOGITS: ("square", "#7f7f7f"),
}


def _column(label: str, kind: str, layer: int, n_layers: int) -> int:
    if kind == EMBED:
        return 0
    if kind == LOGITS:
        return 2 * n_layers + 1
    return 2 * layer + (1 if kind == "attn" else 2)


def kind_layer(label: str) -> tuple[str, int]:
    """``(kind, layer)`` of a node label: ``("attn", l)`` for ``L{l}H{h}`` / ``L{l}KV{j}``,
    ``("neuron", l)`` for ``L{l}N{i}`` / ``L{l}MLP``, ``(label, -1)`` for the embeddings and
    logits."""
    if label in (EMBED, LOGITS):
        return label, -1
    match = re.match(r"^L(\d+)(H|KV|N|MLP)", label)
    if match is None:
        raise ValueError(f"Not a node label: {label!r}.")
    return ("neuron" if match.group(2) in ("N", "MLP") else "attn"), int(match.group(1))


def node_trace(
    x: list[float],
    y: list[float],
    text: list[str],
    symbol: str,
    colour: str,
    name: str,
    hovertext: list[str] | None = None,
    **extra: Any,
) -> go.Scatter:
    """One marker trace of circuit nodes, labelled above (the circuit figures' shared style).

    Args:
        x, y: Node positions.
        text: Labels drawn above the markers (and the hover text unless ``hovertext``).
        symbol, colour: Plotly marker symbol and colour.
        name: Legend entry.
        hovertext: Hover text per node; default ``text``.
        **extra: More ``go.Scatter`` properties (``customdata``, ...).
    """
    return go.Scatter(
        x=x,
        y=y,
        mode="markers+text",
        marker=dict(symbol=symbol, size=14, color=colour, line=dict(width=1, color="black")),
        text=text,
        textposition="top center",
        name=name,
        hovertext=text if hovertext is None else hovertext,
        hoverinfo="text",
        **extra,
    )


def circuit_figure(circuit: Any, max_edges: int = 150, title: str | None = None) -> go.Figure:
    """Draw a :class:`~tl_attnonly.analysis.discovery.edge_scores.Circuit`.

    Args:
        circuit: The circuit (its edges, scores and optional gate/value split).
        max_edges: Draw at most this many edges (largest |score| first).
        title: Figure title; default states the edge count and faithfulness.

    Returns:
        A plotly figure.
    """
    edges = circuit.edges().head(max_edges)
    n_layers = circuit.graph.n_layers
    labels = sorted(set(edges.source) | set(edges.target) | {EMBED, LOGITS})
    split = {}
    if circuit.gate_value is not None:
        split = {row.node: row for row in circuit.gate_value.itertuples()}
    columns: dict[int, list[str]] = {}
    kinds = {}
    for label in labels:
        kind, layer = kind_layer(label)
        kinds[label] = kind
        columns.setdefault(_column(label, kind, layer, n_layers), []).append(label)
    pos = {}
    for col, members in columns.items():
        members.sort(key=lambda s: (len(s), s))
        for i, label in enumerate(members):
            pos[label] = (col, (i + 1) / (len(members) + 1))
    fig = go.Figure()
    top = max(float(edges.score.abs().max()) if len(edges) else 1.0, 1e-12)
    shown = set()
    for row in edges.itertuples():
        (x0, y0), (x1, y1) = pos[row.source], pos[row.target]
        colour, dash = EDGE_STYLES[row.input]
        name = INPUT_NAMES[row.input]
        fig.add_trace(
            go.Scatter(
                x=[x0, x1],
                y=[y0, y1],
                mode="lines",
                line=dict(color=colour, dash=dash, width=0.5 + 5 * abs(row.score) / top),
                opacity=0.9 if row.score >= 0 else 0.45,
                name=name,
                legendgroup=name,
                showlegend=name not in shown,
                hovertext=f"{row.edge}: {row.score:.4g}",
                hoverinfo="text",
            )
        )
        shown.add(name)
    for kind, (symbol, colour) in NODE_STYLES.items():
        members = [label for label in labels if kinds[label] == kind]
        if not members:
            continue
        text = []
        for label in members:
            if label in split:
                s = split[label]
                text.append(f"{label}<br>g {s.gate:.3g} / v {s.value:.3g}")
            else:
                text.append(label)
        fig.add_trace(
            node_trace(
                [pos[m][0] for m in members],
                [pos[m][1] for m in members],
                text,
                symbol,
                colour,
                {"attn": "attention head", "neuron": "neuron-head"}.get(kind, kind),
            )
        )
    ticks = (
        [0] + [c for li in range(n_layers) for c in (2 * li + 1, 2 * li + 2)] + [2 * n_layers + 1]
    )
    tick_text = ["embed"] + [t for li in range(n_layers) for t in (f"L{li} attn", f"L{li} MLP")]
    fig.update_layout(
        title=title
        or (
            f"Circuit: {len(circuit.edges())} edges, faithfulness {circuit.faithfulness:.3f} "
            "(dashed: gate edges; width: |score|; faded: negative)"
        ),
        xaxis=dict(tickvals=ticks, ticktext=tick_text + ["logits"], showgrid=False, zeroline=False),
        yaxis=dict(visible=False),
        plot_bgcolor="white",
        height=500,
        width=max(600, 180 * (n_layers + 1)),
    )
    return fig


# Circuit.figure() draws with this (analysis/ imports nothing from vis/; vis/ plugs in here).
register_figure_builder(circuit_figure)

__all__ = [
    "EDGE_STYLES",
    "INPUT_NAMES",
    "NODE_STYLES",
    "circuit_figure",
    "kind_layer",
    "node_trace",
]
