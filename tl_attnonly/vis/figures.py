"""Plotly figures: neuron-head activity, per-head results, error tables, activation fits."""

from __future__ import annotations

import html
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots
from transformer_lens import ActivationCache

from tl_attnonly.activations import TL_ACTIVATIONS, NeuronHeadCoefficients
from tl_attnonly.hooks import neuron_head_label
from tl_attnonly.vis.patterns import HeadsLike, rank_neuron_heads
from tl_attnonly.vis.sources import converted_model_of, weights_and_z

#: Colours: weight on the bias token -> weight on self.
_SELF_COLORSCALE = [[0.0, "#f7f7f7"], [1.0, "#b2182b"]]


def neuron_activity_heatmap(
    cache: ActivationCache,
    layer: int | Sequence[int] | None,
    str_tokens: Sequence[str],
    *,
    heads: HeadsLike = None,
    top_k: int | None = 40,
    rank_by: str = "z",
    batch_index: int = 0,
    level: Literal["neuron", "head"] = "neuron",
) -> go.Figure:
    """Heatmap of neuron-head activity over tokens: weight on self (1) vs on the bias token (0).

    One panel per layer, rows = neuron-heads (most active first), columns = tokens. Hover shows
    the weight on self, on the bias token, and ``z``.

    Args:
        cache: Cache of an :class:`~tl_attnonly.AttnOnlyTransformer` run with
            ``blocks.{l}.mlp.hook_pattern`` (and ``hook_z``) of the layers shown.
        layer: A layer, several, or ``None`` for all.
        str_tokens: The prompt's string tokens (``model.to_str_tokens(prompt)``).
        heads: Explicit head indices (the same in every layer); default: ranked by ``rank_by``.
        top_k: Neurons (``level="head"``: heads) per layer (``None``: all; thousands of rows
            make a slow figure).
        rank_by: See :func:`neuron_head_scores`.
        batch_index: Which prompt of the batch.
        level: ``"neuron"`` (default): rank neurons, each shown with all its ``K`` heads;
            ``"head"``: rank heads (:func:`~tl_attnonly.vis.patterns.rank_neuron_heads`).

    Returns:
        A plotly Figure.
    """
    model = converted_model_of(cache)
    layers = _layers(layer, model.cfg.n_layers)
    str_tokens = list(str_tokens)
    selections = []
    for lay in layers:
        selections.append(rank_neuron_heads(cache, lay, heads, top_k, rank_by, batch_index, level))
    n_rows = max(len(shown) for shown in selections)
    # Pixels: each panel's rows, plus room under it for the rotated token labels.
    label_px = _LABEL_PX
    height = min(140 + len(layers) * (13 * n_rows + label_px + 30), 4000)
    fig = make_subplots(
        rows=len(layers),
        cols=1,
        subplot_titles=[f"Layer {lay}" for lay in layers],
        vertical_spacing=min(0.5 / max(len(layers) - 1, 1), (label_px + 25) / height),
    )
    x = list(range(len(str_tokens)))
    for row, (lay, shown) in enumerate(zip(layers, selections), start=1):
        pattern, z = weights_and_z(cache, lay, shown, len(str_tokens), batch_index)
        ws = pattern[..., 0]
        labels = [neuron_head_label(lay, h, model.n_heads_per_neuron) for h in shown]
        fig.add_trace(
            go.Heatmap(
                z=ws,
                x=x,
                y=labels,
                zmin=0.0,
                zmax=1.0,
                colorscale=_SELF_COLORSCALE,
                colorbar=dict(
                    title="weight<br>on self",
                    len=0.5,
                    tickvals=[0, 0.5, 1],
                    ticktext=["0: bias", "0.5", "1: self"],
                )
                if row == 1
                else None,
                showscale=row == 1,
                customdata=np.stack([1.0 - ws, z], axis=-1),
                text=[[f"{i}: {html.escape(repr(t))}" for i, t in enumerate(str_tokens)]]
                * len(shown),
                hovertemplate=(
                    "%{y} at token %{text}<br>self: %{z:.3f}<br>bias token: %{customdata[0]:.3f}"
                    "<br>z: %{customdata[1]:.3g}<extra></extra>"
                ),
            ),
            row=row,
            col=1,
        )
        fig.update_yaxes(autorange="reversed", row=row, col=1, tickfont=dict(size=9))
        fig.update_xaxes(
            tickmode="array",
            tickvals=x,
            ticktext=[tick_label(t) for t in str_tokens],
            tickangle=-60,
            tickfont=dict(size=9),
            automargin=True,
            row=row,
            col=1,
        )
    fig.update_yaxes(automargin=True)
    fig.update_layout(
        title="Neuron-head activity: weight on self (1) vs on the bias token (0)",
        height=height,
        # the left margin holds the first rotated token label (it leans left)
        margin=dict(l=90, r=20, t=80, b=label_px),
    )
    return fig


#: Pixels under a heatmap for its token labels, rotated by 60 degrees (12 characters of 9 px).
_LABEL_PX = 75


def patching_heatmap(
    result: Any,
    *,
    layer_labels: Sequence[Any] | None = None,
    head_labels: Sequence[Any] | None = None,
    title: str = "Patching effect per head",
    value_name: str = "effect",
    zmid: float | None = 0.0,
) -> go.Figure:
    """Heatmap of a per-(layer, head) result, e.g. activation patching of neuron-heads.

    Args:
        result: ``[n_layers, n_heads]`` tensor/array, or a DataFrame: either already
            ``layer x head`` shaped (index = layers, columns = heads) or long, with columns
            ``layer``, ``head`` and one numeric value column (``value_name`` if present).
        layer_labels: Row labels (default: the DataFrame index or ``0..n_layers-1``).
        head_labels: Column labels (default: the DataFrame columns or ``0..n_heads-1``).
        title: Figure title.
        value_name: Name of the value (colour bar title; long-DataFrame column).
        zmid: Colour midpoint (diverging colours around 0 by default); ``None`` for sequential.

    Returns:
        A plotly Figure.
    """
    values, rows, cols = _layer_head_matrix(result, value_name)
    rows = list(layer_labels) if layer_labels is not None else rows
    cols = list(head_labels) if head_labels is not None else cols
    if len(rows) != values.shape[0] or len(cols) != values.shape[1]:
        raise ValueError(
            f"{len(rows)} layer labels and {len(cols)} head labels for a {values.shape} result."
        )
    height = max(280, 120 + 40 * values.shape[0])
    fig = go.Figure(
        go.Heatmap(
            z=values,
            x=[str(c) for c in cols],
            y=[str(r) for r in rows],
            colorscale="RdBu_r" if zmid is not None else "Viridis",
            zmid=zmid,
            # few ticks in short figures: they must not overlap
            colorbar=dict(
                title=dict(text=value_name, side="right"),
                nticks=max(3, min(8, (height - 140) // 30)),
                thickness=14,
            ),
            hovertemplate="layer %{y}, head %{x}<br>" + value_name + ": %{z:.4g}<extra></extra>",
        )
    )
    fig.update_layout(
        title=title,
        xaxis=dict(title="head", type="category", automargin=True),
        yaxis=dict(title="layer", type="category", autorange="reversed", automargin=True),
        height=height,
        margin=dict(t=60, b=50),
    )
    return fig


def expert_routing_heatmap(
    cache: Any,
    layer: int,
    str_tokens: Sequence[str] | None = None,
    *,
    batch: int = 0,
    title: str | None = None,
) -> go.Figure:
    """Heatmap of a mixture-of-experts layer's routing in a run: the weight each token gave each
    expert (:func:`~tl_attnonly.analysis.experts.expert_routing`; blank where the token was not
    routed to the expert).

    Args:
        cache: A ``run_with_cache`` cache of a converted model with mixtures of experts (with the
            routing hooks).
        layer: The MoE layer.
        str_tokens: The prompt's tokens (row labels); default positions.
        batch: Which prompt of the batch.
        title: Figure title; default ``"Layer {layer}: routing"``.

    Returns:
        A plotly Figure: tokens down, experts across.
    """
    from tl_attnonly.analysis.experts import expert_routing

    routing = expert_routing(cache, layer)[batch].detach().float().cpu()  # [pos, n_experts]
    values = routing.masked_fill(routing == 0, float("nan")).numpy()
    n_pos, n_experts = values.shape
    rows = [str(t) for t in str_tokens] if str_tokens is not None else list(range(n_pos))
    if len(rows) != n_pos:
        raise ValueError(f"{len(rows)} tokens for a run of {n_pos} positions.")
    labels = [f"{i}: {tick_label(str(t))}" for i, t in enumerate(rows)]
    height = max(280, 120 + 22 * n_pos)
    fig = go.Figure(
        go.Heatmap(
            z=values,
            x=[f"L{layer}E{e}" for e in range(n_experts)],
            y=labels,
            colorscale="Blues",
            zmin=0,
            colorbar=dict(title=dict(text="weight", side="right"), thickness=14),
            hovertemplate="%{y}<br>%{x}: weight %{z:.3g}<extra></extra>",
        )
    )
    fig.update_layout(
        title=title if title is not None else f"Layer {layer}: routing",
        xaxis=dict(title="expert", type="category", automargin=True),
        yaxis=dict(title="token", type="category", autorange="reversed", automargin=True),
        height=height,
        margin=dict(t=60, b=50),
    )
    return fig


def error_table_figure(df: pd.DataFrame, title: str = "", float_format: str = ".3g") -> go.Figure:
    """A DataFrame (equivalence table, GELU-fit errors, omega errors) as a plotly table.

    Args:
        df: Any DataFrame, e.g. from :func:`tl_attnonly.verify.equivalence_table`,
            :func:`tl_attnonly.activation_error_table` or ``tl_attnonly.omega.omega_error_table``.
        title: Figure title.
        float_format: Format of float cells.

    Returns:
        A plotly Figure.
    """
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"error_table_figure takes a pandas DataFrame, got {type(df).__name__}.")
    cells = []
    for col in df.columns:
        series = df[col]
        if pd.api.types.is_float_dtype(series):
            cells.append([format(v, float_format) for v in series])
        else:
            cells.append([str(v) for v in series])
    fig = go.Figure(
        go.Table(
            header=dict(values=[f"<b>{c}</b>" for c in df.columns], align="left"),
            cells=dict(values=cells, align="left"),
        )
    )
    fig.update_layout(
        title=title or None, height=120 + 30 * len(df), margin=dict(l=10, r=10, t=50, b=10)
    )
    return fig


def omega_error_figure(df: pd.DataFrame) -> go.Figure:
    """Error of the literal form against omega (delegates to ``tl_attnonly.omega``).

    Args:
        df: From ``tl_attnonly.omega.omega_error_table(model, tokens, ...)``.

    Returns:
        ``tl_attnonly.omega.plot_omega_error(df)``.
    """
    try:
        from tl_attnonly.omega import plot_omega_error
    except ImportError as err:  # pragma: no cover - depends on the installed version
        raise ImportError(
            "tl_attnonly.omega is not available in this version; plot the table with "
            "error_table_figure(df) instead."
        ) from err
    return plot_omega_error(df)


@dataclass
class _Approximation:
    k: int
    label: str
    values: np.ndarray


def neuron_head_activation(
    coefficients: NeuronHeadCoefficients, x: np.ndarray | torch.Tensor
) -> np.ndarray:
    """What ``K`` neuron-heads compute for a neuron with pre-activation ``x``.

    ``sum_k sigmoid(b_k x + d_k) (f_k x + e_k) + sigmoid(-(b_k x + d_k)) g_k``, i.e.
    :meth:`~tl_attnonly.NeuronHeadCoefficients.evaluate` in float64 (see
    :mod:`tl_attnonly.components.neuron_heads`).

    Args:
        coefficients: A :class:`~tl_attnonly.NeuronHeadCoefficients`.
        x: Pre-activations.

    Returns:
        The approximated activation at ``x`` (float64).
    """
    return coefficients.evaluate(torch.as_tensor(np.asarray(x), dtype=torch.float64)).numpy()


def gelu_fit_error_figure(
    ks: Sequence[int] = (1, 2, 3, 4),
    x_range: tuple[float, float] = (-6.0, 6.0),
    activation: str = "gelu",
    gelu_method: str = "fit",
    n_points: int = 601,
) -> go.Figure:
    """GELU (or another activation) next to its ``K``-neuron-head approximations, and the error.

    Left: the activation and the approximation for each ``K``. Right: ``|approx - exact|`` on a log
    scale. The coefficients are the ones the conversion uses
    (:func:`tl_attnonly.head_coefficients`).

    Args:
        ks: Heads per neuron to show (values without a fit are skipped, with a warning).
        x_range: Pre-activation range.
        activation: TransformerLens ``act_fn`` name (``"gelu"``, ``"gelu_new"``, ...).
        gelu_method: ``"fit"`` or ``"paper"``.
        n_points: Points on the curve.

    Returns:
        A plotly Figure.
    """
    from tl_attnonly import head_coefficients

    x = np.linspace(x_range[0], x_range[1], n_points)
    exact = _exact_activation(activation, x)
    approximations = []
    for k in ks:
        try:
            coefs = head_coefficients(activation, n_heads=k, gelu_method=gelu_method)
        except (ValueError, KeyError, NotImplementedError) as err:
            warnings.warn(f"No {k}-head approximation of {activation}: {err}", stacklevel=2)
            continue
        label = f"K={coefs.n_heads}"
        approximations.append(_Approximation(k, label, neuron_head_activation(coefs, x)))
    if not approximations:
        raise ValueError(f"No approximation of {activation!r} for K in {list(ks)}.")
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=(f"{activation} and its neuron-head approximations", "absolute error"),
    )
    fig.add_trace(
        go.Scatter(x=x, y=exact, name=activation, line=dict(color="black", width=3)), row=1, col=1
    )
    lows, highs = [], []
    for i, ap in enumerate(approximations):
        color = _PALETTE[i % len(_PALETTE)]
        fig.add_trace(
            go.Scatter(
                x=x,
                y=ap.values,
                name=ap.label,
                legendgroup=ap.label,
                line=dict(color=color, dash="dash"),
            ),
            row=1,
            col=1,
        )
        abs_err = np.maximum(np.abs(ap.values - exact), 1e-18)  # exact zeros show on log axes
        lows.append(np.percentile(abs_err, 5))
        highs.append(abs_err.max())
        fig.add_trace(
            go.Scatter(
                x=x,
                y=abs_err,
                name=f"{ap.label} error (max {abs_err.max():.2g})",
                legendgroup=ap.label,
                line=dict(color=color),
            ),
            row=1,
            col=2,
        )
    # Log range from the bulk of the errors: the exact zeros where curves cross would stretch it.
    low = math.floor(math.log10(max(min(lows), 1e-17))) - 1
    high = math.ceil(math.log10(max(max(highs), 1e-16)))
    fig.update_yaxes(type="log", exponentformat="e", range=[low, high], row=1, col=2)
    fig.update_xaxes(title="pre-activation x")
    fig.update_layout(
        title=f"{activation}: K neuron-heads per neuron ({gelu_method})",
        height=420,
        legend=dict(orientation="h", y=-0.2),
    )
    return fig


_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]


def _exact_activation(activation: str, x: np.ndarray) -> np.ndarray:
    if activation not in TL_ACTIVATIONS:
        raise ValueError(
            f"Unknown activation {activation!r}; expected one of {sorted(TL_ACTIVATIONS)}."
        )
    fn = TL_ACTIVATIONS[activation]
    return fn(torch.as_tensor(x, dtype=torch.float64)).numpy()


def _layers(layer: int | Sequence[int] | None, n_layers: int) -> list[int]:
    if layer is None:
        return list(range(n_layers))
    layers = [layer] if isinstance(layer, int) else list(layer)
    bad = [lay for lay in layers if not 0 <= lay < n_layers]
    if bad or not layers:
        raise IndexError(f"layers must be in [0, {n_layers}), got {layers}.")
    return layers


def tick_label(token: str) -> str:
    shown = token.replace("\n", "\\n").replace("\t", "\\t")
    shown = shown if shown.strip() else repr(token)[1:-1].replace(" ", "\u2423") or "\u2205"
    return html.escape(shown[:12])


def _layer_head_matrix(result: Any, value_name: str) -> tuple[np.ndarray, list[Any], list[Any]]:
    if isinstance(result, pd.DataFrame):
        if {"layer", "head"} <= set(result.columns):
            numeric = [
                c
                for c in result.columns
                if c not in ("layer", "head") and pd.api.types.is_numeric_dtype(result[c])
            ]
            column = value_name if value_name in result.columns else (numeric or [None])[0]
            if column is None:
                raise ValueError("The DataFrame has no numeric value column besides layer/head.")
            wide = result.pivot_table(index="layer", columns="head", values=column, sort=True)
        else:
            wide = result
        return wide.to_numpy(dtype=float), list(wide.index), list(wide.columns)
    values = result.detach().float().cpu().numpy() if isinstance(result, torch.Tensor) else result
    values = np.asarray(values, dtype=float)
    if values.ndim == 1:
        values = values[None]
    if values.ndim != 2:
        raise ValueError(f"Expected a [layer, head] result, got shape {values.shape}.")
    return values, list(range(values.shape[0])), list(range(values.shape[1]))


__all__ = [
    "error_table_figure",
    "gelu_fit_error_figure",
    "neuron_activity_heatmap",
    "neuron_head_activation",
    "omega_error_figure",
    "patching_heatmap",
]
