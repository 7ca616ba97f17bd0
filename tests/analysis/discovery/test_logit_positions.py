"""Exact runs from a block compute only the logits their metric reads.

A metric may declare the one position per row whose logits it reads (a ``logit_positions``
attribute: ``logit_diff_metric`` and the task datasets' ``additive_metric()`` do). A bridge's
runs from a block then unembed only those positions (the others are NaN); the values must be
those of the same metric without the declaration, and a metric that reads other positions than
it declares must be refused, not given NaN or a wrong value.
"""

from __future__ import annotations

import pytest
import torch
from kinds import make_pair
from kinds import make_tokens as make_kind_tokens
from test_evaluate import WORDS
from test_run_reuse import _layer_variants

from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis import (
    circuit_metrics,
    logit_diff_metric,
    make_ioi_dataset,
    make_sva_dataset,
)
from tl_attnonly.analysis.discovery.search import coarse_nodes
from tl_attnonly.analysis.discovery.sites import check_logit_positions, logit_positions

CLEAN, CORRUPTED = make_kind_tokens(3, 6, seed=0), make_kind_tokens(3, 6, seed=1)


def _undeclared(metric):
    """The same metric without its ``logit_positions``."""

    def plain(logits, indices):
        return metric(logits, indices)

    return plain


def _bridge_masks():
    _, bridge = make_pair("llama_gqa")
    nodes = coarse_nodes(bridge) + ["L0N2", "L0N5", "L1N0"]
    return bridge, nodes, _layer_variants(bridge, nodes)[1]


@pytest.mark.parametrize("position", [-1, 3])
def test_later_runs_unembed_the_declared_positions_only_with_the_same_values(position):
    bridge, nodes, masks = _bridge_masks()
    metric = logit_diff_metric(torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7]), position)
    widths: list[int] = []
    unembed = analysis_model(bridge).model.unembed
    handle = unembed.register_forward_hook(lambda m, args, out: widths.append(args[0].shape[1]))
    try:
        declared = circuit_metrics(
            bridge, masks, CLEAN, CORRUPTED, metric, nodes=nodes, batch_size=2
        )
    finally:
        handle.remove()
    plain = circuit_metrics(
        bridge, masks, CLEAN, CORRUPTED, _undeclared(metric), nodes=nodes, batch_size=2
    )
    assert declared == pytest.approx(plain, rel=1e-10, abs=1e-12)
    # two batches: each batch's later runs unembed one position per row; the corrupted and the
    # first runs (and the bridge's check) every position
    assert widths.count(1) == 2 * (len(masks) - 1)
    assert all(width in (1, CLEAN.shape[1]) for width in widths)


def test_a_metric_that_reads_other_logits_than_it_declares_is_refused():
    bridge, nodes, masks = _bridge_masks()
    metric = logit_diff_metric(torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7]))  # the last
    metric.logit_positions = lambda indices: torch.zeros(len(indices))  # declares the first
    with pytest.raises(ValueError, match="logit_positions"):
        circuit_metrics(bridge, masks, CLEAN, CORRUPTED, metric, nodes=nodes, batch_size=2)


def test_the_task_datasets_metrics_declare_their_end_positions():
    import tl_attnonly
    from tl_attnonly.bundled import load_bundled_bridge

    model = tl_attnonly.convert(load_bundled_bridge())
    ioi = make_ioi_dataset(
        model, 6, seed=1, names=["self", "key", "value", "name", "data", "item"],
        places=["store", "file"], objects=["list", "code"],
    )  # fmt: skip
    sva = make_sva_dataset(model, 6, seed=0, **WORDS)
    rows = torch.tensor([1, 4])
    for data in (ioi, sva):
        metric = data.additive_metric()
        n_pos = data.tokens.shape[1]
        reads = logit_positions(metric, rows, n_pos)
        assert reads is not None and torch.equal(reads, data.end_pos[rows])
        logits = torch.randn(len(rows), n_pos, model.cfg.d_vocab, dtype=torch.float64)
        check_logit_positions(metric, logits, rows, reads)  # reads only these
        with pytest.raises(ValueError, match="logit_positions"):
            check_logit_positions(metric, logits, rows, reads - 1)
