"""A mixture-of-experts layer as nodes of its experts (``discover_circuit(...,
expert_nodes=True)``, ``coarse_nodes(model, experts=True)``; converted bridges, fp32): each routed
expert ``L{l}E{e}`` and shared expert ``L{l}S`` is a source writing its weighted output, the layer
keeps its one input ``L{l}MLP``.

Checked against definitions outside the discovery code: the components of a run sum to the
layer's ``hook_mlp_out``; node patching of one expert equals the corrupted run with that expert's
clean weighted output swapped in at the layer's output (from
``tl_attnonly.analysis.experts.expert_components`` of two caches); plain EAP into the logits is
the expert's change dotted with the gradient at the last residual stream; exact runs equal the
edge-by-edge definition, the full graph the clean run and the empty graph the corrupted run.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from test_circuit_runs_reference import _check_exact_runs

# (it puts the bridge zoo on the path)
from test_moe_discovery import CLEAN, CORRUPTED, DENSE_0, METRIC, _bridge

from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis import (
    Circuit,
    HeadGraph,
    circuit_metrics,
    discover_circuit,
    edge_attribution_scores,
)
from tl_attnonly.analysis.discovery.counts import EXPERT_LABEL, circuit_counts
from tl_attnonly.analysis.discovery.expert_nodes import (
    expert_source_hooks,
    expert_source_values,
)
from tl_attnonly.analysis.discovery.graph import EXPERT, EXPERTS
from tl_attnonly.analysis.discovery.search import (
    coarse_nodes,
    node_patching_metric,
)
from tl_attnonly.analysis.experts import expert_components

ROWS = torch.arange(4)


@pytest.fixture(scope="module", params=["qwen2_moe", "mixtral", DENSE_0])
def moe(request):
    return _bridge(request.param)


def _last_expert_layer(moe) -> int:
    return max(li for li, b in enumerate(analysis_model(moe).blocks) if b.mlp.is_mixture_of_experts)


def test_an_expert_layer_named_by_its_experts(moe):
    nodes = coarse_nodes(moe, experts=True)
    graph = HeadGraph(moe, nodes=nodes)
    layer = _last_expert_layer(moe)
    (group,) = [g for g in graph.sources if g.kind == EXPERT and g.layer == layer]
    assert group.labels == graph.expert_part_labels[layer]
    assert group.labels[0] == f"L{layer}E0" and f"L{layer}MLP" not in nodes
    (reader,) = [d for d in graph.inputs if d.kind == EXPERTS and d.layer == layer]
    assert reader.labels == (f"L{layer}MLP",)  # one input: the router and every expert read it
    assert graph.restricted  # not the full graph (there the layer is one node)
    whole = HeadGraph(moe, nodes=coarse_nodes(moe))
    assert not whole.split_experts and not [g for g in whole.sources if g.kind == EXPERT]


def test_the_components_of_a_run_sum_to_the_layer_output(moe):
    layer = _last_expert_layer(moe)
    model = analysis_model(moe)
    names = expert_source_hooks(model, layer)
    with torch.no_grad():
        _, cache = moe.run_with_cache(CLEAN, names_filter=lambda n: n in names)
    parts = expert_source_values(dict(cache.cache_dict), model, layer)  # [b, p, n, d]
    out = cache[f"blocks.{layer}.hook_mlp_out"]
    torch.testing.assert_close(parts.sum(2), out, rtol=1e-5, atol=1e-5)
    assert parts.shape[2] == len(HeadGraph(moe).shape.expert_parts[-1])


def two_caches(moe) -> tuple[object, object]:
    """The clean and the corrupted run's caches."""
    with torch.no_grad():
        return moe.run_with_cache(CLEAN)[1], moe.run_with_cache(CORRUPTED)[1]


def test_node_patching_of_one_expert_swaps_its_weighted_output(moe):
    layer = _last_expert_layer(moe)
    out = f"blocks.{layer}.hook_mlp_out"
    clean, corrupted = two_caches(moe)
    e = 2
    want_part = expert_components(clean, layer)[0][e] - expert_components(corrupted, layer)[0][e]

    def swap(act, hook):
        return act + want_part.to(act.dtype)

    with torch.no_grad():
        want = METRIC(moe.run_with_hooks(CORRUPTED, fwd_hooks=[(out, swap)]), ROWS).item()
    got = node_patching_metric(moe, CLEAN, CORRUPTED, METRIC, [f"L{layer}E{e}"])
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    corrupted_metric = METRIC(moe(CORRUPTED), ROWS).item()
    assert abs(want - corrupted_metric) > 1e-4  # the patch changes the metric


def metric_gradient(moe, at: str | None = None) -> tuple[torch.Tensor, object, object]:
    """``(grad, clean cache, corrupted cache)``: the gradient of the metric on the corrupted run
    at hook ``at`` (a leaf there: every path after it; default the last residual stream, what
    plain EAP into the logits reads), and the two runs."""
    last = at or f"blocks.{moe.cfg.n_layers - 1}.hook_resid_post"
    held = {}

    def grab(act, hook):
        held["x"] = act.detach().requires_grad_(True)
        return held["x"]

    (grad,) = torch.autograd.grad(
        METRIC(moe.run_with_hooks(CORRUPTED, fwd_hooks=[(last, grab)]), ROWS), [held["x"]]
    )
    return (grad, *two_caches(moe))


def test_eap_into_the_logits_is_the_change_times_the_gradient(moe):
    layer = _last_expert_layer(moe)
    nodes = coarse_nodes(moe, experts=True)
    scores = edge_attribution_scores(
        moe, CLEAN, CORRUPTED, METRIC, method="eap", nodes=nodes
    ).scores[(f"expert.{layer}", "logits")][:, 0]
    grad, clean, corrupted = metric_gradient(moe)
    delta = expert_components(clean, layer)[0] - expert_components(corrupted, layer)[0]
    want = torch.einsum("nbpd,bpd->n", delta, grad)
    assert want.abs().max() > 1e-4
    torch.testing.assert_close(scores, want, rtol=1e-4, atol=1e-6)


def test_exact_runs_equal_the_edge_by_edge_definition(moe):
    nodes = coarse_nodes(moe, experts=True)
    _check_exact_runs(moe, nodes, CLEAN, CORRUPTED, METRIC, ends=1e-5, rel=1e-4)


def test_discover_circuit_with_expert_nodes(moe, tmp_path):
    """End to end: the found circuit's own exact run is its reported metric, its counts name the
    experts, its figures and exports draw them, and it saves and loads."""
    import tl_attnonly.vis  # noqa: F401  (registers Circuit.figure)
    from tl_attnonly.vis import neuron_circuit_figure

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        circuit = discover_circuit(moe, CLEAN, CORRUPTED, METRIC, progress=False, expert_nodes=True)
    assert circuit.ceiling == pytest.approx(1.0, abs=1e-5)
    nodes = circuit.graph.node_labels()
    (again,) = circuit_metrics(moe, [circuit.mask], CLEAN, CORRUPTED, METRIC, nodes=nodes)
    assert again == pytest.approx(circuit.metric_circuit, abs=1e-6)
    experts = {s for s in circuit.edges().source if EXPERT_LABEL.match(s)}  # (no expert reads)
    assert circuit_counts(circuit)["experts"] == len(experts)
    circuit.figure()
    neuron_circuit_figure(circuit)
    assert circuit.to_mib(d_model=moe.cfg.d_model)["nodes"]
    roles = {n["node_id"].rsplit("_", 1)[0]: n for n in circuit.to_graph_json()["nodes"]}
    assert all(roles[s]["feature_type"] == "mlp expert" for s in experts)
    loaded = Circuit.load(circuit.save(tmp_path / "c"), model=moe)
    assert loaded.graph.split_experts == circuit.graph.split_experts
    (reloaded,) = circuit_metrics(
        moe, [loaded.mask], CLEAN, CORRUPTED, METRIC, nodes=loaded.graph.node_labels()
    )
    assert reloaded == pytest.approx(circuit.metric_circuit, abs=1e-6)


def test_expert_nodes_are_refused_where_there_are_none():
    from tl_attnonly.analysis.discovery.options import DiscoveryOptions

    with pytest.raises(ValueError, match="graph='coarse'"):
        DiscoveryOptions(expert_nodes=True, graph="neurons")
    from zoo import build_bridge, convert_zoo_bridge

    llama = convert_zoo_bridge(build_bridge("llama", torch.float32))
    with pytest.raises(ValueError, match="no mixture-of-experts layer"):
        discover_circuit(llama, CLEAN, CORRUPTED, METRIC, progress=False, expert_nodes=True)


@pytest.mark.parametrize("field", ["expert_parts", "expert_widths"])
def test_a_circuit_saved_before_a_shape_field_loads(tmp_path, field):
    """A mixture-of-experts circuit saved before the shape recorded its experts' labels or
    their widths (its ``circuit.json`` without ``expert_parts`` / ``expert_widths``) loads
    against the model."""
    moe = _bridge("mixtral")
    graph = HeadGraph(moe, nodes=coarse_nodes(moe))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        circuit = discover_circuit(
            moe, CLEAN, CORRUPTED, METRIC, progress=False, mib_curve=False, neurons_per_mlp=0
        )
    path = circuit.save(tmp_path / "c", model=moe)
    record = json.loads((path / "circuit.json").read_text())

    def drop(value):
        if isinstance(value, dict):
            return {k: drop(v) for k, v in value.items() if k != field}
        return [drop(v) for v in value] if isinstance(value, list) else value

    assert drop(record) != record
    (path / "circuit.json").write_text(json.dumps(drop(record)))
    loaded = Circuit.load(path, model=moe)
    assert getattr(loaded.graph.shape, field) == () and getattr(graph.shape, field)
    assert loaded.metric_circuit == circuit.metric_circuit
