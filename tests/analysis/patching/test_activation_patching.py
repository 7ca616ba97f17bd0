"""Activation patching, path patching and attribution patching over neuron-heads."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tokens
from conftest import patch_metric as metric
from conftest import patch_token_pair as _tokens
from models import BRIDGES, facts, make_converted, make_pair, tl3_only
from transformer_lens.patching import generic_activation_patch, get_act_patch_attn_head_out_all_pos

from tl_attnonly.analysis import (
    attribution_patch,
    get_act_patch_all_heads,
    get_act_patch_neuron_heads,
    neuron_head_patch_index,
    parse_receiver,
    path_patch,
    path_patch_sweep,
    rank_agreement,
    run_patches,
)
from tl_attnonly.analysis.patching.paths import Receiver
from tl_attnonly.hooks import (
    HeadRef,
    all_head_refs,
    head_names_filter,
    neuron_act_name,
    neuron_names_filter,
)


@pytest.fixture(scope="module")
def pair():
    """(original, converted): SiLU, LayerNorm, learned positions (TL 4: GPT-2 bridges)."""
    return make_pair("silu", torch.float64, normalization_type="LN")


def _post_neuron_setter(corrupted, index, clean):
    layer, neuron = index
    corrupted[:, :, neuron] = clean[:, :, neuron]
    return corrupted


# ------------------------------------------------------------------------- activation patching
def test_z_patch_restores_what_the_original_neuron_patch_restores(pair):
    model, converted = pair
    clean, corrupted = _tokens()
    _, clean_cache = converted.run_with_cache(clean, names_filter=head_names_filter("z"))
    _, orig_cache = model.run_with_cache(clean, names_filter=lambda n: n.endswith("mlp.hook_post"))
    ours, index_df = get_act_patch_neuron_heads(
        converted, corrupted, clean_cache, metric, "z", return_index_df=True
    )
    theirs = generic_activation_patch(
        model, corrupted, orig_cache, metric, _post_neuron_setter, "post", index_df=index_df
    )
    assert ours.shape == (2, 24)
    baseline = metric(model(corrupted)).item()
    assert (theirs - baseline).abs().max() > 1e-3  # the patches matter
    torch.testing.assert_close(ours.flatten().to(theirs.dtype), theirs, rtol=1e-6, atol=1e-6)
    # In float64, logit by logit, for a few heads and positions.
    # (a bridge's hook function sees its hook point's own name, not the alias it was added by)
    for layer, pos, head in [(0, 2, 5), (1, 6, 0), (1, 9, 23)]:
        z_name, post_name = neuron_act_name("z", layer), neuron_act_name("post", layer)

        def z_hook(z, hook, pos=pos, head=head, name=z_name):
            z = z.clone()
            z[:, pos, head] = clean_cache[name][:, pos, head]
            return z

        def post_hook(post, hook, pos=pos, head=head, name=post_name):
            post = post.clone()
            post[:, pos, head] = orig_cache[name][:, pos, head]
            return post

        a = converted.run_with_hooks(corrupted, fwd_hooks=[(z_name, z_hook)])
        b = model.run_with_hooks(corrupted, fwd_hooks=[(post_name, post_hook)])
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    "kind, per_position", [("z", True), ("pattern", False), ("pattern", True), ("v", False)]
)
def test_batched_mode_equals_one_patch_per_pass(pair, kind, per_position):
    _, converted = pair
    clean, corrupted = _tokens()
    _, clean_cache = converted.run_with_cache(clean, names_filter=head_names_filter(kind))
    kwargs = dict(per_position=per_position, layers=[1], heads=[0, 5, 23], positions=[2, 6, 9])
    one = get_act_patch_neuron_heads(converted, corrupted, clean_cache, metric, kind, **kwargs)
    many = get_act_patch_neuron_heads(
        converted,
        corrupted,
        clean_cache,
        metric,
        kind,
        patches_per_pass=4,
        progress=False,
        **kwargs,
    )
    expected_shape = {
        (True, "z"): (1, 3, 3),
        (True, "pattern"): (1, 3, 3),
        (False, "pattern"): (1, 3),
        (False, "v"): (1, 3),
    }[(per_position, kind)]
    assert one.shape == many.shape == expected_shape
    torch.testing.assert_close(one, many, rtol=1e-6, atol=1e-7)
    # different patches give different results (well above the tolerance; the GPT-2 bridge's
    # pattern patches at these positions differ by less than the HookedTransformer's)
    assert one.std() > (1e-5 if BRIDGES else 1e-4)


def test_pattern_and_value_patches_mean_what_they_say(pair):
    """SiLU: z = sigmoid(pre) * pre. Clean pattern: sigmoid(pre_clean) * pre_corrupted."""
    model, converted = pair
    clean, corrupted = _tokens()
    layer, neuron = 1, 7
    _, cc = converted.run_with_cache(clean, names_filter=head_names_filter("pattern", "v"))
    _, pre_clean = model.run_with_cache(clean, names_filter=neuron_act_name("pre", layer))
    pre_clean = pre_clean[neuron_act_name("pre", layer)][..., neuron]
    results = {
        kind: get_act_patch_neuron_heads(
            converted, corrupted, cc, metric, kind, layers=[layer], heads=[neuron]
        ).item()
        for kind in ("pattern", "v")
    }
    for kind, expected_post in [
        ("pattern", lambda pre: torch.sigmoid(pre_clean) * pre),
        ("v", lambda pre: torch.sigmoid(pre) * pre_clean),
    ]:
        store: dict[str, torch.Tensor] = {}

        def keep_pre(pre, hook, store=store):
            store["pre"] = pre[..., neuron]

        def set_post(post, hook, f=expected_post, store=store):
            post = post.clone()
            post[..., neuron] = f(store["pre"])
            return post

        logits = model.run_with_hooks(
            corrupted,
            fwd_hooks=[
                (neuron_act_name("pre", layer), keep_pre),
                (neuron_act_name("post", layer), set_post),
            ],
        )
        assert results[kind] == pytest.approx(metric(logits).item(), rel=1e-6, abs=1e-7)
    assert results["pattern"] != pytest.approx(results["v"], abs=1e-4)


def test_all_heads_of_a_multi_head_neuron_equal_its_post():
    converted = make_converted("gelu", torch.float64, normalization_type="RMS", family="gpt2")
    K = facts(converted).n_heads_per_neuron
    assert K > 1
    clean, corrupted = _tokens()
    _, cc = converted.run_with_cache(clean, names_filter=head_names_filter("z"))
    _, cc_post = converted.run_with_cache(clean, names_filter=lambda n: n.endswith("hook_post"))
    neurons = [0, 4, 9]

    def all_heads(neuron):
        def fn(z, clean_z):
            z[:, :, neuron * K : (neuron + 1) * K] = clean_z[:, :, neuron * K : (neuron + 1) * K]

        return fn

    grouped = run_patches(
        converted,
        corrupted,
        cc,
        metric,
        [[(neuron_act_name("z", 1), all_heads(i))] for i in neurons],
        patches_per_pass=2,
        progress=False,
    )
    index_df = neuron_head_patch_index(converted, "z", layers=[1], heads=neurons)
    post = generic_activation_patch(
        converted, corrupted, cc_post, metric, _post_neuron_setter, "post", index_df=index_df
    )
    torch.testing.assert_close(grouped, post, rtol=1e-6, atol=1e-7, check_dtype=False)
    single = get_act_patch_neuron_heads(
        converted, corrupted, cc, metric, "z", layers=[1], heads=[4 * K], patches_per_pass=2,
        level="head",
    )  # fmt: skip
    assert single.item() != pytest.approx(grouped[1].item(), abs=1e-5)  # one head is not all K


def test_all_heads_sweep_matches_transformer_lens_and_neuron_sweep(pair):
    _, converted = pair
    clean, corrupted = _tokens()
    _, cc = converted.run_with_cache(clean, names_filter=head_names_filter("z"))
    scores, labels = get_act_patch_all_heads(converted, corrupted, cc, metric, progress=False)
    n_attn = converted.cfg.n_layers * converted.cfg.n_heads
    assert labels[:2] == ["L0H0", "L0H1"] and labels[n_attn] == "L0N0"
    tl_attn = get_act_patch_attn_head_out_all_pos(converted, corrupted, cc, metric)
    torch.testing.assert_close(
        scores[:n_attn], tl_attn.flatten(), rtol=1e-6, atol=1e-7, check_dtype=False
    )
    neuron = get_act_patch_neuron_heads(converted, corrupted, cc, metric, "z", patches_per_pass=9)
    torch.testing.assert_close(scores[n_attn:], neuron.flatten(), rtol=1e-6, atol=1e-7)


def test_patch_index_and_errors(pair):
    _, converted = pair
    df = neuron_head_patch_index(converted, "z", per_position=True, n_pos=4, heads=[1, 2])
    assert list(df.columns) == ["layer", "pos", "head"] and len(df) == 2 * 4 * 2
    df = neuron_head_patch_index(converted, "scores", per_position=True, positions=[0, 3])
    assert list(df.columns) == ["layer", "head", "dest_pos"] and len(df) == 2 * 24 * 2
    with pytest.raises(ValueError, match="keys are constant"):
        neuron_head_patch_index(converted, "k")
    with pytest.raises(ValueError, match="n_pos"):
        neuron_head_patch_index(converted, "z", per_position=True)
    clean, corrupted = _tokens()
    _, cc = converted.run_with_cache(clean, names_filter=head_names_filter("z"))
    with pytest.raises(ValueError, match="set_use_neuron_result"):
        get_act_patch_neuron_heads(converted, corrupted, cc, metric, "result", heads=[0])
    with pytest.raises(TypeError, match="tokens"):
        get_act_patch_neuron_heads(converted, "some text", cc, metric)


def test_result_patch_equals_z_patch():
    converted = make_converted("silu", torch.float64, normalization_type="LN")
    clean, corrupted = _tokens()
    facts(converted).set_use_neuron_result(True)
    _, cc = converted.run_with_cache(clean, names_filter=neuron_names_filter("z", "result"))
    kwargs = dict(layers=[0], heads=[2, 9], patches_per_pass=2, progress=False)
    by_result = get_act_patch_neuron_heads(converted, corrupted, cc, metric, "result", **kwargs)
    by_z = get_act_patch_neuron_heads(converted, corrupted, cc, metric, "z", **kwargs)
    torch.testing.assert_close(by_result, by_z, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------- path patching
def _all_z_clean(model, clean, corrupted):
    _, cc = model.run_with_cache(clean, names_filter=head_names_filter("z"))
    names = [
        f"blocks.{li}.{sub}.hook_z" for li in range(model.cfg.n_layers) for sub in ("attn", "mlp")
    ]

    def set_z(name):
        return lambda z, hook: cc[name]

    return metric(model.run_with_hooks(corrupted, fwd_hooks=[(n, set_z(n)) for n in names]))


def test_path_patching_all_senders_equals_full_activation_patching(pair):
    _, converted = pair
    clean, corrupted = _tokens()
    value = path_patch(
        converted, clean, corrupted, all_head_refs(facts(converted)), "logits", metric
    )
    expected = _all_z_clean(converted, clean, corrupted).item()
    assert value == pytest.approx(expected, rel=0, abs=1e-10)
    # Not trivially the clean or corrupted run (the corrupted embeddings stay).
    assert abs(expected - metric(converted(clean)).item()) > 1e-3
    assert abs(expected - metric(converted(corrupted)).item()) > 1e-3


def test_path_patching_through_every_path_equals_activation_patching():
    """One layer: L0H0 reaches the logits directly or through the layer's neuron-heads only."""
    converted = make_converted("silu", torch.float64, n_layers=1, normalization_type="LN")
    clean, corrupted = _tokens()
    _, cc = converted.run_with_cache(clean, names_filter=head_names_filter("z"))
    n = facts(converted).n_neuron_heads
    receivers = [f"L0N{i}" for i in range(n)] + ["logits"]
    for sender, hook_name in [("L0H0", "blocks.0.attn.hook_z"), ("L0N5", "blocks.0.mlp.hook_z")]:
        ref = HeadRef("attn", 0, 0) if sender == "L0H0" else HeadRef("neuron", 0, 5)

        def patch_one(z, hook, ref=ref, name=hook_name):
            z = z.clone()
            z[:, :, ref.head] = cc[name][:, :, ref.head]
            return z

        expected = metric(converted.run_with_hooks(corrupted, fwd_hooks=[(hook_name, patch_one)]))
        value = path_patch(converted, clean, corrupted, [sender], receivers, metric)
        assert value == pytest.approx(expected.item(), rel=0, abs=1e-10)
    # The direct path alone and the paths through the neuron-heads alone both matter.
    direct = path_patch(converted, clean, corrupted, ["L0H0"], ["logits"], metric)
    via_neurons = path_patch(converted, clean, corrupted, ["L0H0"], receivers[:-1], metric)
    baseline = metric(converted(corrupted)).item()
    assert abs(via_neurons - baseline) > 1e-4 and abs(direct - baseline) > 1e-4


def test_path_patching_respects_order_and_sweeps_match(pair):
    _, converted = pair
    clean, corrupted = _tokens()
    baseline = metric(converted(corrupted)).item()
    # A later head cannot reach an earlier receiver.
    assert path_patch(
        converted, clean, corrupted, ["L1N3", "L1H0"], ["L0H1", "L1H1:q"], metric
    ) == (pytest.approx(baseline, abs=1e-12))
    receivers = ["L1H0:q", "L1N3:v", "L1N4"]
    senders = ["L0H0", "L0H1", "L0N2", "L0N7", "L1H1", "L1N3"]
    swept, labels = path_patch_sweep(
        converted, clean, corrupted, receivers, metric, senders=senders, patches_per_pass=4,
        progress=False,
    )  # fmt: skip
    assert labels == senders
    single = torch.tensor(
        [path_patch(converted, clean, corrupted, [s], receivers, metric) for s in senders],
        dtype=torch.float64,
    )
    # float64 like the other sweeps (path_patch_receiver_sweep, path_patch_grid): a float32
    # result would round the fp64 model's metric to ~1e-8.
    assert swept.dtype == torch.float64
    torch.testing.assert_close(swept.cpu(), single, rtol=0, atol=1e-10)
    assert swept[-1].item() == pytest.approx(baseline, abs=1e-6)  # L1N3 reaches no receiver
    assert (swept[:-1] - baseline).abs().min() > 1e-6  # the others do


def test_receiver_specs():
    assert parse_receiver("L1H0") == Receiver(HeadRef("attn", 1, 0), "qkv")
    assert parse_receiver("L1H0:vq") == Receiver(HeadRef("attn", 1, 0), "qv")
    assert parse_receiver("L2N5.1", 2) == Receiver(HeadRef("neuron", 2, 11), "qv")
    assert parse_receiver(("L2N5", "v")) == Receiver(HeadRef("neuron", 2, 5), "v")
    assert parse_receiver("logits") == Receiver(None, "")
    with pytest.raises(ValueError, match="key is constant"):
        parse_receiver("L1N3:k")
    with pytest.raises(ValueError, match="subset"):
        parse_receiver("L1H0:x")


# ------------------------------------------------------------------------- attribution patching
@tl3_only("no normalisation")
def test_attribution_is_exact_where_the_metric_is_linear():
    """No LayerNorm, last layer's neuron-heads, metric linear in the logits: first order is all."""
    converted = make_converted("silu", torch.float64, normalization_type=None)
    clean, corrupted = _tokens()
    _, cc = converted.run_with_cache(clean, names_filter=head_names_filter("z"))
    estimate, labels = attribution_patch(converted, cc, corrupted, metric, kinds=("neuron",))
    actual = get_act_patch_neuron_heads(
        converted, corrupted, cc, metric, "z", layers=[1], patches_per_pass=24, progress=False
    )
    baseline = metric(converted(corrupted)).item()
    n = facts(converted).n_neuron_heads
    assert labels[n] == "L1N0"
    torch.testing.assert_close(estimate[n:], actual[0] - baseline, rtol=1e-4, atol=1e-6)
    assert (actual[0] - baseline).abs().max() > 1e-3


def test_attribution_agrees_with_activation_patching(pair):
    """Stated tolerance: Spearman >= 0.9 over all heads, signs agree on the 10 largest effects."""
    _, converted = pair
    clean = make_tokens(seed=0)
    corrupted = clean.clone()
    corrupted[:, 4] = (clean[:, 4] + 13) % 61
    _, cc = converted.run_with_cache(clean, names_filter=head_names_filter("z"))
    estimate, labels = attribution_patch(converted, cc, corrupted, metric)
    actual, labels_act = get_act_patch_all_heads(converted, corrupted, cc, metric, progress=False)
    assert labels == labels_act
    effect = actual - metric(converted(corrupted)).item()
    agreement = rank_agreement(estimate, effect, top=10)
    assert agreement["spearman"] >= 0.9, agreement
    assert agreement["sign_agreement"] == 1.0, agreement


def test_attribution_options(pair):
    _, converted = pair
    clean, corrupted = _tokens()
    _, cc = converted.run_with_cache(clean, names_filter=head_names_filter("pattern", "v", "z"))
    for kind in ("pattern", "v"):
        total, _ = attribution_patch(converted, cc, corrupted, metric, activation_name=kind)
        per_pos, _ = attribution_patch(
            converted, cc, corrupted, metric, activation_name=kind, per_position=True
        )
        assert per_pos.shape == (len(total), corrupted.shape[1])
        torch.testing.assert_close(per_pos.sum(-1), total)
    for p in converted.parameters():  # gradients go to the activations, not the parameters
        assert p.grad is None
    frozen = make_converted("silu", torch.float64, normalization_type="LN")
    frozen.requires_grad_(False)
    a, _ = attribution_patch(frozen, cc, corrupted, metric)
    b, _ = attribution_patch(converted, cc, corrupted, metric)
    torch.testing.assert_close(a, b)
    with pytest.raises(KeyError, match="head_names_filter"):
        attribution_patch(converted, cc, corrupted, metric, activation_name="q")
    with pytest.raises(ValueError, match="activation_name"):
        attribution_patch(converted, cc, corrupted, metric, activation_name="k")
