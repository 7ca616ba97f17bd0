""":class:`EdgeScores`: every edge of a head graph with its estimated effect on the metric.

What :func:`~.edge_scores.edge_attribution_scores` returns, and what pruning (:mod:`.pruning`),
the sweep, refinement and :class:`~.circuit.Circuit` read: the graph, one score block per
``(source group, input group)``, and the clean and corrupted metrics the scores are relative to.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from tl_attnonly.analysis.discovery.graph import HeadGraph, edges_frame
from tl_attnonly.analysis.discovery.sites import Mask


@dataclass
class EdgeScores:
    """EAP scores of every edge of a :class:`HeadGraph`.

    Attributes:
        graph: The graph.
        scores: ``(source group key, input group key) -> [n_sources, n_inputs]`` estimated change
            of the metric.
        metric_clean, metric_corrupted: The metric of the clean and the corrupted runs.
        method: ``"eap"`` or ``"eap-ig"``.
    """

    graph: HeadGraph
    scores: dict[tuple[str, str], torch.Tensor]
    metric_clean: float
    metric_corrupted: float
    method: str

    def frame(self, mask: Mask | None = None) -> pd.DataFrame:
        """Edges (all, or those in ``mask``) as a DataFrame sorted by |score|."""
        return edges_frame(self.graph, self.scores, mask)


__all__ = ["EdgeScores"]
