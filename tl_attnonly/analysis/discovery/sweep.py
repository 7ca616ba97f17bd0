"""The sweep of :func:`~.search.discover_circuit`: exact runs of top-``n`` circuits to a target.

Exact circuit runs (:func:`~.runs.circuit_metrics`) of the top ``n`` edges for geometric ``n``
(64, 128, ...; small graphs from 1/64 of their edges) until one reaches the faithfulness
``target``, then bisection between the largest size below the target and the smallest above it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pandas as pd

from tl_attnonly.analysis.discovery.circuit import faithfulness
from tl_attnonly.analysis.discovery.edge_scores import EdgeScores
from tl_attnonly.analysis.discovery.options import DiscoveryOptions
from tl_attnonly.analysis.discovery.pruning import mask_size, prune_ranked
from tl_attnonly.analysis.discovery.run_metrics import run_circuits
from tl_attnonly.analysis.discovery.sites import Mask

if TYPE_CHECKING:
    from tl_attnonly.analysis.task import DiscoveryTask

#: A faithfulness this much below one at fewer edges counts as a fall (warning).
MONOTONE_TOLERANCE = 0.05
#: First size of the geometric sweep (graphs of fewer than 64 x 64 edges: 1/64 of their edges).
FIRST_SIZE = 64


def curve_warnings(curve: pd.DataFrame) -> list[str]:
    out = []
    best_faith, best_edges = -math.inf, 0
    for row in curve.sort_values("edges", kind="stable").itertuples():
        if row.faithfulness < best_faith - MONOTONE_TOLERANCE:
            out.append(
                f"faithfulness falls as edges are added: {best_faith:.3f} at {best_edges} edges, "
                f"{row.faithfulness:.3f} at {row.edges} edges; the edge ranking is not a good "
                "order here (try method='eap-ig', more ig_steps, or another graph)."
            )
            break
        if row.faithfulness > best_faith:
            best_faith, best_edges = row.faithfulness, row.edges
    return out


def sweep_to_target(
    task: DiscoveryTask, scores: EdgeScores, nodes: list[str] | None, opts: DiscoveryOptions
):
    """Exact runs of top-``n`` circuits: geometric ``n``, then bisection (module docstring), on
    the task's model, prompts and metric (its corrupted runs shared); ``nodes``: the graph's.

    Returns ``(mask, metric_circuit, curve, ceiling_metric, warnings)``.
    """
    graph = scores.graph
    runs_graph = task.graph(opts.neuron_level, nodes)
    n_all = graph.n_edges()
    m_clean, m_corr = scores.metric_clean, scores.metric_corrupted
    points: dict[int, tuple[Mask, float]] = {}
    runs = 0

    def run(sizes: list[int]) -> None:
        nonlocal runs
        sizes = [n for n in sizes if n not in points]
        if not sizes:
            return
        masks = [
            graph.full_mask() if n >= n_all else prune_ranked(scores, opts.ranking, top_n=n)
            for n in sizes
        ]
        values = run_circuits(task, runs_graph, masks, progress=opts.progress)
        runs += len(sizes)
        for n, mask, value in zip(sizes, masks, values, strict=True):
            points[n] = (mask, value)

    def faith(n: int) -> float:
        return faithfulness(points[n][1], m_clean, m_corr)

    notes: list[str] = []
    run([n_all])  # the ceiling
    ceiling = faith(n_all)
    if ceiling < opts.target:
        notes.append(
            f"the ceiling is low: the graph's every edge ({n_all:,}) reaches faithfulness "
            f"{ceiling:.3f} < target {opts.target}; no circuit of this graph can reach the target "
            "(the nodes left out of the graph are frozen to the corrupted run): returning the full "
            "graph. Use graph='coarse' or more nodes."
        )
        found = n_all
    else:
        sizes, n = [], max(1, min(FIRST_SIZE, n_all // FIRST_SIZE))
        while n < n_all:
            sizes.append(n)
            n *= 2
        found = n_all
        lo = 0
        for n in sizes:
            if runs >= opts.max_runs:
                notes.append(
                    f"the sweep stopped after max_runs={opts.max_runs} runs before reaching the "
                    f"target; returning the full graph ({n_all:,} edges)."
                )
                break
            run([n])
            if faith(n) >= opts.target:
                found = n
                break
            lo = n
        while lo and found > lo * opts.resolution and runs < opts.max_runs:
            mid = int(round(math.sqrt(lo * found)))
            if mid in (lo, found):
                break
            run([mid])
            if faith(mid) >= opts.target:
                found = mid
            else:
                lo = mid
    curve = pd.DataFrame(
        [
            dict(top_n=n, edges=mask_size(mask), metric=value, faithfulness=faith(n))
            for n, (mask, value) in sorted(points.items())
        ],
        columns=["top_n", "edges", "metric", "faithfulness"],
    )
    # Ranked by signed effect, the top-n circuits hold no opposing edge until every helping one is
    # in, while the full graph holds them all: a curve above 1 that comes back to 1 at the full
    # graph is what that ranking does, not a poor order, so the full graph is left out of the check.
    notes += curve_warnings(curve if opts.ranking == "absolute" else curve[curve.top_n < n_all])
    return points[found][0], points[found][1], curve, ceiling, notes


__all__ = ["FIRST_SIZE", "MONOTONE_TOLERANCE", "curve_warnings", "sweep_to_target"]
