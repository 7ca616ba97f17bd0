"""Per-head stacking, residual decomposition and DLA over attention heads and neuron-heads."""

from __future__ import annotations

import pytest
import torch
from conftest import ZOO, make_tokens
from models import facts, make_converted, make_original, tl3_extra, tl3_only

from tl_attnonly.analysis import (
    decompose_resid_heads,
    get_attn_head_results,
    get_neuron_head_results,
    head_logit_attrs,
    stack_all_head_results,
    stack_neuron_head_results,
)
from tl_attnonly.hooks import decomposition_names_filter, neuron_act_name

ARCHS = [
    "ln_learned",
    pytest.param("rms_rotary", marks=tl3_extra("gqa (a LLaMA bridge)")),
    pytest.param("no_norm", marks=tl3_only("no normalisation")),
    "parallel_neox",
    "gqa",
]


def _converted(act_fn: str, dtype=torch.float64, **cfg):
    return make_converted(act_fn, dtype, **cfg)


def _cache(model, tokens=None, names_filter=None):
    tokens = make_tokens() if tokens is None else tokens
    with torch.no_grad():
        _, cache = model.run_with_cache(
            tokens, names_filter=names_filter or decomposition_names_filter()
        )
    return cache


@pytest.fixture(scope="module")
def multi_head():
    """A GELU model: several neuron-heads per neuron."""
    model = _converted("gelu", normalization_type="LN")
    assert facts(model).n_heads_per_neuron > 1
    return model


# ---------------------------------------------------------------- the decomposition sums to resid
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("act_fn", ["silu", "gelu"])
def test_decomposition_sums_to_resid(arch, act_fn):
    model = _converted(act_fn, torch.float32, **ZOO[arch])
    cache = _cache(model)
    n_layers = model.cfg.n_layers
    stack, labels = decompose_resid_heads(cache, return_labels=True)
    n_heads = n_layers * (model.cfg.n_heads + facts(model).n_neuron_heads)
    has_pos_embed = "hook_pos_embed" in cache.cache_dict
    assert stack.shape == (len(labels), *cache["hook_embed"].shape)
    assert len(labels) == n_heads + (3 if has_pos_embed else 2)
    assert labels[-1] == "bias" and labels[n_heads] == "embed"
    assert ("pos_embed" in labels) == has_pos_embed
    resid = cache[f"blocks.{n_layers - 1}.hook_resid_post"]
    torch.testing.assert_close(stack.sum(0), resid, rtol=0, atol=1e-5)
    # Inputs of earlier layers too (attention input and, when sequential, MLP input).
    _, full = model.run_with_cache(make_tokens())
    for layer in range(n_layers):
        for mlp_input in (False, True):
            if mlp_input and facts(model).cfg.parallel_attn_mlp:
                continue
            part = decompose_resid_heads(full, layer, mlp_input=mlp_input)
            target = full[f"blocks.{layer}.hook_resid_{'mid' if mlp_input else 'pre'}"]
            torch.testing.assert_close(part.sum(0), target, rtol=0, atol=1e-5)


def test_decomposition_float64_is_exact():
    model = _converted("silu", normalization_type="LN")
    cache = _cache(model)
    stack = decompose_resid_heads(cache)
    torch.testing.assert_close(stack.sum(0), cache["blocks.1.hook_resid_post"], rtol=0, atol=1e-12)
    # Every component matters: dropping one neuron-head breaks the sum.
    assert (stack[1:].sum(0) - cache["blocks.1.hook_resid_post"]).abs().max() > 1e-6


def test_k1_matches_transformer_lens_full_decomposition():
    """For K = 1, neuron i is neuron-head i: TL's own decomposition, labels included."""
    model = _converted("silu", torch.float32, normalization_type="LN")
    _, full = model.run_with_cache(make_tokens())
    ours, labels = decompose_resid_heads(full, return_labels=True, pos_slice=-1)
    theirs, tl_labels = full.get_full_resid_decomposition(
        expand_neurons=True, return_labels=True, pos_slice=-1
    )
    assert labels == tl_labels
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    ours_ln = decompose_resid_heads(full, apply_ln=True, pos_slice=-1)
    theirs_ln = full.get_full_resid_decomposition(expand_neurons=True, apply_ln=True, pos_slice=-1)
    torch.testing.assert_close(ours_ln, theirs_ln, rtol=1e-5, atol=1e-5)


def test_stacks_match_transformer_lens():
    model = _converted("silu", normalization_type="RMS")
    _, full = model.run_with_cache(make_tokens())
    attn, attn_labels = stack_all_head_results(full, kinds=("attn",), return_labels=True)
    neur, neur_labels = stack_neuron_head_results(full, return_labels=True)
    keys = set(full.keys())
    tl_attn, tl_attn_labels = full.stack_head_results(return_labels=True)  # caches results
    tl_neur, tl_neur_labels = full.stack_neuron_results(-1, return_labels=True)
    assert (attn_labels, neur_labels) == (tl_attn_labels, tl_neur_labels)
    torch.testing.assert_close(attn, tl_attn, rtol=0, atol=1e-12)
    torch.testing.assert_close(neur, tl_neur, rtol=0, atol=1e-12)
    both, labels = stack_all_head_results(full, return_labels=True)
    assert labels == attn_labels + neur_labels
    torch.testing.assert_close(both, torch.cat([attn, neur]))
    assert keys <= set(full.keys())
    # Ours did not add to the cache (TL's stack_head_results did).
    assert not any(k.endswith("attn.hook_result") for k in keys)


def test_multi_head_neurons_sum_to_neurons(multi_head):
    model = multi_head
    K = facts(model).n_heads_per_neuron
    cache = _cache(model, names_filter=lambda n: n.endswith(("mlp.hook_z", "mlp.hook_post")))
    for layer in range(model.cfg.n_layers):
        heads = get_neuron_head_results(cache, layer)  # [batch, pos, d_mlp * K, d_model]
        per_neuron = heads.unflatten(-2, (model.cfg.d_mlp, K)).sum(-2)
        post = cache[neuron_act_name("post", layer)]
        W_out = facts(model).blocks[layer].mlp.W_out
        torch.testing.assert_close(per_neuron, post[..., None] * W_out, rtol=0, atol=1e-12)
    _, labels = stack_neuron_head_results(cache, return_labels=True)
    assert labels[: K + 1] == [f"L0N0.{k}" for k in range(K)] + ["L0N1.0"]


def test_post_is_accepted_for_k1_only(multi_head):
    silu = _converted("silu")
    only_post = lambda n: n.endswith("mlp.hook_post")  # noqa: E731
    z = get_neuron_head_results(_cache(silu, names_filter=only_post), 0)
    z_ref = get_neuron_head_results(
        _cache(silu, names_filter=lambda n: n.endswith("mlp.hook_z")), 0
    )
    # post (fused path, F.silu) and z (head path) agree to rounding
    torch.testing.assert_close(z, z_ref, rtol=0, atol=1e-14)
    with pytest.raises(KeyError, match="decomposition_names_filter"):
        get_neuron_head_results(_cache(multi_head, names_filter=only_post), 0)


def test_options_projection_ln_remainder_chunks():
    model = _converted("silu", normalization_type="LN")
    cache = _cache(model)
    direction = torch.randn(model.cfg.d_model, 2, dtype=torch.float64)
    full = stack_all_head_results(cache, apply_ln=True, incl_remainder=True)
    projected = stack_all_head_results(
        cache, apply_ln=True, incl_remainder=True, project_output_onto=direction, chunk_size=5
    )
    torch.testing.assert_close(projected, full @ direction, rtol=0, atol=1e-10)
    one = stack_all_head_results(cache, project_output_onto=direction[:, 0], pos_slice=-1)
    assert one.shape == (2 * (2 + 24), 2)
    raw, labels = stack_all_head_results(cache, incl_remainder=True, return_labels=True)
    assert labels[-1] == "remainder"
    torch.testing.assert_close(raw.sum(0), cache["blocks.1.hook_resid_post"], rtol=0, atol=1e-12)
    subset = get_neuron_head_results(cache, 1, heads=[3, 7], pos_slice=(2, 5))
    torch.testing.assert_close(subset, get_neuron_head_results(cache, 1)[:, 2:5, [3, 7]])
    with pytest.raises(MemoryError, match="pos_slice=-1"):
        stack_all_head_results(cache, max_bytes=1000)
    with pytest.raises(IndexError, match="Neuron-head indices"):
        get_neuron_head_results(cache, 0, heads=[24])
    with pytest.raises(ValueError, match="subset"):
        stack_all_head_results(cache, kinds="attn")


def test_attn_results_use_cached_results_when_present():
    model = _converted("silu", normalization_type="LN")
    model.set_use_attn_result(True)
    _, full = model.run_with_cache(make_tokens())
    cached = full["blocks.1.attn.hook_result"]
    torch.testing.assert_close(get_attn_head_results(full, 1), cached, rtol=0, atol=0)
    z = full["blocks.1.attn.hook_z"]
    computed = torch.einsum("bphd,hdm->bphm", z, facts(model).blocks[1].attn.W_O)
    torch.testing.assert_close(cached, computed, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- direct logit attribution
@pytest.mark.parametrize(
    "arch",
    [
        "ln_learned",
        "rms_rotary",
        pytest.param("rmspre", marks=tl3_only("RMSPre")),
        pytest.param("no_norm", marks=tl3_only("no normalisation")),
    ],
)
def test_head_dla_matches_transformer_lens_and_sums_to_the_logit_difference(arch):
    model = _converted("silu", **ZOO[arch])
    tokens = make_tokens()
    _, full = model.run_with_cache(tokens)
    answer, wrong = tokens[:, -1], (tokens[:, -1] + 1) % model.cfg.d_vocab
    attrs, labels = head_logit_attrs(
        full, answer, wrong, pos_slice=-1, return_labels=True, chunk_size=7
    )
    heads = torch.cat(
        [
            full.stack_head_results(pos_slice=-1),
            full.stack_neuron_results(-1, pos_slice=-1),
        ]
    )
    adapter = facts(model)  # (a bridge's own ln_final has no .w, its b_U may be None)
    w = getattr(adapter.ln_final, "w", None)
    if w is None:  # nothing to apply after the norm: exactly TransformerLens's logit_attrs
        expected = full.logit_attrs(heads, answer, wrong, pos_slice=-1)
    else:  # TL's logit_attrs leaves out ln_final.w (centring does not commute with * w)
        directions = model.W_U[:, answer].T - model.W_U[:, wrong].T
        scaled = full.apply_ln_to_stack(heads, layer=-1, pos_slice=-1)
        expected = (scaled * directions * w).sum(-1)
    assert attrs.shape == (len(labels), tokens.shape[0])
    torch.testing.assert_close(attrs, expected, rtol=0, atol=1e-10)
    # With embeddings and biases, the attributions add up to the logit difference, less the
    # constants b_U and ln_final.b.
    total = head_logit_attrs(full, answer, wrong, pos_slice=-1, incl_embeds_and_bias=True).sum(0)
    logits = model(tokens)[:, -1]
    diff = logits.gather(-1, answer[:, None])[:, 0] - logits.gather(-1, wrong[:, None])[:, 0]
    constant = adapter.b_U[answer] - adapter.b_U[wrong]
    b = getattr(adapter.ln_final, "b", None)
    if b is not None:
        constant = constant + (model.W_U[:, answer].T - model.W_U[:, wrong].T) @ b
    torch.testing.assert_close(total + constant, diff, rtol=0, atol=1e-10)


def test_errors_say_what_to_do():
    plain = make_original("silu")
    _, cache = plain.run_with_cache(make_tokens())
    with pytest.raises(TypeError, match="convert"):
        decompose_resid_heads(cache)
    model = _converted("silu")
    partial = _cache(model, names_filter=lambda n: "attn" in n or n == "hook_embed")
    with pytest.raises(KeyError, match="decomposition_names_filter"):
        decompose_resid_heads(partial)
    with pytest.raises(ValueError, match="layer must be in"):
        decompose_resid_heads(_cache(model), layer=5)
