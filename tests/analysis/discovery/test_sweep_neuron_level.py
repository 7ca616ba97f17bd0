"""The sweep's exact runs use the graph of the call's granularity: a neuron-head graph
(``neuron_level=False``, K > 1) restricted to nodes sweeps without rejecting its own labels."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_tokens
from models import make_converted

from tl_attnonly.analysis import circuit_metric, discover_circuit, logit_diff_metric

CLEAN, CORRUPTED = make_tokens(3, 7, seed=0), make_tokens(3, 7, seed=1)
METRIC = logit_diff_metric(torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7]))


def test_a_restricted_neuron_head_graph_sweeps():
    model = make_converted("gelu", normalization_type="LN")  # K = 4 heads per neuron
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        circuit = discover_circuit(
            model, CLEAN, CORRUPTED, METRIC, graph="neurons", neuron_level=False, n_nodes=12,
            progress=False, gate_value=False,
        )  # fmt: skip
    assert not circuit.graph.neuron_level
    nodes = circuit.graph.node_labels()
    again = circuit_metric(
        model, circuit.mask, CLEAN, CORRUPTED, METRIC, neuron_level=False, nodes=nodes
    )
    assert again == pytest.approx(circuit.metric_circuit, rel=1e-10)
