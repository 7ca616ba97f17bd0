"""Circuit discovery on mixtures of experts (a converted bridge; fp32, as Hugging Face's grouped
experts have no float64 kernel everywhere): each expert layer is one node ``L{l}MLP``, its output
``hook_mlp_out`` and its input the layer's normalised input, rebuilt like any reader's and routed
by the layer itself (routing is recomputed from each run's input).

Exact runs equal their definition edge by edge (``test_circuit_runs_reference._reference``, which
normalises an expert layer's rebuilt input with the Hugging Face norm the bridge wraps); the full
graph is the clean run and the empty graph the corrupted run; ``discover_circuit`` runs end to
end, naming no neurons in an expert layer.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2]))
sys.path.insert(0, str(Path(__file__).parents[2] / "bridge"))

from test_circuit_runs_reference import (  # noqa: E402
    _branch_gradient,
    _check_exact_runs,
    _random_mask,
)
from zoo import ZOO, build_bridge, convert_zoo_bridge, tokens  # noqa: E402

from tl_attnonly.adapt import analysis_model  # noqa: E402
from tl_attnonly.analysis import (  # noqa: E402
    HeadGraph,
    circuit_metrics,
    discover_circuit,
    edge_attribution_scores,
)
from tl_attnonly.analysis.discovery.graph import EXPERTS  # noqa: E402
from tl_attnonly.analysis.discovery.search import (  # noqa: E402
    coarse_nodes,
    node_patching_metric,
)
from tl_attnonly.analysis.discovery.sites import logit_diff_metric  # noqa: E402
from tl_attnonly.analysis.experts import experts_used  # noqa: E402

CLEAN, CORRUPTED = tokens(4, 7, seed=1), tokens(4, 7, seed=2)
DENSE_0 = "qwen2_moe_dense0"
METRIC = logit_diff_metric(torch.tensor([3, 4, 5, 6]), torch.tensor([7, 8, 9, 10]))
#: Qwen2-MoE (a shared expert, gated), Mixtral, OLMoE (QK norm), and a Qwen2-MoE whose layer 0
#: is dense (``mlp_only_layers``: named neurons there beside an expert node).
NAMES = ["qwen2_moe", "mixtral", "olmoe", DENSE_0]


def _bridge(name: str, dtype: torch.dtype = torch.float32):
    if name != DENSE_0:
        return convert_zoo_bridge(build_bridge(name, dtype))
    spec = ZOO["qwen2_moe"]
    ZOO[DENSE_0] = dataclasses.replace(
        spec, name=DENSE_0, kwargs={**spec.kwargs, "mlp_only_layers": [0]}
    )
    try:
        return convert_zoo_bridge(build_bridge(DENSE_0, dtype))
    finally:
        del ZOO[DENSE_0]


@pytest.fixture(scope="module", params=NAMES)
def moe(request):
    return _bridge(request.param)


def _experts(model) -> list[int]:
    return [
        li
        for li, block in enumerate(analysis_model(model).blocks)
        if block.mlp.is_mixture_of_experts
    ]


def test_exact_runs_equal_the_edge_by_edge_definition(moe):
    experts = _experts(moe)
    named = [] if 0 in experts else ["L0N2", "L0N5"]  # a dense layer 0's neurons, by name
    nodes = coarse_nodes(moe) + named
    graph = _check_exact_runs(moe, nodes, CLEAN, CORRUPTED, METRIC, ends=1e-5, rel=1e-4)
    assert [g.key for g in graph.sources if g.kind == EXPERTS] == [
        f"experts.{li}" for li in experts
    ]


def test_eap_scores_into_and_out_of_an_expert_layer_are_its_branch_gradient(moe):
    """Plain EAP (gradients at the corrupted run): an edge into layer 1's expert node scores the
    source's change dotted with the gradient of the metric at the layer's own input (a copy at
    its norm's input, so the residual path around it is not counted); an edge out of layer 0's
    scores its output change ``hook_mlp_out`` so."""
    scores = edge_attribution_scores(
        moe, CLEAN, CORRUPTED, METRIC, method="eap", nodes=coarse_nodes(moe)
    ).scores
    names = ["hook_embed", "blocks.0.hook_mlp_out"]
    at = "blocks.1.ln2.hook_in"
    grad, clean, corrupted = _branch_gradient(moe, at, names, CLEAN, CORRUPTED, METRIC)
    layer_0 = "experts.0" if 0 in _experts(moe) else "mlp.0"  # a dense layer 0: its coarse node
    for source, name in (("embed", "hook_embed"), (layer_0, "blocks.0.hook_mlp_out")):
        want = (grad * (clean[name] - corrupted[name])).sum()
        got = scores[(source, "experts.1")]
        assert got.shape == (1, 1) and want.abs() > 1e-3
        torch.testing.assert_close(got[0, 0], want, rtol=1e-4, atol=1e-6)


def test_discover_circuit_runs_with_expert_layers_as_nodes(moe):
    """End to end (the defaults: coarse graph, EAP-IG, sweep, pruning, MIB's curve; and 8
    neurons named per MLP node): the full graph is the model, no neuron is named in an expert
    layer, and the found circuit's own exact run is its reported metric; its figures, exports
    and file work."""
    import tl_attnonly.vis  # noqa: F401  (registers Circuit.figure)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        circuit = discover_circuit(moe, CLEAN, CORRUPTED, METRIC, neurons_per_mlp=8, progress=False)
    # an expert layer has no neurons of its own to name; a dense one has
    assert not set(circuit.extra["named"]) & set(_experts(moe))
    assert circuit.ceiling == pytest.approx(1.0, abs=1e-5)
    (again,) = circuit_metrics(
        moe, [circuit.mask], CLEAN, CORRUPTED, METRIC, nodes=circuit.graph.node_labels()
    )
    assert again == pytest.approx(circuit.metric_circuit, abs=1e-6)
    assert "mib_curve" in circuit.extra
    used = circuit.experts_used(moe, CLEAN, CORRUPTED)
    assert sorted(used) == _experts(moe) and all(u.shape[:2] == CLEAN.shape for u in used.values())
    circuit.figure()
    mib = circuit.to_mib(d_model=moe.cfg.d_model)
    assert all(not edge.endswith("<>") for edge in mib["edges"])


def test_a_circuit_s_run_routes_its_own_input(moe):
    """``circuit_experts_used``: the full graph routes as the clean run, the empty graph as the
    corrupted run, and a circuit between them routes some token otherwise than either (its
    expert layers read their rebuilt input)."""
    from tl_attnonly.analysis.discovery.circuit_routing import circuit_experts_used

    nodes = coarse_nodes(moe)
    graph = HeadGraph(moe, nodes=nodes)
    with torch.no_grad():
        clean = experts_used(moe.run_with_cache(CLEAN)[1])
        corrupted = experts_used(moe.run_with_cache(CORRUPTED)[1])

    def routed(mask):  # a circuit's graph and mask are all it reads
        circuit = SimpleNamespace(graph=graph, mask=mask)
        return circuit_experts_used(moe, circuit, CLEAN, CORRUPTED, batch_size=2)

    experts = _experts(moe)
    for mask, want in ((graph.full_mask(), clean), (graph.full_mask(False), corrupted)):
        got = routed(mask)
        assert sorted(got) == experts
        for layer in experts:
            assert torch.equal(got[layer].sort(-1).values, want[layer].sort(-1).values)
    layer = experts[-1]
    mixed = [routed(_random_mask(graph, 0.5, seed=s))[layer].sort(-1).values for s in range(4)]
    differ = [
        not torch.equal(m, clean[layer].sort(-1).values)
        and not torch.equal(m, corrupted[layer].sort(-1).values)
        for m in mixed
    ]
    assert any(differ)


def test_an_expert_layer_s_neurons_are_not_nodes():
    """Neurons named in an expert layer refuse (node patching, the gate/value split)."""
    moe = convert_zoo_bridge(build_bridge("qwen2_moe", torch.float32))
    with pytest.raises(ValueError, match="mixture of experts"):
        node_patching_metric(moe, CLEAN, CORRUPTED, METRIC, ["L1N3"])


def test_node_attribution_takes_an_expert_layer_whole():
    """Node attribution (the default neuron ranking of ``discover_circuit``'s neuron stage, and
    ``top_nodes``) on a model with a dense layer 0 and an expert layer 1: the dense layer's
    neurons are scored, the expert layer is one node ``L1MLP`` scored at its output (it refused
    every model with an expert layer, so the default call failed whenever a dense layer's MLP
    was in the coarse circuit)."""
    from tl_attnonly.analysis.discovery.node_circuits import ModelInputs, node_attribution_scores
    from tl_attnonly.analysis.discovery.search import top_nodes

    moe = _bridge(DENSE_0)
    rows = torch.arange(4)
    got = node_attribution_scores(
        moe, ModelInputs(CLEAN), ModelInputs(CORRUPTED), lambda out, inputs: METRIC(out, rows)
    )
    name = "blocks.1.hook_mlp_out"
    with torch.no_grad():
        clean = moe.run_with_cache(CLEAN, names_filter=[name])[1][name]
    held = {}

    def grab(act, hook):
        held["x"] = act.detach().requires_grad_(True)
        return held["x"]

    logits = moe.run_with_hooks(CORRUPTED, fwd_hooks=[(name, grab)])
    (grad,) = torch.autograd.grad(METRIC(logits, rows), [held["x"]])
    want = ((clean - held["x"].detach()) * grad).sum().item()
    assert abs(want) > 1e-4
    assert got.scores["L1MLP"] == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert "L0N0" in got.scores and not any(k.startswith("L1N") for k in got.scores.index)
    labels, _ = top_nodes(moe, CLEAN, CORRUPTED, METRIC, 200, progress=False)
    assert "L1MLP" in labels and HeadGraph(moe, nodes=labels).expert_layers == {1}
