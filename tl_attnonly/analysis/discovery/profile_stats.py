"""A circuit's named neurons over a corpus: running statistics, sign quadrants, top contexts.

What :func:`~.profiles.neuron_profiles` streams (its module docstring's b and c): the corpus is cut
into token rows and batches as :func:`~tl_attnonly.analysis.summarize_neuron_heads` cuts it, and
for every profiled neuron (:func:`parse_neuron_label`: ``L{layer}N{index}``) :func:`collect_stats`
keeps, per layer (:class:`LayerStats`), its firing count, the sum and largest ``|o|`` of its output
``o = sum_k z_k``, for a gated neuron the count and sums of each sign quadrant
(:data:`QUADRANTS`), per-token sums, and the top contexts of every ranking (:data:`ALL`, each
quadrant). :func:`profile_examples` and :func:`top_tokens_text` turn them into rows and text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from tl_attnonly.analysis.summaries.collect import (
    SummaryOptions,
    merge_top,
    padded_batches,
    token_rows,
    token_text,
)
from tl_attnonly.analysis.summaries.results import TopContexts
from tl_attnonly.hooks import neuron_act_name

if TYPE_CHECKING:
    from tl_attnonly.protocol import AttnOnlyModel

#: Sign quadrants of a gated neuron: sign of the gate ``g``, sign of the linear branch ``u``.
QUADRANTS = ("g+u+", "g+u-", "g-u+", "g-u-")

#: The ranking of :meth:`~.profiles.NeuronProfiles.contexts` over every position (not one
#: quadrant).
ALL = "all"

#: A neuron's label: ``L{layer}N{index}``.
NEURON_LABEL = re.compile(r"^L(\d+)N(\d+)$")


def parse_neuron_label(label: str) -> tuple[int, int]:
    """``"L3N17"`` -> ``(3, 17)``.

    Raises:
        ValueError: For anything but a neuron label (a neuron-head ``"L3N17.1"`` included).
    """
    match = NEURON_LABEL.match(label)
    if match is None:
        raise ValueError(f"Not a neuron label 'L{{layer}}N{{index}}': {label!r}.")
    return int(match.group(1)), int(match.group(2))


@dataclass
class LayerStats:
    """Running statistics of one layer's profiled neurons (``n`` of them)."""

    index: torch.Tensor  # [n] neuron indices
    labels: list[str]
    gated: bool
    top: dict[str, TopContexts]
    fire: torch.Tensor  # [n]
    out_sum: torch.Tensor  # [n] float64
    max_abs: torch.Tensor  # [n] float64
    quad_count: torch.Tensor  # [n, 4]
    quad_sum: torch.Tensor  # [n, 4] float64
    quad_abs: torch.Tensor  # [n, 4] float64
    token_sum: torch.Tensor | None  # [n, d_vocab] float64
    token_count: torch.Tensor | None  # [d_vocab]


def _empty_top(n: int, k: int, window: int) -> TopContexts:
    """Empty top contexts whose windows keep ``o`` and the self weight in float64 (the ranked
    values are float32, as in the summaries)."""
    top = TopContexts.empty(n, k, window)
    return replace(top, self_weight=top.self_weight.double(), z=top.z.double())


def collect_stats(
    model: AttnOnlyModel,
    neurons: Sequence[str],
    corpus: Iterable[str | torch.Tensor],
    opts: SummaryOptions,
) -> tuple[dict[int, LayerStats], int, int]:
    """Stream ``corpus`` once; every statistic of :mod:`.profiles`' module docstring's (b) and
    (c), with ``opts``' ``k``, ``before``, ``after``, ``max_len`` (given), ``batch_size``,
    ``max_rows``, ``token_stats`` and ``progress``."""
    k, before, after, max_len = opts.k, opts.before, opts.after, int(opts.max_len or 0)
    batch_size, max_rows, token_stats, progress = (
        opts.batch_size, opts.max_rows, opts.token_stats, opts.progress
    )  # fmt: skip
    K = model.n_heads_per_neuron
    V = model.cfg.d_vocab
    by_layer: dict[int, list[tuple[int, str]]] = {}
    for label in neurons:
        layer, index = parse_neuron_label(label)
        by_layer.setdefault(layer, []).append((index, label))
    window = before + after + 1
    stats: dict[int, LayerStats] = {}
    for layer, members in by_layer.items():
        n = len(members)
        gated = model.blocks[layer].mlp.gated
        rankings = (ALL, *QUADRANTS) if gated else (ALL,)
        stats[layer] = LayerStats(
            index=torch.tensor([i for i, _ in members]),
            labels=[label for _, label in members],
            gated=gated,
            top={r: _empty_top(n, k, window) for r in rankings},
            fire=torch.zeros(n, dtype=torch.long),
            out_sum=torch.zeros(n, dtype=torch.float64),
            max_abs=torch.zeros(n, dtype=torch.float64),
            quad_count=torch.zeros(n, 4, dtype=torch.long),
            quad_sum=torch.zeros(n, 4, dtype=torch.float64),
            quad_abs=torch.zeros(n, 4, dtype=torch.float64),
            token_sum=torch.zeros(n, V, dtype=torch.float64) if token_stats else None,
            token_count=torch.zeros(V, dtype=torch.long) if token_stats else None,
        )
    names = set()
    for layer, st in stats.items():
        names |= {neuron_act_name("pattern", layer), neuron_act_name("z", layer)}
        if st.gated:
            names |= {neuron_act_name("pre", layer), neuron_act_name("pre_linear", layer)}
    n_positions = n_rows = 0
    bar = tqdm(desc="neuron profiles (rows)", disable=not progress, unit="row")
    rows = token_rows(model, corpus, max_len)
    for tokens, lengths, valid in padded_batches(rows, batch_size, max_rows):
        n_batch, pad = tokens.shape
        with torch.no_grad():
            _, cache = model.run_with_cache(
                tokens.to(model.cfg.device), names_filter=lambda name: name in names
            )
        for layer, st in stats.items():
            n = len(st.labels)
            heads = (st.index[:, None] * K + torch.arange(K)).flatten()  # [n * K]
            z = cache[neuron_act_name("z", layer)][..., heads, 0].double().cpu()
            out = z.reshape(n_batch, pad, n, K).sum(-1)  # [batch, pos, n]: sum_k z_k
            pattern = cache[neuron_act_name("pattern", layer)][:, heads, :, 0].double().cpu()
            self_w = pattern.reshape(n_batch, n, K, pad).mean(2).transpose(1, 2)  # [b, pos, n]
            out = out.masked_fill(~valid[..., None], 0.0)
            st.fire += ((self_w > 0.5) & valid[..., None]).sum((0, 1))
            st.out_sum += out.sum((0, 1))
            st.max_abs = torch.maximum(st.max_abs, out.abs().amax((0, 1)))
            if st.token_sum is not None and st.token_count is not None:
                flat = tokens[valid]
                st.token_sum.index_add_(1, flat, out[valid].T)
                st.token_count += torch.bincount(flat, minlength=V)
            ranked = {ALL: out.abs()}
            if st.gated:
                g = cache[neuron_act_name("pre", layer)][..., st.index].cpu()
                u = cache[neuron_act_name("pre_linear", layer)][..., st.index].cpu()
                for j, q in enumerate(QUADRANTS):
                    inside = ((g > 0) if q[1] == "+" else ~(g > 0)) & (
                        (u > 0) if q[3] == "+" else ~(u > 0)
                    )
                    inside &= valid[..., None]
                    st.quad_count[:, j] += inside.sum((0, 1))
                    st.quad_sum[:, j] += out.masked_fill(~inside, 0.0).sum((0, 1))
                    st.quad_abs[:, j] += out.abs().masked_fill(~inside, 0.0).sum((0, 1))
                    ranked[q] = out.abs().masked_fill(~inside, -math.inf)
            for ranking, values in ranked.items():
                st.top[ranking] = merge_top(
                    st.top[ranking], values, tokens, self_w, out, lengths, n_rows, before, after
                )
        n_positions += int(valid.sum())
        n_rows += n_batch
        bar.update(n_batch)
    bar.close()
    return stats, n_positions, n_rows


def profile_examples(
    stats: dict[int, LayerStats], tokenizer: Any, before: int
) -> tuple[pd.DataFrame, dict[str, list[str]]]:
    """Every kept context as a row; and per neuron its best contexts' texts (ranking ``all``)."""
    rows = []
    best: dict[str, list[str]] = {}
    for st in stats.values():
        for ranking, top in st.top.items():
            for j, label in enumerate(st.labels):
                for r in range(top.values.shape[1]):
                    if top.values[j, r] == -math.inf:
                        break
                    window = top.tokens[j, r].tolist()
                    pieces = [
                        (
                            f"⟦{token_text(tokenizer, t)}⟧"
                            if i == before
                            else token_text(tokenizer, t)
                        )
                        for i, t in enumerate(window)
                        if t >= 0
                    ]
                    text = "".join(pieces)
                    rows.append(
                        dict(
                            neuron=label,
                            ranking=ranking,
                            rank=r,
                            output=float(top.z[j, r, before]),
                            self_weight=float(top.self_weight[j, r, before]),
                            document=int(top.document[j, r]),
                            position=int(top.position[j, r]),
                            token=token_text(tokenizer, window[before]),
                            text=text,
                        )
                    )
                    if ranking == ALL:
                        best.setdefault(label, []).append(text)
    columns = ["neuron", "ranking", "rank", "output", "self_weight", "document", "position"]
    return pd.DataFrame(rows, columns=[*columns, "token", "text"]), best


def top_tokens_text(st: LayerStats, j: int, tokenizer: Any, n: int, min_count: int) -> str:
    """``"' the' +0.53 (n=12), ..."``: the tokens with the largest mean ``|output|``."""
    if st.token_sum is None or st.token_count is None or n <= 0:
        return ""
    count = st.token_count.double()
    mean = st.token_sum[j] / count.clamp(min=1)
    score = mean.abs().masked_fill(count < max(min_count, 1), -1.0)
    values, idx = score.topk(min(n, score.numel()))
    return ", ".join(
        f"{token_text(tokenizer, int(t))!r} {float(mean[t]):+.3g} (n={int(count[t])})"
        for v, t in zip(values, idx, strict=True)
        if v >= 0
    )


__all__ = [
    "ALL",
    "NEURON_LABEL",
    "QUADRANTS",
    "LayerStats",
    "collect_stats",
    "parse_neuron_label",
    "profile_examples",
    "top_tokens_text",
]
