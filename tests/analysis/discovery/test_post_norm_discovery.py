"""Exact circuit runs and discovery on models with norms after each sublayer (Gemma 2/3, OLMo 2/3).

The semantics (docs/analysis.md, "Norms after each sublayer"): a node's output in a run is its
share of its sublayer's normed output in that run, ``w * centre(out_u) / sigma``, the norm's
scale ``sigma`` the run's; a circuit run mixes those outputs exactly as for pre-norm models. So the
full graph is the clean run and the empty graph the corrupted run (Gemma 2's attention and final
soft caps on), and removing one head's edges equals removing its normed output downstream.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2]))
sys.path.insert(0, str(Path(__file__).parents[2] / "bridge"))
sys.path.insert(0, str(Path(__file__).parents[1]))

from models import BRIDGES  # noqa: E402
from test_post_norm_decomposition import _zoo_bridge  # noqa: E402
from zoo import ZOO  # noqa: E402

from tl_attnonly.adapt import analysis_model  # noqa: E402
from tl_attnonly.analysis import HeadGraph, circuit_metric  # noqa: E402
from tl_attnonly.analysis.discovery import circuit_metrics, discover_circuit  # noqa: E402
from tl_attnonly.analysis.discovery.sites import check_discoverable, logit_diff_metric  # noqa: E402

#: The converted Gemma (GELU-tanh) bridges' metric differs from the unconverted one's by the
#: conversion's error (docs/bridge_zoo.md): about 1e-5 here.
GELU_BOUND = 1e-4


def _task(vocab: int, n: int = 4, pos: int = 8):
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(2, vocab, (n, pos), generator=g)
    corrupted = clean.clone()
    corrupted[:, 3] = torch.randint(2, vocab, (n,), generator=g)
    corrupted[:, 5] = torch.randint(2, vocab, (n,), generator=g)
    correct, wrong = torch.arange(5, 5 + n), torch.arange(20, 20 + n)
    return clean, corrupted, logit_diff_metric(correct, wrong)


def _without_head(model, clean, corrupted, metric) -> tuple[float, float]:
    """``circuit_metric`` of the full graph less head L0H0's edges, and the same by hand: the
    model's run with L0H0's normed output change (clean minus corrupted, each with its own run's
    scale) taken off the attention output it is added with."""
    adapter = analysis_model(model)
    graph = HeadGraph(model)
    full = graph.full_mask()
    key = next(s.key for s in graph.sources if s.kind == "attn" and s.layer == 0)
    mask = {k: v.clone() for k, v in full.items()}
    for (src, _), edges in mask.items():
        if src == key:
            edges[0] = False
    got = circuit_metric(model, mask, clean, corrupted, metric)
    norm = adapter.blocks[0].ln1_post
    W_O = adapter.blocks[0].attn.W_O[0]

    def normed_head(tokens):
        _, cache = model.run_with_cache(tokens)
        out = cache["blocks.0.attn.hook_z"][:, :, 0] @ W_O
        out = out - out.mean(-1, keepdim=True) if norm.centred else out
        return out / cache[norm.hook_scale] * norm.w

    delta = normed_head(clean) - normed_head(corrupted)
    with torch.no_grad():
        logits = model.run_with_hooks(
            clean, fwd_hooks=[("blocks.0.hook_attn_out", lambda act, hook: act - delta)]
        )
    return got, float(metric(logits, torch.arange(len(clean))))


def _end_points(converted, original, clean, corrupted, metric, bound: float) -> None:
    graph = HeadGraph(converted)
    full = graph.full_mask()
    empty = {k: torch.zeros_like(v) for k, v in full.items()}
    idx = torch.arange(len(clean))
    with torch.no_grad():
        want = [float(metric(original(t), idx)) for t in (clean, corrupted)]
        own = [float(metric(converted(t), idx)) for t in (clean, corrupted)]
    assert abs(want[0] - want[1]) > 1e-3  # the corruption matters
    got = [circuit_metric(converted, m, clean, corrupted, metric) for m in (full, empty)]
    assert got == pytest.approx(own, abs=1e-10, rel=0)
    assert got == pytest.approx(want, abs=bound, rel=0)
    # several circuits in one call (runs resumed from a block where the model can)
    many = circuit_metrics(converted, [empty, full, empty], clean, corrupted, metric)
    assert list(many) == pytest.approx([own[1], own[0], own[1]], abs=1e-10, rel=0)


@pytest.mark.parametrize(
    "name",
    ["gemma2", "olmo2"] + [pytest.param(n, marks=pytest.mark.slow) for n in ("gemma3", "olmo3")],
)
def test_bridge_end_points_and_one_head_removed_are_exact(name):
    converted, config = _zoo_bridge(name)
    original, _ = _zoo_bridge(name, convert=False)
    if name == "gemma2":  # soft caps on: they are inside a head and after the unembedding
        assert config.attn_logit_softcapping and config.final_logit_softcapping
    check_discoverable(converted)
    clean, corrupted, metric = _task(128)
    bound = 1e-8 if ZOO[name].act == "silu" else GELU_BOUND
    _end_points(converted, original, clean, corrupted, metric, bound)
    got, want = _without_head(converted, clean, corrupted, metric)
    assert got == pytest.approx(want, abs=1e-10, rel=0)


@pytest.mark.parametrize("name", ["gemma2", "olmo2"])
def test_discover_circuit_runs_on_post_norm_bridges(name):
    converted, _ = _zoo_bridge(name)
    clean, corrupted, metric = _task(128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        circuit = discover_circuit(converted, clean, corrupted, metric, top_n=25, batch_size=2)
    idx = torch.arange(len(clean))
    with torch.no_grad():
        own = [float(metric(converted(t), idx)) for t in (clean, corrupted)]
    assert [circuit.metric_clean, circuit.metric_corrupted] == pytest.approx(own, abs=1e-10)
    again = circuit_metric(converted, circuit.mask, clean, corrupted, metric)
    assert circuit.metric_circuit == pytest.approx(again, abs=1e-10)


def _hooked(name: str, biases: bool = False):
    from conftest import GATED_ZOO, make_model

    import tl_attnonly

    overrides = dict(GATED_ZOO[name])
    act_fn = overrides.pop("act_fn", "silu")
    original = make_model(act_fn, torch.float64, **overrides)
    if not biases:  # Gemma 2 and OLMo 2 have no output biases (randomize_ draws them)
        with torch.no_grad():
            for block in original.blocks:
                for bias in (block.attn.b_O, block.mlp.b_in, block.mlp.b_out):
                    bias.zero_()
    return original, tl_attnonly.convert(original)


@pytest.mark.skipif(BRIDGES, reason="HookedTransformer (TL 3 only)")
@pytest.mark.parametrize("name", ["gemma2", "olmo2"])
def test_hooked_end_points_and_one_head_removed_are_exact(name):
    original, converted = _hooked(name)
    if name == "gemma2":
        assert original.cfg.attn_scores_soft_cap > 0 and original.cfg.output_logits_soft_cap > 0
    clean, corrupted, metric = _task(61)
    bound = 1e-8 if name == "olmo2" else GELU_BOUND
    _end_points(converted, original, clean, corrupted, metric, bound)
    got, want = _without_head(converted, clean, corrupted, metric)
    assert got == pytest.approx(want, abs=1e-10, rel=0)


@pytest.mark.skipif(BRIDGES, reason="HookedTransformer (TL 3 only)")
def test_an_output_bias_before_a_post_norm_is_refused():
    _, converted = _hooked("gemma2", biases=True)
    with pytest.raises(NotImplementedError, match="output bias before its norm"):
        check_discoverable(converted)


def test_a_post_ln_of_the_residual_stream_is_refused():
    """OPT with ``do_layer_norm_before=False`` normalises the residual stream itself."""
    import dataclasses

    from zoo import build_bridge, convert_zoo_bridge

    spec = ZOO["opt"]
    ZOO["opt_post_ln"] = dataclasses.replace(
        spec, name="opt_post_ln", kwargs=dict(spec.kwargs, do_layer_norm_before=False)
    )
    try:
        bridge = convert_zoo_bridge(build_bridge("opt_post_ln"))
    finally:
        del ZOO["opt_post_ln"]
    with pytest.raises(NotImplementedError, match="post-LN of the residual stream"):
        check_discoverable(bridge)
