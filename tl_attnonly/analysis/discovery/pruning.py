"""Pruning edge scores to a circuit: the top edges by score, then no dangling edges.

A mask is ``(source group, input group) -> bool [n_sources, n_inputs]`` over
:class:`~tl_attnonly.analysis.discovery.HeadGraph`; the scores come from
:func:`~tl_attnonly.analysis.discovery.edge_attribution_scores`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from tl_attnonly.analysis.discovery.graph import EMBED, LOGITS, HeadGraph, InputGroup
from tl_attnonly.analysis.discovery.sites import Mask
from tl_attnonly.hooks import attn_head_label

if TYPE_CHECKING:
    from tl_attnonly.analysis.discovery.edge_scores import EdgeScores


def _node_of_input(graph: HeadGraph, dst: InputGroup, v: int) -> list[str]:
    """Labels of the source nodes that read input ``v`` of ``dst`` (their outputs depend on it)."""
    if dst.kind == LOGITS:
        return []
    if dst.kind == "attn" and dst.input in "kv" and graph.gqa:
        group = graph.n_heads // graph.n_kv
        j = dst.index[v]
        return [attn_head_label(dst.layer, h) for h in range(j * group, (j + 1) * group)]
    return [dst.labels[v]]


def prune(
    edge_scores: EdgeScores,
    *,
    top_n: int | None = None,
    threshold: float | None = None,
    absolute: bool = True,
    drop_dangling: bool = True,
) -> Mask:
    """Keep the ``top_n`` edges by score (or all above ``threshold``), then drop dangling edges.

    Args:
        edge_scores: From :func:`edge_attribution_scores`.
        top_n: Number of edges to keep (ties broken by order).
        threshold: Keep edges whose score (or |score|) is at least this.
        absolute: Rank by |score| (default) or by signed score.
        drop_dangling: Remove edges out of nodes with no incoming edge (their change is 0 in the
            circuit run) and into nodes whose output reaches nothing; the circuit metric is
            unchanged, exactly.

    Returns:
        A mask: ``(source group, input group) -> bool [n_sources, n_inputs]``.
    """
    if (top_n is None) == (threshold is None):
        raise ValueError("Give exactly one of top_n=... or threshold=....")
    graph, scores = edge_scores.graph, edge_scores.scores
    keys = list(scores)
    flat = flatten_blocks({k: v.abs() for k, v in scores.items()} if absolute else scores, keys)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    if top_n is not None:
        if top_n > 0:
            keep[flat.topk(min(top_n, flat.numel())).indices] = True
    elif threshold is not None:
        keep = flat >= threshold
    mask = unflatten_blocks(keep, scores, keys)
    return drop_dangling_edges(graph, mask) if drop_dangling else mask


def flatten_blocks(
    blocks: dict[tuple[str, str], torch.Tensor], keys: list[tuple[str, str]]
) -> torch.Tensor:
    """A mask's (or scores') blocks, in ``keys`` order, as one flat tensor."""
    return torch.cat([blocks[k].flatten() for k in keys])


def unflatten_blocks(
    flat: torch.Tensor, like: dict[tuple[str, str], torch.Tensor], keys: list[tuple[str, str]]
) -> Mask:
    """The inverse of :func:`flatten_blocks`: ``flat`` cut into blocks shaped as ``like``'s."""
    out, start = {}, 0
    for k in keys:
        n = like[k].numel()
        out[k] = flat[start : start + n].view_as(like[k]).clone()
        start += n
    return out


def drop_dangling_edges(graph: HeadGraph, mask: Mask) -> Mask:
    """Remove edges that cannot change the circuit metric (see :func:`prune`)."""
    mask = {k: m.clone() for k, m in mask.items()}
    while True:
        has_in: set[str] = set()
        has_out: set[str] = set()
        for src, dst in graph.blocks():
            m = mask[(src.key, dst.key)]
            if not m.any():
                continue
            for u in m.any(1).nonzero().flatten().tolist():
                has_out.add(src.labels[u])
            for v in m.any(0).nonzero().flatten().tolist():
                has_in.update(_node_of_input(graph, dst, v))
        changed = False
        for src, dst in graph.blocks():
            m = mask[(src.key, dst.key)]
            if not m.any():
                continue
            dead_u = torch.tensor(
                [src.kind != EMBED and lab not in has_in for lab in src.labels], device=m.device
            )
            dead_v = torch.tensor(
                [
                    dst.kind != LOGITS
                    and not any(n in has_out for n in _node_of_input(graph, dst, v))
                    for v in range(len(dst.labels))
                ],
                device=m.device,
            )
            new = m & ~dead_u[:, None] & ~dead_v[None, :]
            if not torch.equal(new, m):
                mask[(src.key, dst.key)] = new
                changed = True
        if not changed:
            return mask


#: How a search orders edges: by ``|score|``, or by their signed effect toward the clean run.
RANKINGS = ("signed", "absolute")


def ranking_values(edge_scores: EdgeScores, ranking: str) -> dict[tuple[str, str], torch.Tensor]:
    """Each edge's rank value (larger: kept first) under ``ranking``.

    ``"absolute"``: ``|score|``. ``"signed"``: the score times the sign of ``clean - corrupted``,
    so edges estimated to move the metric toward the clean run come first and edges estimated to
    move it away (toward the corrupted run) come last, whichever way the metric points.
    """
    if ranking not in RANKINGS:
        raise ValueError(f"ranking must be one of {RANKINGS}, got {ranking!r}.")
    if ranking == "absolute":
        return {k: v.abs() for k, v in edge_scores.scores.items()}
    direction = metric_direction(edge_scores.metric_clean, edge_scores.metric_corrupted)
    return {k: v * direction for k, v in edge_scores.scores.items()}


def metric_direction(metric_clean: float, metric_corrupted: float) -> float:
    """``+1`` when the clean run's metric is at least the corrupted one's, else ``-1``: a score
    times this is its effect toward the clean run."""
    return 1.0 if metric_clean >= metric_corrupted else -1.0


def prune_ranked(
    edge_scores: EdgeScores,
    ranking: str,
    *,
    top_n: int | None = None,
    threshold: float | None = None,
) -> Mask:
    """:func:`prune` by :func:`ranking_values`: the ``top_n`` edges (or those whose rank value is
    at least ``threshold``), dangling edges dropped."""
    ranked = replace(edge_scores, scores=ranking_values(edge_scores, ranking))
    return prune(ranked, top_n=top_n, threshold=threshold, absolute=False)


def mask_size(mask: Mask) -> int:
    """Number of edges in a mask."""
    return int(sum(int(m.sum()) for m in mask.values()))


__all__ = [
    "RANKINGS",
    "drop_dangling_edges",
    "flatten_blocks",
    "mask_size",
    "metric_direction",
    "prune",
    "prune_ranked",
    "ranking_values",
    "unflatten_blocks",
]
