"""``circuit_neuron_scores`` (``neuron_ranking="circuit"``): each neuron's attribution along its
MLP node's edges in a coarse circuit, against two independent references (fp64): the EAP scores
of the neurons' edges on the graph with every neuron of the layers named, summed over the
circuit's edges of their node (a restricted graph's edge scores, built in the test), and, with
every edge of the coarse graph, node attribution (``top_nodes``); unresolved and resolved by
position, ``eap`` and ``eap-ig``, on both model kinds."""

from __future__ import annotations

import pytest
from conftest import GATED_ZOO, make_tokens
from kinds import kind_with_task
from models import make_converted
from test_circuit_runs_reference import METRIC, _random_mask
from test_positions import CLASSES

from tl_attnonly.analysis import (
    DiscoveryOptions,
    HeadGraph,
    edge_attribution_scores,
    top_nodes,
)
from tl_attnonly.analysis.discovery import circuit_neuron_scores
from tl_attnonly.analysis.discovery.search import coarse_nodes, expand_mask

CLEAN, CORRUPTED = make_tokens(3, 8, seed=0), make_tokens(3, 8, seed=1)


def _summed_edge_scores(model, graph, mask, layers, method, positions=None) -> dict[str, float]:
    """Per neuron of ``layers``: the sum of its edges' EAP scores on the graph with every neuron
    of ``layers`` named, over the coarse ``mask``'s edges of its node (expanded)."""
    d_mlp = model.cfg.d_mlp
    nodes = coarse_nodes(model) + [f"L{li}N{i}" for li in layers for i in range(d_mlp)]
    es = edge_attribution_scores(
        model, CLEAN, CORRUPTED, METRIC, method=method, nodes=nodes, progress=False,
        positions=positions,
    )  # fmt: skip
    fine = expand_mask(graph, mask, es.graph)
    out: dict[str, float] = {}
    for (src_key, dst_key), kept in fine.items():
        src = es.graph.source_by_key[src_key]
        if src.kind == "neuron":
            for label, v in zip(
                src.labels, (es.scores[(src_key, dst_key)] * kept).sum(1), strict=True
            ):
                out[label] = out.get(label, 0.0) + float(v)
    return out


@pytest.mark.parametrize("method", ["eap", "eap-ig"])
@pytest.mark.parametrize("resolved", [False, True])
def test_it_is_the_sum_of_the_named_neurons_edge_scores_along_the_circuit(method, resolved):
    model = make_converted("silu", **{**GATED_ZOO["llama"], "n_layers": 3})
    positions = CLASSES if resolved else None
    graph = HeadGraph(
        model, nodes=coarse_nodes(model), positions=None if positions is None else CLASSES.names
    )
    mask = _random_mask(graph, 0.5, seed=3)
    layers = [0, 1]
    got = circuit_neuron_scores(
        model, graph, mask, CLEAN, CORRUPTED, METRIC, layers, method=method, positions=positions
    )
    want = _summed_edge_scores(model, graph, mask, layers, method, positions)
    assert set(got.index) == {f"L{li}N{i}" for li in layers for i in range(model.cfg.d_mlp)}
    scale = max(abs(v) for v in want.values())
    assert scale > 1e-3  # the circuit's edges carry something
    for label, value in got.items():
        assert value == pytest.approx(want.get(label, 0.0), abs=1e-10 * scale)
    # fewer edges than the layer's: not the node attribution
    _, node = top_nodes(model, CLEAN, CORRUPTED, METRIC, 1, progress=False)
    assert max(abs(got[k] - node[k]) for k in got.index) > 1e-3 * scale


@pytest.mark.parametrize("family", ["gpt2", "llama_gqa"])
@pytest.mark.parametrize("kind", ["hooked", "bridge"])
def test_with_every_edge_it_is_node_attribution_on_both_kinds(kind, family):
    model, clean, corrupted, metric = kind_with_task(kind, family)
    graph = HeadGraph(model, nodes=coarse_nodes(model))
    layers = list(range(model.cfg.n_layers))
    got = circuit_neuron_scores(model, graph, graph.full_mask(), clean, corrupted, metric, layers)
    _, node = top_nodes(model, clean, corrupted, metric, 1, progress=False)
    scale = max(abs(node[k]) for k in got.index)
    assert scale > 1e-3
    for label, value in got.items():
        assert value == pytest.approx(node[label], abs=1e-10 * scale)


@pytest.mark.parametrize(("family", "rtol"), [("gpt2", 1e-9), ("llama_gqa", 1e-5)])
def test_both_kinds_agree_on_the_same_weights(family, rtol):
    """(The LLaMA bridge's attention softmax runs in float32, hence its tolerance.)"""
    hooked, clean, corrupted, metric = kind_with_task("hooked", family)
    bridge, *_ = kind_with_task("bridge", family)
    scores = []
    for model in (hooked, bridge):
        graph = HeadGraph(model, nodes=coarse_nodes(model))
        mask = _random_mask(graph, 0.5, seed=7)
        scores.append(circuit_neuron_scores(model, graph, mask, clean, corrupted, metric, [0, 1]))
    a, b = scores
    assert list(a.index) == list(b.index)
    assert a.to_numpy() == pytest.approx(b.to_numpy(), abs=rtol * float(a.abs().max()))


def test_a_graph_with_named_neurons_is_refused():
    model = make_converted("silu", **GATED_ZOO["llama"])
    graph = HeadGraph(model, nodes=coarse_nodes(model) + ["L0N1"])
    with pytest.raises(ValueError, match="coarse graph"):
        circuit_neuron_scores(model, graph, graph.full_mask(), CLEAN, CORRUPTED, METRIC, [0])


def test_the_option_is_checked():
    DiscoveryOptions(neuron_ranking="circuit")
    with pytest.raises(ValueError, match="graph='coarse'"):
        DiscoveryOptions(graph="neurons", neuron_ranking="circuit")
