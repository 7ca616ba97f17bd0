"""Compact per-token strips of many neuron-heads: weight on self and on the bias token.

The square circuitsvis view (:func:`~tl_attnonly.vis.patterns.neuron_head_attention_view`) draws a
neuron-head as an ``(1 + N) x (1 + N)`` pattern, but only its diagonal (self) and column 0 (the bias
token) can be non-zero. A strip draws just those two numbers per token, two thin rows per head, so
dozens of heads fit on one screen; keep the square view for a few heads.
"""

from __future__ import annotations

import html
from typing import Any, Literal

import numpy as np
import plotly.graph_objects as go

from tl_attnonly.analysis.experts.routing import layer_head_labels, layer_heads
from tl_attnonly.vis.figures import tick_label
from tl_attnonly.vis.patterns import BIAS_TOKEN, HeadsLike, rank_neuron_heads
from tl_attnonly.vis.sources import (
    TokensLike,
    cache_and_tokens,
    converted_model_of,
    heads_from_neurons,
    weights_and_z,
)

#: Colours from 0 to 1: weight on self (red, as in the activity heatmap) and on the bias token.
_SELF_COLORSCALE = [[0.0, "#f7f7f7"], [1.0, "#b2182b"]]
_BIAS_COLORSCALE = [[0.0, "#f7f7f7"], [1.0, "#4d4d4d"]]
#: Pixels per strip row.
_ROW_PX = 11


def neuron_head_strips(
    source: Any,
    layer: int,
    tokens: TokensLike | None = None,
    *,
    heads: HeadsLike = None,
    neurons: HeadsLike = None,
    top_k: int | None = 32,
    rank_by: str = "z",
    batch_index: int = 0,
    level: Literal["neuron", "head"] = "neuron",
) -> go.Figure:
    """Per-token (self, bias) strips of a layer's neuron-heads: a compact view of many heads.

    Each head is two rows over the prompt's tokens: its weight on the token itself (``self``,
    ``sigmoid(q)``) and on the bias token (``bias``, ``1 - self``). Hover shows both and ``z``.

    Args:
        source: An :class:`~tl_attnonly.AttnOnlyTransformer` or a converted ``TransformerBridge``
            (run on ``tokens``), or its cache (holding ``blocks.{layer}.mlp.hook_pattern``, and
            ``hook_z`` to rank by ``"z"``).
        layer: Layer index.
        tokens: The prompt (text or ids), or with a cache its string tokens.
        heads: Neuron-head indices to show (``h = neuron * K + k``).
        neurons: Neuron indices to show (all ``K`` heads of each); exclusive with ``heads``.
        top_k: Keep the first ``top_k`` neurons (``level="head"``: heads) of the ranking
            (``None``: all).
        rank_by: Ranking when no heads are given; see :func:`neuron_head_scores`.
        batch_index: Which prompt of a batch.
        level: ``"neuron"`` (default): rank neurons, each shown with all its ``K`` heads;
            ``"head"``: rank heads (:func:`~tl_attnonly.vis.patterns.rank_neuron_heads`).

    Returns:
        A plotly Figure, ``2 * len(heads)`` thin rows.
    """
    cache, str_tokens = cache_and_tokens(source, tokens, layer, batch_index)
    model = converted_model_of(cache)
    k_per_neuron = model.n_heads_per_neuron
    n_layer_heads = len(layer_heads(model, layer))  # a mixture of experts: experts' end to end
    heads = heads_from_neurons(heads, neurons, k_per_neuron, n_layer_heads // k_per_neuron)
    shown = rank_neuron_heads(cache, layer, heads, top_k, rank_by, batch_index, level)
    pattern, z_shown = weights_and_z(cache, layer, shown, len(str_tokens), batch_index)
    n_heads, n_pos, _ = pattern.shape  # [head, pos, (self, bias)]
    labels = layer_head_labels(model, layer, shown)
    # rows: head i -> 3i (self), 3i + 1 (bias), 3i + 2 (a gap); unique names, so categorical
    rows = [name for label in labels for name in (f"{label} self", f"{label} bias", f"{label} ")]
    z_rows = np.repeat(z_shown, 3, axis=0).astype(np.float32)  # numbers only: a small figure
    fig = go.Figure()
    for offset, what, colorscale, bar_y in (
        (0, "self", _SELF_COLORSCALE, 1.0),
        (1, "bias", _BIAS_COLORSCALE, 0.45),
    ):
        values = np.full((len(rows), n_pos), np.nan)
        values[offset::3] = pattern[..., offset]
        fig.add_trace(
            go.Heatmap(
                z=values.astype(np.float32),
                x=list(range(n_pos)),
                y=rows,
                zmin=0.0,
                zmax=1.0,
                colorscale=colorscale,
                customdata=z_rows,
                hoverongaps=False,
                colorbar=dict(
                    title=f"on {what}",
                    tickvals=[0, 0.5, 1],
                    len=0.4,
                    y=bar_y,
                    yanchor="top",
                    thickness=12,
                ),
                hovertemplate="%{y}, token %{x}: %{z:.3f}<br>z %{customdata:.3g}<extra></extra>",
            )
        )
    fig.update_yaxes(
        autorange="reversed",
        type="category",
        tickmode="array",
        tickvals=rows[0::3],
        ticktext=labels,
        tickfont=dict(size=9),
        showgrid=False,
        zeroline=False,
        automargin=True,
    )
    fig.update_xaxes(
        tickmode="array",
        tickvals=list(range(n_pos)),
        ticktext=[tick_label(t) for t in str_tokens],
        tickangle=-60,
        tickfont=dict(size=9),
        showgrid=False,
        automargin=True,
    )
    fig.update_layout(
        title=f"Layer {layer}, {n_heads} neuron-heads: weight on self (red) and on "
        f"{html.escape(BIAS_TOKEN)} (grey) per token",
        height=_height(n_heads),
        margin=dict(l=10, r=10, t=60, b=10),
        plot_bgcolor="white",
    )
    return fig


def _height(n_heads: int) -> int:
    return 150 + 3 * _ROW_PX * n_heads


__all__ = ["neuron_head_strips"]
