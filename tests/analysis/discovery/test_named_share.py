"""What the default call's named neurons carry (issue 46, item 1): ``circuit.extra["named_share"]``
is the share of the named MLP layers' effect that their named neurons carry, from three exact runs
(every remainder cut; every named layer cut; both kept), and the circuit warns when it is below
:data:`~tl_attnonly.analysis.discovery.naming.NAMED_SHARE_WARNING`. Checked against the same three
circuits built here on the graph with the named neurons as nodes (masks with those sources' edges
removed, not the stage's kept-neuron runs)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import GATED_ZOO, make_tokens
from models import make_converted

from tl_attnonly.analysis import HeadGraph, circuit_metric, discover_circuit, logit_diff_metric
from tl_attnonly.analysis.discovery import naming
from tl_attnonly.analysis.discovery.naming import NAMED_SHARE_WARNING, named_share

CLEAN, CORRUPTED = make_tokens(4, 8, seed=0), make_tokens(4, 8, seed=1)
METRIC = logit_diff_metric(torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8]))


def _without(circuit, keys: set[str]) -> float:
    """The circuit's metric with every outgoing edge of the source groups ``keys`` removed."""
    nodes = circuit.graph.node_labels()
    graph = HeadGraph(circuit.graph.shape, nodes=nodes)
    mask = {k: (torch.zeros_like(m) if k[0] in keys else m) for k, m in circuit.mask.items()}
    assert set(mask) == set(graph.full_mask())
    return circuit_metric(circuit_model(), mask, CLEAN, CORRUPTED, METRIC, nodes=nodes)


_MODEL = {}


def circuit_model():
    if "m" not in _MODEL:
        _MODEL["m"] = make_converted("silu", **GATED_ZOO["llama"])
    return _MODEL["m"]


@pytest.mark.parametrize("k, threshold", [(1, 0.5), (8, NAMED_SHARE_WARNING)])
def test_the_named_share_is_the_three_circuits(k, threshold, monkeypatch):
    """One neuron named per layer carries about 10% here (warned under a threshold of 1/2); eight
    carry about 98% (not warned under the default)."""
    monkeypatch.setattr(naming, "NAMED_SHARE_WARNING", threshold)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        circuit = discover_circuit(
            circuit_model(), CLEAN, CORRUPTED, METRIC, neurons_per_mlp=k, gate_value=False,
            mib_curve=False, progress=False,
        )  # fmt: skip
    layers = sorted(circuit.extra["named"])
    assert layers and all(circuit.extra["named"][li] for li in layers)
    rests = {f"mlp.{li}" for li in layers}
    named = {f"neuron.{li}" for li in layers}
    named_only, none = _without(circuit, rests), _without(circuit, rests | named)
    want = named_share(circuit.metric_circuit, named_only, none)
    assert want is not None
    assert circuit.extra["named_share"] == pytest.approx(want, rel=1e-6, abs=1e-9)
    warned = any("the named neurons carry" in str(w.message) for w in caught)
    assert warned == (want < threshold) and warned == (k == 1)
    assert warned == any("the named neurons carry" in note for note in circuit.warnings)
    assert f"({want:.0%} of the MLP layers' effect)" in circuit.report()


def test_named_share_formula():
    assert named_share(1.0, 0.55, 0.5) == pytest.approx(0.1)
    assert named_share(0.3, 0.3, 0.3) is None  # the layers move the metric by nothing
    assert named_share(-1.0, -0.5, 0.0) == pytest.approx(0.5)
