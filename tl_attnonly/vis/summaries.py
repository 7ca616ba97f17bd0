"""An HTML view of dataset-level neuron-head summaries (dependency-free, works offline).

For each neuron-head: its firing fraction, the tokens it is most selective for, and its top
contexts. Every context is drawn as text whose tokens are shaded by the head's weight on itself,
with the centre token boxed, and beside it the centre position's attention pattern over the two
keys a neuron-head sees: ``<bias>`` (``1 - self``) and itself (``self``).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tl_attnonly.analysis.summaries import RANKINGS, NeuronHeadSummaries
from tl_attnonly.analysis.summaries.collect import token_text as _token_text


class SummaryView:
    """A rendered summary page: shown inline by Jupyter, ``save(path)`` writes a standalone file.

    Attributes:
        html: The page's HTML.
    """

    def __init__(self, page: str):
        self.html = page

    def _repr_html_(self) -> str:
        return self.html

    def __str__(self) -> str:
        return self.html

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(
            f"<!DOCTYPE html><html><meta charset='utf-8'><body>{self.html}</body></html>"
        )
        return path


def _shade(weight: float) -> str:
    if weight != weight:  # NaN: a token not routed to the head's expert
        return "transparent"
    w = min(max(weight, 0.0), 1.0)
    return f"rgba(214,39,40,{0.85 * w:.3f})"


def _pattern_cells(self_weight: float) -> str:
    cells = [("&lt;bias&gt;", 1.0 - self_weight), ("self", self_weight)]
    return "".join(
        f"<td style='background:{_shade(w)};padding:1px 4px;border:1px solid #ccc' "
        f"title='{name}: {w:.3f}'>{name} {w:.2f}</td>"
        for name, w in cells
    )


def summary_html(
    summaries: NeuronHeadSummaries,
    layer: int,
    heads: Sequence[int] | None = None,
    tokenizer: Any = None,
    ranking: str = "self",
    n_contexts: int = 5,
    n_tokens: int = 5,
) -> SummaryView:
    """HTML of the top contexts of some neuron-heads of one layer.

    A mixture-of-experts layer's heads are its experts' (:meth:`NeuronHeadSummaries.label`
    names them): firing fraction, token counts and contexts over the tokens routed to the head's
    expert; a context token not routed to it is unshaded.

    Args:
        summaries: From :func:`~tl_attnonly.analysis.summarize_neuron_heads`.
        layer: Layer.
        heads: Neuron-head indices; default the 8 with the largest firing-fraction selectivity
            (:meth:`NeuronHeadSummaries.rank` ``by="selectivity"``).
        tokenizer: To print tokens (``model.tokenizer``); without it token ids are shown.
        ranking: ``"self"`` (contexts by weight on self) or ``"abs_z"`` (by ``|z|``).
        n_contexts: Contexts per head.
        n_tokens: Most selective tokens listed per head.

    Returns:
        A :class:`SummaryView`.
    """
    if ranking not in RANKINGS:
        raise ValueError(f"ranking must be one of {RANKINGS}, got {ranking!r}.")
    if heads is None:
        by = "selectivity" if summaries.fire_count_by_token is not None else "firing_fraction"
        heads = summaries.rank(layer, by=by, top=8)
    top = summaries.top[ranking][layer]
    fire = summaries.firing_fraction()[layer]
    positions = summaries.head_positions()[layer]
    K = summaries.n_heads_per_neuron
    by_tok = (
        summaries.firing_fraction_by_token(min_count=5)[layer]
        if summaries.fire_count_by_token is not None
        else None
    )
    counts = summaries.head_token_count()[layer] if by_tok is not None else None
    parts = [
        "<div style='font-family:sans-serif;font-size:13px'>",
        f"<p>Layer {layer}, contexts ranked by "
        f"{'weight on self' if ranking == 'self' else '|z|'}; shading: the head's weight on "
        f"itself (red = fires); {summaries.n_positions} positions in {summaries.n_rows} rows.</p>",
    ]
    for head in heads:
        label = html.escape(summaries.label(layer, head))
        expert, _ = summaries.head_expert(layer, head)
        seen = "" if expert is None else f" of the {int(positions[head])} routed to its expert"
        parts.append(
            f"<h4 style='margin:8px 0 2px'>{label} &mdash; fires at "
            f"{100 * float(fire[head]):.1f}% of positions{seen}</h4>"
        )
        if by_tok is not None and counts is not None:
            row = by_tok[head].nan_to_num(-1.0)
            values, idx = row.topk(min(n_tokens, row.numel()))
            listed = [
                f"{html.escape(repr(_token_text(tokenizer, int(t))))}: {100 * float(v):.0f}% "
                f"(n={int(counts[head, t])})"
                for t, v in zip(idx, values, strict=True)
                if v >= 0
            ]
            parts.append(
                f"<div>fires most on: {', '.join(listed) or '(no token seen 5 times)'}</div>"
            )
        parts.append("<table style='border-collapse:collapse'>")
        centre = summaries.before
        for j in range(min(n_contexts, top.values.shape[1])):
            value = float(top.values[head, j])
            if value == float("-inf"):
                break
            spans = []
            for t, tok in enumerate(top.tokens[head, j].tolist()):
                if tok < 0:
                    continue
                w = float(top.self_weight[head, j, t])
                text = html.escape(_token_text(tokenizer, tok)).replace("\n", "&#8629;")
                border = "border:1px solid black;" if t == centre else ""
                title = (
                    "not routed to its expert"
                    if w != w
                    else f"self {w:.3f}, z {float(top.z[head, j, t]):.3g}"
                )
                spans.append(
                    f"<span style='background:{_shade(w)};{border}white-space:pre' "
                    f"title='{title}'>{text}</span>"
                )
            self_w = float(top.self_weight[head, j, centre])
            parts.append(
                f"<tr><td style='padding-right:6px'>{value:.3g}</td>"
                f"<td style='font-family:monospace;padding-right:8px'>{''.join(spans)}</td>"
                f"{_pattern_cells(self_w)}</tr>"
            )
        parts.append("</table>")
    parts.append(f"<p style='color:#666'>K = {K} heads per neuron.</p></div>")
    return SummaryView("".join(parts))


__all__ = ["SummaryView", "summary_html"]
