"""TransformerLens's own tools give the same results on a converted and an unconverted bridge.

Each family (``tests/kinds.py``: LLaMA with grouped-query attention, Qwen2, GPT-2, GPT-NeoX; all
SiLU / SwiGLU, so exact as neuron-heads) is built twice from the same random weights in float64:
as TransformerLens builds it, and converted (every MLP as neuron-heads). The converted bridge is
built with ``fused=False``, so every forward pass runs the neuron-heads one by one (the default
fused path evaluates each neuron's heads in one expression and, for SiLU, reproduces the original
MLP to the last bit, which would make these comparisons hold trivially);
:func:`test_default_conversion_agrees_too` runs the default conversion once, and
:func:`test_the_comparisons_see_the_neuron_heads` shows that a change inside the neuron-heads
reaches every tool's result (so the comparisons can fail).

Compared, on TransformerLens 3.9 and 4.3 wherever the installed version has the tool (3.9 has
node attribution, direct path patching and ``direct_logit_attribution``; edge granularity,
``faithfulness`` and ``logit_lens`` are 4.x only and skip on 3.9):

* ``ActivationCache`` helpers (``accumulated_resid``, ``decompose_resid``, ``stack_head_results``,
  ``stack_neuron_results``, ``get_full_resid_decomposition``, ``logit_attrs``,
  ``apply_ln_to_stack``, ...), values and labels;
* ``transformer_lens.patching`` (residual, MLP-output, head and neuron sweeps; direct path
  patching on 4.x);
* ``transformer_lens.tools.analysis``: attribution patching at node and edge granularity (EAP,
  ``ig_steps=1``), ablate-outside ``faithfulness`` (corrupt and mean ablation), ``logit_lens``
  and ``direct_logit_attribution``.

TransformerLens 4's ``faithfulness`` and our exact circuit runs (``circuit_metric``) are checked to
be the same intervention (``docs/analysis.md``), and three defects of the bridge conversion that
running TransformerLens 4's own suite on converted bridges found (``tests/tl_suite``) have their
tests here.

By design, and tested to be exactly that: a converted bridge has the neuron-head hook points
(``blocks.{l}.mlp.hook_{q,k,v,attn_scores,pattern,z}``, and ``hook_result`` when per-head results
are on) besides every TransformerLens hook, so a cache of every hook, a tool that selects hooks by
name suffix, and ``hook_dict`` see those too; every TransformerLens hook keeps its value.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

from kinds import D_VOCAB, EXACT, make_bridge, make_tokens  # noqa: E402

import tl_attnonly  # noqa: E402
from tl_attnonly.bridge import set_use_neuron_result  # noqa: E402


def tool(name: str, *modules: str) -> Any:
    """TransformerLens's ``name`` from the first of ``modules`` (default
    ``transformer_lens.tools.analysis``) that has it; the test skips where none does."""
    for module in modules or ("transformer_lens.tools.analysis",):
        found = getattr(importlib.import_module(module), name, None)
        if found is not None:
            return found
    version = importlib.metadata.version("transformer-lens")
    pytest.skip(f"{name} is not in TransformerLens {version}")


#: Families whose attention has one K/V head per query head (TransformerLens's edge granularity,
#: faithfulness and K/V direct paths refuse grouped-query attention, on any bridge).
MHA = ("gpt2", "neox")
GQA = "llama_gqa"
#: float64 agreement, relative to max(1, |values|).
TOL = 1e-10
#: ``transformer_lens.patching`` stores its results in float32 (``torch.zeros(..., device=)``).
TOL_PATCHING = 1e-6
NEURON_HEAD_HOOKS = ("q", "k", "v", "attn_scores", "pattern", "z")
N_LAYERS = 2


@pytest.fixture(scope="module")
def pairs() -> dict[str, tuple[Any, Any]]:
    """family -> (bridge as TransformerLens builds it, converted bridge of the same weights)."""
    built = {}
    for family in EXACT:
        converted = make_bridge(family, convert=False)
        tl_attnonly.convert(converted, tl_attnonly.ConversionOptions(fused=False))
        built[family] = (make_bridge(family, convert=False), converted)
    return built


def clean_and_corrupted(batch: int = 2, pos: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    clean = make_tokens(batch=batch, pos=pos, seed=0)
    corrupted = clean.clone()
    corrupted[:, 1] = (clean[:, 1] + 11) % D_VOCAB
    corrupted[:, -1] = (clean[:, -1] + 5) % D_VOCAB
    return clean, corrupted


def logit_diff(logits: torch.Tensor) -> torch.Tensor:
    """A scalar metric: the mean last-position logit difference of two tokens."""
    return (logits[:, -1, 3] - logits[:, -1, 17]).mean()


def assert_same(original: Any, converted: Any, tol: float = TOL, what: str = "") -> None:
    """Equal within ``tol * max(1, max |original|)``; labels (a ``(tensor, labels)`` pair, a
    dict's keys) equal exactly; ``None`` only for ``None``."""
    if original is None or converted is None:
        assert original is None and converted is None, what
        return
    if isinstance(original, tuple):
        assert original[1] == converted[1], what
        original, converted = original[0], converted[0]
    if isinstance(original, dict):
        assert list(original) == list(converted), what
        original = torch.tensor(list(original.values()), dtype=torch.float64)
        converted = torch.tensor(list(converted.values()), dtype=torch.float64)
    original = torch.as_tensor(original, dtype=torch.float64).detach()
    converted = torch.as_tensor(converted, dtype=torch.float64).detach()
    assert original.shape == converted.shape, what
    scale = max(1.0, float(original.abs().max())) if original.numel() else 1.0
    torch.testing.assert_close(converted, original, rtol=0, atol=tol * scale, msg=what)


def neuron_head_names(hooks: tuple[str, ...] = NEURON_HEAD_HOOKS) -> set[str]:
    return {f"blocks.{layer}.mlp.hook_{name}" for layer in range(N_LAYERS) for name in hooks}


# --- ActivationCache ------------------------------------------------------------------------


@pytest.mark.parametrize("family", EXACT)
def test_cache_has_every_hook_of_the_original_and_the_neuron_heads(pairs, family):
    """By design: the converted bridge's cache of every hook is the original's (same keys, same
    values) plus exactly the neuron-head hooks; ``hook_result`` only with per-head results on."""
    original, converted = pairs[family]
    tokens, _ = clean_and_corrupted()
    _, cache = original.run_with_cache(tokens)
    _, converted_cache = converted.run_with_cache(tokens)
    assert set(converted_cache.keys()) - set(cache.keys()) == neuron_head_names()
    assert set(cache.keys()) <= set(converted_cache.keys())
    for name in cache.keys():
        assert_same(cache[name], converted_cache[name], what=name)
    assert set(converted.hook_dict) - set(original.hook_dict) == neuron_head_names(
        (*NEURON_HEAD_HOOKS, "result")
    )
    set_use_neuron_result(converted, True)
    try:
        _, with_results = converted.run_with_cache(tokens)
    finally:
        set_use_neuron_result(converted, False)
    assert set(with_results.keys()) - set(cache.keys()) == neuron_head_names(
        (*NEURON_HEAD_HOOKS, "result")
    )


@pytest.mark.parametrize("family", EXACT)
def test_activation_cache_helpers_agree(pairs, family):
    original, converted = pairs[family]
    tokens, _ = clean_and_corrupted()
    caches = [model.run_with_cache(tokens)[1] for model in (original, converted)]
    answers, wrong = tokens[:, -1], tokens[:, 0]

    # a parallel block (GPT-NeoX) has no resid_mid, so no MLP-input variants
    mlp_input = not original.cfg.parallel_attn_mlp

    def helpers(cache: Any) -> dict[str, Any]:
        stack = cache.decompose_resid(layer=1, mlp_input=mlp_input)
        return {
            "accumulated_resid": cache.accumulated_resid(
                incl_mid=mlp_input, apply_ln=True, return_labels=True
            ),
            "accumulated_resid(layer 1)": cache.accumulated_resid(
                layer=1, mlp_input=mlp_input, apply_ln=True, return_labels=True
            ),
            "decompose_resid": cache.decompose_resid(apply_ln=True, return_labels=True),
            "decompose_resid(mlp)": cache.decompose_resid(mode="mlp", return_labels=True),
            "stack_head_results": cache.stack_head_results(
                apply_ln=True, incl_remainder=True, return_labels=True
            ),
            "stack_neuron_results": cache.stack_neuron_results(
                N_LAYERS, apply_ln=True, incl_remainder=True, return_labels=True
            ),
            "get_full_resid_decomposition": cache.get_full_resid_decomposition(
                expand_neurons=True, apply_ln=True, return_labels=True
            ),
            "get_full_resid_decomposition(mlp layers)": cache.get_full_resid_decomposition(
                layer=1, mlp_input=mlp_input, expand_neurons=False, return_labels=True
            ),
            "apply_ln_to_stack": cache.apply_ln_to_stack(stack, layer=1, mlp_input=mlp_input),
            "logit_attrs": cache.logit_attrs(
                cache.decompose_resid(pos_slice=-1),
                tokens=answers,
                incorrect_tokens=wrong,
                pos_slice=-1,
            ),
            "stack_activation(post)": cache.stack_activation("post"),
            "stack_activation(pattern)": cache.stack_activation("pattern"),
        }

    expected, got = (helpers(cache) for cache in caches)
    for name in expected:
        assert_same(expected[name], got[name], what=name)


def test_pos_slice_cuts_the_neuron_heads_at_their_position_axis(pairs):
    """TransformerLens's caching hooks slice a ``pos_slice`` along axis -3 for names ending in
    ``hook_q/k/v/z/result`` and -2 otherwise (``get_caching_hooks``); the neuron-head shapes
    (``[batch, pos, n_neuron_heads, 1]``, patterns ``[batch, n_neuron_heads, query_pos, 2]``) put
    their position axis exactly there, so a sliced cache is the full cache sliced."""
    _, converted = pairs["llama_gqa"]
    tokens, _ = clean_and_corrupted()
    _, full = converted.run_with_cache(tokens)
    _, sliced = converted.run_with_cache(tokens, pos_slice=slice(1, 3))
    for name in neuron_head_names():
        axis = -2 if name.endswith(("pattern", "attn_scores")) else -3
        assert_same(full[name].narrow(axis, 1, 2), sliced[name], what=name)


# --- transformer_lens.patching --------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama_gqa", "gpt2"])
def test_activation_patching_agrees(pairs, family):
    """Residual, MLP-output, attention-head and neuron (``mlp.hook_post``) sweeps, on a gated and
    a plain MLP (each sweep is one forward pass per patch: two families keep it quick)."""
    from transformer_lens import patching

    clean, corrupted = clean_and_corrupted(pos=3)
    results = []
    for model in pairs[family]:
        _, cache = model.run_with_cache(clean)
        results.append(
            {
                "resid_pre": patching.get_act_patch_resid_pre(model, corrupted, cache, logit_diff),
                "mlp_out": patching.get_act_patch_mlp_out(model, corrupted, cache, logit_diff),
                "attn_head_out": patching.get_act_patch_attn_head_out_all_pos(
                    model, corrupted, cache, logit_diff
                ),
                "mlp post": patching.generic_activation_patch(
                    model,
                    corrupted,
                    cache,
                    logit_diff,
                    patching.layer_pos_patch_setter,
                    "post",
                    index_axis_names=("layer", "pos"),
                ),
            }
        )
    for name in results[0]:
        assert_same(results[0][name], results[1][name], TOL_PATCHING, what=name)


@pytest.mark.parametrize("component", ["q", "v"])
def test_direct_path_patching_agrees(pairs, component):
    direct_path = tool(
        "get_act_patch_direct_path", "transformer_lens.patching", "transformer_lens.tools.analysis"
    )
    clean, corrupted = clean_and_corrupted()
    results = []
    for model in pairs["gpt2"]:
        _, clean_cache = model.run_with_cache(clean)
        _, corrupted_cache = model.run_with_cache(corrupted)
        results.append(
            direct_path(
                model,
                corrupted,
                clean_cache,
                corrupted_cache,
                logit_diff,
                src_layer=0,
                src_head=1,
                component=component,
                verbose=False,
            )
        )
    assert_same(results[0], results[1], TOL_PATCHING, what=component)
    assert float(results[0].abs().max()) > 0


# --- TransformerLens 4's tools.analysis -------------------------------------------------------


def _attribution(model: Any, granularity: str, batch: int = 2) -> Any:
    """TransformerLens's ``attribution_patch`` (skips where ``granularity`` is not built: edge
    granularity on 3.9)."""
    config_class = tool("EdgeAttributionConfig")
    try:
        config = config_class(granularity=granularity)
    except NotImplementedError as error:
        pytest.skip(str(error))
    clean, corrupted = clean_and_corrupted(batch=batch)
    return tool("attribution_patch")(model, clean, corrupted, logit_diff, config)


@pytest.mark.parametrize("family", EXACT)
def test_node_attribution_agrees(pairs, family):
    """EAP at node granularity (``ig_steps=1``): embed, every attention head, every MLP layer."""
    original, converted = (_attribution(model, "node") for model in pairs[family])
    assert_same(original.node_scores, converted.node_scores, what="node_scores")
    assert sum(abs(score) for score in original.node_scores.values()) > 0


@pytest.mark.parametrize("family", MHA)
def test_edge_attribution_and_faithfulness_agree(pairs, family):
    """EAP at edge granularity and ablate-outside faithfulness of its top edges (corrupt
    ablation; mean ablation too on GPT-2), including the recovery per edge class."""
    original, converted = pairs[family]
    scores = [_attribution(model, "edge", batch=1) for model in (original, converted)]
    faithfulness, config_class = tool("faithfulness"), tool("FaithfulnessConfig")
    assert_same(scores[0].edge_scores, scores[1].edge_scores, what="edge_scores")
    assert_same(scores[0].node_scores, scores[1].node_scores, what="node_scores")
    circuit = scores[0].top_edges(12)
    assert circuit == [(u, v, pytest.approx(s, abs=TOL)) for u, v, s in scores[1].top_edges(12)]
    clean, corrupted = clean_and_corrupted(batch=1)
    mean_tokens = make_tokens(batch=3, pos=clean.shape[1], seed=7)
    for ablation in ("corrupt", "mean") if family == "gpt2" else ("corrupt",):
        config = config_class(ablation=ablation)
        extra = {"mean_tokens": mean_tokens} if ablation == "mean" else {}
        a, b = (
            faithfulness(model, clean, corrupted, logit_diff, circuit, config, **extra)
            for model in (original, converted)
        )
        assert (a.circuit_size, a.total_edges, a.edge_class_counts) == (
            b.circuit_size,
            b.total_edges,
            b.edge_class_counts,
        )
        values = [a.recovered, a.full_metric, a.corrupt_metric]
        assert_same(values, [b.recovered, b.full_metric, b.corrupt_metric], what=ablation)
        assert_same(a.edge_class_recovered, b.edge_class_recovered, what=ablation)


def test_grouped_query_attention_is_refused_alike(pairs):
    """TransformerLens refuses edge granularity, faithfulness and K/V direct paths on GQA models;
    conversion changes none of that (same error, same message)."""
    direct_path = tool(
        "get_act_patch_direct_path", "transformer_lens.patching", "transformer_lens.tools.analysis"
    )
    faithfulness = tool("faithfulness")
    clean, corrupted = clean_and_corrupted(batch=1)
    messages = []
    for model in pairs[GQA]:
        _, cache = model.run_with_cache(clean)
        calls = [
            lambda m=model: _attribution(m, "edge"),
            lambda m=model: faithfulness(m, clean, corrupted, logit_diff, []),
            lambda m=model, c=cache: direct_path(
                m, corrupted, c, c, logit_diff, 0, 0, component="k", verbose=False
            ),
        ]
        for call in calls:
            with pytest.raises(ValueError, match="GQA") as error:
                call()
            messages.append(str(error.value))
    assert messages[:3] == messages[3:]


@pytest.mark.parametrize("family", ["llama_gqa", "gpt2"])
def test_logit_lens_agrees(pairs, family):
    logit_lens = tool("logit_lens")
    tokens, _ = clean_and_corrupted()
    lenses = [logit_lens(model, tokens, targets=[3, 17]) for model in pairs[family]]
    assert lenses[0].labels == lenses[1].labels
    assert_same(lenses[0].readout.values, lenses[1].readout.values, what="logit_lens")
    assert torch.equal(lenses[0].readout.target_ranks, lenses[1].readout.target_ranks)


@pytest.mark.parametrize("family", ["llama_gqa", "gpt2"])
def test_direct_logit_attribution_agrees(family):
    """After ``enable_compatibility_mode()`` (which ``direct_logit_attribution`` requires), the
    bridge converted again, as ``docs/bridge.md`` says."""
    direct_logit_attribution = tool("direct_logit_attribution")
    tokens, _ = clean_and_corrupted()
    original = make_bridge(family, convert=False)
    converted = make_bridge(family, convert=False)
    for model in (original, converted):
        model.enable_compatibility_mode(disable_warnings=True)
    tl_attnonly.convert(converted, tl_attnonly.ConversionOptions(fused=False))
    for unit in ("component", "layer", "head"):
        a, b = (
            direct_logit_attribution(
                model, tokens, answer_tokens=tokens[:, -1], incorrect_tokens=tokens[:, 0], unit=unit
            )
            for model in (original, converted)
        )
        assert_same((a.attribution, a.labels), (b.attribution, b.labels), what=unit)


def test_hook_selection_by_suffix_also_selects_the_neuron_heads(pairs):
    """By design: a tool that picks hooks by name suffix from ``hook_dict`` (here
    ``cache_activation_and_gradient`` with ``endswith("hook_z")``) gets the neuron-heads'
    ``blocks.{l}.mlp.hook_z`` as well; the attention entries and their gradients are unchanged.

    ``hook_embed`` is selected too: with attention ``hook_z`` alone TransformerLens 4.3 returns no
    gradients on any bridge (its ``hook_z`` tensors are reshaped views the forward pass never
    consumes, so the backward pass it drives stops before them), while the neuron-heads'
    ``hook_z`` are consumed, so a converted bridge would return some: a difference of that
    capture, not of the model."""
    tool("attribution_patch")
    from transformer_lens.tools.analysis.attribution_patching import (
        cache_activation_and_gradient,
    )

    tokens, _ = clean_and_corrupted(batch=1)
    caches = [
        cache_activation_and_gradient(
            model, tokens, logit_diff, lambda n: n.endswith("hook_z") or n == "hook_embed"
        )
        for model in pairs["qwen2"]
    ]
    assert set(caches[1].activations) - set(caches[0].activations) == neuron_head_names(("z",))
    assert set(caches[1].gradients) - set(caches[0].gradients) == neuron_head_names(("z",))
    for name in caches[0].activations:
        assert_same(caches[0].activations[name], caches[1].activations[name], what=name)
        assert caches[0].gradients[name] is not None, name
        assert_same(caches[0].gradients[name], caches[1].gradients[name], what=name)
    assert_same(caches[0].metric, caches[1].metric)


def test_converting_again_keeps_the_bridge_s_mode():
    """Found by TransformerLens 4's own DLA tests with every bridge converted: a bridge built in
    training mode, converted, put in eval mode, then converted again (after
    ``enable_compatibility_mode()``, as documented) had its MLP projections back in training
    mode: the new neuron-head layer took the mode of the Hugging Face MLP kept aside at the first
    conversion, which ``eval()`` no longer reaches. TransformerLens's tools then refuse the
    bridge (``require_eval_mode``). The layer takes the bridge component's mode, and
    ``unconvert_bridge`` gives the Hugging Face MLP the same. Also: converting a bridge in
    training mode refused GPT-2 ("not the standard out(act(in x))"), its self-check comparing two
    dropout draws; the check now runs in eval mode."""
    from kinds import FAMILIES, make_hf
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

    from tl_attnonly.bridge import unconvert_bridge

    for family in ("gpt2", "llama_gqa"):
        hf, config = make_hf(family)
        bridge = build_bridge_from_module(hf.train(), FAMILIES[family][0], hf_config=config)
        tl_attnonly.convert(bridge)
        bridge.eval()
        bridge.enable_compatibility_mode(disable_warnings=True)
        tl_attnonly.convert(bridge)
        assert [n for n, m in bridge.named_modules() if m.training] == [], family
        tokens, _ = clean_and_corrupted()
        tool("direct_logit_attribution")(
            bridge, tokens, answer_tokens=tokens[:, -1], incorrect_tokens=tokens[:, 0]
        )
        unconvert_bridge(bridge)
        assert [n for n, m in bridge.named_modules() if m.training] == [], family
        bridge.train()
        tl_attnonly.convert(bridge)
        assert all(m.training for m in bridge.modules()), family


def test_a_deep_copy_of_a_converted_bridge_runs_its_own_neuron_heads():
    """Found by TransformerLens 4's own tests with every bridge converted (``copy.deepcopy`` of a
    bridge, ``test_joint_qkv_attention.py``): the clone's forward pass raised "ran without its
    neuron-heads", because the guard hooks the copy took along still read the original's
    layers. The clone computes what the original does, through its own neuron-heads."""
    import copy

    from tl_attnonly.bridge import neuron_head_layers

    bridge = make_bridge("llama_gqa")
    clone = copy.deepcopy(bridge)
    tokens, _ = clean_and_corrupted()
    logits, cache = clone.run_with_cache(tokens)
    assert "blocks.1.mlp.hook_pattern" in cache.keys()
    assert_same(bridge(tokens), logits)
    assert all(a is not b for a, b in zip(neuron_head_layers(bridge), neuron_head_layers(clone)))
    clone.blocks[0].mlp.hook_pattern.add_perma_hook(lambda pattern, hook: pattern * 0.5)
    with pytest.raises(AssertionError):  # the clone's hooks are its own
        assert_same(bridge(tokens), clone(tokens))


# --- the comparisons can fail ---------------------------------------------------------------


def test_default_conversion_agrees_too():
    """The default (fused) conversion, as a user gets it."""
    original = make_bridge("llama_gqa", convert=False)
    converted = make_bridge("llama_gqa")
    scores = [_attribution(model, "node").node_scores for model in (original, converted)]
    assert_same(scores[0], scores[1])


def test_the_comparisons_see_the_neuron_heads():
    """A change inside the neuron-heads (every self weight of layer 0's patterns times 0.99, a
    permanent hook, so it applies inside every tool's own forward passes) moves each tool's result
    far outside the tolerances above: the agreement is the neuron-heads' doing, not a path
    around them."""
    from transformer_lens import patching

    original = make_bridge("gpt2", convert=False)
    converted = make_bridge("gpt2")

    def damp(pattern: torch.Tensor, hook: Any) -> torch.Tensor:
        return pattern * torch.tensor([0.99, 1.0], dtype=pattern.dtype)

    converted.blocks[0].mlp.hook_pattern.add_perma_hook(damp)
    clean, corrupted = clean_and_corrupted(pos=3)
    scores = [_attribution(model, "node").node_scores for model in (original, converted)]
    with pytest.raises(AssertionError):
        assert_same(scores[0], scores[1])
    sweeps = []
    for model in (original, converted):
        _, cache = model.run_with_cache(clean)
        sweeps.append(patching.get_act_patch_resid_pre(model, corrupted, cache, logit_diff))
    with pytest.raises(AssertionError):
        assert_same(sweeps[0], sweeps[1], TOL_PATCHING)


# --- TransformerLens 4's faithfulness and our exact circuit runs ------------------------------


def _our_mask(graph: Any, edges: set[tuple[Any, Any]]) -> dict[tuple[str, str], torch.Tensor]:
    """Our coarse graph's mask (every attention head; each MLP layer one node ``L{l}MLP``) of
    TransformerLens edges kept at every position: ``embed``, ``attn_head_out`` and ``mlp_out``
    writers are our ``embed``, ``L{l}H{h}`` and ``L{l}MLP`` sources; ``q/k/v_input`` readers our
    head inputs, ``mlp_in`` both inputs (gate and value) of ``L{l}MLP``, ``logits`` ours."""

    def writer(node: Any) -> tuple[str, str]:
        if node.kind == "embed":
            return "embed", "embed"
        if node.kind == "attn_head_out":
            return f"attn.{node.layer}", f"L{node.layer}H{node.head}"
        return f"mlp.{node.layer}", f"L{node.layer}MLP"

    def readers(node: Any) -> list[tuple[str, str]]:
        if node.kind == "logits":
            return [("logits", "logits")]
        if node.kind == "mlp_in":
            return [(f"mlp.{node.layer}.{i}", f"L{node.layer}MLP") for i in ("gate", "value")]
        return [(f"attn.{node.layer}.{node.kind[0]}", f"L{node.layer}H{node.head}")]

    mask = graph.full_mask(False)
    for src_node, dst_node in edges:
        src_key, src_label = writer(src_node)
        for dst_key, dst_label in readers(dst_node):
            rows = graph.source_by_key[src_key].labels
            columns = graph.input_by_key[dst_key].labels
            mask[(src_key, dst_key)][rows.index(src_label), columns.index(dst_label)] = True
    return mask


def test_tl4_faithfulness_is_our_exact_circuit_run(pairs):
    """Both are exact interventions: TransformerLens 4's ``faithfulness`` (ablate every edge
    outside the circuit: the reader's input gets the corrupted run's contribution of that writer)
    and our ``circuit_metric`` (every input gets the corrupted residual stream plus the current
    run's change of the writers joined to it) give the same recovered fraction for the same
    circuit, on a converted bridge. TransformerLens's circuit is its top edges (by |EAP score|)
    taken at every position; ours is that circuit on our coarse graph."""
    faithfulness = tool("faithfulness")
    from tl_attnonly.analysis import HeadGraph, circuit_metric
    from tl_attnonly.analysis.discovery.search import coarse_nodes

    _, converted = pairs["gpt2"]
    clean, corrupted = clean_and_corrupted(batch=1)
    scores = _attribution(converted, "edge", batch=1)
    top = {
        (u.__class__(u.kind, 0, u.layer, u.head), v.__class__(v.kind, 0, v.layer, v.head))
        for u, v, _ in scores.top_edges(30)
    }
    positions = range(clean.shape[1])
    tl_circuit = [
        (u.__class__(u.kind, p, u.layer, u.head), v.__class__(v.kind, p, v.layer, v.head))
        for u, v in sorted(top, key=str)
        for p in positions
    ]
    theirs = faithfulness(converted, clean, corrupted, logit_diff, tl_circuit)
    nodes = coarse_nodes(converted)
    graph = HeadGraph(converted, nodes=nodes)
    runs = {
        name: circuit_metric(converted, mask, clean, corrupted, logit_diff, nodes=nodes)
        for name, mask in {
            "circuit": _our_mask(graph, top),
            "clean": graph.full_mask(True),
            "corrupted": graph.full_mask(False),
        }.items()
    }
    ours = (runs["circuit"] - runs["corrupted"]) / (runs["clean"] - runs["corrupted"])
    assert_same([theirs.full_metric, theirs.corrupt_metric], [runs["clean"], runs["corrupted"]])
    assert 0.2 < theirs.recovered < 0.95  # a partial circuit (0.75 here)
    assert_same(theirs.recovered, ours, what="recovered")
