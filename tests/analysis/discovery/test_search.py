"""``discover_circuit`` coarse to fine: the sweep, named neurons, evidence and the traps.

Every figure a circuit reports is checked against an independent exact circuit run (fp64 models):
the sweep's returned faithfulness, every point of its curve, the named-neuron circuit against the
coarse one, the MLP split against runs of the coarse graph, the node-patching baseline against
its two ends (nothing patched: the corrupted run; everything: the clean run).
"""

from __future__ import annotations

import math
import warnings

import pandas as pd
import pytest
import torch
from conftest import GATED_ZOO, make_tokens
from models import make_converted, tl3_extra

from tl_attnonly.analysis import (
    DiscoveryOptions,
    HeadGraph,
    circuit_gate_value_split,
    circuit_metric,
    circuit_metrics,
    discover_circuit,
    edge_attribution_scores,
    faithfulness,
    logit_diff_metric,
    prune,
)
from tl_attnonly.analysis.discovery.search import (
    coarse_nodes,
    expand_mask,
    node_patching_metric,
)
from tl_attnonly.analysis.discovery.sweep import curve_warnings

CLEAN, CORRUPTED = make_tokens(4, 8, seed=0), make_tokens(4, 8, seed=1)
METRIC = logit_diff_metric(torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8]))
ROWS = torch.arange(4)


def _model(name: str = "llama"):
    if name == "llama":
        return make_converted("silu", **GATED_ZOO["llama"])
    if name == "gqa":
        return make_converted(
            "silu", normalization_type="RMS", n_heads=4, d_head=4, n_key_value_heads=2
        )
    return make_converted("gelu", normalization_type="LN")


def _top(scores, n, ranking):
    """The top-n edges by the ranking, written out here: |score|, or score toward the clean run."""
    if ranking == "absolute":
        return prune(scores, top_n=n)
    sign = 1.0 if scores.metric_clean >= scores.metric_corrupted else -1.0
    signed = type(scores)(
        scores.graph, {k: v * sign for k, v in scores.scores.items()}, scores.metric_clean,
        scores.metric_corrupted, scores.method,
    )  # fmt: skip
    return prune(signed, top_n=n, absolute=False)


def _quiet(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return discover_circuit(**kw)


@pytest.mark.parametrize(
    "name, ranking",
    [
        ("llama", "signed"),
        ("llama", "absolute"),
        pytest.param("ln_gelu", "signed", marks=pytest.mark.slow),
        pytest.param("gqa", "signed", marks=tl3_extra("llama")),  # the same LLaMA bridge
    ],
)
def test_sweep_returns_the_smallest_run_size_reaching_the_target_exactly(name, ranking):
    model = _model(name)
    circuit = _quiet(
        model=model, clean_tokens=CLEAN, corrupted_tokens=CORRUPTED, metric=METRIC,
        neurons_per_mlp=0, gate_value=False, progress=False, resolution=1.05, max_runs=40,
        prune_runs=0, ranking=ranking,
    )  # fmt: skip
    nodes = coarse_nodes(model)
    assert set(circuit.graph.node_labels()) == set(nodes)
    # the reported faithfulness is an independent exact run's
    again = circuit_metric(model, circuit.mask, CLEAN, CORRUPTED, METRIC, nodes=nodes)
    assert circuit.metric_circuit == pytest.approx(again, rel=1e-12)
    assert circuit.faithfulness == pytest.approx(
        faithfulness(again, circuit.metric_clean, circuit.metric_corrupted), rel=1e-12
    )
    assert circuit.faithfulness >= 0.8
    # the coarse graph holds every node: its ceiling is the clean run
    assert circuit.ceiling == pytest.approx(1.0, abs=1e-9)
    # every point of the curve is an exact run of the top-n circuit
    curve = circuit.curve
    n_all = circuit.graph.n_edges()
    masks = [
        circuit.graph.full_mask() if n >= n_all else _top(circuit.scores, n, ranking)
        for n in curve.top_n
    ]
    values = circuit_metrics(model, masks, CLEAN, CORRUPTED, METRIC, nodes=nodes)
    assert curve.metric.tolist() == pytest.approx(values, rel=1e-12)
    # bisection: the returned size reaches the target, the largest size run below it does not,
    # and the two are within the resolution
    size = int(curve.top_n[curve.edges == len(circuit.edges())].min())
    below = curve[curve.top_n < size]
    if len(below):
        assert (below.faithfulness < 0.8).all()
        assert size <= below.top_n.max() * 1.05 or size - below.top_n.max() <= 1
    # brute force: no prefix of the ranking below the largest failing size run reaches it there
    all_sizes = list(range(1, size + 1))
    exact = circuit_metrics(
        model, [_top(circuit.scores, n, ranking) for n in all_sizes], CLEAN, CORRUPTED, METRIC,
        nodes=nodes,
    )  # fmt: skip
    faiths = [faithfulness(v, circuit.metric_clean, circuit.metric_corrupted) for v in exact]
    assert faiths[-1] == pytest.approx(circuit.faithfulness, rel=1e-12)
    first = next(n for n, f in zip(all_sizes, faiths, strict=True) if f >= 0.8)
    assert first <= size  # the sweep never returns a size below the true first one


def test_named_neurons_compute_the_coarse_circuit_and_split_each_mlp_node():
    model = _model("llama")
    circuit = _quiet(
        model=model, clean_tokens=CLEAN, corrupted_tokens=CORRUPTED, metric=METRIC,
        neurons_per_mlp=3, max_gate_value_neurons=2, progress=False,
    )  # fmt: skip
    coarse = circuit.extra["coarse"]
    # the expanded circuit is the coarse one, exactly
    assert circuit.metric_circuit == pytest.approx(coarse.metric_circuit, rel=1e-10)
    named = circuit.extra["named"]
    assert named and all(len(v) == 3 for v in named.values())
    fine_nodes = coarse_nodes(model) + [n for v in named.values() for n in v]
    assert set(circuit.graph.node_labels()) == set(fine_nodes)
    again = circuit_metric(model, circuit.mask, CLEAN, CORRUPTED, METRIC, nodes=fine_nodes)
    assert circuit.metric_circuit == pytest.approx(again, rel=1e-12)
    # each MLP node's layer effect equals removing L{l}MLP's outgoing edges in the coarse graph
    split = circuit.mlp_split.set_index("node")
    assert set(split.index) == {f"L{li}MLP" for li in named}
    denom = circuit.metric_clean - circuit.metric_corrupted
    for node in split.index:
        cut = {
            k: (torch.zeros_like(m) if k[0] == f"mlp.{node[1:-3]}" else m)
            for k, m in coarse.mask.items()
        }
        value = circuit_metric(model, cut, CLEAN, CORRUPTED, METRIC, nodes=coarse_nodes(model))
        assert split.loc[node, "layer_effect"] == pytest.approx(
            (coarse.metric_circuit - value) / denom, rel=1e-9, abs=1e-12
        )
    # the gate/value table names neurons of the circuit, with both kinds of edges counted
    table = circuit.gate_value
    assert set(table.node) <= {n for v in named.values() for n in v}
    assert ((table.n_gate_edges > 0) | table.gate.isna()).all()
    assert circuit.node_patching is not None and math.isfinite(circuit.node_patching)
    text = circuit.report()
    for part in ("ceiling", "coarse circuit", "node patching", "faithfulness vs size", "L"):
        assert part in text
    assert f"{circuit.faithfulness:.3f}" in text


def test_expand_mask_of_the_full_and_empty_coarse_graph():
    model = _model("ln_gelu")
    coarse = HeadGraph(model, nodes=coarse_nodes(model))
    fine_nodes = coarse_nodes(model) + ["L0N3", "L1N7"]
    fine = HeadGraph(model, nodes=fine_nodes)
    for value in (True, False):
        out = expand_mask(coarse, coarse.full_mask(value), fine)
        assert set(out) == set(fine.block_keys())
        assert all(bool((m == value).all()) for m in out.values())


def test_node_patching_ends_are_the_corrupted_and_clean_runs():
    model = _model("llama")
    clean = METRIC(model(CLEAN), ROWS).item()
    corrupted = METRIC(model(CORRUPTED), ROWS).item()
    none = node_patching_metric(model, CLEAN, CORRUPTED, METRIC, [])
    assert none == pytest.approx(corrupted, rel=1e-12)
    everything = ["embed", *coarse_nodes(model)]
    assert node_patching_metric(model, CLEAN, CORRUPTED, METRIC, everything, batch_size=3) == (
        pytest.approx(clean, rel=1e-10)
    )
    # a whole MLP layer equals naming each of its neurons
    d_mlp = model.cfg.d_mlp
    layer = node_patching_metric(model, CLEAN, CORRUPTED, METRIC, ["L0MLP"])
    each = node_patching_metric(model, CLEAN, CORRUPTED, METRIC, [f"L0N{i}" for i in range(d_mlp)])
    assert layer == pytest.approx(each, rel=1e-12)
    with pytest.raises(ValueError, match="L0N5.1"):
        node_patching_metric(model, CLEAN, CORRUPTED, METRIC, ["L0N5.1"])


def test_gate_value_without_gate_edges_is_not_measured_not_zero():
    """Trap (i): a neuron whose gate edges were all pruned had gate = 0 in the table."""
    model = _model("llama")
    graph = HeadGraph(model)
    mask = graph.full_mask(False)
    mask[("embed", "neuron.1.value")][0, 4] = True  # L1N4 gets a value edge, no gate edge
    mask[("neuron.1", "logits")][4, 0] = True
    with pytest.warns(UserWarning, match="L1N4: gate not measured: no gate edge kept"):
        table = circuit_gate_value_split(
            model, mask, CLEAN, CORRUPTED, METRIC, neurons=["L1N4"], progress=False
        )
    row = table.iloc[0]
    assert math.isnan(row.gate) and math.isnan(row.interaction)
    assert row.n_gate_edges == 0 and row.n_value_edges == 1
    assert math.isfinite(row.value) and row.value == pytest.approx(row.both, rel=1e-12)


def _mean_metric(logits, indices):
    """Not additive: a mean over the batch it is given."""
    c, w = torch.tensor([1, 2, 3, 4])[indices], torch.tensor([5, 6, 7, 8])[indices]
    rows = torch.arange(len(indices))
    return (logits[rows, -1, c] - logits[rows, -1, w]).mean()


def test_a_mean_metric_over_batches_is_refused_or_declared():
    """Trap (ii): a per-batch mean summed over 2 batches reported twice the clean metric."""
    model = _model("llama")
    with pytest.raises(ValueError, match="not additive over examples"):
        edge_attribution_scores(model, CLEAN, CORRUPTED, _mean_metric, batch_size=2, progress=False)
    with pytest.raises(ValueError, match="metric_reduction='mean'"):
        discover_circuit(model, CLEAN, CORRUPTED, _mean_metric, batch_size=2, progress=False)
    with pytest.raises(ValueError, match="not additive"):
        circuit_metric(model, HeadGraph(model).full_mask(), CLEAN, CORRUPTED, _mean_metric,
                       batch_size=2)  # fmt: skip
    # one batch: nothing is summed, nothing to refuse; declared: the same metrics in batches
    whole = _quiet(
        model=model, clean_tokens=CLEAN, corrupted_tokens=CORRUPTED, metric=_mean_metric,
        neurons_per_mlp=0, gate_value=False, progress=False,
    )  # fmt: skip
    batched = _quiet(
        model=model, clean_tokens=CLEAN, corrupted_tokens=CORRUPTED, metric=_mean_metric,
        neurons_per_mlp=0, gate_value=False, progress=False, batch_size=2,
        metric_reduction="mean",
    )  # fmt: skip
    clean = _mean_metric(model(CLEAN), ROWS).item()
    assert whole.metric_clean == pytest.approx(clean, rel=1e-12)
    assert batched.metric_clean == pytest.approx(clean, rel=1e-12)
    assert batched.metric_corrupted == pytest.approx(whole.metric_corrupted, rel=1e-12)
    assert batched.faithfulness == pytest.approx(whole.faithfulness, rel=1e-9)


def test_low_ceiling_and_falling_curve_are_warned():
    """Trap (iii): nothing said when the graph's every edge recovers little, or when the
    faithfulness falls as edges are added."""
    model = _model("llama")
    with pytest.warns(UserWarning, match="the ceiling is low"):
        circuit = discover_circuit(
            model, CLEAN, CORRUPTED, METRIC, graph="neurons", nodes=["L0H1"], gate_value=False,
            progress=False,
        )  # fmt: skip
    assert circuit.ceiling < 0.8 and any("ceiling" in w for w in circuit.warnings)
    curve = pd.DataFrame(dict(top_n=[1, 2, 4], edges=[1, 2, 4], faithfulness=[0.1, 0.6, 0.3]))
    (note,) = curve_warnings(curve)
    assert "falls as edges are added: 0.600 at 2 edges, 0.300 at 4 edges" in note
    assert curve_warnings(curve.assign(faithfulness=[0.1, 0.6, 0.58])) == []


def test_options_and_earlier_keywords():
    opts = DiscoveryOptions().with_overrides(target=0.9, batch_size=2)
    assert (opts.graph, opts.target, opts.batch_size, opts.method) == ("coarse", 0.9, 2, "eap-ig")
    with pytest.raises(TypeError, match="Unknown discovery option"):
        DiscoveryOptions().with_overrides(top_k=3)
    with pytest.raises(ValueError, match="graph='neurons'"):
        DiscoveryOptions(nodes=["L0H1"])
    with pytest.raises(ValueError, match="not both"):
        DiscoveryOptions(top_n=3, threshold=0.1)
    # the earlier keywords keep the earlier single stage: neuron-level graph, plain EAP
    model = _model("llama")
    circuit = _quiet(
        model=model, clean_tokens=CLEAN, corrupted_tokens=CORRUPTED, metric=METRIC, top_n=10,
        gate_value=False, progress=False,
    )  # fmt: skip
    assert circuit.scores.method == "eap" and not circuit.graph.restricted
    assert circuit.ceiling == pytest.approx(1.0, abs=1e-9)


def test_gate_value_edge_counts_are_edges_not_source_groups():
    """n_value_edges counted one per source group: two heads of one layer into a neuron's value
    read 1 (the bracket circuit of notebook 08 showed 16 value edges into 8 neurons, and 1 each)."""
    model = _model("llama")
    mask = HeadGraph(model).full_mask(False)
    mask[("attn.0", "neuron.1.value")][[0, 1], 4] = True  # L0H0 and L0H1 -> L1N4's value
    mask[("embed", "neuron.1.value")][0, 4] = True
    mask[("attn.0", "neuron.1.gate")][2, 4] = True  # L0H2 -> L1N4's gate
    mask[("neuron.1", "logits")][4, 0] = True
    table = circuit_gate_value_split(
        model, mask, CLEAN, CORRUPTED, METRIC, neurons=["L1N4"], progress=False
    )
    row = table.iloc[0]
    assert (row.n_gate_edges, row.n_value_edges) == (1, 3)


def test_the_default_call_names_no_neuron_and_says_how_to_resolve_its_mlp_nodes():
    """The defaults keep each MLP node its whole layer: no neuron named, no neuron stage, no
    gate/value table of neurons (none to split), and the report says how to name them."""
    from tl_attnonly.analysis.discovery.counts import WHOLE_MLP_NOTE

    circuit = _quiet(
        model=_model(), clean_tokens=CLEAN, corrupted_tokens=CORRUPTED, metric=METRIC,
        batch_size=2, progress=False, mib_curve=False,
    )  # fmt: skip
    assert any(n.endswith("MLP") for n in circuit.nodes()), "the circuit holds an MLP node"
    assert not any(("N" in n) for n in circuit.nodes() if n.startswith("L"))
    assert "named" not in circuit.extra and "neurons" not in circuit.extra["seconds"]
    assert circuit.gate_value is None and circuit.mlp_split is None
    report = circuit.report()
    assert WHOLE_MLP_NOTE in report and "gate/value split" not in report
