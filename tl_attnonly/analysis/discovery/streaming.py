"""The top-n edges of a head graph too large to hold its scores: streamed block by block.

:func:`top_edges` computes the same edge attribution scores as
:func:`~tl_attnonly.analysis.edge_attribution_scores`, but never holds them all. It first keeps,
for every row (example and position) of the dataset, what each source group changes and what each
input group's gradient is (the EAP score of an edge is a sum over rows of their product through
the residual stream: ``rows x (n_sources + n_inputs)`` numbers, not ``n_sources x n_inputs``);
then it scores one ``(source group, input group)`` block at a time and keeps a running top-n. The
edges it returns are the full computation's top-n (tested on small models), and their circuit runs
exactly on the restricted graph of their nodes (:meth:`TopEdges.restricted_mask`), so a circuit
of a model whose full graph has 1e9 edges needs neither a dense score tensor nor a dense mask.

Time: every edge is still scored (``O(n_edges * (d_model + rows))`` operations); memory: the
per-row terms plus one block.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pandas as pd
import torch
from jaxtyping import Int
from tqdm.auto import tqdm

from tl_attnonly._types import tokens_on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.eap_blocks import block_scores
from tl_attnonly.analysis.discovery.edge_scores import attribution_terms
from tl_attnonly.analysis.discovery.graph import EMBED, MLP_REST, HeadGraph, edge_label
from tl_attnonly.analysis.discovery.sites import (
    BLOCK_BUDGET,
    DiscoveryMetric,
    Mask,
    check_scoring_args,
    reader_matrix,
    writer_matrix,
)
from tl_attnonly.analysis.task import DiscoveryTask

if TYPE_CHECKING:
    from tl_attnonly.protocol import ModelLike


@dataclass
class TopEdges:
    """The ``n`` highest-scoring edges of a head graph (:func:`top_edges`).

    Attributes:
        frame: One row per edge, best first: ``edge, source, target, input, source_kind,
            target_kind, score`` (as :meth:`~tl_attnonly.analysis.EdgeScores.frame`).
        graph: The graph that was scored (full, or restricted by ``nodes=``).
        metric_clean, metric_corrupted: The metric of the clean and the corrupted runs.
        method: ``"eap"`` or ``"eap-ig"``.
        n_scored: How many edges were scored.
    """

    frame: pd.DataFrame
    graph: HeadGraph
    metric_clean: float
    metric_corrupted: float
    method: str
    n_scored: int

    def nodes(self) -> list[str]:
        """The attention heads and neurons the edges join (a key/value head of grouped-query
        attention stands for every query head it serves, a latent attention layer's input
        ``L{l}ATTN`` for every head of the layer, an expert layer's input ``L{l}MLP`` for its
        experts where they are its nodes)."""
        frame = self.frame
        wanted = set(frame.target)
        readers = {  # each target's reading nodes (HeadGraph.reading_nodes)
            label: self.graph.reading_nodes(dst, v)
            for dst in self.graph.inputs
            for v, label in enumerate(dst.labels)
            if label in wanted
        }
        out: dict[str, None] = {}
        for source, target in zip(frame.source, frame.target, strict=True):
            if source != EMBED:
                out[source] = None
            out.update(dict.fromkeys(readers[target]))
        return list(out)

    def restricted_mask(self, model: ModelLike) -> tuple[list[str], Mask]:
        """``(nodes, mask)``: the restricted graph of :meth:`nodes` with exactly these edges.

        Pass both to :func:`~tl_attnonly.analysis.circuit_metric` (``nodes=nodes``) for the
        circuit's exact run.
        """
        model = analysis_model(model)
        nodes = self.nodes()
        if any(g.kind == MLP_REST for g in self.graph.sources):  # keep the remainders' members
            nodes = self.graph.node_labels()
        graph = HeadGraph(model, neuron_level=self.graph.neuron_level, nodes=nodes)
        mask = graph.full_mask(False)
        position = {g.key: {label: i for i, label in enumerate(g.labels)} for g in graph.sources}
        position.update(
            {g.key: {label: i for i, label in enumerate(g.labels)} for g in graph.inputs}
        )
        for row in self.frame.itertuples():
            src = EMBED if row.source_kind == EMBED else f"{row.source_kind}.{_layer(row.source)}"
            dst = (
                "logits"
                if row.target_kind == "logits"
                else f"{row.target_kind}.{_layer(row.target)}.{row.input}"
            )
            mask[(src, dst)][position[src][row.source], position[dst][row.target]] = True
        return nodes, mask


def _layer(label: str) -> int:
    """The layer of ``"L3H1"``, ``"L3N5"``, ``"L3N5.2"``, ``"L3KV0"``."""
    return int(label[1:].split("H")[0].split("N")[0].split("K")[0])


def top_edges(
    model: ModelLike,
    n: int,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    metric: DiscoveryMetric,
    *,
    absolute: bool = True,
    progress: bool = True,
    nodes: Collection[str] | None = None,
    method: str = "eap",
    ig_steps: int = 5,
    neuron_level: bool = True,
    batch_size: int | None = None,
    block_bytes: int = BLOCK_BUDGET,
) -> TopEdges:
    """The ``n`` edges of ``model``'s head graph with the largest EAP score (or ``|score|``),
    without holding every score.

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` or a ``TransformerBridge``
            converted with :func:`tl_attnonly.convert` (in place).
        n: How many edges to keep.
        clean_tokens, corrupted_tokens: ``[n_examples, pos]``, same shape.
        metric: As in :func:`~tl_attnonly.analysis.edge_attribution_scores`.
        absolute: Rank by ``|score|`` (default) or by signed score.
        progress: Progress bars (batches, then blocks).
        nodes, method, ig_steps, neuron_level, batch_size, block_bytes: As in
            :func:`~tl_attnonly.analysis.edge_attribution_scores`.

    Returns:
        :class:`TopEdges`.
    """
    model = analysis_model(model)
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    check_scoring_args(model, clean_tokens, corrupted_tokens, method, ig_steps, neuron_level)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}.")
    graph = HeadGraph(model, neuron_level=neuron_level, nodes=nodes)
    metrics = [0.0, 0.0]
    deltas: dict[str, list[torch.Tensor]] = {}
    reads: dict[str, list] = {}
    task = DiscoveryTask(model, clean_tokens, corrupted_tokens, metric, batch_size=batch_size)
    terms = attribution_terms(task, graph, method, ig_steps, progress, metrics)
    for batch_deltas, batch_reads, weight, _ in terms:
        for key, delta in batch_deltas.items():
            deltas.setdefault(key, []).append(delta)
        for key, (g, lin) in batch_reads.items():
            reads.setdefault(key, []).append((g * weight, lin))
    rows = {key: torch.cat(parts) for key, parts in deltas.items()}
    read_rows = {key: _cat_reads(parts) for key, parts in reads.items()}
    dtype = next(model.parameters()).dtype
    best = torch.empty(0, dtype=torch.float64)
    best_score = torch.empty(0, dtype=torch.float64)
    best_where: list[tuple[int, int]] = []  # (block number, flat index), aligned with best
    blocks = list(graph.blocks())
    for b, (src, dst) in enumerate(tqdm(blocks, desc="edge blocks", disable=not progress)):
        g, lin = read_rows[dst.key]
        with torch.no_grad():
            R = reader_matrix(model, dst, graph, g)
            U = writer_matrix(model, src, graph, g)
            block = block_scores(rows[src.key], U, g, R, lin, block_bytes).to(dtype).flatten()
        rank = (block.abs() if absolute else block).to(torch.float64)
        top = rank.topk(min(n, rank.numel()))
        best = torch.cat([best, top.values])
        best_score = torch.cat([best_score, block[top.indices].to(torch.float64)])
        best_where += [(b, int(i)) for i in top.indices.tolist()]
        if len(best) > n:
            keep = best.topk(n).indices.sort().values
            best, best_score = best[keep], best_score[keep]
            best_where = [best_where[int(i)] for i in keep.tolist()]
    order = best.argsort(descending=True, stable=True)
    records = []
    for i in order.tolist():
        b, flat = best_where[i]
        src, dst = blocks[b]
        u, v = divmod(flat, len(dst.labels))
        records.append(
            (
                edge_label(src.labels[u], dst.labels[v], dst.input),
                src.labels[u], dst.labels[v], dst.input, src.kind, dst.kind,
                float(best_score[i]),
            )
        )  # fmt: skip
    frame = pd.DataFrame(
        records,
        columns=["edge", "source", "target", "input", "source_kind", "target_kind", "score"],
    )
    return TopEdges(frame, graph, metrics[0], metrics[1], method, graph.n_edges())


def _cat_reads(parts: list) -> tuple[torch.Tensor, object]:
    """Concatenate per-batch read gradients and normalisation linearisations along the rows."""
    g = torch.cat([p[0] for p in parts])
    lins = [p[1] for p in parts]
    if lins[0] is None:
        return g, None
    x_hat = torch.cat([lin[0] for lin in lins])
    inv = torch.cat([lin[1] for lin in lins])
    return g, (x_hat, inv, lins[0][2], lins[0][3])


__all__ = [
    "TopEdges",
    "top_edges",
]
