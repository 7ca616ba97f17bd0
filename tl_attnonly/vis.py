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

Example:
    >>> converted = tl_attnonly.convert(model)
    >>> neuron_head_attention_view(converted, layer=0, tokens="def f(x):", top_k=16)
    >>> logits, cache = converted.run_with_cache("def f(x):")
    >>> neuron_activity_heatmap(cache, layer=0, str_tokens=converted.to_str_tokens("def f(x):"))
"""

from __future__ import annotations

import html
import json
import math
import re
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from circuitsvis.utils.render import RenderedHTML, render_cdn
from jaxtyping import Float
from plotly.subplots import make_subplots
from transformer_lens import ActivationCache

from tl_attnonly.hooks import neuron_act_name, neuron_head_label

#: How the bias token is drawn in every view.
BIAS_TOKEN = "<bias>"

#: Neuron-heads per circuitsvis page by default.
DEFAULT_PAGE_SIZE = 32

#: Most neuron-heads one circuitsvis view may hold: circuitsvis draws one chart per head, and a page
#: slows down past a few hundred.
MAX_HEADS_PER_VIEW = 256

#: How neuron-heads can be ranked (see :func:`neuron_head_scores`).
RANK_BY = ("z", "self", "contrast", "output")

_RANK_DESCRIPTIONS = {
    "z": "max |z| over tokens (the neuron's activation, for K = 1)",
    "self": "max weight on self over tokens",
    "contrast": "max - min weight on self over tokens",
    "output": "max |z| * |W_O| over tokens (size of what it writes)",
}

#: Colours: weight on the bias token -> weight on self.
_SELF_COLORSCALE = [[0.0, "#f7f7f7"], [1.0, "#b2182b"]]

TokensLike = str | torch.Tensor | Sequence[str]
HeadsLike = int | Sequence[int] | torch.Tensor | None


# ------------------------------------------------------------------------------------------------
# data: patterns, scores, head selection
# ------------------------------------------------------------------------------------------------
def square_neuron_pattern(
    pattern: Float[torch.Tensor, "head query_pos 2"],
) -> Float[torch.Tensor, "head 1+query_pos 1+query_pos"]:
    """Compact neuron-head patterns as square patterns with the bias token as token 0.

    circuitsvis needs ``[head, dest, src]`` with ``dest == src``. Row 0 is the bias token, which
    attends only to itself; row ``1 + q`` puts ``pattern[..., q, 1]`` on the bias token (column 0)
    and ``pattern[..., q, 0]`` on itself (column ``1 + q``). The result is lower-triangular, like a
    causal pattern.

    Args:
        pattern: ``blocks.{l}.mlp.hook_pattern`` of one prompt (``[head, query_pos, 2]``, last axis
            (self, bias)).

    Returns:
        ``[head, 1 + query_pos, 1 + query_pos]``; every row sums to 1.
    """
    if pattern.ndim != 3 or pattern.shape[-1] != 2:
        raise ValueError(
            f"Expected one prompt's compact pattern [head, query_pos, 2], got "
            f"{tuple(pattern.shape)}. Index the batch first: cache[name][batch_index]."
        )
    n_heads, n_pos, _ = pattern.shape
    square = pattern.new_zeros(n_heads, n_pos + 1, n_pos + 1)
    square[:, 0, 0] = 1.0
    square[:, 1:, 0] = pattern[..., 1]
    square[:, 1:, 1:].diagonal(dim1=-2, dim2=-1).copy_(pattern[..., 0])
    return square


def neuron_head_scores(
    cache: ActivationCache,
    layer: int,
    rank_by: str = "z",
    batch_index: int = 0,
) -> torch.Tensor:
    """How active each neuron-head of a layer is on one prompt.

    Args:
        cache: Cache of an :class:`~tl_attnonly.AttnOnlyTransformer` run holding
            ``blocks.{layer}.mlp.hook_pattern`` (and ``hook_z`` for ``"z"``/``"output"``).
        layer: Layer index.
        rank_by: ``"z"``: max over tokens of ``|z|`` (for ``K = 1`` the neuron's activation);
            ``"self"``: max weight on self; ``"contrast"``: max minus min weight on self (heads that
            switch between self and the bias token); ``"output"``: max ``|z| * |W_O|`` (size of
            what the head writes to the residual stream).
        batch_index: Which prompt of the batch.

    Returns:
        One score per neuron-head, ``[n_neuron_heads]``, higher = more active.
    """
    if rank_by not in RANK_BY:
        raise ValueError(f"rank_by must be one of {RANK_BY}, got {rank_by!r}.")
    if rank_by in ("self", "contrast"):
        weight_self = _cached(cache, "pattern", layer)[batch_index, :, :, 0].float()
        if rank_by == "self":
            return weight_self.amax(-1)
        return weight_self.amax(-1) - weight_self.amin(-1)
    z = _cached(cache, "z", layer)[batch_index, :, :, 0].float().abs().amax(0)
    if rank_by == "z":
        return z
    w_o = _model(cache).neuron_heads[layer].W_O.detach().float().norm(dim=-1).squeeze(-1)
    return z * w_o.to(z.device)


def select_neuron_heads(
    scores: torch.Tensor | None,
    n_neuron_heads: int,
    heads: HeadsLike = None,
    top_k: int | None = None,
) -> list[int]:
    """Neuron-heads to show, in display order.

    Args:
        scores: One score per head (used when ``heads`` is None): heads are ordered by descending
            score. ``None`` keeps index order.
        n_neuron_heads: Heads in the layer.
        heads: Explicit head indices (kept in the order given).
        top_k: Keep only the first ``top_k`` of the order.

    Returns:
        Head indices.
    """
    if heads is not None:
        if isinstance(heads, int):
            heads = [heads]
        order = [int(h) for h in torch.as_tensor(heads).flatten().tolist()]
        bad = [h for h in order if not 0 <= h < n_neuron_heads]
        if bad:
            raise IndexError(
                f"Neuron-head indices must be in [0, {n_neuron_heads}), got {bad[:5]}. A "
                "neuron-head index is neuron * K + k; pass neurons=[...] to select neurons instead."
            )
    elif scores is None:
        order = list(range(n_neuron_heads))
    else:
        order = torch.argsort(scores.float().cpu(), descending=True, stable=True).tolist()
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}.")
        order = order[:top_k]
    return order


# ------------------------------------------------------------------------------------------------
# circuitsvis
# ------------------------------------------------------------------------------------------------
class NeuronHeadView(RenderedHTML):
    """A circuitsvis attention view of neuron-heads, with what it shows.

    A :class:`~circuitsvis.utils.render.RenderedHTML`: Jupyter shows it inline. Unlike plain
    circuitsvis objects it always renders from the JavaScript bundled with circuitsvis (no CDN,
    no connectivity check), so it also works offline. ``str(view)`` is circuitsvis's CDN version.

    Attributes:
        layer: Layer of the neuron-heads.
        heads: Neuron-head indices shown, in order.
        labels: Their labels (``L0N17``, or ``L0N17.2`` for ``K > 1``).
        str_tokens: Tokens drawn, ``"<bias>"`` first.
        page: Page shown (0-based).
        n_pages: Pages in the selection.
        n_selected: Heads in the whole selection (all pages).
        component: The circuitsvis React component (``"AttentionHeads"``).
        props: The component's properties, as a JSON string safe to put inside ``<script>``.
        caption: One line saying what is shown.
    """

    def __init__(
        self,
        *,
        layer: int,
        heads: list[int],
        labels: list[str],
        str_tokens: list[str],
        page: int,
        n_pages: int,
        n_selected: int,
        props: dict[str, Any],
        caption: str,
        component: str = "AttentionHeads",
    ):
        self.layer = layer
        self.heads = heads
        self.labels = labels
        self.str_tokens = str_tokens
        self.page = page
        self.n_pages = n_pages
        self.n_selected = n_selected
        self.component = component
        self.props = script_safe_json(props)
        self.caption = caption
        div_id = _div_id()
        local_src = (
            f'<p style="font-family: sans-serif; font-size: 13px;">{html.escape(caption)}</p>'
            f'<div id="{div_id}" style="margin: 15px 0;"></div>\n'
            f'<script crossorigin type="module">\n{circuitsvis_js()}\n'
            f"{self.render_call(div_id)}\n</script>"
        )
        super().__init__(local_src, render_cdn(component, **props))

    def render_call(self, div_id: str) -> str:
        """JavaScript that draws this view into ``div_id`` once ``CircuitsVis`` is loaded."""
        return f'CircuitsVis.render("{div_id}", CircuitsVis.{self.component}, {self.props});'

    def _repr_html_(self) -> str:
        return self.local_src

    def to_html(self, title: str | None = None) -> str:
        """A standalone HTML page (JavaScript inlined, works offline)."""
        title = html.escape(title or self.caption)
        return (
            f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{title}</title></head>'
            f"<body>\n{self.local_src}\n</body></html>\n"
        )

    def __repr__(self) -> str:
        return f"<NeuronHeadView {self.caption}>"


def neuron_head_attention_view(
    source: Any,
    layer: int,
    tokens: TokensLike | None = None,
    *,
    heads: HeadsLike = None,
    neurons: HeadsLike = None,
    top_k: int | None = None,
    rank_by: str = "z",
    page: int = 0,
    page_size: int = DEFAULT_PAGE_SIZE,
    batch_index: int = 0,
) -> NeuronHeadView:
    """circuitsvis attention view of a layer's neuron-heads, the bias token drawn as ``"<bias>"``.

    Heads are chosen by ``heads`` or ``neurons`` (explicit), else ranked by ``rank_by`` (most
    active first); ``top_k`` keeps the first ``k``; the selection is then cut into pages of
    ``page_size`` and page ``page`` is drawn. A page never holds more than
    :data:`MAX_HEADS_PER_VIEW` heads: circuitsvis draws one chart per head.

    Args:
        source: An :class:`~tl_attnonly.AttnOnlyTransformer` (it is run on ``tokens``) or the
            :class:`~transformer_lens.ActivationCache` of its run (holding
            ``blocks.{layer}.mlp.hook_pattern``, and ``hook_z`` to rank by ``"z"``/``"output"``).
        layer: Layer index.
        tokens: The prompt: text, token ids ``[pos]``/``[batch, pos]``, or (with a cache) its
            string tokens. Needed to label the tokens.
        heads: Neuron-head indices to show (``h = neuron * K + k``).
        neurons: Neuron indices to show (all ``K`` heads of each); exclusive with ``heads``.
        top_k: Keep only the ``top_k`` first heads of the selection.
        rank_by: Ranking when no heads are given; see :func:`neuron_head_scores`.
        page: Which page of the selection (0-based).
        page_size: Heads per page (at most :data:`MAX_HEADS_PER_VIEW`).
        batch_index: Which prompt of a batch.

    Returns:
        A :class:`NeuronHeadView`; ``view.heads`` and ``view.n_pages`` say what it holds.

    Example:
        >>> view = neuron_head_attention_view(converted, 0, "x = 1", top_k=64, page_size=16)
        >>> view.n_pages  # 4; pass page=1, 2, 3 for the rest
    """
    if page_size < 1 or page_size > MAX_HEADS_PER_VIEW:
        raise ValueError(
            f"page_size must be in [1, {MAX_HEADS_PER_VIEW}] (circuitsvis draws one chart per "
            f"head), got {page_size}. Use page=... to go through a larger selection."
        )
    cache, str_tokens = _cache_and_tokens(source, tokens, layer, batch_index)
    model = _model(cache)
    n_heads = model.n_neuron_heads
    k_per_neuron = model.n_heads_per_neuron
    heads = _heads_from_neurons(heads, neurons, k_per_neuron, model.cfg.d_mlp)
    scores = None if heads is not None else neuron_head_scores(cache, layer, rank_by, batch_index)
    selection = select_neuron_heads(scores, n_heads, heads, top_k)
    n_pages = max(1, math.ceil(len(selection) / page_size))
    if not 0 <= page < n_pages:
        raise IndexError(f"page must be in [0, {n_pages}) for {len(selection)} heads, got {page}.")
    shown = selection[page * page_size : (page + 1) * page_size]
    pattern = _cached(cache, "pattern", layer)[batch_index, shown]
    if len(str_tokens) != pattern.shape[1]:
        raise ValueError(
            f"{len(str_tokens)} tokens given for a cache of {pattern.shape[1]} positions: pass the "
            "prompt the cache was computed on."
        )
    square = square_neuron_pattern(pattern.detach().float().cpu())
    labels = [neuron_head_label(layer, h, k_per_neuron) for h in shown]
    how = "chosen" if heads is not None else f"ranked by {_RANK_DESCRIPTIONS[rank_by]}"
    caption = (
        f"Layer {layer}: neuron-heads {page * page_size + 1}-{page * page_size + len(shown)} of "
        f"{len(selection)} {how} (of {n_heads} in the layer; page {page + 1}/{n_pages}). "
        f"Column 0 is the bias token {BIAS_TOKEN}; the diagonal is each token's weight on itself."
    )
    props = {
        "attention": np.round(square.double().numpy(), 4),
        "tokens": [BIAS_TOKEN, *str_tokens],
        "attentionHeadNames": labels,
        "maxValue": 1.0,
        "minValue": 0.0,
        "maskUpperTri": True,
    }
    return NeuronHeadView(
        layer=layer,
        heads=shown,
        labels=labels,
        str_tokens=[BIAS_TOKEN, *str_tokens],
        page=page,
        n_pages=n_pages,
        n_selected=len(selection),
        props=props,
        caption=caption,
    )


def circuitsvis_js() -> str:
    """circuitsvis's bundled JavaScript (defines ``CircuitsVis``), safe to inline in ``<script>``.

    It is the file circuitsvis itself inlines for offline rendering (``dist/cdn/iife.js``); it loads
    nothing from the network.
    """
    return _circuitsvis_js()


_JS_CACHE: dict[str, str] = {}


def _circuitsvis_js() -> str:
    if "js" not in _JS_CACHE:
        import circuitsvis

        path = Path(circuitsvis.__file__).parent / "dist" / "cdn" / "iife.js"
        if not path.is_file():
            raise FileNotFoundError(
                f"circuitsvis's bundled JavaScript is missing ({path.name}); reinstall circuitsvis "
                "(pip install --force-reinstall 'circuitsvis>=1.43')."
            )
        js = path.read_text(encoding="utf-8")
        # Keep the bundle from closing the <script> element; "<\/" means "</" in JavaScript.
        js = js.replace("</script", "<\\/script").replace("//# sourceMappingURL=iife.js.map", "")
        _JS_CACHE["js"] = js
    return _JS_CACHE["js"]


_ZERO = re.compile(r"(?<=[\[ ])0\.0(?=[,\]])")


def script_safe_json(obj: Any) -> str:
    """JSON for inside ``<script>``: tensors/arrays as lists, ``<``, ``>``, ``&`` escaped."""

    def default(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return o.tolist()
        if isinstance(o, np.ndarray):
            return o.tolist()
        if isinstance(o, np.generic):
            return o.item()
        raise TypeError(f"Cannot serialise {type(o).__name__} for circuitsvis.")

    text = json.dumps({k: v for k, v in obj.items() if v is not None}, default=default)
    text = _ZERO.sub("0", text)  # the many exact zeros of masked cells: "0" instead of "0.0"
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


# ------------------------------------------------------------------------------------------------
# plotly figures
# ------------------------------------------------------------------------------------------------
def neuron_activity_heatmap(
    cache: ActivationCache,
    layer: int | Sequence[int] | None,
    str_tokens: Sequence[str],
    *,
    heads: HeadsLike = None,
    top_k: int | None = 40,
    rank_by: str = "z",
    batch_index: int = 0,
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
        top_k: Heads per layer (``None``: all; thousands of rows make a slow figure).
        rank_by: See :func:`neuron_head_scores`.
        batch_index: Which prompt of the batch.

    Returns:
        A plotly Figure.
    """
    model = _model(cache)
    layers = _layers(layer, model.cfg.n_layers)
    str_tokens = list(str_tokens)
    fig = make_subplots(
        rows=len(layers),
        cols=1,
        subplot_titles=[f"Layer {lay}" for lay in layers],
        vertical_spacing=0.25 / max(len(layers), 1),
    )
    x = list(range(len(str_tokens)))
    n_rows = 0
    for row, lay in enumerate(layers, start=1):
        scores = None if heads is not None else neuron_head_scores(cache, lay, rank_by, batch_index)
        shown = select_neuron_heads(scores, model.n_neuron_heads, heads, top_k)
        n_rows = max(n_rows, len(shown))
        weight_self = _cached(cache, "pattern", lay)[batch_index, shown, :, 0].detach().float()
        if weight_self.shape[-1] != len(str_tokens):
            raise ValueError(
                f"{len(str_tokens)} tokens given for a cache of {weight_self.shape[-1]} positions: "
                "pass the string tokens of the prompt the cache was computed on."
            )
        z = _optional(cache, "z", lay)
        z = (
            z[batch_index, :, shown, 0].detach().float().T.cpu().numpy()
            if z is not None
            else np.full(weight_self.shape, np.nan)
        )
        labels = [neuron_head_label(lay, h, model.n_heads_per_neuron) for h in shown]
        ws = weight_self.cpu().numpy()
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
            ticktext=[_tick(t) for t in str_tokens],
            tickangle=-60,
            tickfont=dict(size=9),
            row=row,
            col=1,
        )
    fig.update_layout(
        title="Neuron-head activity: weight on self (1) vs on the bias token (0)",
        height=min(160 + len(layers) * (60 + 13 * n_rows), 4000),
        margin=dict(l=80, r=20, t=80, b=60),
    )
    return fig


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
    fig = go.Figure(
        go.Heatmap(
            z=values,
            x=[str(c) for c in cols],
            y=[str(r) for r in rows],
            colorscale="RdBu_r" if zmid is not None else "Viridis",
            zmid=zmid,
            colorbar=dict(title=value_name),
            hovertemplate="layer %{y}, head %{x}<br>" + value_name + ": %{z:.4g}<extra></extra>",
        )
    )
    fig.update_layout(
        title=title,
        xaxis=dict(title="head", type="category"),
        yaxis=dict(title="layer", type="category", autorange="reversed"),
        height=max(250, 120 + 40 * values.shape[0]),
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


def neuron_head_activation(coefficients: Any, x: np.ndarray | torch.Tensor) -> np.ndarray:
    """What ``K`` neuron-heads compute for a neuron with pre-activation ``x``.

    ``sum_k sigmoid(b_k x + d_k) (f_k x + e_k) + sigmoid(-(b_k x + d_k)) g_k`` (see
    :mod:`tl_attnonly.components.neuron_heads`).

    Args:
        coefficients: A :class:`~tl_attnonly.NeuronHeadCoefficients`.
        x: Pre-activations.

    Returns:
        The approximated activation at ``x`` (float64).
    """
    x = torch.as_tensor(np.asarray(x), dtype=torch.float64).unsqueeze(-1)
    b, d, f, e, g = (
        torch.tensor(list(getattr(coefficients, name)), dtype=torch.float64)
        for name in ("b", "d", "f", "e", "g")
    )
    q = b * x + d
    out = torch.sigmoid(q) * (f * x + e) + torch.sigmoid(-q) * g
    return out.sum(-1).numpy()


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
        err = np.maximum(np.abs(ap.values - exact), 1e-18)  # exact zeros still show on log axes
        lows.append(np.percentile(err, 5))
        highs.append(err.max())
        fig.add_trace(
            go.Scatter(
                x=x,
                y=err,
                name=f"{ap.label} error (max {err.max():.2g})",
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
    from transformer_lens.utilities.activation_functions import SUPPORTED_ACTIVATIONS

    if activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"Unknown activation {activation!r}; expected one of {sorted(SUPPORTED_ACTIVATIONS)}."
        )
    fn = SUPPORTED_ACTIVATIONS[activation]
    return fn(torch.as_tensor(x, dtype=torch.float64)).numpy()


# ------------------------------------------------------------------------------------------------
# saving
# ------------------------------------------------------------------------------------------------
def save_figure(
    fig: go.Figure | RenderedHTML,
    path: str | Path,
    *,
    width: int | None = None,
    height: int | None = None,
    scale: float = 2.0,
) -> Path:
    """Write a plotly figure or a circuitsvis view to ``.html`` or ``.png``.

    HTML is self-contained (plotly.js / circuitsvis's JavaScript inlined) and works offline. PNG
    needs a Chrome/Chromium: plotly uses kaleido, circuitsvis views are screenshotted by a
    headless Chromium. If none is found, the figure is written as HTML next to the requested path
    and a warning says how to get PNGs (``plotly_get_chrome``, or install ``chromium``).

    Args:
        fig: A plotly Figure or a circuitsvis RenderedHTML (e.g. a :class:`NeuronHeadView`).
        path: Output path ending in ``.html`` or ``.png``.
        width: PNG width in CSS pixels (default: the figure's, or 1000).
        height: PNG height in CSS pixels (default: the figure's, or 800 for views).
        scale: PNG pixel ratio.

    Returns:
        The path written (``.html`` instead of ``.png`` when PNG export was not possible).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".html", ".htm", ".png"):
        raise ValueError(f"Can write .html or .png, got {path.name!r}.")
    path.parent.mkdir(parents=True, exist_ok=True)
    is_plotly = isinstance(fig, go.Figure)
    if not is_plotly and not isinstance(fig, RenderedHTML):
        raise TypeError(
            f"save_figure takes a plotly Figure or a circuitsvis view, got {type(fig).__name__}."
        )
    if suffix in (".html", ".htm"):
        path.write_text(_standalone_html(fig), encoding="utf-8")
        return path
    try:
        if is_plotly:
            fig.write_image(str(path), width=width, height=height, scale=scale)
        else:
            _screenshot(_standalone_html(fig), path, width or 1000, height or 800, scale)
        return path
    except Exception as err:  # kaleido/Chrome errors have many types
        fallback = path.with_suffix(".html")
        fallback.write_text(_standalone_html(fig), encoding="utf-8")
        warnings.warn(
            f"Could not write {path.name} ({type(err).__name__}: {str(err).splitlines()[0]}). PNG "
            "export needs Chrome or Chromium: run `plotly_get_chrome` (plotly figures) or install "
            f"chromium (e.g. `apt-get install chromium`). Wrote {fallback} instead.",
            RuntimeWarning,
            stacklevel=2,
        )
        return fallback


def find_chromium() -> str | None:
    """Path of a Chrome/Chromium executable, or ``None``."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _standalone_html(fig: go.Figure | RenderedHTML) -> str:
    if isinstance(fig, go.Figure):
        return fig.to_html(include_plotlyjs=True, full_html=True)
    if isinstance(fig, NeuronHeadView):
        return fig.to_html()
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"></head><body>\n'
        f"{fig.local_src}\n</body></html>\n"
    )


def _screenshot(page: str, path: Path, width: int, height: int, scale: float) -> None:
    chromium = find_chromium()
    if chromium is None:
        raise FileNotFoundError("no chromium/chrome executable on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "view.html"
        src.write_text(page, encoding="utf-8")
        cmd = [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--force-device-scale-factor={scale}",
            f"--window-size={width},{height}",
            "--virtual-time-budget=10000",
            f"--user-data-dir={Path(tmp) / 'profile'}",
            f"--screenshot={path.resolve()}",
            src.resolve().as_uri(),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0 or not path.exists():
            raise RuntimeError(f"chromium failed: {done.stderr.strip()[-300:]}")


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def _model(cache_or_model: Any) -> Any:
    model = (
        getattr(cache_or_model, "model", None)
        if isinstance(cache_or_model, ActivationCache)
        else cache_or_model
    )
    if model is None or not hasattr(model, "neuron_heads"):
        name = type(model).__name__
        raise TypeError(
            f"Expected a converted model (tl_attnonly.AttnOnlyTransformer) or its cache, got "
            f"{name}. Convert first: converted = tl_attnonly.convert(model)."
        )
    return model


def _cached(cache: ActivationCache, kind: str, layer: int) -> torch.Tensor:
    tensor = _optional(cache, kind, layer)
    if tensor is None:
        name = neuron_act_name(kind, layer)
        raise KeyError(
            f"{name} is not in the cache. Run the converted model with it cached, e.g. "
            f"converted.run_with_cache(tokens, names_filter=lambda n: n.endswith(('mlp.hook_"
            "pattern', 'mlp.hook_z')))."
        )
    return tensor


def _optional(cache: ActivationCache, kind: str, layer: int) -> torch.Tensor | None:
    name = neuron_act_name(kind, layer)
    return cache[name] if name in cache.cache_dict else None


def _layers(layer: int | Sequence[int] | None, n_layers: int) -> list[int]:
    if layer is None:
        return list(range(n_layers))
    layers = [layer] if isinstance(layer, int) else list(layer)
    bad = [lay for lay in layers if not 0 <= lay < n_layers]
    if bad or not layers:
        raise IndexError(f"layers must be in [0, {n_layers}), got {layers}.")
    return layers


def _heads_from_neurons(
    heads: HeadsLike, neurons: HeadsLike, k_per_neuron: int, d_mlp: int
) -> list[int] | None:
    if neurons is None:
        return None if heads is None else heads  # type: ignore[return-value]
    if heads is not None:
        raise ValueError("Pass heads=... or neurons=..., not both.")
    if isinstance(neurons, int):
        neurons = [neurons]
    out = []
    for n in torch.as_tensor(neurons).flatten().tolist():
        if not 0 <= n < d_mlp:
            raise IndexError(f"Neuron indices must be in [0, {d_mlp}), got {n}.")
        out.extend(range(n * k_per_neuron, (n + 1) * k_per_neuron))
    return out


def _cache_and_tokens(
    source: Any, tokens: TokensLike | None, layer: int, batch_index: int
) -> tuple[ActivationCache, list[str]]:
    if isinstance(source, ActivationCache):
        model = _model(source)
        if tokens is None:
            raise ValueError(
                "Pass tokens=...: the prompt (text or ids) or its string tokens, to label the view."
            )
        if isinstance(tokens, (list, tuple)):
            return source, [str(t) for t in tokens]
        return source, _str_tokens(model, tokens, batch_index)
    model = _model(source)
    if tokens is None:
        raise ValueError("Pass tokens=...: the prompt to run the model on (text or token ids).")
    if isinstance(tokens, (list, tuple)):
        raise TypeError("With a model, pass the prompt as text or token ids, not string tokens.")
    ids = model.to_tokens(tokens) if isinstance(tokens, str) else torch.as_tensor(tokens)
    if ids.ndim == 1:
        ids = ids.unsqueeze(0)
    if not 0 <= layer < model.cfg.n_layers:
        raise IndexError(f"layer must be in [0, {model.cfg.n_layers}), got {layer}.")
    names = (neuron_act_name("pattern", layer), neuron_act_name("z", layer))
    with torch.inference_mode():
        _, cache = model.run_with_cache(ids, names_filter=lambda n: n in names)
    return cache, _str_tokens(model, ids, batch_index)


def _str_tokens(model: Any, tokens: str | torch.Tensor, batch_index: int) -> list[str]:
    if isinstance(tokens, str):
        return list(model.to_str_tokens(tokens))
    ids = torch.as_tensor(tokens)
    if ids.ndim == 2:
        ids = ids[batch_index]
    if model.tokenizer is None:
        return [str(int(t)) for t in ids]
    return list(model.to_str_tokens(ids))


def _tick(token: str) -> str:
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


def _div_id() -> str:
    import uuid

    return "circuits-vis-" + uuid.uuid4().hex[:12]
