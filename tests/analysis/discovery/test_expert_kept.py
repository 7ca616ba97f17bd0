"""Expert nodes passing on some of their neurons' changes (``circuit_metrics(...,
kept_neurons=[{"L1E2": bool [n]}])``). Converted bridges in
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

import pytest
import torch
from test_circuit_runs_reference import _random_mask, _reference
from test_expert_neurons import _contribution
from test_expert_nodes import _last_expert_layer as _layer

# (it puts the bridge zoo on the path)
from test_moe_discovery import CLEAN, CORRUPTED, DENSE_0, METRIC, _bridge
from transformer_lens import ActivationCache

from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis import HeadGraph, circuit_metrics
from tl_attnonly.analysis.discovery.expert_kept import expert_width
from tl_attnonly.analysis.discovery.expert_nodes import EXPERT_LABEL, expert_source_hooks
from tl_attnonly.analysis.discovery.graph import EXPERT, EXPERT_NEURON
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
    cut = {}
    for (s, d), block in mask.items():
        src = graph.source_by_key[s]
        keep = torch.tensor([label not in kept for label in src.labels])
        cut[(s, d)] = block & keep[:, None]
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


def _cut_rows(graph: HeadGraph, mask, labels) -> dict:
    out = {}
    for (s, d), block in mask.items():
        src = graph.source_by_key[s]
        keep = torch.tensor([label not in labels for label in src.labels])
        out[(s, d)] = block & keep[:, None]
    return out


def test_kept_neurons_are_the_runs_of_the_graph_with_them_named(moe):
    """The stage's meaning: an expert passing on ``K`` is the graph with ``K`` named (the
    expert's edges on each) and the expert's remainder cut. On a graph that names some of the
    expert's neurons already, a named neuron passes on its change if kept and the remainder its
    kept neurons not named."""
    coarse, kept = _graph(moe), _kept(moe)
    mask = _random_mask(coarse, 0.6, seed=7)
    named = [f"{e}N{j}" for e, k in kept.items() for j in k.nonzero().flatten().tolist()]
    fine = _named_graph(moe, named)
    want = _cut_rows(fine, expand_mask(coarse, mask, fine), set(kept))
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
