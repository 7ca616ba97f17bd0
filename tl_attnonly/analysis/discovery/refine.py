"""Greedy pruning of a found circuit by exact runs (the stage after the sweep).

The sweep (:mod:`.sweep`) returns the smallest top-``n`` circuit reaching the faithfulness target.
A top-``n`` circuit keeps every edge above a rank, and first-order scores miss interactions: some
kept edges are not needed once the others are there, and some work against the behaviour, so
removing them keeps (or raises) faithfulness. :func:`prune_by_runs` walks the circuit's edges from
the lowest rank up (:func:`~.pruning.ranking_values`) and removes them in chunks, each removal
checked by an exact circuit run:

* a round runs three candidates in one :func:`~.runs.circuit_metrics` call (one corrupted run):
  the circuit without its next ``k``, ``k // 2`` and ``k // 4`` untried edges (dangling edges
  dropped, which changes no metric);
* the largest removal whose faithfulness stays at or above the target is kept and ``k`` doubles;
  if none is, the ``k // 4`` edges are marked kept (never tried again) and ``k`` halves;
* it stops when every edge has been tried or after ``max_runs`` runs.

Every accepted circuit's faithfulness is its exact run's, so the result reaches the target by
construction; it is a subset of the input circuit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from jaxtyping import Int
from tqdm.auto import tqdm

from tl_attnonly._types import tokens_on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.circuit import faithfulness
from tl_attnonly.analysis.discovery.edge_scores import EdgeScores
from tl_attnonly.analysis.discovery.positions import PositionClasses
from tl_attnonly.analysis.discovery.pruning import (
    drop_dangling_flat,
    flatten_blocks,
    ranking_values,
    unflatten_blocks,
)
from tl_attnonly.analysis.discovery.run_metrics import circuit_metrics
from tl_attnonly.analysis.discovery.run_reuse import CorruptedRuns
from tl_attnonly.analysis.discovery.sites import DiscoveryMetric, Mask

if TYPE_CHECKING:
    from tl_attnonly.protocol import ModelLike

#: Candidates per round: the next ``k``, ``k // 2`` and ``k // 4`` untried edges.
SHRINK = (1, 2, 4)


def prune_by_runs(
    model: ModelLike,
    scores: EdgeScores,
    mask: Mask,
    metric_circuit: float,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    metric: DiscoveryMetric,
    *,
    target: float,
    max_runs: int,
    ranking: str = "signed",
    nodes: list[str] | None = None,
    neuron_level: bool = True,
    batch_size: int | None = None,
    positions: PositionClasses | None = None,
    progress: bool = True,
    corrupted_runs: CorruptedRuns | None = None,
) -> tuple[Mask, float, pd.DataFrame]:
    """Remove a circuit's edges, lowest rank first, while its exact faithfulness stays at or
    above ``target`` (module docstring).

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer`.
        scores: The edge scores that rank the edges (:func:`~.edge_scores.edge_attribution_scores`).
        mask: The circuit to prune (its faithfulness should reach ``target``).
        metric_circuit: The metric of ``mask``'s exact run.
        clean_tokens, corrupted_tokens, metric: As in :func:`~.runs.circuit_metrics`.
        target: Faithfulness every accepted circuit keeps.
        max_runs: Most exact circuit runs (each candidate is one run).
        ranking: The order edges are tried in, lowest first (:func:`~.pruning.ranking_values`):
            ``"signed"`` (default) tries the edges that work against the clean behaviour first,
            ``"absolute"`` the smallest ``|score|``.
        nodes, neuron_level, batch_size, positions: The graph and batches, as for ``scores``.
        progress: Progress bar over runs.
        corrupted_runs: A :class:`~.runs.CorruptedRuns` shared with other calls.

    Returns:
        ``(mask, metric_circuit, steps)``: the pruned circuit, its exact metric, and one row per
        candidate run (``round``, ``removed`` edges tried, ``edges`` of the candidate,
        ``faithfulness``, ``accepted``).
    """
    model = analysis_model(model)
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    m_clean, m_corr = scores.metric_clean, scores.metric_corrupted
    keys = list(scores.scores)
    flat_scores = flatten_blocks(ranking_values(scores, ranking), keys)
    cur = flatten_blocks(mask, keys).to(torch.bool)
    # ascending rank value, ties by position (deterministic)
    order = torch.sort(flat_scores.cpu(), stable=True).indices.to(cur.device)
    order = order[cur[order]]
    kept = torch.zeros_like(cur)
    value = metric_circuit
    k = max(1, int(cur.sum()) // 4)
    rows: list[dict[str, Any]] = []
    runs, rnd = 0, 0
    bar = tqdm(total=max_runs, desc="pruning by exact runs", disable=not progress)
    while runs < max_runs:
        live = order[cur[order] & ~kept[order]]
        if len(live) == 0:
            break
        sizes = sorted({max(1, k // s) for s in SHRINK}, reverse=True)[: max_runs - runs]
        candidates = []
        for size in sizes:
            flat = cur.clone()
            flat[live[:size]] = False
            candidates.append(drop_dangling_flat(scores.graph, flat, keys))
        values = circuit_metrics(
            model, [unflatten_blocks(c, mask, keys) for c in candidates], clean_tokens,
            corrupted_tokens, metric, neuron_level=neuron_level, nodes=nodes,
            batch_size=batch_size, positions=positions, corrupted_runs=corrupted_runs,
        )  # fmt: skip
        runs += len(candidates)
        bar.update(len(candidates))
        faith = [faithfulness(v, m_clean, m_corr) for v in values]
        passing = [i for i, f in enumerate(faith) if f >= target]
        for i, (size, cand) in enumerate(zip(sizes, candidates, strict=True)):
            rows.append(
                dict(round=rnd, removed=size, edges=int(cand.sum()), faithfulness=faith[i],
                     accepted=bool(passing) and i == passing[0])
            )  # fmt: skip
        if passing:
            i = passing[0]
            cur, value = candidates[i], values[i]
            k = sizes[i] * 2
        else:
            kept[live[: sizes[-1]]] = True
            k = max(1, sizes[-1] // 2)
        rnd += 1
        bar.set_postfix(edges=int(cur.sum()))
    bar.close()
    columns = ["round", "removed", "edges", "faithfulness", "accepted"]
    return unflatten_blocks(cur, mask, keys), value, pd.DataFrame(rows, columns=columns)


__all__ = ["prune_by_runs"]
