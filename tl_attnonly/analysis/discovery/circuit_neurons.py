"""Each neuron's attribution along its MLP node's circuit edges (``neuron_ranking="circuit"``).

Node attribution (:func:`~.search.top_nodes`) estimates patching neuron ``i`` of layer ``l``
into the corrupted run with every later reader receiving its change: to first order,

    ``score_i = sum_{batch, pos} delta_i (W_out[i] . d metric / d resid)``

where ``d metric / d resid`` (after the MLP of layer ``l``) is the sum over every later reader
``r`` of what ``r``'s gradient reads back through its normalisation (``H_r``, the read
direction of edge attribution patching, :mod:`.edge_scores`). In the adaptive neuron stage's
runs (:mod:`.neuron_stage`) a named neuron passes its change on along the circuit's edges of
``L{l}MLP`` only; the other readers read the corrupted run. Its first-order effect there is the
same sum over those readers alone:

    ``circuit_score_i = sum_{batch, pos} delta_i (W_out[i] . sum_{L{l}MLP -> r in circuit} H_r)``

the sum over the circuit's edges of ``L{l}MLP`` of the EAP scores that the edges of neuron ``i``
would have on the graph with every neuron named (the test compares them), computed with one
gradient pass per batch (``method="eap"``; ``"eap-ig"``: ``ig_steps`` passes) on the coarse graph,
without building that graph. With every edge of the coarse graph in the circuit it is node
attribution's score (its ``d metric / d resid`` is every reader's: the test compares them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd
import torch

from tl_attnonly._types import tokens_on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.eap_blocks import read_directions
from tl_attnonly.analysis.discovery.edge_scores import attribution_terms
from tl_attnonly.analysis.discovery.graph import MLP_REST, HeadGraph
from tl_attnonly.analysis.discovery.positions import PositionClasses
from tl_attnonly.analysis.discovery.sites import (
    DiscoveryMetric,
    Mask,
    batch_indices,
    check_additive,
    check_scoring_args,
    reader_matrix,
    writer_matrix,
)
from tl_attnonly.analysis.task import DiscoveryTask

if TYPE_CHECKING:
    from tl_attnonly.protocol import ModelLike


def circuit_neuron_scores(
    model: ModelLike,
    graph: HeadGraph,
    mask: Mask,
    clean_tokens: torch.Tensor,
    corrupted_tokens: torch.Tensor,
    metric: DiscoveryMetric,
    layers: Sequence[int],
    *,
    method: str = "eap",
    ig_steps: int = 5,
    batch_size: int | None = None,
    positions: PositionClasses | None = None,
    progress: bool = False,
) -> pd.Series:
    """Each neuron of ``layers``' attribution along its MLP node's edges in the circuit ``mask``
    (module docstring).

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` (or a converted bridge).
        graph: The circuit's coarse graph (each of ``layers`` an MLP node ``L{l}MLP`` holding
            every neuron of its layer: :func:`~.search.coarse_nodes`).
        mask: The circuit, ``(source group, input group) -> bool [n_sources, n_inputs]``.
        clean_tokens, corrupted_tokens: ``[n_examples, pos]``.
        metric: As in :func:`~tl_attnonly.analysis.edge_attribution_scores`.
        layers: The MLP nodes' layers to score.
        method: ``"eap"`` (the gradient on the corrupted run) or ``"eap-ig"``.
        ig_steps: Interpolation steps of ``"eap-ig"``.
        batch_size: Examples per pass; default all at once.
        positions: The graph's position classes, if it is resolved by position.
        progress: Progress bar over passes.

    Returns:
        ``L{l}N{i}`` -> estimated change of the metric (metric units), for every neuron of
        ``layers`` (0 for a layer whose node has no edge in the circuit).

    Raises:
        ValueError: If a layer's MLP is not one node of ``graph`` holding every neuron.
    """
    model = analysis_model(model)
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    check_scoring_args(model, clean_tokens, corrupted_tokens, method, ig_steps, graph.neuron_level)
    check_additive(model, clean_tokens, metric, batch_indices(clean_tokens.shape[0], batch_size))
    d_mlp = int(model.cfg.d_mlp or 0)
    sources = {}
    for li in layers:
        src = graph.source_by_key.get(f"mlp.{li}")
        if src is None or src.kind != MLP_REST or len(src.index) != d_mlp:
            raise ValueError(
                f"Layer {li}'s MLP is not one node L{li}MLP of every neuron in this graph: "
                "circuit neuron scores need the coarse graph (coarse_nodes(model))."
            )
        sources[li] = src
    # per layer, each reader group's circuit columns (the readers joined to L{l}MLP)
    joined = {
        li: [
            (dst, mask[(src.key, dst.key)][0].to(clean_tokens.device))
            for dst in graph.inputs
            if dst.labels and dst.order > src.order and bool(mask[(src.key, dst.key)].any())
        ]
        for li, src in sources.items()
    }
    totals = {li: torch.zeros(d_mlp, dtype=torch.float64) for li in layers}
    readers: dict[str, torch.Tensor] = {}
    summed: dict[int, torch.Tensor] = {}  # layer -> [rows, d]: the circuit readers' directions
    task = DiscoveryTask(
        model, clean_tokens, corrupted_tokens, metric, positions, batch_size=batch_size
    )
    for deltas, reads, weight, batch_done in attribution_terms(
        task, graph, method, ig_steps, progress, [0.0, 0.0]
    ):
        with torch.no_grad():
            for li, edges in joined.items():
                for dst, cols in edges:
                    g, lin, *class_rows = reads[dst.key]
                    if dst.key not in readers:
                        readers[dst.key] = reader_matrix(model, dst, graph, g)
                    H = read_directions(g[:, cols], readers[dst.key][cols], lin).sum(1)
                    if li not in summed:
                        rows = deltas[sources[li].key].shape[0]
                        summed[li] = H.new_zeros(rows, H.shape[-1])
                    if class_rows:  # a position class's input: its rows only
                        summed[li].index_add_(0, class_rows[0], H * weight)
                    else:
                        summed[li] += H * weight
            if not batch_done:
                continue
            for li, H in summed.items():
                delta = deltas[sources[li].key][:, 0].to(H.dtype)  # [rows, d_mlp]
                U = writer_matrix(model, sources[li], graph, delta)[0].to(H.dtype)  # [m, d]
                totals[li] += (delta * (H @ U.T)).sum(0).double().cpu()
            summed = {}
    return pd.Series(
        {f"L{li}N{i}": float(v) for li in layers for i, v in enumerate(totals[li].tolist())}
    )


__all__ = ["circuit_neuron_scores"]
