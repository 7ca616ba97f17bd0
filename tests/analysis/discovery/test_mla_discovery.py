"""Circuit discovery on multi-head latent attention (DeepSeek-V3's MLA; a converted bridge, fp64):
each attention layer is read through one input ``L{l}ATTN``, the layer's normalised input
``blocks.{l}.attn.hook_in`` (every head's q, k and v come from latents the heads share), while its
heads stay source nodes writing their own outputs.

Exact runs equal their definition edge by edge (``test_circuit_runs_reference._reference``, which
normalises the rebuilt input with the Hugging Face norm ``ln1`` wraps); the full graph is the
clean run and the empty graph the corrupted run; plain EAP scores an edge into ``L{l}ATTN`` by the
gradient at the layer's own input; ``discover_circuit`` runs end to end, with its report, figures,
exports and file. The zoo's DeepSeek-V3 has a dense layer 0 and an expert layer 1; the second
model also compresses its queries (``q_lora_rank``: a normalised query latent).
"""

from __future__ import annotations

import dataclasses
import json
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
)
from zoo import ZOO, build_bridge, convert_zoo_bridge, tokens  # noqa: E402

from tl_attnonly.analysis import (  # noqa: E402
    Circuit,
    HeadGraph,
    circuit_metrics,
    discover_circuit,
    edge_attribution_scores,
)
from tl_attnonly.analysis.discovery.attention_support import attention_problems  # noqa: E402
from tl_attnonly.analysis.discovery.counts import circuit_counts  # noqa: E402
from tl_attnonly.analysis.discovery.graph import LATENT_ATTN  # noqa: E402
from tl_attnonly.analysis.discovery.search import coarse_nodes  # noqa: E402
from tl_attnonly.analysis.discovery.sites import logit_diff_metric  # noqa: E402

CLEAN, CORRUPTED = tokens(4, 7, seed=1), tokens(4, 7, seed=2)
METRIC = logit_diff_metric(torch.tensor([3, 4, 5, 6]), torch.tensor([7, 8, 9, 10]))
Q_LATENT = "deepseek_v3_q_latent"
SCHEMA = Path(__file__).parents[2] / "data" / "neuronpedia_graph_schema.json"


def _bridge(name: str):
    if name != Q_LATENT:
        return convert_zoo_bridge(build_bridge(name, torch.float64))
    spec = ZOO["deepseek_v3"]
    ZOO[Q_LATENT] = dataclasses.replace(
        spec, name=Q_LATENT, kwargs={**spec.kwargs, "q_lora_rank": 12}
    )
    try:
        return convert_zoo_bridge(build_bridge(Q_LATENT, torch.float64))
    finally:
        del ZOO[Q_LATENT]


@pytest.fixture(scope="module", params=["deepseek_v3", Q_LATENT])
def mla(request):
    return _bridge(request.param)


def test_each_latent_attention_layer_is_read_through_one_input(mla):
    graph = HeadGraph(mla, nodes=coarse_nodes(mla))
    latent = [(d.key, d.labels, d.input) for d in graph.inputs if d.kind == LATENT_ATTN]
    assert latent == [(f"attn.{li}.in", (f"L{li}ATTN",), "qkv") for li in range(2)]
    assert not [d for d in graph.inputs if d.kind == "attn"]  # no per-head q/k/v inputs
    assert [len(g.labels) for g in graph.sources if g.kind == "attn"] == [4, 4]  # heads: nodes


def test_exact_runs_equal_the_edge_by_edge_definition(mla):
    nodes = coarse_nodes(mla) + ["L0N2", "L0N5"]  # the dense layer 0's neurons, by name
    _check_exact_runs(mla, nodes, CLEAN, CORRUPTED, METRIC, ends=1e-10, rel=1e-9)


def test_eap_scores_into_a_latent_attention_layer_are_its_branch_gradient(mla):
    """Plain EAP (gradients at the corrupted run): an edge into ``L1ATTN`` scores the source's
    change dotted with the gradient of the metric at a copy of the layer's input taken at its
    norm's input (so the residual path around the layer is not counted). To 1e-6: Hugging Face's
    DeepSeek RMSNorm computes in float32 even on float64 inputs, and EAP linearises it in closed
    form."""
    scores = edge_attribution_scores(
        mla, CLEAN, CORRUPTED, METRIC, method="eap", nodes=coarse_nodes(mla)
    ).scores
    names = ["hook_embed", "blocks.0.attn.hook_z"]
    at = "blocks.1.ln1.hook_in"
    grad, clean, corrupted = _branch_gradient(mla, at, names, CLEAN, CORRUPTED, METRIC)
    embed = (grad * (clean["hook_embed"] - corrupted["hook_embed"])).sum()
    got = scores[("embed", "attn.1.in")]
    assert got.shape == (1, 1) and embed.abs() > 1e-3
    torch.testing.assert_close(got[0, 0], embed, rtol=1e-6, atol=1e-8)
    W_O = mla.blocks[0].attn.o.original_component.weight.T.unflatten(0, (4, -1))  # [h, v, d]
    change = clean["blocks.0.attn.hook_z"] - corrupted["blocks.0.attn.hook_z"]
    want = torch.einsum("bphv,hvd,bpd->h", change, W_O, grad)
    torch.testing.assert_close(scores[("attn.0", "attn.1.in")][:, 0], want, rtol=1e-6, atol=1e-8)


def test_discover_circuit_runs_with_latent_attention(mla, tmp_path):
    """End to end (the defaults): the full graph is the model, the found circuit's own exact run
    is its reported metric, its counts name the latent inputs, and its figures, exports and file
    work."""
    import jsonschema

    import tl_attnonly.vis  # noqa: F401  (registers Circuit.figure)
    from tl_attnonly.vis import neuron_circuit_figure

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        circuit = discover_circuit(mla, CLEAN, CORRUPTED, METRIC, progress=False)
    assert circuit.ceiling == pytest.approx(1.0, abs=1e-9)
    (again,) = circuit_metrics(
        mla, [circuit.mask], CLEAN, CORRUPTED, METRIC, nodes=circuit.graph.node_labels()
    )
    assert again == pytest.approx(circuit.metric_circuit, abs=1e-10)
    latent = {t for t in circuit.edges().target if t.endswith("ATTN")}
    assert circuit_counts(circuit)["latent_attn_inputs"] == len(latent)
    if latent:
        assert "latent attention inputs L{l}ATTN" in circuit.report()
    circuit.figure()
    neuron_circuit_figure(circuit)
    mib = circuit.to_mib(d_model=mla.cfg.d_model)
    # an edge into L{l}ATTN is the edges into every head's q, k and v, its score split evenly
    row = circuit.scores.scores[("embed", "attn.1.in")].item()
    assert mib["edges"]["input->a1.h2<k>"]["score"] == pytest.approx(row / 12, rel=1e-9)
    graph_json = circuit.to_graph_json()
    jsonschema.validate(graph_json, json.loads(SCHEMA.read_text()))
    path = circuit.save(tmp_path / "mla")
    loaded = Circuit.load(path, model=mla)
    assert loaded.graph.shape == circuit.graph.shape
    assert loaded.graph.shape.latent_attn_layers == (0, 1)
    (reloaded,) = circuit_metrics(
        mla, [loaded.mask], CLEAN, CORRUPTED, METRIC, nodes=loaded.graph.node_labels()
    )
    assert reloaded == pytest.approx(circuit.metric_circuit, abs=1e-10)


def test_latent_attention_without_its_input_hook_is_refused():
    """A layer without linear q/k/v maps is read through ``blocks.{l}.attn.hook_in``: a model
    without that hook is refused, naming it."""

    class Latent:
        @property
        def W_Q(self):
            raise NotImplementedError("no W_Q")

    dense = SimpleNamespace(W_Q=torch.zeros(1), W_K=torch.zeros(1))
    model = SimpleNamespace(
        blocks=[SimpleNamespace(attn=dense), SimpleNamespace(attn=Latent())],
        hook_dict={"blocks.0.attn.hook_in": None},
    )
    (problem,) = attention_problems(model)
    assert "blocks.{l}.attn.hook_in" in problem and "[1]" in problem
    model.hook_dict["blocks.1.attn.hook_in"] = None
    assert attention_problems(model) == []
