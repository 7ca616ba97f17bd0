"""Pattern views: neuron-head patterns as square patterns, head selection, circuitsvis views.

A neuron-head sees two keys: its own token and the *bias token*. The views draw the bias token as a
real first token, ``"<bias>"``, so a neuron-head's pattern looks like any attention pattern: each
query row puts ``sigmoid(q)`` on itself (the diagonal) and the rest on ``"<bias>"`` (column 0).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from circuitsvis.utils.render import RenderedHTML, render_cdn
from jaxtyping import Float
from transformer_lens import ActivationCache

from tl_attnonly._types import HeadsLike, replace_options
from tl_attnonly.analysis.experts.routing import layer_head_labels, layer_heads
from tl_attnonly.protocol import AttnOnlyModel
from tl_attnonly.vis.export import circuitsvis_js, script_safe_json
from tl_attnonly.vis.sources import (
    TokensLike,
    cache_and_tokens,
    converted_model_of,
    heads_from_neurons,
)
from tl_attnonly.vis.sources import cached as _cached

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
    "z": "max |z| over tokens (the neuron's activation: the sum of its heads' z)",
    "self": "max weight on self over tokens",
    "contrast": "max - min weight on self over tokens",
    "output": "max |z| * |W_O| over tokens (size of what it writes)",
}


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


def circuitsvis_pattern_args(
    pattern: Float[torch.Tensor, "head query_pos 2"],
    str_tokens: Sequence[str],
) -> dict[str, Any]:
    """Arguments for circuitsvis's own attention views that draw neuron-heads as they are.

    ``circuitsvis.attention.attention_patterns(**circuitsvis_pattern_args(pattern, str_tokens))``
    (or ``attention_heads``) draws each neuron-head as a square pattern with the bias token
    ``"<bias>"`` as token 0: row ``1 + q`` has the weight on itself on the diagonal and the rest
    in column 0 (:func:`square_neuron_pattern`), so circuitsvis's causal mask hides nothing.
    (:func:`~tl_attnonly.hooks.dense_neuron_pattern` is not a circuitsvis input: its rows are
    query positions and its key axis is one longer, so the self weight of every row lies above
    the diagonal, which circuitsvis masks.) :func:`neuron_head_attention_view` draws these
    squares, with head labels, ranking and pages.

    Args:
        pattern: ``blocks.{l}.mlp.hook_pattern`` of one prompt, chosen heads
            (``cache[name][batch_index, heads]``: ``[head, query_pos, 2]``, last axis
            (self, bias)).
        str_tokens: The prompt's string tokens, one per query position.

    Returns:
        ``{"tokens": ["<bias>", *str_tokens], "attention": [head, 1 + pos, 1 + pos]}``; a row
        that is NaN in ``pattern`` (a token not routed to an expert head) is drawn empty (0).

    Raises:
        ValueError: For a pattern that is not one prompt's compact pattern, or tokens that are
            not one per position.
    """
    square = square_neuron_pattern(pattern.detach().float().cpu()).nan_to_num(0.0)
    if len(str_tokens) != pattern.shape[1]:
        raise ValueError(
            f"{len(str_tokens)} tokens given for a cache of {pattern.shape[1]} positions: pass the "
            "prompt the cache was computed on."
        )
    return {"tokens": [BIAS_TOKEN, *str_tokens], "attention": square}


def neuron_head_scores(
    cache: ActivationCache,
    layer: int,
    rank_by: str = "z",
    batch_index: int = 0,
    level: Literal["head", "neuron"] = "head",
) -> torch.Tensor:
    """How active each neuron-head (or each neuron) of a layer is on one prompt.

    Args:
        cache: Cache of an :class:`~tl_attnonly.AttnOnlyTransformer` run holding
            ``blocks.{layer}.mlp.hook_pattern`` (and ``hook_z`` for ``"z"``/``"output"``).
        layer: Layer index.
        rank_by: ``"z"``: max over tokens of ``|z|`` (at ``level="neuron"``, of the sum of the
            neuron's ``K`` heads' ``z``: the neuron's activation for any ``K``; at ``"head"``,
            one head's part of it, the neuron's activation only where ``K = 1``);
            ``"self"``: max weight on self; ``"contrast"``: max minus min weight on self (heads that
            switch between self and the bias token); ``"output"``: max ``|z| * |W_O|`` (size of
            what the head writes to the residual stream).
        batch_index: Which prompt of the batch.
        level: ``"head"`` (default here): one score per neuron-head. ``"neuron"``: one per neuron,
            from the sum of its ``K`` heads' ``z`` (what the neuron writes before ``W_out``) for
            ``"z"``/``"output"``, the largest of its heads' scores for ``"self"``/``"contrast"``.

    Returns:
        One score per neuron-head ``[n_neuron_heads]`` (or per neuron ``[d_mlp]``), higher = more
        active. On a mixture-of-experts layer (the view's cache: the experts' heads end to end,
        NaN at tokens not routed to a head's expert) each head is scored over its routed tokens.
    """
    if rank_by not in RANK_BY:
        raise ValueError(f"rank_by must be one of {RANK_BY}, got {rank_by!r}.")
    if level not in ("head", "neuron"):
        raise ValueError(f"level must be 'neuron' or 'head', got {level!r}.")
    K = converted_model_of(cache).n_heads_per_neuron
    if rank_by in ("self", "contrast"):  # NaN: a token not routed to an expert head's expert
        weight_self = _cached(cache, "pattern", layer)[batch_index, :, :, 0].float()
        ran = ~weight_self.isnan()
        score = weight_self.nan_to_num(0.0).amax(-1)
        if rank_by == "contrast":
            score = score - weight_self.masked_fill(~ran, 1.0).amin(-1)
        score = score.masked_fill(~ran.any(-1), 0.0)  # a head that saw no token
        return score.reshape(-1, K).amax(-1) if level == "neuron" else score
    z_heads = _cached(cache, "z", layer)[batch_index, :, :, 0]  # [pos, n_neuron_heads]
    if level == "neuron":  # the neuron: the sum of its heads, then the max over tokens
        z_heads = z_heads.reshape(z_heads.shape[0], -1, K).sum(-1)
    z = z_heads.float().abs().nan_to_num(0.0).amax(0)
    if rank_by == "z":
        return z
    mlp = converted_model_of(cache).blocks[layer].mlp
    if mlp.is_mixture_of_experts:
        raise NotImplementedError(
            f"rank_by='output' needs one output vector per neuron-head; layer {layer} is a "
            f"{type(mlp).__name__}, whose heads' outputs depend on the routing. Use rank_by='z'."
        )
    w_o = (mlp.W_out if level == "neuron" else mlp.W_O).detach().float().norm(dim=-1)
    return z * w_o.reshape(-1).to(z.device)


def rank_neuron_heads(
    cache: ActivationCache,
    layer: int,
    heads: HeadsLike = None,
    top_k: int | None = None,
    rank_by: str = "z",
    batch_index: int = 0,
    level: Literal["neuron", "head"] = "neuron",
) -> list[int]:
    """The neuron-heads a view shows: ``heads`` as given, else the most active first.

    At ``level="neuron"`` (the default) neurons are ranked (:func:`neuron_head_scores` with
    ``level="neuron"``) and each contributes all its ``K`` heads, consecutively; ``top_k`` counts
    neurons. At ``level="head"`` heads are ranked one by one and ``top_k`` counts heads. For
    ``K = 1`` the two are the same.

    Returns:
        Neuron-head indices (``neuron * K + k``), in display order.
    """
    model = converted_model_of(cache)
    K = model.n_heads_per_neuron
    if level not in ("neuron", "head"):
        raise ValueError(f"level must be 'neuron' or 'head', got {level!r}.")
    if heads is not None or level == "head" or K == 1:
        scores = (
            None if heads is not None else neuron_head_scores(cache, layer, rank_by, batch_index)
        )
        return select_neuron_heads(scores, len(layer_heads(model, layer)), heads, top_k)
    scores = neuron_head_scores(cache, layer, rank_by, batch_index, level="neuron")
    neurons = select_neuron_heads(scores, scores.shape[0], None, top_k)
    return [n * K + k for n in neurons for k in range(K)]


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


@dataclass(frozen=True)
class HeadSelection:
    """Which neuron-heads :func:`neuron_head_attention_view` shows.

    Attributes:
        heads: Neuron-head indices to show (``h = neuron * K + k``).
        neurons: Neuron indices to show (all ``K`` heads of each); exclusive with ``heads``.
        top_k: Keep only the ``top_k`` first neurons (``level="head"``: heads) of the ranking.
        rank_by: Ranking when no heads are given; see :func:`neuron_head_scores`.
        level: ``"neuron"`` (default) ranks neurons, ``"head"`` ranks heads
            (:func:`rank_neuron_heads`).
    """

    heads: HeadsLike = None
    neurons: HeadsLike = None
    top_k: int | None = None
    rank_by: str = "z"
    level: Literal["neuron", "head"] = "neuron"

    def with_overrides(self, **changes: Any) -> HeadSelection:
        """A copy with the given fields replaced.

        Raises:
            TypeError: For a name that is not a field, listing the fields.
        """
        return replace_options(
            self,
            changes,
            "neuron_head_attention_view() got unexpected keyword argument(s) {unknown}; "
            "the selection's fields are {names} (tl_attnonly.vis.HeadSelection).",
        )


def neuron_head_attention_view(
    source: AttnOnlyModel | ActivationCache,
    layer: int,
    tokens: TokensLike | None = None,
    *,
    page: int = 0,
    page_size: int = DEFAULT_PAGE_SIZE,
    batch_index: int = 0,
    selection: HeadSelection | None = None,
    **overrides: Any,
) -> NeuronHeadView:
    """circuitsvis attention view of a layer's neuron-heads, the bias token drawn as ``"<bias>"``.

    Heads are chosen by ``heads`` or ``neurons`` (explicit), else ranked by ``rank_by`` (most
    active first: neurons, each with all its ``K`` heads, unless ``level="head"``); ``top_k``
    keeps the first ``k`` (neurons, or heads at head level); the selection is then cut into pages of
    ``page_size`` and page ``page`` is drawn. A page never holds more than
    :data:`MAX_HEADS_PER_VIEW` heads: circuitsvis draws one chart per head.

    Args:
        source: An :class:`~tl_attnonly.AttnOnlyTransformer` or a converted ``TransformerBridge``
            (it is run on ``tokens``), or the :class:`~transformer_lens.ActivationCache` of its
            run (holding ``blocks.{layer}.mlp.hook_pattern``, and ``hook_z`` to rank by
            ``"z"``/``"output"``; an expert layer: its experts' hooks and the router's indices).
        layer: Layer index.
        tokens: The prompt: text, token ids ``[pos]``/``[batch, pos]``, or (with a cache) its
            string tokens. Needed to label the tokens.
        page: Which page of the selection (0-based).
        page_size: Heads per page (at most :data:`MAX_HEADS_PER_VIEW`).
        batch_index: Which prompt of a batch.
        selection: Which heads (:class:`HeadSelection`: ``heads``, ``neurons``, ``top_k``,
            ``rank_by``, ``level``).
        **overrides: Any of those fields by keyword (``top_k=64``); it replaces the one in
            ``selection``.

    Returns:
        A :class:`NeuronHeadView`; ``view.heads`` and ``view.n_pages`` say what it holds.

    Example:
        >>> view = neuron_head_attention_view(converted, 0, "x = 1", top_k=64, page_size=16)
        >>> view.n_pages  # 4; pass page=1, 2, 3 for the rest
    """
    if selection is not None and not isinstance(selection, HeadSelection):
        raise TypeError(
            "neuron_head_attention_view(..., selection=...) takes a tl_attnonly.vis."
            f"HeadSelection, got {type(selection).__name__}."
        )
    chosen = (selection or HeadSelection()).with_overrides(**overrides)
    heads, neurons, top_k = chosen.heads, chosen.neurons, chosen.top_k
    rank_by, level = chosen.rank_by, chosen.level
    if page_size < 1 or page_size > MAX_HEADS_PER_VIEW:
        raise ValueError(
            f"page_size must be in [1, {MAX_HEADS_PER_VIEW}] (circuitsvis draws one chart per "
            f"head), got {page_size}. Use page=... to go through a larger selection."
        )
    cache, str_tokens = cache_and_tokens(source, tokens, layer, batch_index)
    model = converted_model_of(cache)
    n_heads = len(layer_heads(model, layer))
    k_per_neuron = model.n_heads_per_neuron
    heads = heads_from_neurons(heads, neurons, k_per_neuron, n_heads // k_per_neuron)
    ranked = rank_neuron_heads(cache, layer, heads, top_k, rank_by, batch_index, level)
    n_pages = max(1, math.ceil(len(ranked) / page_size))
    if not 0 <= page < n_pages:
        raise IndexError(f"page must be in [0, {n_pages}) for {len(ranked)} heads, got {page}.")
    shown = ranked[page * page_size : (page + 1) * page_size]
    drawn = circuitsvis_pattern_args(
        _cached(cache, "pattern", layer)[batch_index, shown], str_tokens
    )
    labels = layer_head_labels(model, layer, shown)
    what = "neurons" if level == "neuron" and k_per_neuron > 1 else "heads"
    description = _RANK_DESCRIPTIONS[rank_by]
    if rank_by == "z" and what == "heads" and k_per_neuron > 1:  # one head is not the neuron
        description = (
            f"max |z| over tokens (one head's part of its neuron's activation, K = {k_per_neuron})"
        )
    how = "chosen" if heads is not None else f"{what} ranked by {description}"
    caption = (
        f"Layer {layer}: neuron-heads {page * page_size + 1}-{page * page_size + len(shown)} of "
        f"{len(ranked)} {how} (of {n_heads} in the layer; page {page + 1}/{n_pages}). "
        f"Column 0 is the bias token {BIAS_TOKEN}; the diagonal is each token's weight on itself."
    )
    if getattr(model.neuron_heads[layer], "is_mixture_of_experts", False):
        caption += (
            " A mixture of experts: its experts' neuron-heads end to end; a token not routed to "
            "a head's expert has an empty row."
        )
    props = {
        "attention": np.round(drawn["attention"].double().numpy(), 4),
        "tokens": drawn["tokens"],
        "attentionHeadNames": labels,
        "maxValue": 1.0,
        "minValue": 0.0,
        "maskUpperTri": True,
    }
    return NeuronHeadView(
        layer=layer,
        heads=shown,
        labels=labels,
        str_tokens=drawn["tokens"],
        page=page,
        n_pages=n_pages,
        n_selected=len(ranked),
        props=props,
        caption=caption,
    )


def _div_id() -> str:
    import uuid

    return "circuits-vis-" + uuid.uuid4().hex[:12]


__all__ = [
    "BIAS_TOKEN",
    "DEFAULT_PAGE_SIZE",
    "HeadSelection",
    "MAX_HEADS_PER_VIEW",
    "RANK_BY",
    "NeuronHeadView",
    "TokensLike",
    "circuitsvis_pattern_args",
    "neuron_head_attention_view",
    "neuron_head_scores",
    "select_neuron_heads",
    "square_neuron_pattern",
]
