"""Gate/value splits: of a circuit's neurons by exact circuit runs
(:func:`~tl_attnonly.analysis.circuit_gate_value_split`, ``discovery/gate_value.py``) and of
paths into neurons by path patching (:func:`~tl_attnonly.analysis.path_gate_value_split`,
``patching/paths.py``), checked against hand-made patches.
"""

from __future__ import annotations

import pytest
import torch
from models import facts, tl3_only
from test_circuit_discovery import _LINEAR_WEIGHTS, CLEAN, CORRUPTED, _linear_metric, _model

from tl_attnonly.analysis import circuit_gate_value_split, path_gate_value_split
from tl_attnonly.analysis.discovery.graph import HeadGraph


def _gated_product(model, layer: int, neuron: int, g: torch.Tensor, u: torch.Tensor):
    """What a gated neuron's heads write, ``sum_k sigmoid(b_k g + d_k) (f_k g + e_k - g_k) u``."""
    c = facts(model).blocks[layer].mlp.coefficients
    return sum(
        torch.sigmoid(b * g + d) * (f * g + e - gk) * u
        for b, d, f, e, gk in zip(c.b, c.d, c.f, c.e, c.g, strict=True)
    )


@tl3_only("no normalisation")
@pytest.mark.parametrize(
    "act_fn, gated", [("silu", False), ("silu", True), ("gelu_pytorch_tanh", True), ("relu", True)]
)
def test_gate_value_split_of_a_last_layer_neuron_is_the_product_rule(act_fn, gated):
    """A last-layer neuron read linearly writes ``F(gate input, value input)``: plain SiLU
    ``sigmoid(q) v`` with ``q = v = pre``; gated ``act_K(g) u``. Its gate edges alone give
    ``F(gate_clean, value_corr) - F(gate_corr, value_corr)``, its value edges alone ``F(gate_corr,
    value_clean) - F(gate_corr, value_corr)``, both ``F(clean, clean) - F(corr, corr)``, summed over
    the examples' last positions; ``both = gate + value + interaction``, interaction non-zero."""
    model = _model(act_fn, normalization_type=None, gated_mlp=gated)
    metric = _linear_metric(5)
    graph = HeadGraph(model)
    neuron = 6
    split = circuit_gate_value_split(
        model, graph.full_mask(True), CLEAN, CORRUPTED, metric, neurons=[f"L1N{neuron}"],
        progress=False,
    ).iloc[0]  # fmt: skip
    _, clean = model.run_with_cache(CLEAN)
    _, corr = model.run_with_cache(CORRUPTED)
    g_cl, g_co, u_cl, u_co = (
        cache[f"blocks.1.mlp.hook_{kind}"][:, -1, neuron].detach()
        for kind in (("pre", "pre_linear") if gated else ("pre", "pre"))
        for cache in (clean, corr)
    )
    read = (facts(model).blocks[1].mlp.W_out[neuron] @ model.W_U @ _LINEAR_WEIGHTS[5]).detach()

    def F(g, u):
        z = _gated_product(model, 1, neuron, g, u) if gated else g.sigmoid() * u
        return float(z.sum() * read)

    none = F(g_co, u_co)
    assert split.gate == pytest.approx(F(g_cl, u_co) - none, rel=1e-9)
    assert split.value == pytest.approx(F(g_co, u_cl) - none, rel=1e-9)
    assert split.both == pytest.approx(F(g_cl, u_cl) - none, rel=1e-9)
    assert split.both == pytest.approx(split.gate + split.value + split.interaction, rel=1e-12)
    assert abs(split.interaction) > 1e-6  # a product: the two inputs interact


def test_path_gate_value_split_matches_hand_patching():
    model = _model(normalization_type="LN")
    metric = _linear_metric(6)
    split = path_gate_value_split(model, CLEAN, CORRUPTED, ["L0H1"], ["L1N3"], metric)
    _, clean = model.run_with_cache(CLEAN)
    _, corr = model.run_with_cache(CORRUPTED)
    blocks = facts(model).blocks
    delta = (clean["blocks.0.attn.hook_z"] - corr["blocks.0.attn.hook_z"])[:, :, 1]
    resid = corr["blocks.1.hook_resid_mid"] + delta @ blocks[0].attn.W_O[1]
    mlp = blocks[1].mlp
    pre = blocks[1].ln2(resid) @ mlp.W_in[:, 3] + mlp.b_in[3]
    base = metric(model(CORRUPTED)).item()

    def run(*kinds):
        def hook(act, hook):
            act = act.clone()
            act[:, :, 3, 0] = pre
            return act

        hooks = [(f"blocks.1.mlp.hook_{k}", hook) for k in kinds]
        return metric(model.run_with_hooks(CORRUPTED, fwd_hooks=hooks)).item() - base

    assert split["gate"] == pytest.approx(run("q"), rel=1e-10)
    assert split["value"] == pytest.approx(run("v"), rel=1e-10)
    assert split["both"] == pytest.approx(run("q", "v"), rel=1e-10)
    assert split["interaction"] == pytest.approx(
        split["both"] - split["gate"] - split["value"], rel=1e-12
    )
