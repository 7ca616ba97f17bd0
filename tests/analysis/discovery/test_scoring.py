"""Honest scoring: CPR- and CMD-style figures, MIB's areas, both rankings on the same prompts.

References are independent: areas by numpy's trapezoid rule, every point of a curve by an exact
run of a top-n circuit pruned here (``prune`` on ranking values written out in the test), each
ranking's sweep by ``discover_circuit`` with that ranking (its own scoring and sweep).
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import GATED_ZOO, make_tokens
from models import make_converted
from test_search import _top  # top-n by |score| or signed score, written out there

from tl_attnonly.analysis import (
    MIB_FRACTIONS,
    circuit_metrics,
    compare_rankings,
    discover_circuit,
    faithfulness,
    faithfulness_curve,
    logit_diff_metric,
    score_curve,
)
from tl_attnonly.analysis.discovery.search import coarse_nodes

CLEAN, CORRUPTED = make_tokens(4, 8, seed=0), make_tokens(4, 8, seed=1)
METRIC = logit_diff_metric(torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8]))


def test_score_curve_areas_are_the_trapezoid_rule_over_normalised_size():
    curve = pd.DataFrame(dict(edges=[50, 0, 10, 100], faithfulness=[1.2, 0.0, 0.5, 1.0]))
    scored = score_curve(curve, 100)
    size = np.array([0.0, 0.1, 0.5, 1.0])
    faith = np.array([0.0, 0.5, 1.2, 1.0])
    assert scored.table.edges.tolist() == [0, 10, 50, 100]
    assert scored.table["size"].tolist() == pytest.approx(size.tolist())
    assert scored.table.distance.tolist() == pytest.approx(np.abs(1 - faith).tolist())
    assert scored.cpr == pytest.approx(np.trapezoid(faith, size))  # 0.915
    assert scored.cmd == pytest.approx(np.trapezoid(np.abs(1 - faith), size))  # 0.265
    assert (scored.cpr, scored.cmd) == pytest.approx((0.915, 0.265))
    # overshooting raises CPR but counts against CMD
    over = score_curve(curve.assign(faithfulness=[1.5, 0.0, 0.5, 1.0]), 100)
    assert over.cpr > scored.cpr and over.cmd > scored.cmd
    with pytest.raises(ValueError, match="columns"):
        score_curve(curve.rename(columns={"edges": "size"}), 100)
    with pytest.raises(ValueError, match="n_edges"):
        score_curve(curve, 50)


def test_curve_points_are_exact_runs_and_rankings_compare_on_the_same_prompts():
    """Every point of a ranking's curve (compare_rankings', faithfulness_curve's and
    discover_circuit's own) is an exact run of the ranking's top edges."""
    model = make_converted("silu", **GATED_ZOO["llama"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = {
            r: discover_circuit(
                model, CLEAN, CORRUPTED, METRIC, ranking=r, neurons_per_mlp=0, prune_runs=0,
                gate_value=False, progress=False,
            )
            for r in ("signed", "absolute")
        }  # fmt: skip
    scores = found["signed"].scores
    nodes = coarse_nodes(model)
    n_all = scores.graph.n_edges()
    table, curves = compare_rankings(model, found["signed"], CLEAN, CORRUPTED, METRIC)
    table = table.set_index("ranking")
    for ranking in ("signed", "absolute"):
        # each point: the top int(f * n) edges of the ranking, run exactly
        sizes = [int(f * n_all) for f in MIB_FRACTIONS]
        masks = [_top(scores, n, ranking) if n < n_all else scores.graph.full_mask() for n in sizes]
        values = circuit_metrics(model, masks, CLEAN, CORRUPTED, METRIC, nodes=nodes)
        faith = [faithfulness(v, scores.metric_clean, scores.metric_corrupted) for v in values]
        curve = curves[ranking]
        assert curve.top_n.tolist() == sizes
        assert curve.faithfulness.tolist() == pytest.approx(faith, rel=1e-12)
        edges = [sum(int(m.sum()) for m in mask.values()) for mask in masks]
        x = np.array(edges) / n_all
        row = table.loc[ranking]
        assert row.cpr == pytest.approx(np.trapezoid(faith, x), rel=1e-12)
        assert row.cmd == pytest.approx(np.trapezoid(np.abs(1 - np.array(faith)), x), rel=1e-12)
        # the sweep: discover_circuit's own with that ranking, on the same prompts
        assert row.edges == len(found[ranking].edges())
        assert row.faithfulness == pytest.approx(found[ranking].faithfulness, rel=1e-10)
        assert bool(row.reached) == (found[ranking].faithfulness >= 0.8)
        # discover_circuit's own curve on MIB's grid (mib_curve=True, the default): the same
        # points, the same areas, and report() prints them
        extra = found[ranking].extra
        assert extra["mib_curve"].top_n.tolist() == sizes
        assert extra["mib_curve"].faithfulness.tolist() == pytest.approx(faith, rel=1e-12)
        assert extra["mib_curve"].distance.tolist() == pytest.approx(
            np.abs(1 - np.array(faith)).tolist(), rel=1e-12
        )
        assert (extra["mib_cpr"], extra["mib_cmd"]) == pytest.approx((row.cpr, row.cmd))
        assert f"CPR {row.cpr:.3f}" in found[ranking].report()
    direct = faithfulness_curve(model, scores, CLEAN, CORRUPTED, METRIC, ranking="absolute")
    assert direct.faithfulness.tolist() == pytest.approx(curves["absolute"].faithfulness.tolist())
    with pytest.raises(ValueError, match="fractions"):
        faithfulness_curve(model, scores, CLEAN, CORRUPTED, METRIC, fractions=[0.0, 1.0])
    with pytest.raises(TypeError, match="Circuit or EdgeScores"):
        compare_rankings(model, "circuit", CLEAN, CORRUPTED, METRIC)
