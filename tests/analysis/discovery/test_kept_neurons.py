"""``circuit_metrics(..., kept_neurons=...)``: MLP nodes that pass on some neurons' changes only.

The neuron stage (``neurons_per_mlp="auto"``) runs the coarse circuit with layers cut: a cut
layer's remainder and its left-out named neurons lose their outgoing edges. Those runs are made on
the coarse graph, each cut layer's MLP node passing on its kept neurons' changes only. They must
be the runs of the same circuits on a graph with the neurons named (expanded coarse mask, cut
rows removed), checked against the edge-by-edge definition (fp64), on both model kinds, several
per call and one by one.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import GATED_ZOO
from kinds import kind_with_task, make_pair
from kinds import make_tokens as make_kind_tokens
from models import make_converted
from test_circuit_runs_reference import CLEAN, CORRUPTED, METRIC, _random_mask, _reference
from test_run_reuse import _first_block_runs

from tl_attnonly.analysis import HeadGraph, circuit_metrics, logit_diff_metric
from tl_attnonly.analysis.discovery import run_reuse, runs
from tl_attnonly.analysis.discovery.search import coarse_nodes, expand_mask

#: layer -> the named neurons of the fine graph; each circuit: layer -> the named neurons kept
NAMED = {0: [2, 5, 7], 1: [0, 3, 9]}
CUTS: list[dict[int, list[int]]] = [
    {},  # the coarse circuit itself
    {0: [2, 5, 7]},  # layer 0's remainder cut, its named neurons kept
    {0: [5]},
    {1: []},  # layer 1 cut entirely
    {0: [], 1: [3, 9]},
    {1: [0]},
]


def _fine(model, coarse_mask) -> tuple[HeadGraph, list[str], list[dict]]:
    """The graph with ``NAMED`` as nodes and each circuit of ``CUTS`` on it (the coarse mask
    expanded, each cut layer's remainder and left-out named neurons without outgoing edges)."""
    nodes = coarse_nodes(model) + [f"L{li}N{i}" for li, ns in NAMED.items() for i in ns]
    graph = HeadGraph(model, nodes=nodes)
    coarse = HeadGraph(model, nodes=coarse_nodes(model))
    base = expand_mask(coarse, coarse_mask, graph)
    masks = []
    for cuts in CUTS:
        mask = dict(base)
        for src in graph.sources:
            if src.layer not in cuts or src.kind not in ("neuron", "mlp"):
                continue
            keep = {f"L{src.layer}N{i}" for i in cuts[src.layer]}
            drop = torch.tensor([src.kind == "mlp" or lab not in keep for lab in src.labels])
            for key, block in base.items():
                if key[0] == src.key:
                    mask[key] = block & ~drop[:, None]
        masks.append(mask)
    return graph, nodes, masks


def _kept(model) -> list[dict[int, torch.Tensor]]:
    out = []
    for cuts in CUTS:
        entry = {}
        for layer, neurons in cuts.items():
            keep = torch.zeros(model.cfg.d_mlp, dtype=torch.bool)
            keep[neurons] = True
            entry[layer] = keep
        out.append(entry)
    return out


@pytest.mark.parametrize("act_fn, overrides", [("silu", GATED_ZOO["llama"]), ("gelu", {})])
def test_kept_neurons_are_the_runs_of_a_graph_with_the_neurons_named(act_fn, overrides):
    model = make_converted(act_fn, **overrides)
    coarse = HeadGraph(model, nodes=coarse_nodes(model))
    coarse_mask = _random_mask(coarse, 0.6, seed=3)
    graph, nodes, masks = _fine(model, coarse_mask)
    expected = [_reference(model, graph, mask) for mask in masks]
    assert len({round(v, 9) for v in expected}) >= 4  # the cuts change the circuit
    kept = _kept(model)
    together = circuit_metrics(
        model, [coarse_mask] * len(CUTS), CLEAN, CORRUPTED, METRIC,
        nodes=coarse_nodes(model), kept_neurons=kept, batch_size=2,
    )  # fmt: skip
    apart = [
        circuit_metrics(
            model, [coarse_mask], CLEAN, CORRUPTED, METRIC, nodes=coarse_nodes(model),
            kept_neurons=[entry],
        )[0]
        for entry in kept
    ]  # fmt: skip
    fine = circuit_metrics(model, masks, CLEAN, CORRUPTED, METRIC, nodes=nodes)
    assert together == pytest.approx(expected, rel=1e-10, abs=1e-12)
    assert apart == pytest.approx(expected, rel=1e-10, abs=1e-12)
    assert fine == pytest.approx(expected, rel=1e-10, abs=1e-12)


def test_both_kinds_run_kept_neurons_alike():
    """On a HookedTransformer and a TransformerBridge (later runs from a block: the bridge's
    runner), kept-neuron runs equal the fine graph's runs; the kinds agree with each other."""
    hooked, bridge = make_pair("llama_gqa")
    clean, corrupted = make_kind_tokens(2, 6, seed=0), make_kind_tokens(2, 6, seed=1)
    metric = logit_diff_metric(torch.tensor([1, 2]), torch.tensor([5, 6]))
    values = []
    for model in (m for m in (hooked, bridge) if m is not None):
        coarse = HeadGraph(model, nodes=coarse_nodes(model))
        coarse_mask = _random_mask(coarse, 0.6, seed=3)
        _, nodes, masks = _fine(model, coarse_mask)
        fine = [
            circuit_metrics(model, [m], clean, corrupted, metric, nodes=nodes)[0] for m in masks
        ]
        kept = circuit_metrics(
            model, [coarse_mask] * len(CUTS), clean, corrupted, metric,
            nodes=coarse_nodes(model), kept_neurons=_kept(model),
        )  # fmt: skip
        assert len({round(v, 9) for v in fine}) >= 4
        assert kept == pytest.approx(fine, rel=1e-10, abs=1e-12)
        values.append(kept)
    if len(values) == 2:  # the kinds themselves agree to ~1e-7 (their norms' arithmetic)
        assert values[0] == pytest.approx(values[1], rel=1e-5, abs=1e-8)


def test_a_layer_whose_kept_neurons_differ_changes_every_input_above_it():
    model = make_converted("silu", **GATED_ZOO["llama"])
    graph = HeadGraph(model, nodes=coarse_nodes(model))
    mask = graph.full_mask()
    kept = _kept(model)
    # the same mask object, the same kept neurons: every input group is shared
    every = {d.key for d in graph.inputs if d.labels}
    assert run_reuse.shared_prefix(graph, mask, mask, kept[1], kept[1]) == (every, float("inf"))
    # layer 1's MLP passes on other neurons: the inputs up to it are shared, none above
    shared, below = run_reuse.shared_prefix(graph, mask, mask, {}, kept[3])
    mlp1 = graph.source_by_key["mlp.1"].order
    assert shared == {d.key for d in graph.inputs if d.labels and d.order <= mlp1}
    assert below == mlp1
    shared, below = run_reuse.shared_prefix(graph, mask, mask, kept[1], kept[2])  # layer 0
    assert below == graph.source_by_key["mlp.0"].order
    assert not any(key.startswith(("attn.1", "mlp.1")) for key in shared)


@pytest.mark.parametrize("kind", ["hooked", "bridge"])
def test_a_kept_run_serves_later_calls_with_the_same_values(kind):
    """``kept_run=``: the calls' circuits take what they share with a kept circuit's run (made
    once per batch, in the first call): the values are those of calls without it, fp64, on both
    model kinds, and circuits that differ from the kept one in layer 1 only never run block 0
    again (without it, each call's first circuit does)."""
    model, clean, corrupted, metric = kind_with_task(kind)
    nodes = coarse_nodes(model)
    mask = _random_mask(HeadGraph(model, nodes=nodes), 0.6, seed=3)
    kept = _kept(model)
    reference = kept[1]  # layer 0 cut but for 3 named neurons
    later = [{**reference, 1: k[1]} for k in kept if 1 in k]  # layer 1 as well
    apart = [
        circuit_metrics(model, [mask], clean, corrupted, metric, nodes=nodes, kept_neurons=[k])[0]
        for k in [reference, *later]
    ]
    assert len({round(v, 9) for v in apart}) == len(apart)  # the circuits differ
    store = runs.KeptRun(mask, reference)

    def calls(kept_run) -> tuple[list[float], list[int]]:
        corrupted_runs = runs.CorruptedRuns()  # made in the first call: not counted later
        values, counts = [], []
        for k in [reference, *later]:  # one call each, two batches each
            blocks, handle = _first_block_runs(model)
            try:
                values += circuit_metrics(
                    model, [mask], clean, corrupted, metric, nodes=nodes, kept_neurons=[k],
                    batch_size=2, kept_run=kept_run, corrupted_runs=corrupted_runs,
                )  # fmt: skip
            finally:
                handle.remove()
            counts.append(blocks[0])
        return values, counts

    plain, plain_counts = calls(None)
    values, counts = calls(store)
    assert plain == pytest.approx(apart, rel=1e-10, abs=1e-12)
    assert values == pytest.approx(apart, rel=1e-10, abs=1e-12)
    # each later call: without a kept run, each batch's (only) circuit is a full run; with it,
    # block 0 does not run (the kept circuit ran in the first call)
    assert [c - k for c, k in zip(plain_counts[1:], counts[1:], strict=True)] == [2] * len(later)
    assert len(store._runs) == 2 and store.kept_bytes > 0


@pytest.mark.parametrize("kind", ["hooked", "bridge"])
def test_a_kept_run_made_from_its_parent_starts_where_they_differ(kind):
    """``KeptRun(parent=...)``: the kept circuit, differing from the parent's in layer 1 only,
    is run from the parent's run of each batch, past block 0 (a kept run without a parent runs
    block 0 once per batch); the calls' values are those of full runs one by one, fp64, on both
    model kinds, and the parent is let go after the first call."""
    model, clean, corrupted, metric = kind_with_task(kind)
    nodes = coarse_nodes(model)
    mask = _random_mask(HeadGraph(model, nodes=nodes), 0.6, seed=3)
    kept = _kept(model)
    parent_kept = kept[1]  # layer 0 cut but for 3 named neurons
    child_kept = {**parent_kept, 1: kept[5][1]}  # and layer 1 cut but for one
    circuits = [child_kept, *({**parent_kept, 1: k[1]} for k in kept if 1 in k)]
    apart = [
        circuit_metrics(model, [mask], clean, corrupted, metric, nodes=nodes, kept_neurons=[k])[0]
        for k in circuits
    ]
    corrupted_runs = runs.CorruptedRuns()
    parent = runs.KeptRun(mask, parent_kept)
    kw = dict(nodes=nodes, batch_size=2, corrupted_runs=corrupted_runs)
    circuit_metrics(model, [mask], clean, corrupted, metric, kept_neurons=[parent_kept],
                    kept_run=parent, **kw)  # fmt: skip
    # the parent's merged changes (each batch's) are let go once the child's runs are made
    gone = [
        weakref.ref(parent.first_run(idx).reference)
        for idx in (torch.arange(2), torch.arange(2, 3))
    ]
    counts = []
    child = runs.KeptRun(mask, child_kept, parent=parent)
    for store in (child, runs.KeptRun(mask, child_kept)):
        blocks, handle = _first_block_runs(model)
        try:
            values = circuit_metrics(
                model, [mask] * len(circuits), clean, corrupted, metric, kept_neurons=circuits,
                kept_run=store, **kw,
            )  # fmt: skip
        finally:
            handle.remove()
        assert values == pytest.approx(apart, rel=1e-10, abs=1e-12)
        assert store.parent is None
        counts.append(blocks[0])
    assert counts[1] - counts[0] == 2  # two batches: block 0 run for each without the parent
    del parent
    gc.collect()
    assert [ref() for ref in gone] == [None, None]  # while the child lives
    assert len(child._runs) == 2


def test_a_kept_run_beyond_its_budget_is_made_again_and_refuses_other_inputs():
    model = make_converted("silu", **GATED_ZOO["llama"])
    nodes = coarse_nodes(model)
    mask = _random_mask(HeadGraph(model, nodes=nodes), 0.6, seed=3)
    kept = _kept(model)
    apart = circuit_metrics(model, [mask] * len(kept), CLEAN, CORRUPTED, METRIC, nodes=nodes,
                            kept_neurons=kept)  # fmt: skip
    store = runs.KeptRun(mask, kept[4], budget=0)
    n_batches = 0
    for call in range(2):
        got = circuit_metrics(
            model, [mask] * len(kept), CLEAN, CORRUPTED, METRIC, nodes=nodes, kept_neurons=kept,
            kept_run=store,
        )  # fmt: skip
        assert got == pytest.approx(apart, rel=1e-10, abs=1e-12)
        assert store.kept_bytes == 0 and not store._runs
        if call == 0:
            n_batches = store.missed  # each batch's run made and not kept
            assert n_batches >= 1
    assert store.missed == 2 * n_batches  # made again in the second call
    with pytest.raises(ValueError, match="use one per search"):
        circuit_metrics(
            model, [mask], CLEAN.clone(), CORRUPTED, METRIC, nodes=nodes, kept_run=store
        )
    with pytest.raises(ValueError, match="use one per search"):
        circuit_metrics(
            model, [mask], CLEAN, CORRUPTED.clone(), METRIC, nodes=nodes, kept_run=store
        )
    with pytest.raises(ValueError, match="use one per search"):
        circuit_metrics(model, [mask], CLEAN, CORRUPTED, lambda x: METRIC(x), nodes=nodes,
                        kept_run=store)  # fmt: skip
    with pytest.raises(ValueError, match="use one per search"):
        full = HeadGraph(model).full_mask()  # another graph: every neuron a node
        circuit_metrics(model, [full], CLEAN, CORRUPTED, METRIC, kept_run=store)


def test_kept_neurons_refused_where_they_cannot_be_run():
    model = make_converted("silu", **GATED_ZOO["llama"])
    nodes = coarse_nodes(model)
    mask = HeadGraph(model, nodes=nodes).full_mask()
    keep = torch.ones(model.cfg.d_mlp, dtype=torch.bool)

    def run(kept, masks=(mask,), **kw):
        return circuit_metrics(
            model, list(masks), CLEAN, CORRUPTED, METRIC, nodes=nodes, kept_neurons=kept, **kw
        )

    with pytest.raises(ValueError, match="kept_neurons has 1 entries for 2 masks"):
        run([{0: keep}], masks=(mask, mask))
    with pytest.raises(ValueError, match=r"must be bool \[d_mlp\]"):
        run([{0: keep.float()}])
    with pytest.raises(ValueError, match=r"must be bool \[d_mlp\]"):
        run([{0: keep[:-1]}])
    with pytest.raises(ValueError, match="layer 5 is not in"):
        run([{5: keep}])
    # every neuron kept is the coarse circuit itself
    assert run([{0: keep, 1: keep}]) == pytest.approx(run(None), rel=1e-12)
    heads = make_converted("gelu", n_heads_per_neuron=2)  # a neuron's heads as nodes
    head_mask = HeadGraph(heads, neuron_level=False, nodes=coarse_nodes(heads)).full_mask()
    with pytest.raises(ValueError, match="kept_neurons needs a neuron-level graph"):
        circuit_metrics(
            heads, [head_mask], CLEAN, CORRUPTED, METRIC, neuron_level=False,
            nodes=coarse_nodes(heads), kept_neurons=[{0: keep}],
        )  # fmt: skip


@pytest.mark.parametrize("neurons_per_mlp", [3, "auto"])
def test_mlp_split_equals_runs_on_the_graph_with_named_neurons(neurons_per_mlp):
    """``Circuit.mlp_split`` (run with ``kept_neurons`` on the coarse graph) equals the runs of
    the returned circuit on its own graph (named neurons as nodes) without each layer's named
    neurons' outgoing edges, its remainder's, and both."""
    import warnings

    from tl_attnonly.analysis import circuit_metric, discover_circuit, faithfulness

    model = make_converted("silu", **GATED_ZOO["llama"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the circuit's notes are not the subject
        circuit = discover_circuit(
            model, CLEAN, CORRUPTED, METRIC, neurons_per_mlp=neurons_per_mlp, gate_value=False,
            progress=False, max_neurons_per_mlp=4,
        )  # fmt: skip
    named = circuit.extra["named"]
    nodes = coarse_nodes(model) + [n for li in sorted(named) for n in named[li]]
    m_clean, m_corr = circuit.metric_clean, circuit.metric_corrupted

    def without(keys: set[str]) -> float:
        mask = {k: (torch.zeros_like(m) if k[0] in keys else m) for k, m in circuit.mask.items()}
        value = circuit_metric(model, mask, CLEAN, CORRUPTED, METRIC, nodes=nodes)
        return circuit.faithfulness - faithfulness(value, m_clean, m_corr)

    split = circuit.mlp_split.set_index("node")
    assert len(split) >= 1
    for node, row in split.iterrows():
        li = int(node[1:-3])
        assert row.named_effect == pytest.approx(without({f"neuron.{li}"}), abs=1e-10)
        assert row.rest_effect == pytest.approx(without({f"mlp.{li}"}), abs=1e-10)
        assert row.layer_effect == pytest.approx(without({f"neuron.{li}", f"mlp.{li}"}), abs=1e-10)
    if neurons_per_mlp == 3:  # every layer keeps its remainder: both parts carry something
        assert (split.named_effect.abs() > 1e-6).any()
        assert (split.rest_effect.abs() > 1e-6).any()
