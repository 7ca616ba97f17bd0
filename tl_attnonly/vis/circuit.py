"""A plotly figure of a circuit over attention heads and neuron-heads, and the page layout that
both circuit figures share.

Columns are the residual stream's order (embeddings, then each layer's attention heads and MLP
nodes, then the logits); only occupied levels are drawn: a run of layers with no node of the
circuit collapses into half a column whose tick names the layers (``L1–16 empty``). Attention
heads are circles, key/value groups of grouped-query attention (``L{l}KV{j}``: the k and v
inputs that several query heads share) open circles, neuron-heads diamonds sized by what they
carry (the ``|score|`` of their circuit edges out) and, where the circuit measured it
(``circuit.mlp_split``), faded by the share of their layer's effect that the named neurons (or
the remainder) carry. An edge's colour says which input it feeds (q, k, v of an attention head;
gate or value of a neuron-head; the logits), gate edges are dashed, and its width grows with
``|score|``. Neurons whose gate/value split was computed carry it in their label where there is
room (``g``: effect through the pattern alone, ``v``: through the value alone).

The layout is in pixels (the axes span the plot area's pixels), so labels are placed where no two
label boxes (estimated from character count and font size: :func:`label_box`) intersect and none
covers a marker (:func:`place_labels`); a label with no room is shown on hover only, and the title
says how many. The title's counts are :func:`circuit_counts`'s. With ``atlas=`` each MLP node's
label links to its page in a neuron atlas (:mod:`tl_attnonly.vis.links`).
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

import plotly.graph_objects as go

from tl_attnonly.analysis.discovery.atlas_links import AtlasLocation
from tl_attnonly.analysis.discovery.circuit import register_figure_builder
from tl_attnonly.analysis.discovery.counts import (
    circuit_counts,
    counts_text,
    kind_layer,
    reader_kind,
)
from tl_attnonly.analysis.discovery.graph import EMBED, LOGITS
from tl_attnonly.vis.links import link_nodes, set_links

#: Colour and dash of each input kind.
EDGE_STYLES = {
    "q": ("#2ca02c", "solid"),
    "k": ("#9467bd", "solid"),
    "v": ("#1f77b4", "solid"),
    "gate": ("#d62728", "dash"),
    "value": ("#ff7f0e", "solid"),
    "qkv": ("#17becf", "solid"),
    "": ("#444444", "solid"),
}
#: Legend name of each input kind.
INPUT_NAMES = {
    "q": "attention q",
    "k": "attention k",
    "v": "attention v",
    "gate": "neuron gate (pattern)",
    "value": "neuron value",
    "qkv": "latent attention input (q, k, v)",
    "": "logits",
}
NODE_STYLES = {
    EMBED: ("square", "#7f7f7f"),
    "attn": ("circle", "#1f77b4"),
    "kv": ("circle-open", "#1f77b4"),
    "latent": ("square-open", "#1f77b4"),
    "expert": ("hexagon", "#ff7f0e"),
    "neuron": ("diamond", "#ff7f0e"),
    LOGITS: ("square", "#7f7f7f"),
}
#: Legend name of each node kind (``"kv"``: a key/value group of grouped-query attention).
NODE_NAMES = {
    EMBED: "embeddings",
    "attn": "attention head",
    "kv": "key/value group (GQA: k, v shared by query heads)",
    "latent": "latent attention input (MLA: read by every head)",
    "expert": "expert (its weighted output)",
    "neuron": "neuron-head",
    LOGITS: "logits",
}
#: Which node kinds' labels are placed first (lower first): ends, heads, other attention
#: readers, MLP nodes.
NODE_RANK = {EMBED: 0, LOGITS: 0, "attn": 1, "kv": 2, "latent": 2, "expert": 3, "neuron": 3}
#: Page width (px) the circuit figures fit by default.
MAX_WIDTH = 1600
#: Node labels' font size (px); :func:`text_size` estimates their boxes from it.
LABEL_FONT = 11
#: Title font size (px).
TITLE_FONT = 15
#: Estimated glyph width and line height, in units of the font size (generous for plotly's fonts).
CHAR_WIDTH, LINE_HEIGHT = 0.7, 1.3
#: Marker size (px) of a node; MLP nodes range from ``NODE_SIZE / 2`` to ``1.5 * NODE_SIZE``.
NODE_SIZE = 14
#: Where a label may sit around its marker, tried in this order.
LABEL_POSITIONS = ("top center", "bottom center", "middle right", "middle left")
_GAP = 3.0  # px between a marker and its label
_TITLE_Y = 32  # px from the top to the title: below plotly's mode bar (about 25 px)
_TAG = re.compile(r"<[^>]+>")


def text_size(text: str, font: float = LABEL_FONT) -> tuple[float, float]:
    """Estimated ``(width, height)`` in px of a label (``<br>`` breaks lines, tags take no room)."""
    lines = text.split("<br>")
    width = max(len(_TAG.sub("", line)) for line in lines) * CHAR_WIDTH * font
    return width, len(lines) * LINE_HEIGHT * font


def label_box(
    x: float, y: float, text: str, position: str, marker: float = NODE_SIZE
) -> tuple[float, float, float, float]:
    """``(x0, y0, x1, y1)``, in px with y up, of ``text`` drawn at ``position`` (one of
    :data:`LABEL_POSITIONS`) around a marker of size ``marker`` at ``(x, y)``."""
    w, h = text_size(text)
    r = marker / 2 + _GAP
    vertical, horizontal = position.split()
    y0 = {"top": y + r, "bottom": y - r - h, "middle": y - h / 2}[vertical]
    x0 = {"center": x - w / 2, "right": x + r, "left": x - r - w}[horizontal]
    return x0, y0, x0 + w, y0 + h


def boxes_overlap(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two ``(x0, y0, x1, y1)`` boxes intersect (touching is not intersecting)."""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def place_labels(
    nodes: Sequence[tuple[float, float, float, Sequence[str]]], width: float, height: float
) -> list[tuple[str, str]]:
    """Greedy label placement: each node ``(x, y, marker size, texts)``, in the given order (most
    important first), gets the first of its ``texts`` (longest first) at the first of
    :data:`LABEL_POSITIONS` whose :func:`label_box` stays inside ``[0, width] x [0, height]`` and
    meets no label placed before nor any other marker; ``("", "top center")`` (hover only) if none.
    """
    markers = [(x - s / 2, y - s / 2, x + s / 2, y + s / 2) for x, y, s, _ in nodes]
    placed: list[tuple[float, float, float, float]] = []
    out = []
    for i, (x, y, size, texts) in enumerate(nodes):
        choice = ("", "top center")
        for text in texts:
            for position in LABEL_POSITIONS:
                box = label_box(x, y, text, position, size)
                if (
                    box[0] < 0 or box[1] < 0 or box[2] > width or box[3] > height
                    or any(boxes_overlap(box, other) for other in placed)
                    or any(boxes_overlap(box, m) for j, m in enumerate(markers) if j != i)
                ):  # fmt: skip
                    continue
                choice = (text, position)
                placed.append(box)
                break
            if choice[0]:
                break
        out.append(choice)
    return out


def occupied_levels(labels: Iterable[str], n_layers: int) -> list[tuple[float, str, list[str]]]:
    """The levels a circuit figure draws along the residual stream: ``(slot, tick text, labels)``
    of the embeddings, each layer's attention then MLP level holding a label, and the logits, in
    order, one slot apart; a run of layers with none takes half a slot between its neighbours,
    as ``(slot, "L{a}–{b}<br>empty", [])``."""
    groups: dict[tuple[int, int], list[str]] = {}
    for label in labels:
        kind, layer = kind_layer(label)
        layer = n_layers if kind == LOGITS else layer
        groups.setdefault((layer, int(kind in ("neuron", LOGITS))), []).append(label)
    out: list[tuple[float, str, list[str]]] = []
    slot, previous = -1.0, -1
    for layer, sub in sorted(groups):
        if layer - previous > 1:  # layers previous + 1 .. layer - 1 hold nothing
            a, b = previous + 1, layer - 1
            out.append((slot + 0.75, (f"L{a}" if a == b else f"L{a}–{b}") + "<br>empty", []))
            slot += 0.5
        slot += 1.0
        previous = layer
        members = groups[(layer, sub)]
        kind = kind_layer(members[0])[0]
        text = kind if kind in (EMBED, LOGITS) else f"L{layer}<br>{'MLP' if sub else 'attn'}"
        out.append((slot, text, members))
    return out


def mlp_carry(circuit: Any) -> tuple[dict[str, float], dict[str, float]]:
    """What each MLP node carries: ``(score, share)``. ``score``: the sum of ``|score|`` of its
    circuit edges out; ``share``: where ``circuit.mlp_split`` measured its layer, the share of
    the layer's effect (``layer_effect``) that its group carries (``named_effect`` for a named
    neuron, ``rest_effect`` for the remainder ``L{l}MLP``), clipped to ``[0, 1]``."""
    frame = circuit.edges()
    score: dict[str, float] = {}
    for source, value in zip(frame.source, frame.score.abs(), strict=True):
        if source != EMBED and kind_layer(source)[0] == "neuron":
            score[source] = score.get(source, 0.0) + float(value)
    share: dict[str, float] = {}
    split = getattr(circuit, "mlp_split", None)
    for row in () if split is None else split.itertuples():
        if not math.isfinite(row.layer_effect) or row.layer_effect == 0:
            continue
        for labels, effect in ((str(row.named).split(", "), row.named_effect),
                               ([row.node], row.rest_effect)):  # fmt: skip
            for label in filter(None, labels):
                share[label] = min(max(effect / row.layer_effect, 0.0), 1.0)
    return score, share


def mlp_markers(labels: Sequence[str], carry: tuple[dict[str, float], dict[str, float]]) -> tuple[
    list[float], list[float], list[str]
]:  # fmt: skip
    """Marker sizes, opacities and hover lines of MLP nodes by what they carry
    (:func:`mlp_carry`): size by the square root of ``score`` relative to the largest, opacity
    ``0.25 + 0.75 * share`` (1 where not measured)."""
    score, share = carry
    top = max([score.get(n, 0.0) for n in labels] + [1e-12])
    sizes, opacities, hover = [], [], []
    for n in labels:
        sizes.append(NODE_SIZE * (0.5 + math.sqrt(score.get(n, 0.0) / top)))
        opacities.append(0.25 + 0.75 * share[n] if n in share else 1.0)
        line = f"|score| of its circuit edges out: {score.get(n, 0.0):.3g}"
        if n in share:
            line += f"; its group carries {100 * share[n]:.0f}% of the layer's effect"
        hover.append(line)
    return sizes, opacities, hover


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
        **extra: More ``go.Scatter`` properties (``customdata``, ``textposition``, ...); ``size``
            and ``opacity`` (a number or one per node) go to the marker.
    """
    size, opacity = extra.pop("size", NODE_SIZE), extra.pop("opacity", 1.0)
    return go.Scatter(
        x=x,
        y=y,
        mode="markers+text",
        marker=dict(
            symbol=symbol,
            size=size,
            opacity=opacity,
            color=colour,
            line=dict(width=1, color="black" if "open" not in symbol else colour),
        ),  # fmt: skip
        text=text,
        textposition=extra.pop("textposition", "top center"),
        textfont=dict(size=LABEL_FONT),
        name=name,
        hovertext=text if hovertext is None else hovertext,
        hoverinfo="text",
        **extra,
    )


def page_layout(
    fig: go.Figure,
    title: str,
    plot: tuple[float, float],
    ticks: list[tuple[float, str]],
    axis: str,
    n_hidden: int,
) -> go.Figure:
    """Size ``fig`` to its plot area ``plot = (width, height)`` px (the axes span its pixels) plus
    margins that hold the title (wrapped to the width), the level ticks ``(px, text)`` on
    ``axis`` (``"x"`` or ``"y"``) and a horizontal legend below; the title says how many labels
    (``n_hidden``) are shown on hover only."""
    plot_w, plot_h = math.ceil(plot[0]), math.ceil(plot[1])  # whole pixels: 1 px per unit
    texts = [t if axis == "x" else t.replace("<br>", " ") for _, t in ticks]
    left = 16 + math.ceil(max(text_size(t)[0] for t in texts) if axis == "y" else 24)
    right = 24
    width = left + plot_w + right
    per_line = max(12, int((width - 40) / (CHAR_WIDTH * TITLE_FONT)))
    lines = textwrap.wrap(title, per_line)
    if n_hidden:
        note = f"{n_hidden} labels on hover only (no room)"
        lines += [f"<sup>{line}</sup>" for line in textwrap.wrap(note, per_line)]
    top = _TITLE_Y + 12 + math.ceil(len(lines) * LINE_HEIGHT * TITLE_FONT)
    names = [t.name for t in fig.data if t.showlegend is not False and t.name]
    rows, used = 1, 0.0
    for name in dict.fromkeys(names):
        item = len(name) * CHAR_WIDTH * LABEL_FONT + 50
        if used + item > width - 20 and used:
            rows, used = rows + 1, 0.0
        used += item
    tick_h = math.ceil(2 * LINE_HEIGHT * LABEL_FONT) + 12 if axis == "x" else 8
    bottom = tick_h + rows * 24 + 12
    height = top + plot_h + bottom
    level_axis = dict(
        tickvals=[p for p, _ in ticks], ticktext=texts, showgrid=False, zeroline=False,
        tickfont=dict(size=LABEL_FONT), range=[0, plot_w if axis == "x" else plot_h],
    )  # fmt: skip
    other_axis = dict(visible=False, range=[0, plot_h if axis == "x" else plot_w])
    fig.update_layout(
        title=dict(
            text="<br>".join(lines),
            x=0.5,
            xanchor="center",
            xref="container",
            y=1 - _TITLE_Y / height,
            yanchor="top",
            yref="container",
            font=dict(size=TITLE_FONT),
        ),  # fmt: skip
        xaxis=level_axis if axis == "x" else other_axis,
        yaxis=other_axis if axis == "x" else level_axis,
        legend=dict(
            orientation="h",
            x=0,
            xanchor="left",
            y=-tick_h / plot_h,
            yanchor="top",
            font=dict(size=LABEL_FONT),
        ),  # fmt: skip
        margin=dict(l=left, r=right, t=top, b=bottom, autoexpand=False),
        plot_bgcolor="white",
        width=width,
        height=height,
        meta=dict(hidden_labels=n_hidden),
    )
    return fig


def circuit_figure(
    circuit: Any,
    max_edges: int = 150,
    title: str | None = None,
    max_width: int = MAX_WIDTH,
    atlas: AtlasLocation | None = None,
) -> go.Figure:
    """Draw a :class:`~tl_attnonly.analysis.Circuit` (module docstring).

    Args:
        circuit: The circuit (its edges, scores and optional gate/value split).
        max_edges: Draw at most this many edges (largest |score| first).
        title: Figure title; default states the counts (:func:`circuit_counts`) and faithfulness.
        max_width: The figure's width at most (px); columns narrow to fit, and labels that then
            have no room are shown on hover only.
        atlas: Where a neuron atlas of the model is (a URL or relative path as a string, a folder
            as a ``Path``): each named neuron's label links to its page and each MLP layer
            node's to its layer's, the hover names the page (:mod:`tl_attnonly.vis.links`; save
            with :func:`~tl_attnonly.vis.save_figure` for links that open from ``file://``).

    Returns:
        A plotly figure, ``max_width`` px wide at most; its axes span the plot area's pixels.
    """
    edges = circuit.edges().head(max_edges)
    labels = sorted(set(edges.source) | set(edges.target) | {EMBED, LOGITS})
    split = {}
    if circuit.gate_value is not None:
        split = {row.node: row for row in circuit.gate_value.itertuples()}
    levels = occupied_levels(labels, circuit.graph.n_layers)
    span = levels[-1][0] + 1
    col = max(12.0, min(120.0, (max_width - 90) / span))
    row = NODE_SIZE * 2.2 + (2 if split else 1) * LINE_HEIGHT * LABEL_FONT
    plot_h = max(240.0, (max(len(m) for _, _, m in levels) + 1) * row)
    pos = {}
    for slot, _, members in levels:
        members.sort(key=lambda s: (reader_kind(s) is not None, len(s), s))
        for i, label in enumerate(members):
            pos[label] = ((slot + 0.5) * col, plot_h / 2 + ((len(members) - 1) / 2 - i) * row)
    fig = go.Figure()
    top = max(float(edges.score.abs().max()) if len(edges) else 1.0, 1e-12)
    shown = set()
    for edge in edges.itertuples():
        (x0, y0), (x1, y1) = pos[edge.source], pos[edge.target]
        colour, dash = EDGE_STYLES[edge.input]
        name = INPUT_NAMES[edge.input]
        fig.add_trace(
            go.Scatter(
                x=[x0, x1],
                y=[y0, y1],
                mode="lines",
                line=dict(color=colour, dash=dash, width=0.5 + 5 * abs(edge.score) / top),
                opacity=0.9 if edge.score >= 0 else 0.45,
                name=name,
                legendgroup=name,
                showlegend=name not in shown,
                hovertext=f"{edge.edge}: {edge.score:.4g}",
                hoverinfo="text",
            )
        )
        shown.add(name)
    kinds = {n: reader_kind(n) or kind_layer(n)[0] for n in labels}
    mlp = [n for n in labels if kinds[n] == "neuron"]
    sizes, opacities, hover = mlp_markers(mlp, mlp_carry(circuit))
    marker: dict[str, tuple[float, float, str]] = {n: (NODE_SIZE, 1.0, n) for n in labels}
    for n, size, opacity, carry in zip(mlp, sizes, opacities, hover, strict=True):
        marker[n] = (size, opacity, f"{n}<br>{carry}")
    texts = {}
    for n in labels:
        gv = split.get(n)
        texts[n] = [n] if gv is None else [f"{n}<br>g {gv.gate:.3g} / v {gv.value:.3g}", n]
        if gv is not None:
            gate_value = f"gate {gv.gate:.3g} / value {gv.value:.3g}"
            marker[n] = (*marker[n][:2], f"{marker[n][2]}<br>{gate_value}")
    order = sorted(labels, key=lambda n: (NODE_RANK[kinds[n]], -marker[n][0], n))
    placed = dict(zip(order, place_labels(
        [(*pos[n], marker[n][0], texts[n]) for n in order], (span) * col, plot_h
    ), strict=True))  # fmt: skip
    pages = link_nodes(placed, marker, atlas)
    for kind, (symbol, colour) in NODE_STYLES.items():
        members = [n for n in labels if kinds[n] == kind]
        if members:
            fig.add_trace(
                node_trace(
                    [pos[m][0] for m in members], [pos[m][1] for m in members],
                    [placed[m][0] for m in members], symbol, colour, NODE_NAMES[kind],
                    [marker[m][2] for m in members], customdata=members,
                    textposition=[placed[m][1] for m in members],
                    size=[marker[m][0] for m in members],
                    opacity=[marker[m][1] for m in members],
                )
            )  # fmt: skip
    default = (
        f"Circuit: {counts_text(circuit_counts(circuit))}; faithfulness "
        f"{circuit.faithfulness:.3f} (dashed: gate edges; width: |score|; faded: negative; "
        "MLP nodes sized by |score| out)"
    )
    ticks = [((slot + 0.5) * col, text) for slot, text, _ in levels]
    hidden = sum(not placed[n][0] for n in labels)
    fig = page_layout(fig, title or default, (span * col, plot_h), ticks, "x", hidden)
    return set_links(fig, pages)


# Circuit.figure() draws with this (analysis/ imports nothing from vis/; vis/ plugs in here).
register_figure_builder(circuit_figure)

__all__ = [
    "EDGE_STYLES",
    "INPUT_NAMES",
    "LABEL_FONT",
    "LABEL_POSITIONS",
    "MAX_WIDTH",
    "NODE_NAMES",
    "NODE_RANK",
    "NODE_SIZE",
    "NODE_STYLES",
    "boxes_overlap",
    "circuit_counts",
    "circuit_figure",
    "counts_text",
    "kind_layer",
    "label_box",
    "mlp_carry",
    "mlp_markers",
    "node_trace",
    "occupied_levels",
    "page_layout",
    "place_labels",
    "reader_kind",
    "text_size",
]
