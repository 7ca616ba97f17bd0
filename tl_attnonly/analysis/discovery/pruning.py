"""Pruning edge scores to a circuit: the top edges by score, then no dangling edges.

A mask is ``(source group, input group) -> bool [n_sources, n_inputs]`` over
:class:`~tl_attnonly.analysis.discovery.HeadGraph`; the scores come from
:func:`~tl_attnonly.analysis.discovery.edge_attribution_scores`.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from jaxtyping import Bool

from tl_attnonly.analysis.discovery.graph import EMBED, LOGITS, HeadGraph
from tl_attnonly.analysis.discovery.sites import Mask

if TYPE_CHECKING:
    from tl_attnonly.analysis.discovery.scored_edges import EdgeScores


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


class _EdgeNodes:
    """Each edge of a graph's flat mask (:func:`flatten_blocks`, in ``graph.blocks()`` order)
    as node ids, for :func:`drop_dangling_edges`: the node of its source row (``src``), its
    input column (``col``), each column's reading nodes (``col_nodes``, padded with -1: a
    grouped key or value input is read by every head of its group), and which nodes never
    die for want of an input (the embedding) and which columns never die for want of a
    reader (the logits)."""

    def __init__(self, graph: HeadGraph):
        ids: dict[str, int] = {}
        src: list[torch.Tensor] = []
        col: list[torch.Tensor] = []
        col_nodes: list[list[int]] = []
        logits_col: list[bool] = []
        blocks = list(graph.blocks())
        self.keys = [(s.key, d.key) for s, d in blocks]
        col_start: dict[str, int] = {}
        for dst in graph.inputs:
            col_start[dst.key] = len(col_nodes)
            for v in range(len(dst.labels)):
                col_nodes.append([ids.setdefault(n, len(ids)) for n in graph.reading_nodes(dst, v)])
                logits_col.append(dst.kind == LOGITS)
        for s, d in blocks:
            rows = torch.tensor([ids.setdefault(lab, len(ids)) for lab in s.labels])
            cols = torch.arange(len(d.labels)) + col_start[d.key]
            src.append(rows[:, None].expand(-1, len(cols)).flatten())
            col.append(cols[None, :].expand(len(rows), -1).flatten())
        embed = torch.zeros(len(ids), dtype=torch.bool)
        for s in graph.sources:
            if s.kind == EMBED:
                embed[[ids[lab] for lab in s.labels]] = True
        width = max((len(n) for n in col_nodes), default=0)
        padded = torch.full((len(col_nodes), max(width, 1)), -1, dtype=torch.long)
        for c, nodes in enumerate(col_nodes):
            padded[c, : len(nodes)] = torch.tensor(nodes, dtype=torch.long)
        self.n_nodes = len(ids)
        # int32 (8 bytes an edge in all: 24 MB for a 3M-edge graph, kept while the graph lives)
        self.src = (torch.cat(src) if src else torch.zeros(0, dtype=torch.long)).int()
        self.col = (torch.cat(col) if col else torch.zeros(0, dtype=torch.long)).int()
        self.col_nodes = padded
        self.logits_col = torch.tensor(logits_col, dtype=torch.bool)
        self.embed = embed

    def to(self, device: torch.device) -> _EdgeNodes:
        """A copy of the index with its tensors on ``device``."""
        moved = copy.copy(self)
        for name in ("src", "col", "col_nodes", "logits_col", "embed"):
            setattr(moved, name, getattr(self, name).to(device))
        return moved


#: graph -> device -> its :class:`_EdgeNodes` (built on the first pruning of the graph)
_EDGE_NODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _edge_nodes(graph: HeadGraph, device: torch.device | None = None) -> _EdgeNodes:
    """The graph's edge index (on the CPU, or on ``device``), made once per graph and device."""
    on = _EDGE_NODES.setdefault(graph, {})
    cpu = torch.device("cpu")
    if cpu not in on:
        on[cpu] = _EdgeNodes(graph)
    device = cpu if device is None else device
    if device not in on:
        on[device] = on[cpu].to(device)
    return on[device]


def drop_dangling_edges(graph: HeadGraph, mask: Mask) -> Mask:
    """Remove edges that cannot change the circuit metric (see :func:`prune`): repeatedly, every
    edge whose source node has no kept input edge (the embedding excepted) or whose input is
    read by no node with a kept output edge (the logits excepted), until none is removed.

    All edges at once, as node ids (:class:`_EdgeNodes`, built once per graph): a few tensor
    operations per round on the whole mask, not several per block (a coarse graph of
    SmolLM2-135M has about 3,700 blocks; pruning calls this once per candidate)."""
    keys = _edge_nodes(graph).keys
    return unflatten_blocks(drop_dangling_flat(graph, flatten_blocks(mask, keys), keys), mask, keys)


def drop_dangling_flat(
    graph: HeadGraph, flat: Bool[torch.Tensor, " n_edges"], keys: list[tuple[str, str]]
) -> Bool[torch.Tensor, " n_edges"]:
    """:func:`drop_dangling_edges` on a flat mask (:func:`flatten_blocks` in ``keys`` order),
    returned flat in the same order (a new tensor)."""
    index = _edge_nodes(graph)
    if keys != index.keys:  # another order: through the blocks
        shapes = {(s.key, d.key): (len(s.labels), len(d.labels)) for s, d in graph.blocks()}
        like = {k: torch.empty(shapes[k], dtype=torch.bool, device="meta") for k in keys}
        blocks = unflatten_blocks(flat, like, keys)
        return flatten_blocks(drop_dangling_edges(graph, blocks), keys)
    index = _edge_nodes(graph, flat.device)
    alive = flat.clone()
    valid = index.col_nodes >= 0
    while True:
        has_out = torch.zeros(index.n_nodes, dtype=torch.bool, device=flat.device)
        has_out[index.src[alive]] = True
        read = torch.zeros(len(index.col_nodes), dtype=torch.bool, device=flat.device)
        read[index.col[alive]] = True
        has_in = torch.zeros(index.n_nodes, dtype=torch.bool, device=flat.device)
        has_in[index.col_nodes[read][valid[read]]] = True
        dead_node = ~has_in & ~index.embed
        read_on = (has_out[index.col_nodes.clamp(min=0)] & valid).any(1)
        dead_col = ~read_on & ~index.logits_col
        new = alive & ~dead_node[index.src] & ~dead_col[index.col]
        if torch.equal(new, alive):
            return alive
        alive = new


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
    "drop_dangling_flat",
    "flatten_blocks",
    "mask_size",
    "metric_direction",
    "prune",
    "prune_ranked",
    "ranking_values",
    "unflatten_blocks",
]
