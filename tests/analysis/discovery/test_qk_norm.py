"""Circuit discovery on models with q/k normalisation (Qwen3; Gemma 3 and OLMo 2 add post-norms).

A q/k norm is inside a head: the head's ``hook_q`` / ``hook_k`` hold ``W_Q ln1(x) + b_Q`` (per
head, before the norm) on both model kinds, and the model normalises them after the hook. So an
exact run rebuilds a head's ``q``/``k`` from its mixed residual input as on any pre-norm model and
lets the model apply the norm: the norm is part of the head node. These tests check that premise
on both kinds (a rebuilt ``q``/``k`` equals the hook's value, and differs from the normalised one),
that the full and empty graphs are the clean and corrupted runs of the unconverted model, that
random circuits equal their edge-by-edge definition, and that ``discover_circuit`` runs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import GATED_ZOO, make_tokens
from models import BRIDGES, facts, make_bridge, make_pair

from tl_attnonly.analysis import (
    HeadGraph,
    circuit_metric,
    discover_circuit,
    edge_attribution_scores,
    evaluate_circuit,
    logit_diff_metric,
)
from tl_attnonly.analysis.discovery.exact_run import _recompute
from tl_attnonly.analysis.discovery.graph import InputGroup
from tl_attnonly.hooks import block_act_name

QWEN3 = dict(GATED_ZOO["llama"], use_qk_norm=True)
CLEAN, CORRUPTED = make_tokens(3, 7, seed=0), make_tokens(3, 7, seed=1)
METRIC = logit_diff_metric(torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7]))
ROWS = torch.arange(CLEAN.shape[0])

#: "default": the tests' model kind of the installed line (TL 3: HookedTransformer with
#: use_qk_norm; TL 4: a Qwen3 bridge); "bridge": a Qwen3 bridge on TL 3 as well.
KINDS = ["default", pytest.param("bridge", marks=pytest.mark.skipif(BRIDGES, reason="= default"))]


def _pair(kind: str):
    if kind == "bridge":
        return make_bridge(convert=False, **QWEN3), make_bridge(**QWEN3)
    return make_pair("silu", **QWEN3)


@pytest.fixture(scope="module", params=KINDS)
def pair(request):
    return _pair(request.param)


def _qk_norm_weight(model, layer: int):
    """The q norm's weight of attention layer ``layer`` (either kind), to perturb it."""
    attn = model.blocks[layer].attn
    for owner in (attn, getattr(attn, "original_component", None)):
        norm = getattr(owner, "q_norm", None)
        if norm is not None:
            return norm.w if hasattr(norm, "w") else norm.weight
    raise AssertionError("no q_norm found")


def test_a_rebuilt_q_and_k_is_the_hook_s_value_before_the_norm(pair):
    _, converted = pair
    model = facts(converted)
    assert model.cfg.use_qk_norm
    graph = HeadGraph(converted)
    with torch.no_grad():
        _, cache = converted.run_with_cache(CLEAN)
    for layer in range(model.cfg.n_layers):
        x = cache[block_act_name("resid_pre", layer)]
        for inp in ("q", "k"):
            dst = next(
                d for d in graph.inputs if d.kind == "attn" and d.layer == layer and d.input == inp
            )
            assert isinstance(dst, InputGroup)
            n = len(dst.labels)
            nodes = torch.arange(n)
            got, _ = _recompute(model, dst, graph, x.unsqueeze(2).expand(-1, -1, n, -1), nodes)
            hook = cache[f"blocks.{layer}.attn.hook_{inp}"]
            torch.testing.assert_close(got, hook[:, :, :n], rtol=1e-10, atol=1e-12)
            normed = hook / hook.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
            assert (got - normed[:, :, :n]).abs().max() > 1e-3  # the norm is not in the hook


def test_the_full_and_empty_graphs_are_the_clean_and_corrupted_runs(pair):
    original, converted = pair
    with torch.no_grad():
        clean = METRIC(original(CLEAN), ROWS).item()
        corrupted = METRIC(original(CORRUPTED), ROWS).item()
    graph = HeadGraph(converted)
    full = circuit_metric(converted, graph.full_mask(), CLEAN, CORRUPTED, METRIC)
    empty = circuit_metric(converted, graph.full_mask(False), CLEAN, CORRUPTED, METRIC)
    assert full == pytest.approx(clean, rel=1e-8, abs=1e-10)
    assert empty == pytest.approx(corrupted, rel=1e-8, abs=1e-10)
    assert abs(clean - corrupted) > 1e-3


def test_a_circuit_run_reads_the_q_norm(pair):
    """A run whose heads read mixed inputs changes with the q norm's weight: the norm is applied
    after the rebuilt ``q`` (and so is part of the head node), not skipped."""
    _, converted = pair
    graph = HeadGraph(converted)
    g = torch.Generator().manual_seed(0)
    mask = {k: torch.rand(m.shape, generator=g) < 0.5 for k, m in graph.full_mask().items()}
    before = circuit_metric(converted, mask, CLEAN, CORRUPTED, METRIC)
    weight = _qk_norm_weight(converted, 1)
    with torch.no_grad():
        saved = weight.clone()
        weight.mul_(3.0)
        try:
            after = circuit_metric(converted, mask, CLEAN, CORRUPTED, METRIC)
        finally:
            weight.copy_(saved)
    assert abs(after - before) > 1e-6


def test_discover_circuit_runs_end_to_end(pair):
    original, converted = pair
    scores = edge_attribution_scores(converted, CLEAN, CORRUPTED, METRIC)
    assert all(torch.isfinite(s).all() for s in scores.scores.values())
    circuit = discover_circuit(converted, CLEAN, CORRUPTED, METRIC, target=0.8, neurons_per_mlp=0)
    again = evaluate_circuit(converted, circuit, CLEAN, CORRUPTED, METRIC)
    assert circuit.metric_circuit == pytest.approx(again.metric_circuit, rel=1e-10)
    with torch.no_grad():
        assert circuit.metric_clean == pytest.approx(METRIC(original(CLEAN), ROWS).item(), rel=1e-8)
