"""Exact runs of several circuits in one call reuse the first run's inputs below the first change.

``circuit_metrics`` takes the hook outputs of the input groups below the first residual position
at which a circuit's edges differ from the first circuit's from the first run
(``run_reuse.shared_prefix``) instead of rebuilding them. The metrics must be those of one run per
call (no reuse) and of the edge-by-edge definition (fp64), on both model kinds, and fewer inputs
must be rebuilt.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import GATED_ZOO, make_tokens
from kinds import kind_with_task, make_pair
from kinds import make_tokens as make_kind_tokens
from models import make_converted
from test_circuit_runs_reference import _random_mask, _record_source_values, _reference

from tl_attnonly.analysis import HeadGraph, circuit_metrics, logit_diff_metric
from tl_attnonly.analysis.discovery import exact_run, run_reuse, runs
from tl_attnonly.analysis.discovery.search import coarse_nodes, expand_mask

CLEAN, CORRUPTED = make_tokens(3, 7, seed=0), make_tokens(3, 7, seed=1)
METRIC = logit_diff_metric(torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7]))


def _layer_variants(model, nodes: list[str]) -> tuple[HeadGraph, list]:
    """A random coarse circuit expanded onto ``nodes``, then the same without the outgoing
    edges of each layer's named neurons, remainder, or both (the neuron stage's runs)."""
    coarse = HeadGraph(model, nodes=coarse_nodes(model))
    graph = HeadGraph(model, nodes=nodes)
    base = expand_mask(coarse, _random_mask(coarse, 0.6, seed=3), graph)
    masks = [base]
    for layer in range(model.cfg.n_layers):
        for keys in ({f"neuron.{layer}"}, {f"mlp.{layer}"}, {f"neuron.{layer}", f"mlp.{layer}"}):
            masks.append({k: m & (k[0] not in keys) for k, m in base.items()})
    return graph, masks


def _one_call_each(model, masks, nodes, clean, corrupted, metric) -> list[float]:
    return [
        circuit_metrics(model, [m], clean, corrupted, metric, nodes=nodes, batch_size=2)[0]
        for m in masks
    ]


def _count_recomputes(monkeypatch) -> list[int]:
    calls = [0]
    recompute = exact_run._recompute

    def counted(*args, **kwargs):
        calls[0] += 1
        return recompute(*args, **kwargs)

    monkeypatch.setattr(exact_run, "_recompute", counted)
    return calls


def test_shared_prefix_is_every_group_below_the_first_change():
    model = make_converted("silu", **GATED_ZOO["llama"])
    nodes = coarse_nodes(model) + ["L0N2", "L0N5", "L1N0"]
    graph, masks = _layer_variants(model, nodes)
    last = masks[-1]  # the last layer's named neurons and remainder cut: only the logits change
    order = max(d.order for d in graph.inputs if d.key.startswith("neuron.1"))
    shared, _ = run_reuse.shared_prefix(graph, masks[0], last)
    assert shared == {d.key for d in graph.inputs if d.labels and d.order <= order}
    assert run_reuse.shared_prefix(graph, masks[0], masks[0])[0] == {
        d.key for d in graph.inputs if d.labels
    }
    first_layer, _ = run_reuse.shared_prefix(graph, masks[0], masks[1])  # L0's named neurons cut
    assert all(not key.startswith(("attn.1", "neuron.1", "mlp.1")) for key in first_layer)


@pytest.mark.parametrize("act_fn, overrides", [("silu", GATED_ZOO["llama"]), ("gelu", {})])
def test_runs_in_one_call_equal_runs_one_by_one_and_the_definition(act_fn, overrides, monkeypatch):
    model = make_converted(act_fn, **overrides)
    nodes = coarse_nodes(model) + ["L0N2", "L0N5", "L1N0", "L1N9"]
    graph, masks = _layer_variants(model, nodes)
    calls = _count_recomputes(monkeypatch)
    together = circuit_metrics(model, masks, CLEAN, CORRUPTED, METRIC, nodes=nodes, batch_size=2)
    rebuilt_together, calls[0] = calls[0], 0
    apart = _one_call_each(model, masks, nodes, CLEAN, CORRUPTED, METRIC)
    assert calls[0] > rebuilt_together  # the shared inputs were not rebuilt
    for value, alone, mask in zip(together, apart, masks, strict=True):
        assert value == pytest.approx(alone, rel=1e-10, abs=1e-12)
        assert value == pytest.approx(_reference(model, graph, mask), rel=1e-10, abs=1e-12)


def test_both_kinds_give_the_same_runs_in_one_call():
    hooked, bridge = make_pair("llama_gqa")
    clean, corrupted = make_kind_tokens(2, 6, seed=0), make_kind_tokens(2, 6, seed=1)
    metric = logit_diff_metric(torch.tensor([1, 2]), torch.tensor([5, 6]))
    values = []
    for model in (m for m in (hooked, bridge) if m is not None):
        nodes = coarse_nodes(model) + ["L0N2", "L0N5", "L1N0"]
        _, masks = _layer_variants(model, nodes)
        together = circuit_metrics(model, masks, clean, corrupted, metric, nodes=nodes)
        apart = _one_call_each(model, masks, nodes, clean, corrupted, metric)
        assert together == pytest.approx(apart, rel=1e-10, abs=1e-12)
        values.append(together)
    if len(values) == 2:  # the kinds themselves agree to ~1e-7 (their norms' arithmetic)
        assert values[0] == pytest.approx(values[1], rel=1e-5, abs=1e-8)


def _first_block_runs(model) -> tuple[list[int], object]:
    """A counter of the first block's forward calls (a torch forward hook, removed by the
    returned handle)."""
    from tl_attnonly.adapt import analysis_model

    calls = [0]

    def count(module, args, output):
        calls[0] += 1

    return calls, analysis_model(model).model.blocks[0].register_forward_hook(count)


@pytest.mark.parametrize("kind", ["hooked", "bridge"])
def test_later_runs_start_at_their_first_changed_block(kind):
    """Runs that share the first run's inputs below a block start there: on a HookedTransformer
    the first block runs as often for seven circuits as for one (once per batch, besides the
    corrupted runs), and on both kinds the values are those of full runs one by one."""
    model, clean, corrupted, metric = kind_with_task(kind)
    nodes = coarse_nodes(model) + ["L0N2", "L0N5", "L1N0"]
    _, masks = _layer_variants(model, nodes)
    apart = _one_call_each(model, masks, nodes, clean, corrupted, metric)
    counts = []
    for some in (masks[:1], masks):  # two batches each
        calls, handle = _first_block_runs(model)
        try:
            together = circuit_metrics(
                model, some, clean, corrupted, metric, nodes=nodes, batch_size=2
            )
        finally:
            handle.remove()
        counts.append(calls[0])
    assert together == pytest.approx(apart, rel=1e-10, abs=1e-12)
    # every later mask changes edges out of block 0 or later: each starts at block 1 or later.
    # A bridge's runner calls the blocks from there with the arguments each batch's first run
    # gave them; checking that this is exact (once per bridge) runs block 0 once more.
    added = 0 if kind == "hooked" else 1
    assert counts[1] == counts[0] + added


def test_what_no_mask_changes_is_computed_once_per_batch(monkeypatch):
    """Each source's writer matrix and corrupted values are computed once per batch for all the
    circuits of a call (``PlanRun``'s memo), not once per circuit; the values stay those of
    one call per circuit."""
    from tl_attnonly.analysis.discovery import run_plan

    model = make_converted("silu", **GATED_ZOO["llama"])
    nodes = coarse_nodes(model) + ["L0N2", "L0N5", "L1N0"]
    graph, masks = _layer_variants(model, nodes)
    apart = _one_call_each(model, masks, nodes, CLEAN, CORRUPTED, METRIC)
    calls: list[str] = []
    writer_matrix = run_plan.writer_matrix

    def counted(model, src, *args):
        calls.append(src.key)
        return writer_matrix(model, src, *args)

    monkeypatch.setattr(run_plan, "writer_matrix", counted)
    together = circuit_metrics(model, masks, CLEAN, CORRUPTED, METRIC, nodes=nodes, batch_size=2)
    assert together == pytest.approx(apart, rel=1e-10, abs=1e-12)
    assert len(calls) == len(set(calls)) * 2  # two batches, each source once per batch
    assert len(set(calls)) <= len([s for s in graph.sources if s.labels])


def test_reader_weights_are_gathered_once_per_search(monkeypatch):
    """The weights a rebuilt input is read with (``W_gate`` / ``W_in`` of a layer's neurons,
    ``W_Q`` etc. of the heads) are gathered once per layer and input for all the calls that
    share a :class:`CorruptedRuns` (a search's), not once per run, batch or call; the values stay
    those of one call per circuit."""
    from tl_attnonly.analysis.task import CorruptedRuns

    model = make_converted("silu", **GATED_ZOO["llama"])
    nodes = coarse_nodes(model) + ["L0N2", "L0N5", "L1N0"]
    _, masks = _layer_variants(model, nodes)
    apart = _one_call_each(model, masks, nodes, CLEAN, CORRUPTED, METRIC)
    gathered, recomputed = [0], set()
    read_matrix, recompute = exact_run.neuron_read_matrix, exact_run._recompute

    def counted_read(*args):
        gathered[0] += 1
        return read_matrix(*args)

    def seen(model, dst, graph, x, nodes, *args):
        recomputed.add((x.shape[0], dst.key, tuple(nodes.tolist())))  # the batch by its size
        return recompute(model, dst, graph, x, nodes, *args)

    monkeypatch.setattr(exact_run, "neuron_read_matrix", counted_read)
    monkeypatch.setattr(exact_run, "_recompute", seen)
    runs = CorruptedRuns()
    together = circuit_metrics(
        model, masks, CLEAN, CORRUPTED, METRIC, nodes=nodes, batch_size=2, corrupted_runs=runs
    )
    assert together == pytest.approx(apart, rel=1e-10, abs=1e-12)
    layer_inputs = {
        tuple(key[1].split(".")[1:3]) for key in recomputed if not key[1].startswith("attn")
    }
    assert gathered[0] == len(layer_inputs) > 0  # a layer's named neurons and its remainder
    again = circuit_metrics(  # another call of the search: nothing gathered again
        model, masks[::-1], CLEAN, CORRUPTED, METRIC, nodes=nodes, batch_size=2,
        corrupted_runs=runs,
    )  # fmt: skip
    assert again == pytest.approx(apart[::-1], rel=1e-10, abs=1e-12)
    assert gathered[0] == len(layer_inputs)


def test_later_runs_copy_the_changes_of_sources_below_their_first_change(monkeypatch):
    """A later run's merged rows of the sources below its first source with other edges are the
    first run's (copied, not computed): a circuit that differs from the first only in the edges
    of the last layer's named neurons computes the changes of that layer's MLP sources alone,
    with the values of one call per circuit."""
    model = make_converted("silu", **GATED_ZOO["llama"])
    nodes = coarse_nodes(model) + ["L0N2", "L0N5", "L1N0"]
    graph, masks = _layer_variants(model, nodes)
    last = masks[-3]  # the last layer's named neurons cut
    apart = _one_call_each(model, [masks[0], last], nodes, CLEAN, CORRUPTED, METRIC)
    computed = _record_source_values(monkeypatch)
    circuit_metrics(model, masks[:1], CLEAN, CORRUPTED, METRIC, nodes=nodes)
    alone = len(computed)
    computed.clear()
    together = circuit_metrics(model, [masks[0], last], CLEAN, CORRUPTED, METRIC, nodes=nodes)
    assert together == pytest.approx(apart, rel=1e-10, abs=1e-12)
    below = run_reuse.shared_prefix(graph, masks[0], last)[1]
    layer = model.cfg.n_layers - 1
    assert below == min(s.order for s in graph.sources if s.layer == layer and s.kind != "attn")
    # the second run: only the last layer's MLP remainder, still read by the logits (its
    # current and, for the first time in the call, corrupted values: the first run took the
    # layer's change, named neurons and remainder merged, from its output)
    assert {src.key for src in computed[alone:]} == {f"mlp.{layer}"}


def test_a_later_plan_takes_the_first_plans_rows_below_its_first_change():
    """A later circuit's plan takes the first plan's merged rows of the orders below its first
    source with other edges as they are, and equals the plan built from its own mask."""
    from tl_attnonly.analysis.discovery.run_plan import CircuitPlan

    model = make_converted("silu", **GATED_ZOO["llama"])
    graph, masks = _layer_variants(model, coarse_nodes(model) + ["L0N2", "L0N5", "L1N0"])
    first = CircuitPlan(graph, masks[0])
    for mask in masks[1:]:
        below = run_reuse.shared_prefix(graph, masks[0], mask)[1]
        taken, own = CircuitPlan(graph, mask, first, below), CircuitPlan(graph, mask)
        assert taken.orders == own.orders and taken.offsets == own.offsets
        assert taken.incidence.keys() == own.incidence.keys()
        assert all(torch.equal(taken.incidence[k], own.incidence[k]) for k in own.incidence)
        for order in own.orders:
            assert [(g.key, r.tolist(), i.tolist()) for g, r, i in taken.members[order]] == [
                (g.key, r.tolist(), i.tolist()) for g, r, i in own.members[order]
            ]
            assert (taken.members[order] is first.members[order]) == (order < below)


def test_row_sums_equal_the_dense_product():
    from tl_attnonly.analysis.discovery.run_plan import _row_sums

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        W = torch.randn(9, 40, generator=gen, dtype=dtype)
        cols = torch.rand(7, 4, generator=gen) > 0.6
        cols[:, 0] = False  # a reader with no edge: zero
        expected = cols.T.to(dtype) @ W[:7]
        got = _row_sums(cols, W)
        assert got.dtype == dtype and got.shape == (4, 40)
        assert torch.allclose(got, expected, rtol=1e-6 if dtype == torch.float32 else 1e-12)
        assert torch.equal(got[0], torch.zeros(40, dtype=dtype))


def _count_corrupted_runs(monkeypatch, model) -> list[int]:
    from tl_attnonly.adapt import analysis_model

    calls = [0]
    kind = type(analysis_model(model))
    run_with_cache = kind.run_with_cache

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return run_with_cache(self, *args, **kwargs)

    monkeypatch.setattr(kind, "run_with_cache", counted)
    return calls


def test_corrupted_runs_are_made_once_per_batch_across_calls(monkeypatch):
    model = make_converted("silu", **GATED_ZOO["llama"])
    nodes = coarse_nodes(model) + ["L0N2", "L0N5"]
    _, masks = _layer_variants(model, nodes)
    alone = _one_call_each(model, masks[:3], nodes, CLEAN, CORRUPTED, METRIC)
    calls = _count_corrupted_runs(monkeypatch, model)
    store = runs.CorruptedRuns()
    shared = [
        circuit_metrics(
            model, [m], CLEAN, CORRUPTED, METRIC, nodes=nodes, batch_size=2,
            corrupted_runs=store,
        )[0]
        for m in masks[:3]
    ]  # fmt: skip
    assert calls[0] == 2  # two batches, one corrupted run each, for three calls
    assert shared == alone  # the same activations: the same values, bit for bit
    with pytest.raises(ValueError, match="one per model and token pair"):
        circuit_metrics(
            model, masks[:1], CLEAN, CORRUPTED.clone(), METRIC, nodes=nodes, corrupted_runs=store
        )


def test_discover_circuit_is_the_same_with_corrupted_runs_kept_or_not(monkeypatch):
    from tl_attnonly.analysis import discover_circuit
    from tl_attnonly.analysis.discovery import search

    model = make_converted("silu", **GATED_ZOO["llama"])
    clean, corrupted = make_tokens(4, 8, seed=0), make_tokens(4, 8, seed=1)
    metric = logit_diff_metric(torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8]))

    def found():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the circuit's notes are not the subject
            return discover_circuit(
                model, clean, corrupted, metric, batch_size=2, neurons_per_mlp=8, progress=False
            )

    kept = found()
    calls = _count_corrupted_runs(monkeypatch, model)
    monkeypatch.setattr(search, "CorruptedRuns", lambda: runs.CorruptedRuns(budget=0))
    again = found()
    assert calls[0] > 2  # without keeping, each exact-run call made its own corrupted runs
    assert kept.mask.keys() == again.mask.keys()
    assert all(torch.equal(kept.mask[k], again.mask[k]) for k in kept.mask)
    assert kept.faithfulness == again.faithfulness
    assert kept.gate_value.equals(again.gate_value)
    assert kept.mlp_split.equals(again.mlp_split)


#: Per search: the model, the candidate caps (a remainder kept, none kept), the table's columns
AUTO_CASES = {
    "layers": (
        GATED_ZOO["llama"], (4, 64),
        ["node", "named", "remainder", "remainder_share", "faithfulness"],
    ),
    "joint": (
        {**GATED_ZOO["qwen2"], "n_layers": 3}, (5, 16),
        ["node", "named", "remainder", "remainder_share", "share_alone"],
    ),
}  # fmt: skip
#: The adaptive-stage tests' prompts and metric
AUTO_CLEAN, AUTO_CORRUPTED = make_tokens(4, 8, seed=0), make_tokens(4, 8, seed=1)
AUTO_METRIC = logit_diff_metric(torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8]))


def _auto(model, search: str, max_neurons_per_mlp: int):
    """``discover_circuit(..., neurons_per_mlp="auto")`` on the adaptive-stage prompts (its
    notes, which are not the subject, silenced)."""
    from tl_attnonly.analysis import discover_circuit

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return discover_circuit(
            model, AUTO_CLEAN, AUTO_CORRUPTED, AUTO_METRIC, neurons_per_mlp="auto",
            gate_value=False, max_neurons_per_mlp=max_neurons_per_mlp, neuron_search=search,
            progress=False,
        )  # fmt: skip


@pytest.mark.parametrize("search", sorted(AUTO_CASES))
def test_auto_neuron_stage_in_few_calls_chooses_as_one_run_per_call(monkeypatch, search):
    """``neurons_per_mlp="auto"`` runs its candidates a few per call; the choice (named
    neurons, remainders, faithfulness) is the one of one run per call."""
    from tl_attnonly.analysis.discovery import neuron_stage

    config, caps, columns = AUTO_CASES[search]
    model = make_converted("silu", **config)
    calls = [0]

    def counted(model, masks, *args, **kwargs):
        calls[0] += 1
        return circuit_metrics(model, masks, *args, **kwargs)

    def one_per_call(model, masks, *args, kept_neurons, **kwargs):
        return [
            counted(model, [m], *args, kept_neurons=[kept], **kwargs)[0]
            for m, kept in zip(masks, kept_neurons, strict=True)
        ]

    def found(runner, max_neurons_per_mlp: int):
        calls[0] = 0
        monkeypatch.setattr(neuron_stage, "circuit_metrics", runner)
        return _auto(model, search, max_neurons_per_mlp), calls[0]

    for cap in caps:  # a remainder kept, then none (on TransformerLens 3.9's random weights)
        batched, n_batched = found(counted, cap)
        alone, n_alone = found(one_per_call, cap)
        assert batched.extra["named"] == alone.extra["named"]
        assert batched.faithfulness == pytest.approx(alone.faithfulness, rel=1e-10)
        got, want = batched.extra["neuron_stage"], alone.extra["neuron_stage"]
        assert list(got.columns[: len(columns)]) == columns
        assert got[columns[:3]].equals(want[columns[:3]])
        for column in columns[3:]:
            assert got[column].to_numpy() == pytest.approx(want[column].to_numpy(), abs=1e-10)
        assert n_alone == batched.extra["neuron_stage_runs"]  # every run counted
        assert n_batched < n_alone  # fewer calls (corrupted runs), the same choice


@pytest.mark.parametrize("search", sorted(AUTO_CASES))
def test_auto_neuron_stage_runs_from_its_kept_circuits(monkeypatch, search):
    """The adaptive stage keeps a circuit's run (``NeuronStage.keep``: the coarse circuit, then
    each trimmed or checked layer's base) that its calls' circuits start from: the same choice
    as without, with block 0 run less often."""
    from tl_attnonly.analysis.discovery.neuron_stage import NeuronStage

    config, caps, _ = AUTO_CASES[search]
    model = make_converted("silu", **{**config, "n_layers": 4})  # layers above the first cut

    def found():
        calls, handle = _first_block_runs(model)
        try:
            circuit = _auto(model, search, caps[-1])
        finally:
            handle.remove()
        return circuit, calls[0]

    kept, n_kept = found()
    monkeypatch.setattr(NeuronStage, "keep", lambda self, cuts, below=None: None)
    plain, n_plain = found()
    assert kept.extra["named"] == plain.extra["named"]
    assert kept.faithfulness == pytest.approx(plain.faithfulness, rel=1e-10)
    got, want = kept.extra["neuron_stage"], plain.extra["neuron_stage"]
    assert got[["node", "named", "remainder"]].equals(want[["node", "named", "remainder"]])
    assert got["remainder_share"].to_numpy() == pytest.approx(
        want["remainder_share"].to_numpy(), abs=1e-10
    )
    assert n_kept < n_plain


@pytest.mark.parametrize("search", sorted(AUTO_CASES))
def test_auto_neuron_stage_runs_one_size_per_call_from_held_runs(monkeypatch, search):
    """Where the stage's kept runs hold every batch (``NeuronStage.speculate`` False), its
    searches run one size per call: the same choice as with the speculative sizes of a call,
    in no more runs (fewer wherever a search bisects: ``test_adaptive_neurons``'s rule); without
    kept runs it runs those sizes."""
    from tl_attnonly.analysis.discovery.neuron_stage import NeuronStage

    config, caps, _ = AUTO_CASES[search]
    model = make_converted("silu", **{**config, "n_layers": 4})
    held = _auto(model, search, caps[-1])
    with monkeypatch.context() as m:
        m.setattr(NeuronStage, "speculate", property(lambda self: True))
        speculating = _auto(model, search, caps[-1])
    with monkeypatch.context() as m:  # no kept run: the stage speculates by itself
        m.setattr(NeuronStage, "keep", lambda self, cuts, below=None: None)
        unkept = _auto(model, search, caps[-1])
    assert held.extra["named"] == speculating.extra["named"] == unkept.extra["named"]
    assert held.faithfulness == pytest.approx(speculating.faithfulness, rel=1e-10)
    got, want = held.extra["neuron_stage"], speculating.extra["neuron_stage"]
    assert got[["node", "named", "remainder"]].equals(want[["node", "named", "remainder"]])
    runs = [c.extra["neuron_stage_runs"] for c in (held, speculating, unkept)]
    assert runs[0] <= runs[1] == runs[2]
