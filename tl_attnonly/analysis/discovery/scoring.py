"""Honest scoring of circuits: recovery and distance side by side, over sizes, for both rankings.

A single faithfulness at a single size hides two things. A circuit ranked by signed effect
(``ranking="signed"``) leaves out the edges that work against the behaviour, so its faithfulness
can pass 1: it *recovers* the behaviour and more, without *being* the model. And the size at which
a target is reached says nothing of the sizes around it. The MIB benchmark (Mueller et al. 2025,
*MIB: A Mechanistic Interpretability Benchmark*, arXiv 2504.13151; its circuit track's
``MIB_circuit_track/evaluation.py``, ``evaluate_area_under_curve``) scores a ranking of edges by
the exact faithfulness ``f(k)`` of its top-``k`` circuits at the edge fractions
``0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1`` (:data:`MIB_FRACTIONS`) and two
trapezoid areas over those sizes:

* **CPR** (circuit performance ratio): the area under ``f`` -- how much the circuits recover
  (higher is better; can exceed what the full model does when opposing edges are left out);
* **CMD** (circuit-model distance): the area under ``|1 - f|`` -- how far the circuits are from
  the full model (lower is better; overshooting counts against it).

Here the size axis is the circuit's edge count over the graph's (``size = edges / n_edges``; MIB
takes its sizes as the same fractions of its graph's edges), so the areas lie in ``[0, 1]`` when
``f`` does. :func:`score_curve` computes both from any curve of exact runs (a sweep's
``Circuit.curve`` too, on its own sizes: areas are only comparable on one grid);
:func:`faithfulness_curve` runs the MIB grid for a ranking; :func:`compare_rankings` puts the
signed and the absolute ranking side by side on the same prompts and the same edge scores (one
scoring, then exact runs only): each ranking's sweep to the target (:func:`~.sweep.sweep_to_target`)
and its CPR / CMD on the grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pandas as pd
import torch
from jaxtyping import Int

from tl_attnonly._types import tokens_on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.circuit import Circuit, faithfulness
from tl_attnonly.analysis.discovery.edge_scores import EdgeScores
from tl_attnonly.analysis.discovery.options import DiscoveryOptions
from tl_attnonly.analysis.discovery.positions import PositionClasses
from tl_attnonly.analysis.discovery.pruning import RANKINGS, mask_size, prune_ranked
from tl_attnonly.analysis.discovery.run_metrics import circuit_metrics
from tl_attnonly.analysis.discovery.run_reuse import CorruptedRuns
from tl_attnonly.analysis.discovery.sites import DiscoveryMetric, check_discoverable
from tl_attnonly.analysis.discovery.sweep import sweep_to_target
from tl_attnonly.analysis.task import DiscoveryTask

if TYPE_CHECKING:
    from tl_attnonly.protocol import ModelLike

#: MIB's circuit sizes, as fractions of the graph's edges (``evaluate_area_under_curve``).
MIB_FRACTIONS: tuple[float, ...] = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


@dataclass(frozen=True)
class CurveScores:
    """CPR-style and CMD-style figures of one faithfulness-vs-size curve (:func:`score_curve`).

    Attributes:
        table: One row per size, smallest first: ``edges``, ``size`` (``edges / n_edges``),
            ``faithfulness`` (CPR-style: what the circuit recovers) and ``distance``
            (CMD-style: ``|1 - faithfulness|``, how far it is from the full model).
        cpr: Trapezoid area under ``faithfulness`` over ``size`` (higher: recovers more).
        cmd: Trapezoid area under ``distance`` over ``size`` (lower: closer to the model).
        n_edges: The graph's edge count (the size axis's unit).
    """

    table: pd.DataFrame
    cpr: float
    cmd: float
    n_edges: int


def _trapezoid(x: Sequence[float], y: Sequence[float]) -> float:
    return float(sum((x[i + 1] - x[i]) * (y[i] + y[i + 1]) / 2 for i in range(len(x) - 1)))


def score_curve(curve: pd.DataFrame, n_edges: int) -> CurveScores:
    """CPR-style and CMD-style figures of a curve of exact faithfulness values, side by side.

    Args:
        curve: Columns ``edges`` (circuit size) and ``faithfulness`` (its exact run), e.g.
            ``Circuit.curve`` or :func:`faithfulness_curve`'s; rows of equal size are averaged.
        n_edges: The graph's edge count (``circuit.graph.n_edges()``).

    Returns:
        :class:`CurveScores`; its areas are over the sizes the curve has (MIB's grid:
        :func:`faithfulness_curve`), 0 for a curve of one size.

    Raises:
        ValueError: For a curve without those columns, no rows, or a size outside
            ``[0, n_edges]``.
    """
    missing = {"edges", "faithfulness"} - set(curve.columns)
    if missing:
        raise ValueError(f"The curve needs columns 'edges' and 'faithfulness'; missing {missing}.")
    if n_edges < 1:
        raise ValueError(f"n_edges must be >= 1, got {n_edges}.")
    points = curve.groupby("edges", sort=True).faithfulness.mean()
    if points.empty:
        raise ValueError("The curve has no rows.")
    if points.index.min() < 0 or points.index.max() > n_edges:
        raise ValueError(f"Curve sizes must lie in [0, n_edges={n_edges}].")
    edges = [int(e) for e in points.index]
    size = [e / n_edges for e in edges]
    faith = [float(v) for v in points]
    distance = [abs(1.0 - f) for f in faith]
    table = pd.DataFrame(
        dict(edges=edges, size=size, faithfulness=faith, distance=distance),
        columns=["edges", "size", "faithfulness", "distance"],
    )
    return CurveScores(table, _trapezoid(size, faith), _trapezoid(size, distance), n_edges)


def _graph_nodes(scores: EdgeScores) -> list[str] | None:
    """The ``nodes=`` that rebuilds ``scores.graph`` (None: the full graph)."""
    return scores.graph.node_labels() if scores.graph.restricted else None


def _check_positions(scores: EdgeScores, positions: PositionClasses | None) -> None:
    want = scores.graph.positions
    have = None if positions is None else tuple(positions.names)
    if want != have:
        raise ValueError(
            f"The edge scores' graph is resolved by positions {want}, but positions= gives "
            f"{have}: pass the PositionClasses the scores were computed with."
        )


def faithfulness_curve(
    model: ModelLike,
    scores: EdgeScores,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    metric: DiscoveryMetric,
    *,
    ranking: str = "signed",
    fractions: Sequence[float] = MIB_FRACTIONS,
    positions: PositionClasses | None = None,
    batch_size: int | None = None,
    progress: bool = False,
    corrupted_runs: CorruptedRuns | None = None,
) -> pd.DataFrame:
    """Exact faithfulness of the top-``k`` circuits of a ranking at fractions of the graph's edges.

    ``k = int(fraction * n_edges)`` as MIB takes it (dangling edges then dropped, so ``edges``
    may be below ``top_n``); every circuit runs exactly (:func:`~.runs.circuit_metrics`, one
    corrupted run per batch for them all).

    Args:
        model: The model the scores were computed on.
        scores: Edge scores (``circuit.scores``, or ``circuit.extra["coarse"].scores``).
        clean_tokens, corrupted_tokens, metric: As for the scores.
        ranking: ``"signed"`` or ``"absolute"`` (:func:`~.pruning.ranking_values`).
        fractions: Sizes in ``(0, 1]``, default :data:`MIB_FRACTIONS`.
        positions: The scores' position classes, if their graph is resolved by position.
        batch_size: Examples per pass.
        progress: Progress bar.
        corrupted_runs: The corrupted runs of a search on the same prompts (reused).

    Returns:
        One row per fraction: ``fraction, top_n, edges, metric, faithfulness``.
    """
    model = analysis_model(model)
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    if ranking not in RANKINGS:
        raise ValueError(f"ranking must be one of {RANKINGS}, got {ranking!r}.")
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        raise ValueError(
            f"fractions must be a non-empty list of values in (0, 1], got {fractions}."
        )
    _check_positions(scores, positions)
    graph = scores.graph
    n_all = graph.n_edges()
    top = [int(f * n_all) for f in fractions]
    masks = [
        graph.full_mask() if n >= n_all else prune_ranked(scores, ranking, top_n=n) for n in top
    ]
    values = circuit_metrics(
        model, masks, clean_tokens, corrupted_tokens, metric, nodes=_graph_nodes(scores),
        batch_size=batch_size, progress=progress, positions=positions,
        corrupted_runs=corrupted_runs,
    )  # fmt: skip
    return pd.DataFrame(
        [
            dict(
                fraction=f,
                top_n=n,
                edges=mask_size(m),
                metric=v,
                faithfulness=faithfulness(v, scores.metric_clean, scores.metric_corrupted),
            )
            for f, n, m, v in zip(fractions, top, masks, values, strict=True)
        ],  # fmt: skip
        columns=["fraction", "top_n", "edges", "metric", "faithfulness"],
    )


def compare_rankings(
    model: ModelLike,
    found: Circuit | EdgeScores,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    metric: DiscoveryMetric,
    *,
    rankings: Sequence[str] = RANKINGS,
    target: float = 0.8,
    fractions: Sequence[float] = MIB_FRACTIONS,
    positions: PositionClasses | None = None,
    batch_size: int | None = None,
    max_runs: int = 24,
    resolution: float = 1.1,
    progress: bool = False,
) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """The signed and the absolute ranking on the same prompts and the same edge scores.

    For each ranking: the sweep of :func:`~tl_attnonly.analysis.discover_circuit` to ``target``
    (its smallest top-``n`` circuit reaching the target, by exact runs; no pruning pass) and the
    MIB grid's CPR and CMD (:func:`faithfulness_curve`, :func:`score_curve`). Only exact runs are
    made; the scores are reused.

    Args:
        model: The model.
        found: A :class:`~.circuit.Circuit` from ``discover_circuit`` (its ranking's scores:
            ``circuit.extra["coarse"].scores`` when neurons were named, else ``circuit.scores``)
            or :class:`~.scored_edges.EdgeScores`.
        clean_tokens, corrupted_tokens, metric: The prompts and metric of the scores.
        rankings: Which rankings (default both).
        target, max_runs, resolution: As in :class:`~.options.DiscoveryOptions`.
        fractions, positions, batch_size, progress: As in :func:`faithfulness_curve`.

    Returns:
        ``(table, curves)``: ``table`` has one row per ranking -- ``ranking``, ``edges`` and
        ``faithfulness`` of the sweep's circuit, ``reached`` (whether it reaches ``target``),
        ``cpr``, ``cmd``, ``max_faithfulness`` (largest on the grid) and ``n_edges``;
        ``curves[ranking]`` is its :func:`faithfulness_curve` with a ``distance`` column.
    """
    model = analysis_model(model)
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    if isinstance(found, Circuit):
        base = found.extra.get("coarse", found)
        scores = base.scores
    elif isinstance(found, EdgeScores):
        scores = found
    else:
        raise TypeError(
            f"compare_rankings takes a Circuit or EdgeScores, got {type(found).__name__}."
        )
    _check_positions(scores, positions)
    task = DiscoveryTask(
        model, clean_tokens, corrupted_tokens, metric, positions, batch_size=batch_size
    )
    # the sweeps' exact runs check the task once (circuit_metrics' checks)
    check_discoverable(model, True)
    task.check_tokens()
    task.check_additive()
    rows, curves = [], {}
    for ranking in rankings:
        opts = DiscoveryOptions(
            target=target, ranking=ranking, batch_size=batch_size, max_runs=max_runs,
            resolution=resolution, progress=progress,
        )  # fmt: skip
        mask, m_circ, _, _, _ = sweep_to_target(task, scores, _graph_nodes(scores), opts)
        curve = faithfulness_curve(
            model, scores, clean_tokens, corrupted_tokens, metric, ranking=ranking,
            fractions=fractions, positions=positions, batch_size=batch_size, progress=progress,
        )  # fmt: skip
        scored = score_curve(curve, scores.graph.n_edges())
        curves[ranking] = curve.assign(distance=(1.0 - curve.faithfulness).abs())
        swept = faithfulness(m_circ, scores.metric_clean, scores.metric_corrupted)
        rows.append(
            dict(ranking=ranking, edges=mask_size(mask), faithfulness=swept,
                 reached=swept >= target, cpr=scored.cpr, cmd=scored.cmd,
                 max_faithfulness=float(curve.faithfulness.max()), n_edges=scored.n_edges)
        )  # fmt: skip
    columns = ["ranking", "edges", "faithfulness", "reached", "cpr", "cmd", "max_faithfulness",
               "n_edges"]  # fmt: skip
    return pd.DataFrame(rows, columns=columns), curves


__all__ = [
    "MIB_FRACTIONS",
    "CurveScores",
    "compare_rankings",
    "faithfulness_curve",
    "score_curve",
]
