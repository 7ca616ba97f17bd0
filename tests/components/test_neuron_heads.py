"""The neuron-heads behave as attention heads: hook edits, derived weights, per-head results."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_tokens

from tl_attnonly import convert
from tl_attnonly.hooks import dense_neuron_pattern, neuron_act_name, neuron_head_label

LAYER, NEURON = 1, 5


@pytest.fixture
def silu_pair():
    model = make_model("silu", torch.float64, normalization_type="LN")
    return model, convert(model)


def _set_neuron(value_fn):
    def hook(act, hook):
        act = act.clone()
        act[:, :, NEURON] = value_fn(act[:, :, NEURON])
        return act

    return hook


def _original_with_post_from_pre(model, tokens, fn):
    """Run the original model with neuron NEURON of layer LAYER set to fn(its pre-activation)."""
    cache = {}

    def store_pre(act, hook):
        cache["pre"] = act

    def replace_post(act, hook):
        act = act.clone()
        act[:, :, NEURON] = fn(cache["pre"][:, :, NEURON])
        return act

    return model.run_with_hooks(
        tokens,
        fwd_hooks=[
            (f"blocks.{LAYER}.mlp.hook_pre", store_pre),
            (f"blocks.{LAYER}.mlp.hook_post", replace_post),
        ],
    )


def _run_with_fixed_pattern(converted, tokens, weight_self: float, weight_bias: float):
    """Run with neuron NEURON of layer LAYER attending (weight_self, weight_bias) everywhere."""

    def fix_pattern(pattern, hook):
        pattern = pattern.clone()
        pattern[:, NEURON] = torch.tensor([weight_self, weight_bias], dtype=pattern.dtype)
        return pattern

    return converted.run_with_hooks(
        tokens, fwd_hooks=[(neuron_act_name("pattern", LAYER), fix_pattern)]
    )


def test_all_bias_pattern_equals_ablating_the_neuron(silu_pair, tokens):
    model, converted = silu_pair
    edited = _run_with_fixed_pattern(converted, tokens, 0.0, 1.0)
    ablated = model.run_with_hooks(
        tokens, fwd_hooks=[(f"blocks.{LAYER}.mlp.hook_post", _set_neuron(torch.zeros_like))]
    )
    unedited = model(tokens)
    assert (edited - unedited).abs().max() > 1e-3  # the edit matters
    torch.testing.assert_close(edited, ablated, rtol=0, atol=1e-10)


def test_all_self_pattern_makes_the_neuron_linear(silu_pair, tokens):
    """Weight 1 on itself: z = value = pre."""
    model, converted = silu_pair
    edited = _run_with_fixed_pattern(converted, tokens, 1.0, 0.0)
    expected = _original_with_post_from_pre(model, tokens, lambda x: x)
    torch.testing.assert_close(edited, expected, rtol=0, atol=1e-10)


def test_editing_scores_goes_through_softmax(silu_pair, tokens):
    """Scores (s, 0) -> (2s, 0): the weight on self becomes sigmoid(2 pre)."""
    model, converted = silu_pair

    def double_scores(scores, hook):
        scores = scores.clone()
        scores[:, NEURON] = scores[:, NEURON] * 2
        return scores

    edited = converted.run_with_hooks(
        tokens, fwd_hooks=[(neuron_act_name("scores", LAYER), double_scores)]
    )
    expected = _original_with_post_from_pre(model, tokens, lambda x: x * torch.sigmoid(2 * x))
    torch.testing.assert_close(edited, expected, rtol=0, atol=1e-10)


def test_editing_values_scales_the_neuron(silu_pair, tokens):
    model, converted = silu_pair

    def triple(v, hook):
        v = v.clone()
        v[:, :, NEURON] *= 3
        return v

    edited = converted.run_with_hooks(tokens, fwd_hooks=[(neuron_act_name("v", LAYER), triple)])
    expected = model.run_with_hooks(
        tokens, fwd_hooks=[(f"blocks.{LAYER}.mlp.hook_post", _set_neuron(lambda x: 3 * x))]
    )
    torch.testing.assert_close(edited, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("act_fn", ["silu", "gelu_new"])
def test_derived_head_weights_reproduce_the_hooks(act_fn, tokens):
    model = make_model(act_fn, torch.float64, normalization_type="LN")
    converted = convert(model)
    _, cache = converted.run_with_cache(tokens)
    for layer, mlp in enumerate(converted.neuron_heads):
        ln2 = converted.blocks[layer].ln2
        x = cache[f"blocks.{layer}.ln2.hook_normalized"] * ln2.w + ln2.b  # the MLP's input
        q = torch.einsum("bpd,hdo->bpho", x, mlp.W_Q) + mlp.b_Q
        k = torch.einsum("bpd,hdo->bpho", x, mlp.W_K) + mlp.b_K
        v = torch.einsum("bpd,hdo->bpho", x, mlp.W_V) + mlp.b_V
        torch.testing.assert_close(q, cache[neuron_act_name("q", layer)])
        torch.testing.assert_close(k, cache[neuron_act_name("k", layer)])
        torch.testing.assert_close(v, cache[neuron_act_name("v", layer)])
        # bias-token score q * k_bias, and z from the pattern and the bias token's value
        pattern = cache[neuron_act_name("pattern", layer)].transpose(1, 2)
        z = pattern[..., :1] * v + pattern[..., 1:] * mlp.v_bias_token
        torch.testing.assert_close(z, cache[neuron_act_name("z", layer)])
        torch.testing.assert_close(
            cache[neuron_act_name("scores", layer)][..., 1],
            (q * mlp.k_bias_token).squeeze(-1).transpose(1, 2),
        )
        out = torch.einsum("bpho,hod->bpd", z, mlp.W_O) + mlp.b_O
        torch.testing.assert_close(out, cache[f"blocks.{layer}.hook_mlp_out"])


def test_per_head_results_sum_to_mlp_out_and_are_patchable(tokens):
    model = make_model("gelu_new", torch.float64, normalization_type="LN")
    converted = convert(model)
    reference = converted(tokens)
    with pytest.raises(ValueError, match="set_use_neuron_result"):
        converted.add_hook(neuron_act_name("result", 0), lambda a, hook: a)
    converted.set_use_neuron_result(True)
    logits, cache = converted.run_with_cache(tokens)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-10)
    for layer, mlp in enumerate(converted.neuron_heads):
        result = cache[neuron_act_name("result", layer)]
        assert result.shape == (*tokens.shape, mlp.n_neuron_heads, model.cfg.d_model)
        torch.testing.assert_close(
            result.sum(-2) + mlp.b_out, cache[f"blocks.{layer}.hook_mlp_out"]
        )

    # zeroing every head of one neuron in hook_result == zeroing the neuron in hook_post
    K = converted.n_heads_per_neuron

    def zero_heads(result, hook):
        result = result.clone()
        result[:, :, NEURON * K : (NEURON + 1) * K] = 0
        return result

    via_result = converted.run_with_hooks(
        tokens, fwd_hooks=[(neuron_act_name("result", LAYER), zero_heads)]
    )
    via_post = converted.run_with_hooks(
        tokens, fwd_hooks=[(f"blocks.{LAYER}.mlp.hook_post", _set_neuron(torch.zeros_like))]
    )
    assert (via_result - reference).abs().max() > 1e-4
    torch.testing.assert_close(via_result, via_post, rtol=0, atol=1e-10)


def test_dense_pattern_layout(silu_pair, tokens):
    _, converted = silu_pair
    _, cache = converted.run_with_cache(tokens)
    compact = cache[neuron_act_name("pattern", 0)]
    heads = [0, 3, 7]
    dense = dense_neuron_pattern(compact, heads=heads)
    batch, n_pos = tokens.shape
    assert dense.shape == (batch, 3, n_pos, n_pos + 1)
    torch.testing.assert_close(dense.sum(-1), torch.ones(batch, 3, n_pos, dtype=dense.dtype))
    for i, h in enumerate(heads):
        for q in range(n_pos):
            assert dense[0, i, q, 0] == compact[0, h, q, 1]
            assert dense[0, i, q, 1 + q] == compact[0, h, q, 0]
            others = torch.cat([dense[0, i, q, 1 : 1 + q], dense[0, i, q, 2 + q :]])
            assert torch.all(others == 0)
    with pytest.raises(MemoryError, match="heads="):
        dense_neuron_pattern(compact, max_bytes=100)


def test_labels_and_names():
    assert neuron_act_name("pattern", 3) == "blocks.3.mlp.hook_pattern"
    assert neuron_act_name("scores", 0) == "blocks.0.mlp.hook_attn_scores"
    assert neuron_head_label(3, 1024) == "L3N1024"
    assert neuron_head_label(3, 4097, n_heads_per_neuron=4) == "L3N1024.1"
    with pytest.raises(ValueError, match="expected one of"):
        neuron_act_name("attention", 0)


def test_in_place_hook_edits_do_not_leak_between_hooks(silu_pair, tokens):
    """SiLU's q and v equal pre; an in-place edit of v must change v only."""
    model, converted = silu_pair
    captured = {}

    def edit_v_in_place(v, hook):
        v[:, :, NEURON] *= 3

    def capture(name):
        def hook(act, hook):
            captured[name] = act  # no copy: a leaking in-place edit would show here

        return hook

    with torch.no_grad():
        edited = converted.run_with_hooks(
            tokens,
            fwd_hooks=[
                (neuron_act_name("v", LAYER), edit_v_in_place),
                (neuron_act_name("q", LAYER), capture("q")),
                (neuron_act_name("pre", LAYER), capture("pre")),
            ],
        )
        clean = {}  # the same hooks, without the edit
        converted.run_with_hooks(
            tokens,
            fwd_hooks=[
                (neuron_act_name("v", LAYER), lambda v, hook: None),
                (neuron_act_name("q", LAYER), lambda q, hook: clean.update(q=q.clone())),
                (neuron_act_name("pre", LAYER), lambda p, hook: clean.update(pre=p.clone())),
            ],
        )
    torch.testing.assert_close(captured["pre"], clean["pre"], rtol=0, atol=0)
    torch.testing.assert_close(captured["q"], clean["q"], rtol=0, atol=0)
    expected = model.run_with_hooks(
        tokens, fwd_hooks=[(f"blocks.{LAYER}.mlp.hook_post", _set_neuron(lambda x: 3 * x))]
    )
    torch.testing.assert_close(edited, expected, rtol=0, atol=1e-10)


def test_default_relu_in_float16_gives_zero_for_a_zero_pre_activation():
    """float16 cannot hold the default relu_k (1e6): the layers hold the slope at 65504, so a
    pre-activation of exactly 0 gives 0 on the fused and on the head path (``inf * 0`` would be
    NaN), and the logits match the original float16 model's."""
    model = make_model("relu", torch.float32)
    with torch.no_grad():  # neuron 0 of layer 0: pre-activation exactly 0 everywhere
        model.blocks[0].mlp.W_in[:, 0] = 0.0
        model.blocks[0].mlp.b_in[0] = 0.0
    tokens = make_tokens()
    converted = convert(model).to(torch.float16, print_details=False)
    expected = model.to(torch.float16, print_details=False)(tokens)
    fused = converted(tokens)
    heads, cache = converted.run_with_cache(
        tokens, names_filter=lambda name: name.startswith("blocks.0.mlp.hook_p")
    )  # hook_pattern cached: the head path
    assert (cache["blocks.0.mlp.hook_pattern"][:, 0, :, 0] == 0.5).all()  # sigmoid(0)
    assert (cache["blocks.0.mlp.hook_post"][..., 0] == 0).all()
    for logits in (fused, heads):
        assert torch.isfinite(logits).all()
        assert (logits - expected).abs().max().item() <= 1e-3  # measured 0
