"""Expert nodes passing on some of their neurons' changes (``circuit_metrics(...,
kept_neurons=[{"L1E2": bool [n]}])``), and the adaptive neuron stage on them
(``discover_circuit(..., expert_nodes=True, neurons_per_mlp="auto")``). Converted bridges in
float64, as ``test_expert_neurons`` (the converted experts' own loop; Qwen2-MoE with a shared
expert, Mixtral, and a Qwen2-MoE whose layer 0 is dense).

An expert passing on its kept neurons ``K`` changes by ``sum_{j in K} (c_j(current) -
c_j(corrupted)) W_out[j]``, ``c_j`` its routing weight (or shared gate) times ``hook_post[j]`` in
that run, with that run's routing. Checked against the edge-by-edge definition with that change
built here from the runs' hooks (``test_expert_neurons._contribution``), against the graph with
``K`` named and the expert's remainder cut (the stage's meaning), and against the plain runs
where ``K`` is every neuron (these experts have no bias) or none (the expert's edges cut).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_circuit_runs_reference import _random_mask, _reference
from test_expert_neurons import _contribution, cut_rows
from test_expert_nodes import _last_expert_layer as _layer

# (it puts the bridge zoo on the path)
from test_moe_discovery import CLEAN, CORRUPTED, DENSE_0, METRIC, _bridge
from transformer_lens import ActivationCache

from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis import Circuit, HeadGraph, circuit_metrics, discover_circuit
from tl_attnonly.analysis.discovery.expert_kept import expert_width
from tl_attnonly.analysis.discovery.expert_nodes import EXPERT_LABEL, expert_source_hooks
from tl_attnonly.analysis.discovery.graph import EXPERT, EXPERT_NEURON
from tl_attnonly.analysis.discovery.neuron_stage import neuron_mask
from tl_attnonly.analysis.discovery.options import DiscoveryOptions
from tl_attnonly.analysis.discovery.search import coarse_nodes, expand_mask
from tl_attnonly.analysis.patching.dense_layers import expert_layers


@pytest.fixture(scope="module", params=["qwen2_moe", "mixtral", DENSE_0])
def moe(request):
    return _bridge(request.param, torch.float64)


def _graph(moe) -> HeadGraph:
    return HeadGraph(moe, nodes=coarse_nodes(moe, experts=True))


def _kept(moe) -> dict[str, torch.Tensor]:
    """Some neurons of a routed expert of the first and of the last expert layer (the last
    layer's routing then differs between the runs), and of the last layer's shared expert."""
    graph = _graph(moe)
    first, last = min(graph.split_experts), _layer(moe)
    labels = [f"L{first}E1", f"L{last}E2"]
    if f"L{last}S" in graph.expert_part_labels[last]:
        labels.append(f"L{last}S")
    g = torch.Generator().manual_seed(0)
    out = {}
    for label in dict.fromkeys(labels):
        width = expert_width(graph, label)
        out[label] = torch.rand(width, generator=g) < 0.4
        assert 0 < int(out[label].sum()) < width
    return out


def _by_hand(moe, kept: dict[str, torch.Tensor]):
    """``changed`` for :func:`_reference`: an expert of ``kept`` changes by its kept neurons'
    contributions, current less corrupted, each from its own run's routing and ``hook_post``."""

    def changed(src, change, current, corr_cache):
        if src.kind != EXPERT or not any(label in kept for label in src.labels):
            return change
        now = ActivationCache(dict(current), moe)
        change = change.clone()
        for i, label in enumerate(src.labels):
            if label in kept:
                neurons = [f"{label}N{j}" for j in kept[label].nonzero().flatten().tolist()]
                change[:, :, i] = sum(
                    _contribution_at(moe, now, n) - _contribution_at(moe, corr_cache, n)
                    for n in neurons
                )
        return change

    return changed


def _contribution_at(moe, cache, label: str) -> torch.Tensor:
    """``test_expert_neurons._contribution`` of a neuron of any expert layer (it reads the last
    layer's)."""
    layer = int(EXPERT_LABEL.match(label[: label.rindex("N")]).group(1))
    if layer == _layer(moe):
        return _contribution(moe, cache, label)
    from tl_attnonly.analysis.experts import expert_activation, expert_routing, moe_layer

    e, j = (int(x) for x in label[len(f"L{layer}E") :].split("N"))
    post = expert_activation(cache, layer, e, "post", fill=0.0)[..., j]
    coef = expert_routing(cache, layer)[..., e] * post
    W_out = moe_layer(analysis_model(moe), layer).expert_list()[e].out_matrix
    return coef[..., None] * W_out[j]


def _hooks(moe) -> list[str]:
    """Every expert layer's hooks a neuron's contribution is read from."""
    model = analysis_model(moe)
    return [n for li in sorted(expert_layers(model)) for n in expert_source_hooks(model, li, True)]


def test_an_expert_passing_on_some_neurons_equals_the_definition(moe):
    graph, kept = _graph(moe), _kept(moe)
    masks = [graph.full_mask(), _random_mask(graph, 0.5, seed=4), _random_mask(graph, 0.8, seed=5)]
    nodes = coarse_nodes(moe, experts=True)
    got = circuit_metrics(
        moe, masks, CLEAN, CORRUPTED, METRIC, nodes=nodes, kept_neurons=[kept] * len(masks),
        batch_size=2,
    )  # fmt: skip
    plain = circuit_metrics(moe, masks, CLEAN, CORRUPTED, METRIC, nodes=nodes)
    for value, whole, mask in zip(got, plain, masks, strict=True):
        want = _reference(
            moe, graph, mask, CLEAN, CORRUPTED, METRIC, changed=_by_hand(moe, kept),
            extra_hooks=_hooks(moe),
        )  # fmt: skip
        assert value == pytest.approx(want, rel=1e-9, abs=1e-10)
        assert abs(value - whole) > 1e-6  # the kept neurons are not the whole experts


def test_every_neuron_is_the_whole_expert_and_none_is_no_edge(moe):
    """These experts have no output bias: every neuron kept is the expert's whole change; none
    kept is the expert without outgoing edges."""
    graph, kept = _graph(moe), _kept(moe)
    mask = _random_mask(graph, 0.6, seed=6)
    every = {label: torch.ones_like(k) for label, k in kept.items()}
    none = {label: torch.zeros_like(k) for label, k in kept.items()}
    cut = cut_rows(graph, mask, set(kept))
    nodes = coarse_nodes(moe, experts=True)
    got = circuit_metrics(
        moe, [mask, mask, mask, cut], CLEAN, CORRUPTED, METRIC, nodes=nodes,
        kept_neurons=[None, every, none, None],
    )  # fmt: skip
    assert got[1] == pytest.approx(got[0], rel=1e-9, abs=1e-10)
    assert got[2] == pytest.approx(got[3], rel=1e-9, abs=1e-10)
    assert abs(got[0] - got[3]) > 1e-6


def _named_graph(moe, named: list[str]) -> HeadGraph:
    return HeadGraph(moe, nodes=coarse_nodes(moe, experts=True) + named)


def test_kept_neurons_are_the_runs_of_the_graph_with_them_named(moe):
    """The stage's meaning: an expert passing on ``K`` is the graph with ``K`` named (the
    expert's edges on each) and the expert's remainder cut. On a graph that names some of the
    expert's neurons already, a named neuron passes on its change if kept and the remainder its
    kept neurons not named."""
    coarse, kept = _graph(moe), _kept(moe)
    mask = _random_mask(coarse, 0.6, seed=7)
    named = [f"{e}N{j}" for e, k in kept.items() for j in k.nonzero().flatten().tolist()]
    fine = _named_graph(moe, named)
    want = cut_rows(fine, expand_mask(coarse, mask, fine), set(kept))
    (expected,) = circuit_metrics(moe, [want], CLEAN, CORRUPTED, METRIC, nodes=fine.node_labels())
    (got,) = circuit_metrics(
        moe, [mask], CLEAN, CORRUPTED, METRIC, nodes=coarse.node_labels(), kept_neurons=[kept]
    )
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-10)
    # a graph naming two neurons of each expert, one kept and one not
    some = []
    for e, k in kept.items():
        some += [f"{e}N{int(k.nonzero()[0])}", f"{e}N{int((~k).nonzero()[0])}"]
    partly = _named_graph(moe, some)
    (on_partly,) = circuit_metrics(
        moe, [expand_mask(coarse, mask, partly)], CLEAN, CORRUPTED, METRIC,
        nodes=partly.node_labels(), kept_neurons=[kept],
    )  # fmt: skip
    assert on_partly == pytest.approx(expected, rel=1e-9, abs=1e-10)
    assert [g.kind for g in partly.sources].count(EXPERT_NEURON) >= 1


def test_kept_neurons_of_an_expert_are_checked(moe):
    graph, layer = _graph(moe), _layer(moe)
    mask = graph.full_mask()
    nodes = coarse_nodes(moe, experts=True)
    width = expert_width(graph, f"L{layer}E0")
    bad = [
        ({layer: torch.ones(moe.cfg.d_mlp or width, dtype=torch.bool)}, "is a mixture of experts"),
        ({f"L{layer}E99": torch.ones(width, dtype=torch.bool)}, "neither a layer nor an expert"),
        ({f"L{layer}E0": torch.ones(width + 1, dtype=torch.bool)}, "must be bool"),
    ]
    for entry, match in bad:
        with pytest.raises(ValueError, match=match):
            circuit_metrics(
                moe, [mask], CLEAN, CORRUPTED, METRIC, nodes=nodes, kept_neurons=[entry]
            )
    whole = coarse_nodes(moe)  # the layer one node: no expert node to key
    with pytest.raises(ValueError, match="neither a layer nor an expert"):
        circuit_metrics(
            moe, [HeadGraph(moe, nodes=whole).full_mask()], CLEAN, CORRUPTED, METRIC,
            nodes=whole, kept_neurons=[{f"L{layer}E0": torch.ones(width, dtype=torch.bool)}],
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the adaptive stage: discover_circuit(..., expert_nodes=True, neurons_per_mlp="auto")


#: The stage's goal: high, with few candidates, so that on Qwen2-MoE it keeps some remainders,
#: drops one in its last step and names neurons in others (on these random models a smaller
#: circuit overshoots the clean run: every node is cut there).
TARGET = 0.99


def _auto(moe, **overrides) -> Circuit:
    """The coarse circuit of every edge (``top_n`` above their count), then the stage."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return discover_circuit(
            moe, CLEAN, CORRUPTED, METRIC, progress=False, graph="coarse", top_n=10**4,
            target=TARGET, expert_nodes=True, neurons_per_mlp="auto", max_neurons_per_mlp=4,
            mib_curve=False, gate_value=False, **overrides,
        )  # fmt: skip


@pytest.fixture(scope="module")
def found(moe):
    return _auto(moe)


def _stage_kept(circuit: Circuit, graph: HeadGraph, d_mlp: int) -> dict:
    """The ``kept_neurons`` entry of the returned circuit on the coarse graph: each MLP node
    whose remainder the stage cut passes on its named neurons only."""
    table = circuit.extra["neuron_stage"]
    named = [n for v in circuit.extra["named"].values() for n in v]
    out = {}
    for row in table.itertuples():
        if row.remainder:  # kept whole
            continue
        if EXPERT_LABEL.match(row.node):
            mine = [n for n in named if n.startswith(f"{row.node}N")]
            out[row.node] = neuron_mask(expert_width(graph, row.node), mine)
        else:
            layer = int(row.node[1:-3])
            out[layer] = neuron_mask(d_mlp, [n for n in named if n.startswith(f"L{layer}N")])
    return out


def test_the_stage_resolves_each_expert_node_by_exact_runs(moe, found):
    coarse = found.extra["coarse"]
    experts = [n for n in coarse.nodes() if EXPERT_LABEL.match(n)]
    table = found.extra["neuron_stage"]
    assert experts and set(experts) <= set(table.node)  # every expert node of the circuit
    named = [n for v in found.extra["named"].values() for n in v]
    for row in table.itertuples():  # each node's named neurons are its own
        prefix = row.node if EXPERT_LABEL.match(row.node) else row.node[: -len("MLP")]
        assert len([n for n in named if n.startswith(f"{prefix}N")]) == row.named
    assert found.faithfulness >= min(TARGET, coarse.faithfulness) - 1e-9  # the goal
    assert found.extra["neuron_stage_runs"] > 0
    report = found.report()
    assert 'neurons_per_mlp="auto"' in report and all(n in report for n in experts)


def test_the_circuit_s_metric_is_its_exact_run_on_both_graphs(moe, found):
    """What the stage reports is the circuit's exact run: on its graph with the named neurons,
    and on the coarse graph with each cut node passing on its named neurons only."""
    (again,) = circuit_metrics(
        moe, [found.mask], CLEAN, CORRUPTED, METRIC, nodes=found.graph.node_labels()
    )
    assert again == pytest.approx(found.metric_circuit, rel=1e-9, abs=1e-10)
    coarse = found.extra["coarse"]
    kept = _stage_kept(found, coarse.graph, int(moe.cfg.d_mlp or 0))
    (on_coarse,) = circuit_metrics(
        moe, [coarse.mask], CLEAN, CORRUPTED, METRIC, nodes=coarse.graph.node_labels(),
        kept_neurons=[kept],
    )  # fmt: skip
    assert on_coarse == pytest.approx(found.metric_circuit, rel=1e-9, abs=1e-10)
    # each kept node's share: the circuit with it minus without it (its edges cut), exact runs
    # on the circuit's graph
    kept_rows = [r for r in found.extra["neuron_stage"].itertuples() if r.remainder]
    masks = [cut_rows(found.graph, found.mask, {r.node}) for r in kept_rows]
    without = circuit_metrics(
        moe, masks, CLEAN, CORRUPTED, METRIC, nodes=found.graph.node_labels()
    ) if masks else []  # fmt: skip
    denom = found.metric_clean - found.metric_corrupted
    for row, value in zip(kept_rows, without, strict=True):
        share = found.faithfulness - (value - found.metric_corrupted) / denom
        assert share == pytest.approx(row.remainder_share, rel=1e-8, abs=1e-10)


def test_save_and_load(moe, found, tmp_path):
    loaded = Circuit.load(found.save(tmp_path / "c"), model=moe)
    assert loaded.extra["named"] == found.extra["named"]
    assert list(loaded.extra["neuron_stage"].node) == list(found.extra["neuron_stage"].node)
    assert loaded.graph.expert_neurons == found.graph.expert_neurons
    (reloaded,) = circuit_metrics(
        moe, [loaded.mask], CLEAN, CORRUPTED, METRIC, nodes=loaded.graph.node_labels()
    )
    assert reloaded == pytest.approx(found.metric_circuit, rel=1e-9, abs=1e-10)


def test_layer_by_layer_search_on_experts():
    """``neuron_search="layers"``: a node whose candidates cannot replace it names them all
    beside its remainder; the circuit's metric is its exact run on both graphs."""
    moe = _bridge("qwen2_moe", torch.float64)
    circuit = _auto(moe, neuron_search="layers")
    (again,) = circuit_metrics(
        moe, [circuit.mask], CLEAN, CORRUPTED, METRIC, nodes=circuit.graph.node_labels()
    )
    assert again == pytest.approx(circuit.metric_circuit, rel=1e-9, abs=1e-10)
    coarse = circuit.extra["coarse"]
    (on_coarse,) = circuit_metrics(
        moe, [coarse.mask], CLEAN, CORRUPTED, METRIC, nodes=coarse.graph.node_labels(),
        kept_neurons=[_stage_kept(circuit, coarse.graph, int(moe.cfg.d_mlp or 0))],
    )  # fmt: skip
    assert on_coarse == pytest.approx(circuit.metric_circuit, rel=1e-9, abs=1e-10)
    table = circuit.extra["neuron_stage"]
    assert all(EXPERT_LABEL.match(n) for n in table.node)
    assert circuit.faithfulness >= min(TARGET, coarse.faithfulness) - 1e-9


def test_auto_is_accepted_with_expert_nodes_and_other_rankings_refused():
    DiscoveryOptions(expert_nodes=True, neurons_per_mlp="auto")  # refused before
    for ranking in ("relp", "circuit"):
        with pytest.raises(ValueError, match=f"neuron_ranking='{ranking}' with expert_nodes"):
            DiscoveryOptions(expert_nodes=True, neurons_per_mlp="auto", neuron_ranking=ranking)
