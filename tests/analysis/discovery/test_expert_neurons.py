"""Expert neurons as nodes (``nodes=[..., "L1E0N5", "L1SN3"]``; converted bridges in float64,
which the converted experts' own loop computes: Hugging Face's grouped kernel is not run): a named
neuron of a routed expert writes its routing weight times its ``hook_post`` times its row of
``W_out`` at the tokens routed to its expert, a shared expert's neuron its gated contribution,
and its expert's node ``L{l}E{e}`` becomes the expert's remainder; the layer keeps its one input
``L{l}MLP``.

Checked against definitions outside the discovery code (a ``run_with_cache`` cache read through
``tl_attnonly.analysis.experts``: ``expert_routing``, ``expert_activation``,
``expert_components``): each named neuron's contribution, the remainder plus its named neurons
is the expert's weighted output and every node of the layer sums to ``hook_mlp_out``; node
patching of a neuron swaps its clean contribution in at the layer's output; plain EAP into the
logits is its change dotted with the gradient; exact runs equal the edge-by-edge definition, the
full graph the clean run and the empty graph the corrupted run.
"""

from __future__ import annotations

import pytest
import torch
from test_circuit_runs_reference import _check_exact_runs
from test_expert_nodes import ROWS, metric_gradient, two_caches
from test_expert_nodes import _last_expert_layer as _layer

# (it puts the bridge zoo on the path)
from test_moe_discovery import CLEAN, CORRUPTED, DENSE_0, METRIC, _bridge

from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis import HeadGraph, circuit_metrics, edge_attribution_scores
from tl_attnonly.analysis.discovery.expert_nodes import EXPERT_LABEL, EXPERT_NEURON_LABEL
from tl_attnonly.analysis.discovery.graph import EXPERT, EXPERT_NEURON, EXPERTS
from tl_attnonly.analysis.discovery.search import coarse_nodes, node_patching_metric
from tl_attnonly.analysis.discovery.sites import source_hook_names, source_values, writer_matrix
from tl_attnonly.analysis.experts import (
    expert_activation,
    expert_components,
    expert_routing,
    moe_layer,
    shared_experts,
)


@pytest.fixture(scope="module", params=["qwen2_moe", "mixtral", DENSE_0])
def moe(request):
    return _bridge(request.param, torch.float64)


def _named(moe) -> list[str]:
    """Neurons of two routed experts of the last expert layer, and of its shared expert."""
    layer = _layer(moe)
    moe_block = moe_layer(analysis_model(moe), layer)
    shared = [f"L{layer}SN4", f"L{layer}SN60"] if shared_experts(moe_block) else []
    return [f"L{layer}E0N3", f"L{layer}E2N5", f"L{layer}E2N7", *shared]


def _contribution(moe, cache, label: str) -> torch.Tensor:
    """``[batch, pos, d_model]``: what neuron ``label`` writes, by its definition: a routed
    expert's routing weight times ``hook_post[j]`` times ``W_out[j]`` (0 where not routed;
    ``b_post`` is 0 for these experts), a shared expert's gate times ``hook_post[j]`` times
    ``W_out[j]``."""
    layer = _layer(moe)
    block = moe_layer(analysis_model(moe), layer)
    owner, j = label[len(f"L{layer}") :].split("N")
    j = int(j)
    if owner == "S":
        (name,) = shared_experts(block)
        post = expert_activation(cache, layer, name, "post")[..., j]
        gate = torch.sigmoid(cache[f"blocks.{layer}.mlp.{name}_gate.hook_out"])
        coef = post * gate.reshape(post.shape)
        W_out = shared_experts(block)[name].out_matrix
    else:
        e = int(owner[1:])
        post = expert_activation(cache, layer, e, "post", fill=0.0)[..., j]
        coef = expert_routing(cache, layer)[..., e] * post
        W_out = block.expert_list()[e].out_matrix
    return coef[..., None] * W_out[j]


def _nodes(moe) -> list[str]:
    return coarse_nodes(moe, experts=True) + _named(moe)


def test_expert_neurons_are_nodes_beside_their_experts(moe):
    layer = _layer(moe)
    graph = HeadGraph(moe, nodes=_nodes(moe))
    (neurons,) = [g for g in graph.sources if g.kind == EXPERT_NEURON]
    assert neurons.layer == layer and list(neurons.labels) == _named(moe)
    (experts,) = [g for g in graph.sources if g.kind == EXPERT and g.layer == layer]
    assert experts.labels == graph.expert_part_labels[layer]  # each now its remainder
    (reader,) = [d for d in graph.inputs if d.kind == EXPERTS and d.layer == layer]
    assert reader.labels == (f"L{layer}MLP",)  # the neurons read the layer's one input too
    assert set(_named(moe)) <= set(graph.reading_nodes(reader, 0))
    with pytest.raises(ValueError, match="does not have"):
        HeadGraph(moe, nodes=[*_nodes(moe), f"L{layer}E0N{10**6}"])


def test_named_neurons_and_remainders_sum_to_the_layer_output(moe):
    """Each named neuron writes its contribution by definition; each expert's remainder plus its
    named neurons is its weighted output; all of them sum to ``hook_mlp_out``."""
    layer = _layer(moe)
    graph = HeadGraph(moe, nodes=_nodes(moe))
    names = source_hook_names(moe, graph)
    with torch.no_grad():
        _, cache = moe.run_with_cache(CLEAN)
    acts = {n: cache[n] for n in names}
    by_kind = {}
    for src in graph.sources:
        if src.layer == layer and src.kind in (EXPERT, EXPERT_NEURON):
            values = source_values(acts, src, graph, moe)  # [b, p, n, r]
            U = writer_matrix(moe, src, graph, values)  # [n, r, d]
            by_kind[src.kind] = (src.labels, torch.einsum("bpnr,nrd->nbpd", values, U))
    labels, neurons = by_kind[EXPERT_NEURON]
    for label, got in zip(labels, neurons, strict=True):
        want = _contribution(moe, cache, label)
        assert want.abs().max() > 1e-3  # the neuron writes something
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    parts, part_labels = expert_components(cache, layer)
    rest_labels, rest = by_kind[EXPERT]
    assert list(rest_labels) == part_labels
    for i, part in enumerate(part_labels):
        mine = [n for n, label in zip(neurons, labels, strict=True) if label.startswith(f"{part}N")]
        torch.testing.assert_close(rest[i] + sum(mine, torch.zeros_like(rest[i])), parts[i])
    torch.testing.assert_close(
        rest.sum(0) + neurons.sum(0), cache[f"blocks.{layer}.hook_mlp_out"], rtol=1e-10, atol=1e-12
    )


def test_exact_runs_with_expert_neurons_equal_the_definition(moe):
    graph = _check_exact_runs(moe, _nodes(moe), CLEAN, CORRUPTED, METRIC, ends=1e-10, rel=1e-9)
    assert [g.kind for g in graph.sources].count(EXPERT_NEURON) == 1


def test_node_patching_of_an_expert_neuron_swaps_its_contribution(moe):
    layer = _layer(moe)
    out = f"blocks.{layer}.hook_mlp_out"
    clean, corrupted = two_caches(moe)
    corrupted_metric = METRIC(moe(CORRUPTED), ROWS).item()
    for named in ([_named(moe)[1]], _named(moe)[-2:]):  # a routed expert's; two
        change = sum(_contribution(moe, clean, n) - _contribution(moe, corrupted, n) for n in named)

        def swap(act, hook, change=change):
            return act + change.to(act.dtype)

        with torch.no_grad():
            want = METRIC(moe.run_with_hooks(CORRUPTED, fwd_hooks=[(out, swap)]), ROWS).item()
        got = node_patching_metric(moe, CLEAN, CORRUPTED, METRIC, named)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
        assert abs(want - corrupted_metric) > 1e-6  # the patch changes the metric
    # a neuron patched with its whole expert counts once: the expert's weighted output
    whole = node_patching_metric(moe, CLEAN, CORRUPTED, METRIC, [f"L{layer}E2"])
    both = node_patching_metric(moe, CLEAN, CORRUPTED, METRIC, [f"L{layer}E2", _named(moe)[1]])
    assert both == pytest.approx(whole, rel=1e-12, abs=1e-12)


def test_eap_into_the_logits_is_the_neuron_s_change_times_the_gradient(moe):
    layer = _layer(moe)
    scores = edge_attribution_scores(
        moe, CLEAN, CORRUPTED, METRIC, method="eap", nodes=_nodes(moe)
    ).scores[(f"expert_neuron.{layer}", "logits")][:, 0]
    grad, clean, corrupted = metric_gradient(moe)
    want = torch.stack(
        [
            ((_contribution(moe, clean, n) - _contribution(moe, corrupted, n)) * grad).sum()
            for n in _named(moe)
        ]
    )
    assert want.abs().max() > 1e-4
    torch.testing.assert_close(scores, want, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# the neuron stage: discover_circuit(..., expert_nodes=True, neurons_per_mlp=2)


@pytest.fixture(scope="module")
def found(moe):
    """The circuit of a fixed size (40 coarse edges: experts of both layers in it) with 2
    neurons named per MLP node, an expert's or a dense layer's."""
    import warnings

    from tl_attnonly.analysis import discover_circuit

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return discover_circuit(
            moe, CLEAN, CORRUPTED, METRIC, progress=False, graph="coarse", top_n=40,
            expert_nodes=True, neurons_per_mlp=2, mib_curve=False,
        )  # fmt: skip


def graph_parts(moe, layer: int) -> list[str]:
    """The expert nodes of ``layer``, in order (routed experts, then shared)."""
    return list(HeadGraph(moe).expert_part_labels[layer])


def _experts_of(circuit) -> list[str]:
    """The expert nodes of the coarse circuit (its sources ``L{l}E{e}``, ``L{l}S``)."""
    from tl_attnonly.analysis.discovery.counts import EXPERT_LABEL

    return [n for n in circuit.extra["coarse"].nodes() if EXPERT_LABEL.match(n)]


def _attribution(moe, layer: int, labels: list[str]) -> dict[str, float]:
    """Node attribution of expert neurons by its definition: the neuron's contribution, clean
    less corrupted (:func:`_contribution`), dotted with the gradient of the metric at the
    layer's output on the corrupted run (a leaf there: every path after it)."""
    grad, clean, corrupted = metric_gradient(moe, f"blocks.{layer}.hook_mlp_out")
    with torch.no_grad():
        return {
            n: float(
                ((_contribution(moe, clean, n) - _contribution(moe, corrupted, n)) * grad).sum()
            )
            for n in labels
        }


def test_each_expert_node_names_its_best_neurons(moe, found):
    """Every expert node of the coarse circuit names its 2 neurons of largest node attribution
    ``|score|``; they are nodes of the circuit's graph, listed in ``extra["named"]``, and the
    expanded circuit is the coarse one (its exact run the same)."""
    experts = _experts_of(found)
    assert experts
    named = found.extra["named"]
    checked = 0
    for expert in experts:
        layer = int(expert[1:].split("E")[0].split("S")[0])
        mine = [n for n in named[layer] if n.startswith(f"{expert}N")]
        assert len(mine) == 2
        if layer == _layer(moe):  # the last expert layer's, against the definition
            block = moe_layer(analysis_model(moe), layer)
            experts_ = [*block.expert_list(), *shared_experts(block).values()]
            width = experts_[graph_parts(moe, layer).index(expert)].d_mlp
            scores = _attribution(moe, layer, [f"{expert}N{j}" for j in range(width)])
            best = sorted(scores, key=lambda n: -abs(scores[n]))[:2]
            assert mine == best
            checked += 1
    assert checked
    assert set(n for v in named.values() for n in v) <= set(found.graph.node_labels())
    assert found.metric_circuit == pytest.approx(found.extra["coarse"].metric_circuit, abs=1e-10)
    (again,) = circuit_metrics(
        moe, [found.mask], CLEAN, CORRUPTED, METRIC, nodes=found.graph.node_labels()
    )
    assert again == pytest.approx(found.metric_circuit, abs=1e-10)


def cut_rows(graph: HeadGraph, mask, labels) -> dict:
    """``mask`` without the outgoing edges of the source nodes ``labels``."""
    out = {}
    for (s, d), block in mask.items():
        src = graph.source_by_key[s]
        keep = torch.tensor([label not in labels for label in src.labels])
        out[(s, d)] = block & keep[:, None]
    return out


def test_the_split_of_an_expert_node_is_its_exact_runs(moe, found):
    """``mlp_split``'s row of an expert node: the circuit without its named neurons' outgoing
    edges, without its remainder's, without both, by exact runs of masks built here."""
    graph, mask = found.graph, found.mask
    denom = found.metric_clean - found.metric_corrupted
    row = next(r for r in found.mlp_split.itertuples() if EXPERT_LABEL.match(r.node))
    named = row.named.split(", ")
    layer = int(row.node[1:].split("E")[0].split("S")[0])

    masks = [
        cut_rows(graph, mask, labels) for labels in (set(named), {row.node}, {*named, row.node})
    ]
    got = circuit_metrics(moe, masks, CLEAN, CORRUPTED, METRIC, nodes=graph.node_labels())
    effects = [(found.metric_circuit - g) / denom for g in got]
    assert effects == pytest.approx(
        [row.named_effect, row.rest_effect, row.layer_effect], rel=1e-8, abs=1e-10
    )
    assert layer in graph.expert_neurons and set(named) <= set(graph.expert_neurons[layer])


def test_counts_report_figures_exports_and_file(moe, found, tmp_path):
    import tl_attnonly.vis  # noqa: F401  (registers Circuit.figure)
    from tl_attnonly.analysis import Circuit
    from tl_attnonly.analysis.discovery.counts import circuit_counts
    from tl_attnonly.vis import neuron_circuit_figure

    named = [n for v in found.extra["named"].values() for n in v]
    expert_neurons = [n for n in named if EXPERT_NEURON_LABEL.match(n)]
    assert expert_neurons
    counts = circuit_counts(found)
    assert counts["named_neurons"] == len(named)
    assert counts["experts"] == len({s for s in found.edges().source if EXPERT_LABEL.match(s)})
    report = found.report()
    assert all(n in report for n in expert_neurons)  # the MLP split names them
    found.figure()
    figure = neuron_circuit_figure(found).to_json()
    assert all(n in figure for n in expert_neurons if n in set(found.edges().source))
    mib = found.to_mib(d_model=moe.cfg.d_model)  # an expert neuron is part of MIB's m{l}
    for n in expert_neurons:
        if n in set(found.edges().source):
            assert mib["nodes"][f"m{int(n[1:].split('E')[0].split('S')[0])}"]["in_graph"]
    nodes = found.to_graph_json()["nodes"]
    roles = {n["node_id"].rsplit("_", 1)[0]: n for n in nodes}
    drawn = [n for n in expert_neurons if n in roles]
    assert drawn and all(roles[n]["feature_type"] == "mlp expert neuron" for n in drawn)
    assert len({(n["layer"], n["feature"]) for n in nodes}) == len(nodes)
    loaded = Circuit.load(found.save(tmp_path / "c"), model=moe)
    assert loaded.graph.expert_neurons == found.graph.expert_neurons
    assert loaded.extra["named"] == found.extra["named"]
    (reloaded,) = circuit_metrics(
        moe, [loaded.mask], CLEAN, CORRUPTED, METRIC, nodes=loaded.graph.node_labels()
    )
    assert reloaded == pytest.approx(found.metric_circuit, abs=1e-10)


def test_what_the_expert_neuron_stage_refuses():
    """Before any work: the rankings other than node attribution (the adaptive count:
    ``test_expert_kept``)."""
    from tl_attnonly.analysis.discovery.options import DiscoveryOptions

    for ranking in ("relp", "circuit"):
        with pytest.raises(ValueError, match=f"neuron_ranking='{ranking}' with expert_nodes"):
            DiscoveryOptions(expert_nodes=True, neurons_per_mlp=2, neuron_ranking=ranking)
    DiscoveryOptions(expert_nodes=True, neurons_per_mlp=0, neuron_ranking="relp")  # names none
