"""``neuron_circuit_figure``: the circuit's heads (circles), named neurons (diamonds) and edges
by layer, read back from the figure's data and checked against the circuit and its profiles."""

from __future__ import annotations

import pytest
import torch
from conftest import GATED_ZOO, make_tokens
from models import make_converted

import tl_attnonly.vis  # noqa: F401 - registers the figure builders
from tl_attnonly.analysis import discover_circuit, logit_diff_metric, neuron_profiles
from tl_attnonly.analysis.discovery import profiles as profiles_module
from tl_attnonly.vis import neuron_circuit_figure

CLEAN, CORRUPTED = make_tokens(4, 8, seed=0), make_tokens(4, 8, seed=1)
METRIC = logit_diff_metric(torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8]))

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def profiles():
    model = make_converted("silu", **GATED_ZOO["llama"])
    circuit = discover_circuit(
        model, CLEAN, CORRUPTED, METRIC, progress=False, method="eap", graph="coarse", top_n=30,
        neurons_per_mlp=3, max_gate_value_neurons=3,
    )  # fmt: skip
    return neuron_profiles(model, circuit, [make_tokens(4, 12, seed=3)], k=2)


def _nodes(fig) -> dict[str, tuple[str, str, float, float, str]]:
    """label -> (trace name, symbol, x, y, hover text), from the figure's marker traces."""
    out = {}
    for trace in fig.data:
        if trace.mode != "markers+text":
            continue
        for label, x, y, hover in zip(
            trace.customdata, trace.x, trace.y, trace.hovertext, strict=True
        ):
            assert label not in out, f"{label} drawn twice"
            out[label] = (trace.name, trace.marker.symbol, x, y, hover)
    return out


def _edges(fig) -> list[tuple[str, str, tuple]]:
    """(edge label, input, segment endpoints) of every drawn edge, from the line traces."""
    out = []
    for trace in fig.data:
        if trace.mode != "lines":
            continue
        points = list(zip(trace.x, trace.y, strict=True))
        segments = [points[i : i + 2] for i in range(0, len(points), 3)]
        assert all(points[i] == (None, None) for i in range(2, len(points), 3))
        for edge, segment in zip(trace.meta["edges"], segments, strict=True):
            out.append((edge, trace.meta["input"], tuple(segment)))
    return out


def test_nodes_sit_at_their_layer_with_the_symbol_of_their_kind(profiles):
    circuit = profiles.circuit
    fig = neuron_circuit_figure(profiles)
    nodes = _nodes(fig)
    assert set(profiles.neurons) <= set(nodes)
    assert set(circuit.nodes()) | {"embed", "logits"} == set(nodes)
    # each node sits at its level's tick (only occupied levels are drawn, in the stream's order)
    ticks = dict(zip(fig.layout.yaxis.tickvals, fig.layout.yaxis.ticktext, strict=True))
    assert list(ticks) == sorted(ticks)
    for label, (name, symbol, _, y, _) in nodes.items():
        if label == "embed":
            assert ticks[y] == "embed" and symbol == "square"
        elif label == "logits":
            assert ticks[y] == "logits" and symbol == "square"
        elif label.endswith("MLP"):
            assert (name, symbol, ticks[y]) == ("MLP remainder (neurons not named)",
                                                "diamond-open", f"L{label[1:-3]} MLP")  # fmt: skip
        elif "N" in label:
            layer = int(label[1:].split("N")[0])
            assert (name, symbol, ticks[y]) == ("named neuron", "diamond", f"L{layer} MLP")
        elif "KV" in label:
            layer = int(label[1:].split("KV")[0])
            assert (name[:15], symbol, ticks[y]) == ("key/value group", "circle-open",
                                                     f"L{layer} attn")  # fmt: skip
        else:
            layer = int(label[1:].split("H")[0])
            assert (name, symbol, ticks[y]) == ("attention head", "circle", f"L{layer} attn")
    # no two nodes on one spot
    assert len({(x, y) for _, _, x, y, _ in nodes.values()}) == len(nodes)


def test_every_circuit_edge_is_drawn_once_between_its_nodes(profiles):
    circuit = profiles.circuit
    fig = neuron_circuit_figure(profiles, max_edges=10_000)
    nodes = _nodes(fig)
    drawn = _edges(fig)
    frame = circuit.edges().set_index("edge")
    assert sorted(e for e, _, _ in drawn) == sorted(frame.index)
    for edge, inp, ((x0, y0), (x1, y1)) in drawn:
        row = frame.loc[edge]
        assert inp == row.input
        assert (x0, y0) == nodes[row.source][2:4] and (x1, y1) == nodes[row.target][2:4]
        assert y0 < y1 or row.target == "logits"  # edges run up the residual stream
    few = _edges(neuron_circuit_figure(profiles, max_edges=5))
    assert sorted(e for e, _, _ in few) == sorted(frame.index[:5])
    named = set(profiles.neurons)
    only = _edges(neuron_circuit_figure(profiles, max_edges=10_000, named_only=True))
    expected = frame[frame.source.isin(named) | frame.target.isin(named)].index
    assert sorted(e for e, _, _ in only) == sorted(expected) and len(only) < len(drawn)


def test_a_neurons_hover_carries_its_profile(profiles):
    nodes = _nodes(neuron_circuit_figure(profiles))
    for label in profiles.neurons:
        row = profiles.row(label)
        hover = nodes[label][4]
        assert f"gate {row.gate:.3g} / value {row.value:.3g}" in hover
        assert f"fires at {100 * row.firing_fraction:.1f}%" in hover
        assert f"g+u+ {100 * row['share_g+u+']:.0f}%/{100 * row['abs_share_g+u+']:.0f}%" in hover
    # a plain circuit (no profiles) draws the same nodes, hover the label alone
    plain = _nodes(neuron_circuit_figure(profiles.circuit))
    assert set(plain) == set(nodes)
    assert plain[profiles.neurons[0]][4].split("<br>")[0] == profiles.neurons[0]


def test_profiles_figure_uses_the_builder_vis_registers_and_refuses_without_one(
    profiles, monkeypatch
):
    assert profiles_module._figure_builder is neuron_circuit_figure
    assert _nodes(profiles.figure()) == _nodes(neuron_circuit_figure(profiles))
    monkeypatch.setattr(profiles_module, "_figure_builder", None)
    with pytest.raises(RuntimeError, match="import tl_attnonly.vis"):
        profiles.figure()
    with pytest.raises(TypeError, match="Circuit or its NeuronProfiles"):
        neuron_circuit_figure(profiles.table)


def test_a_circuit_naming_no_neuron_draws_and_reports_its_mlp_nodes_as_whole_layers(profiles):
    """The default call names no neuron: its ``L{l}MLP`` nodes are whole layers, drawn and
    reported as such (with how to resolve them); a circuit with named neurons keeps the word
    remainder."""
    from tl_attnonly.analysis.discovery.counts import WHOLE_MLP_NOTE
    from tl_attnonly.vis.neuron_circuit import WHOLE_MLP_NAME

    coarse, named = profiles.circuit.extra["coarse"], profiles.circuit
    mlp = [n for n in coarse.nodes() if n.endswith("MLP")]
    assert mlp, "the coarse circuit holds an MLP node"
    nodes = _nodes(neuron_circuit_figure(coarse))
    assert {nodes[n][0] for n in mlp} == {WHOLE_MLP_NAME}
    assert WHOLE_MLP_NOTE in coarse.report()
    assert "neurons_per_mlp='auto'" in WHOLE_MLP_NOTE
    rest = {nodes[0] for label, nodes in _nodes(neuron_circuit_figure(named)).items()
            if label.endswith("MLP")}  # fmt: skip
    assert rest <= {"MLP remainder (neurons not named)"}
    assert WHOLE_MLP_NOTE not in named.report()
