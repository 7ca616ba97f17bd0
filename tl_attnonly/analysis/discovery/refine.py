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
from tqdm.auto import tqdm

from tl_attnonly.analysis.discovery.circuit import faithfulness
from tl_attnonly.analysis.discovery.edge_scores import EdgeScores
from tl_attnonly.analysis.discovery.options import DiscoveryOptions
from tl_attnonly.analysis.discovery.pruning import (
    drop_dangling_flat,
    flatten_blocks,
    ranking_values,
    unflatten_blocks,
)
from tl_attnonly.analysis.discovery.run_metrics import run_circuits
from tl_attnonly.analysis.discovery.sites import Mask

if TYPE_CHECKING:
    from tl_attnonly.analysis.task import DiscoveryTask

#: Candidates per round: the next ``k``, ``k // 2`` and ``k // 4`` untried edges.
SHRINK = (1, 2, 4)


def prune_by_runs(
    task: DiscoveryTask,
    scores: EdgeScores,
    mask: Mask,
    metric_circuit: float,
    nodes: list[str] | None,
    opts: DiscoveryOptions,
) -> tuple[Mask, float, pd.DataFrame]:
    """Remove a circuit's edges, lowest rank first, while its exact faithfulness stays at or
    above ``opts.target`` (module docstring).

    Args:
        task: The model, prompts, metric, position classes, batch size and corrupted runs
            (:class:`~tl_attnonly.analysis.task.DiscoveryTask`).
        scores: The edge scores that rank the edges (:func:`~.edge_scores.edge_attribution_scores`).
        mask: The circuit to prune (its faithfulness should reach ``opts.target``).
        metric_circuit: The metric of ``mask``'s exact run.
        nodes: The graph's nodes, as for ``scores``.
        opts: ``target`` (faithfulness every accepted circuit keeps), ``prune_runs`` (most exact
            circuit runs; each candidate is one run), ``ranking`` (the order edges are tried in,
            lowest first, :func:`~.pruning.ranking_values`: ``"signed"`` tries the edges that
            work against the clean behaviour first, ``"absolute"`` the smallest ``|score|``),
            ``neuron_level`` (the graph's) and ``progress`` (a bar over runs).

    Returns:
        ``(mask, metric_circuit, steps)``: the pruned circuit, its exact metric, and one row per
        candidate run (``round``, ``removed`` edges tried, ``edges`` of the candidate,
        ``faithfulness``, ``accepted``).
    """
    target, max_runs, ranking = opts.target, opts.prune_runs, opts.ranking
    graph = task.graph(opts.neuron_level, nodes)
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
    bar = tqdm(total=max_runs, desc="pruning by exact runs", disable=not opts.progress)
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
        values = run_circuits(task, graph, [unflatten_blocks(c, mask, keys) for c in candidates])
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
