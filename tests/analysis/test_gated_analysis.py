"""Analysis tools on gated neuron-heads (SwiGLU/GeGLU): each checked against the original model."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import GATED_ZOO, make_tokens
from models import facts, make_converted, make_original, make_pair, tl3_only

import tl_attnonly
from tl_attnonly.analysis import (
    attribution_patch,
    composition_scores,
    decompose_resid_heads,
    get_act_patch_neuron_heads,
    head_logit_attrs,
    neuron_full_ov_circuit,
    neuron_ov_circuit,
    path_patch,
)
from tl_attnonly.hooks import (
    decomposition_names_filter,
    neuron_act_name,
    neuron_head_label,
    neuron_names_filter,
)

LAYER, NEURON = 1, 7


def llama(act_fn: str = "silu"):
    """``(act_fn, dtype, overrides)`` of a LLaMA-style gated model (additive residual:
    decomposition and DLA apply; TL 4: a LLaMA bridge, or a Gemma one for GeGLU)."""
    overrides = dict(GATED_ZOO["llama"])
    return act_fn, torch.float64, overrides


@pytest.fixture(scope="module")
def pair():
    act_fn, dtype, overrides = llama()
    return make_pair(act_fn, dtype, **overrides)


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 3].sum() - logits[:, -1, 5].sum()


@pytest.mark.parametrize(
    "act_fn, only_post", [("silu", False), ("silu", True), ("gelu_pytorch_tanh", False)]
)
def test_decomposition_sums_to_resid_post(act_fn, only_post):
    """b_in (added after the product) is in ``bias``; for K = 1, hook_post - b_in is z."""
    act_fn, dtype, overrides = llama(act_fn)
    converted = make_converted(act_fn, dtype, **overrides)
    tokens = make_tokens()
    preset = decomposition_names_filter()
    names = preset
    if only_post:  # the neuron-heads' z replaced by hook_post

        def names(name: str) -> bool:
            if name.endswith("mlp.hook_z"):
                return False
            return preset(name) or name.endswith("mlp.hook_post")

    _, cache = converted.run_with_cache(tokens, names_filter=names)
    assert only_post == (neuron_act_name("z", 0) not in cache.keys())
    n = converted.cfg.n_layers
    stack, labels = decompose_resid_heads(cache, n, return_labels=True)
    torch.testing.assert_close(
        stack.sum(0), cache[f"blocks.{n - 1}.hook_resid_post"], rtol=0, atol=1e-10
    )
    adapter = facts(converted)  # (a bridge's b_U may be None: no unembedding bias)
    assert labels[-1] == "bias" and neuron_head_label(0, 0, adapter.n_heads_per_neuron) in labels
    # DLA rows (with embeddings and bias) sum to the logit difference minus its constants
    logits = converted(tokens)
    attrs = head_logit_attrs(cache, 3, 5, pos_slice=-1, incl_embeds_and_bias=True)
    W_U, b_U = adapter.W_U, adapter.b_U
    expected = logits[:, -1, 3] - logits[:, -1, 5] - (b_U[3] - b_U[5])
    torch.testing.assert_close(attrs.sum(0), expected, rtol=0, atol=1e-9)
    assert W_U.shape[0] == converted.cfg.d_model


def _patched_post(model, tokens, layer, neuron, post_value):
    def hook(post, hook):
        post[..., neuron] = post_value
        return post

    return model.run_with_hooks(tokens, fwd_hooks=[(neuron_act_name("post", layer), hook)])


def test_z_pattern_and_value_patching_match_the_original(pair):
    """Patching a gated neuron-head's z, pattern or value == the original with hook_post set to
    what the maths gives (z: clean product; pattern: sigmoid(g_clean) g_corr u_corr; value:
    sigmoid(g_corr) g_clean u_clean; each plus b_in)."""
    model, converted = pair
    clean, corrupted = make_tokens(seed=0), make_tokens(seed=1)
    _, c_cache = model.run_with_cache(clean)
    _, x_cache = model.run_with_cache(corrupted)
    mlp = facts(converted).blocks[LAYER].mlp  # b_in: the original's (a bridge's: zero)

    def pre(cache, kind):
        return cache[neuron_act_name(kind, LAYER)][..., NEURON]

    b_in = mlp.b_in[NEURON]
    g_c, u_c, g_x, u_x = (
        pre(c_cache, "pre"),
        pre(c_cache, "pre_linear"),
        pre(x_cache, "pre"),
        pre(x_cache, "pre_linear"),
    )
    expected_post = {
        "z": torch.sigmoid(g_c) * g_c * u_c + b_in,
        "pattern": torch.sigmoid(g_c) * g_x * u_x + b_in,
        "v": torch.sigmoid(g_x) * g_c * u_c + b_in,
    }
    _, clean_cache = converted.run_with_cache(clean)
    for kind, post in expected_post.items():
        got = get_act_patch_neuron_heads(
            converted, corrupted, clean_cache, metric, kind, layers=[LAYER], heads=[NEURON],
            progress=False,
        )  # fmt: skip
        want = metric(_patched_post(model, corrupted, LAYER, NEURON, post)).item()
        # TL's generic_activation_patch returns float32
        assert abs(got.flatten()[0].item() - want) < 1e-6, kind
    unpatched = metric(model(corrupted)).item()
    assert abs(want - unpatched) > 1e-3  # the patches change the metric


def test_path_patching_last_layer_sender_equals_activation_patching(pair):
    """A last-layer neuron-head reaches the logits only directly: path patching it to the logits
    is activation patching its z."""
    _, converted = pair
    clean, corrupted = make_tokens(seed=0), make_tokens(seed=1)
    _, clean_cache = converted.run_with_cache(clean)
    label = neuron_head_label(LAYER, NEURON)
    got = path_patch(converted, clean, corrupted, [label], "logits", metric)
    want = get_act_patch_neuron_heads(
        converted, corrupted, clean_cache, metric, "z", layers=[LAYER], heads=[NEURON],
        progress=False,
    )  # fmt: skip
    assert abs(float(got) - float(want.flatten()[0])) < 1e-6  # want: float32 (TL)


def test_attribution_patching_matches_the_originals_gradient(pair):
    """z-attribution of gated neuron-heads == (clean - corrupted post) . d metric / d post in the
    original (K = 1: z = post - b_in)."""
    model, converted = pair
    clean, corrupted = make_tokens(seed=0), make_tokens(seed=1)
    _, clean_cache = converted.run_with_cache(clean)
    scores, labels = attribution_patch(
        converted, clean_cache, corrupted, metric, activation_name="z", kinds=("neuron",)
    )
    name = neuron_act_name("post", LAYER)
    _, ref_clean = model.run_with_cache(clean)
    store = {}

    def keep(post, hook):
        post.retain_grad()
        store["post"] = post
        return post

    with torch.enable_grad():
        metric(model.run_with_hooks(corrupted, fwd_hooks=[(name, keep)])).backward()
    post = store["post"]
    want = ((ref_clean[name] - post.detach()) * post.grad).sum((0, 1))[NEURON]
    got = scores[labels.index(neuron_head_label(LAYER, NEURON))]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_ov_circuit_per_unit_u_and_refusals(pair):
    """Gated OV: refused without per_unit_u; with it, (x A) * u B is what the head writes."""
    _, converted = pair
    with pytest.raises(ValueError, match="per_unit_u"):
        neuron_ov_circuit(converted, LAYER)
    with pytest.raises(ValueError, match="per_unit_u"):
        neuron_full_ov_circuit(converted, LAYER)
    with pytest.raises(ValueError, match="per_unit_u"):
        composition_scores(converted, "V")
    ov = neuron_ov_circuit(converted, LAYER, per_unit_u=True)
    adapter = facts(converted)
    adapter.set_use_neuron_result(True)
    try:
        tokens = make_tokens()
        _, cache = converted.run_with_cache(tokens)
    finally:
        adapter.set_use_neuron_result(False)
    x = adapter.blocks[LAYER].ln2(cache[f"blocks.{LAYER}.hook_resid_mid"])  # the MLP's input
    u = cache[neuron_act_name("pre_linear", LAYER)]
    value_per_u = torch.einsum("bpd,hdo->bpho", x, ov.A)  # [batch, pos, head, 1]
    pattern_self = cache[neuron_act_name("pattern", LAYER)][..., 0].transpose(1, 2)
    written = (pattern_self * u)[..., None] * torch.einsum("bpho,hom->bphm", value_per_u, ov.B)
    torch.testing.assert_close(written, cache[neuron_act_name("result", LAYER)], rtol=0, atol=1e-10)
    # Q-composition into gated heads needs no OV of theirs; senders restricted to attention heads
    q = composition_scores(converted, "Q", senders=["L0H0", "L0H1"])
    assert q.scores.shape[0] == 2 and torch.isfinite(q.scores).all()
    v = composition_scores(converted, "V", per_unit_u=True)
    assert torch.isfinite(v.scores).all() and v.scores.abs().sum() > 0


def test_names_filter_presets_and_views(pair):
    _, converted = pair
    tokens = make_tokens()
    names = neuron_names_filter("pre_linear", "pattern")
    _, cache = converted.run_with_cache(tokens, names_filter=names)
    assert sorted(cache.keys()) == sorted(
        neuron_act_name(kind, layer) for kind in ("pre_linear", "pattern") for layer in range(2)
    )
    from tl_attnonly.vis import neuron_head_attention_view

    view = neuron_head_attention_view(converted, LAYER, tokens[0], top_k=3, rank_by="output")
    props = json.loads(view.props)
    attention = torch.tensor(props["attention"])  # [head, 1 + pos, 1 + pos], bias token first
    compact = cache[neuron_act_name("pattern", LAYER)][0, view.heads]
    torch.testing.assert_close(attention[:, 1:, 0], compact[..., 1].float(), atol=6e-5, rtol=0)


@tl3_only("mixtures of experts")
def test_analysis_refuses_moe_by_name():
    model = make_original(
        "silu", torch.float32, gated_mlp=True, num_experts=2, experts_per_token=1,
        normalization_type="RMS",
    )  # fmt: skip
    converted = tl_attnonly.convert(model)
    with pytest.raises(NotImplementedError, match="NeuronHeadMoE"):
        neuron_ov_circuit(converted, 0)
