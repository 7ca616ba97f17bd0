"""Activation patching by neuron: ``get_act_patch_neuron_heads(..., level="neuron")``.

On a GELU model a neuron is ``K = 4`` neuron-heads; patching one of them patches a part of the
neuron only. At ``level="neuron"`` (the default where ``K > 1``) a patch is all ``K`` heads of a
neuron, which is patching the neuron's ``hook_post``: the reference here is that patch on the
*unconverted* model, by plain hooks, one neuron per forward pass. The unconverted model's GELU is
replaced by the fitted sum of its neuron-heads (``coefficients.evaluate``, as in
``tests/test_fuzz_configs.py``) so that the comparison is exact in float64; against the plain GELU
it holds to the fit's error, far below what one head of a neuron gives.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_model
from conftest import patch_metric as metric
from conftest import patch_token_pair as _tokens
from kinds import make_bridge as make_family_bridge
from models import BRIDGES, facts, make_bridge, make_converted
from transformer_lens.patching import generic_activation_patch

import tl_attnonly
from tl_attnonly.analysis import (
    PatchingOptions,
    get_act_patch_neuron_heads,
    get_act_patch_outputs,
    neuron_head_patch_index,
    run_patches,
)
from tl_attnonly.hooks import head_names_filter, neuron_act_name

#: The model kinds: a converted HookedTransformer (TransformerLens 3.x) and a converted bridge.
KINDS = ["AttnOnlyTransformer", "TransformerBridge"]


@pytest.fixture(scope="module", params=KINDS)
def gelu_pair(request):
    """``(unconverted, converted)``: the same random GELU model (LayerNorm), ``K = 4``."""
    if request.param == "AttnOnlyTransformer":
        if BRIDGES:
            pytest.skip("no HookedTransformer on TransformerLens 4.x")
        original = make_model("gelu", torch.float64, normalization_type="LN")
        return original, tl_attnonly.convert(original)
    return (
        make_bridge("gelu", torch.float64, family="gpt2", convert=False),
        make_bridge("gelu", torch.float64, family="gpt2"),
    )


def _post_patches(original, converted, clean, corrupted, layers, *, fitted: bool) -> torch.Tensor:
    """``[len(layers), d_mlp]``: the metric with each neuron's clean ``hook_post`` patched into
    the unconverted model's corrupted run, one neuron per forward pass (plain hooks). ``fitted``:
    the GELU replaced by the sum of the neuron's heads, what the converted model computes."""
    n_layers, d_mlp = original.cfg.n_layers, original.cfg.d_mlp
    coefficients = facts(converted).neuron_heads[0].coefficients

    def run(tokens, patch=None, store=None):
        pre: dict[int, torch.Tensor] = {}
        hooks = []
        for layer in range(n_layers):

            def keep(act, hook, layer=layer):
                pre[layer] = act

            def post_hook(post, hook, layer=layer):
                post = coefficients.evaluate(pre[layer]) if fitted else post.clone()
                if store is not None:
                    store[layer] = post
                if patch is not None and patch[0] == layer:
                    post[..., patch[1]] = patch[2][layer][..., patch[1]]
                return post

            hooks += [
                (neuron_act_name("pre", layer), keep),
                (neuron_act_name("post", layer), post_hook),
            ]
        with torch.no_grad():
            return original.run_with_hooks(tokens, fwd_hooks=hooks)

    clean_post: dict[int, torch.Tensor] = {}
    run(clean, store=clean_post)
    out = torch.zeros(len(layers), d_mlp, dtype=torch.float64)
    for i, layer in enumerate(layers):
        for neuron in range(d_mlp):
            out[i, neuron] = float(metric(run(corrupted, patch=(layer, neuron, clean_post))))
    return out


def test_neuron_level_is_the_unconverted_models_post_patch(gelu_pair):
    """The default on a ``K = 4`` model patches whole neurons: ``[n_layers, d_mlp]``, equal to
    patching each neuron's ``hook_post`` of the unconverted model. (Before: one head per patch,
    ``[n_layers, n_neuron_heads]``.)"""
    original, converted = gelu_pair
    K = facts(converted).n_heads_per_neuron
    assert K == 4
    clean, corrupted = _tokens()
    _, cache = converted.run_with_cache(clean, names_filter=head_names_filter("z"))
    by_neuron, index_df = get_act_patch_neuron_heads(
        converted, corrupted, cache, metric, progress=False, return_index_df=True
    )
    assert by_neuron.shape == (2, original.cfg.d_mlp)
    assert list(index_df.columns) == ["layer", "neuron"]
    reference = _post_patches(original, converted, clean, corrupted, [0, 1], fitted=True)
    with torch.no_grad():
        baseline = float(metric(converted(corrupted)))
    assert (reference - baseline).abs().max() > 1e-3  # the patches matter
    diff = float((by_neuron - reference).abs().max())
    print(f"\nmax |level='neuron' - unconverted hook_post patch| (fitted GELU): {diff:.3e}")
    torch.testing.assert_close(by_neuron, reference, rtol=0, atol=1e-10)
    # TransformerLens's generic_activation_patch (one patch per pass; float32 results)
    one_by_one = get_act_patch_neuron_heads(
        converted, corrupted, cache, metric, patches_per_pass=1, level="neuron", layers=[1]
    )
    torch.testing.assert_close(one_by_one, reference[1:], rtol=1e-6, atol=1e-6)
    # The plain GELU (layer 1): the same to the fit's error; one head of each neuron is far off.
    plain = _post_patches(original, converted, clean, corrupted, [1], fitted=False)
    fit_error = float((by_neuron[1:] - plain).abs().max())
    print(f"max |level='neuron' - unconverted hook_post patch| (plain GELU): {fit_error:.3e}")
    assert fit_error < 1e-5
    heads = get_act_patch_neuron_heads(
        converted, corrupted, cache, metric, level="head", progress=False
    )
    assert heads.shape == (2, original.cfg.d_mlp * K)
    one_head = heads.reshape(2, -1, K)[..., 0]  # head 0 of every neuron alone
    head_error = float((one_head - reference).abs().max())
    print(f"max |one head of each neuron - unconverted hook_post patch|: {head_error:.3e}")
    assert head_error > 100 * fit_error


def test_the_original_post_patch_of_transformer_lens_agrees(gelu_pair):
    """TransformerLens's own ``generic_activation_patch`` of ``post`` on the unconverted model,
    with the index frame of ``level="neuron"``: the same up to the GELU fit and float32."""
    original, converted = gelu_pair
    clean, corrupted = _tokens()
    _, cache = converted.run_with_cache(clean, names_filter=head_names_filter("z"))
    _, orig_cache = original.run_with_cache(clean, names_filter=lambda n: n.endswith("hook_post"))
    ours, index_df = get_act_patch_neuron_heads(
        converted, corrupted, cache, metric, layers=[1], heads=[0, 5, 23], return_index_df=True,
        progress=False,
    )  # fmt: skip

    def set_post(corrupted_post, index, clean_post):
        layer, neuron = index
        corrupted_post[:, :, neuron] = clean_post[:, :, neuron]
        return corrupted_post

    theirs = generic_activation_patch(
        original, corrupted, orig_cache, metric, set_post, "post", index_df=index_df
    )
    torch.testing.assert_close(ours.flatten(), theirs.double(), rtol=0, atol=1e-5)


def _all_k_heads(neuron: int, K: int, kind: str, pos: int | None = None):
    heads = slice(neuron * K, neuron * K + K)

    def fn(corrupted, clean):
        if kind == "pattern":  # [batch, head, query_pos, 2]
            if pos is None:
                corrupted[:, heads] = clean[:, heads]
            else:
                corrupted[:, heads, pos] = clean[:, heads, pos]
        elif pos is None:  # [batch, pos, head, ...]
            corrupted[:, :, heads] = clean[:, :, heads]
        else:
            corrupted[:, pos, heads] = clean[:, pos, heads]

    return fn


@pytest.mark.parametrize(
    "kind, per_position", [("v", False), ("q", True), ("pattern", False), ("pattern", True)]
)
def test_other_activations_patch_all_k_heads_of_a_neuron(gelu_pair, kind, per_position):
    _, converted = gelu_pair
    K = facts(converted).n_heads_per_neuron
    clean, corrupted = _tokens()
    _, cache = converted.run_with_cache(clean, names_filter=head_names_filter(kind))
    neurons, positions = [1, 7], [2, 6]
    kw = dict(per_position=per_position, layers=[0], heads=neurons, positions=positions)
    batched = get_act_patch_neuron_heads(
        converted, corrupted, cache, metric, kind, patches_per_pass=3, progress=False, **kw
    )
    one_by_one = get_act_patch_neuron_heads(
        converted, corrupted, cache, metric, kind, patches_per_pass=1, **kw
    )
    index_df = neuron_head_patch_index(converted, kind, n_pos=corrupted.shape[1], **kw)
    column = "pos" if "pos" in index_df else "dest_pos"
    name = neuron_act_name(kind, 0)
    patches = [
        [(name, _all_k_heads(row.neuron, K, kind, getattr(row, column) if per_position else None))]
        for row in index_df.itertuples()
    ]
    reference = run_patches(converted, corrupted, cache, metric, patches, progress=False)
    torch.testing.assert_close(batched.flatten(), reference, rtol=0, atol=1e-10)
    torch.testing.assert_close(one_by_one.flatten(), reference, rtol=1e-6, atol=1e-7)
    assert batched.shape == ((1, 2, 2) if per_position else (1, 2))
    assert reference.std() > 1e-6


def test_gated_k4_neurons_are_all_k_heads_patched_together():
    """GeGLU (a Gemma bridge, ``K = 4``): the default patches (output deltas from the patched
    layer on) equal full passes that patch the ``K`` heads' ``z`` of each neuron together."""
    bridge = make_family_bridge("gemma")
    K = facts(bridge).n_heads_per_neuron
    assert K == 4
    clean, corrupted = _tokens()
    _, cache = bridge.run_with_cache(clean, names_filter=head_names_filter("z"))
    ours = get_act_patch_neuron_heads(bridge, corrupted, cache, metric, progress=False)
    d_mlp = bridge.cfg.d_mlp
    assert ours.shape == (2, d_mlp)
    patches = [
        [(neuron_act_name("z", layer), _all_k_heads(i, K, "z"))]
        for layer in range(2)
        for i in range(d_mlp)
    ]
    reference = run_patches(bridge, corrupted, cache, metric, patches, progress=False)
    diff = float((ours.flatten() - reference).abs().max())
    print(f"\nGemma bridge: max |level='neuron' - all K heads' z patched|: {diff:.3e}")
    torch.testing.assert_close(ours.flatten(), reference, rtol=0, atol=1e-8)


def test_k1_default_is_head_level_unchanged():
    converted = make_converted("silu", torch.float64, normalization_type="LN")
    assert facts(converted).n_heads_per_neuron == 1
    clean, corrupted = _tokens()
    _, cache = converted.run_with_cache(clean, names_filter=head_names_filter("z", "pattern"))
    for kind, kw in [("z", {}), ("pattern", dict(per_position=True, positions=[2, 6]))]:
        default, df = get_act_patch_neuron_heads(
            converted, corrupted, cache, metric, kind, return_index_df=True, progress=False, **kw
        )
        head, df_head = get_act_patch_neuron_heads(
            converted, corrupted, cache, metric, kind, level="head", return_index_df=True,
            progress=False, **kw,
        )  # fmt: skip
        neuron, df_neuron = get_act_patch_neuron_heads(
            converted, corrupted, cache, metric, kind, level="neuron", return_index_df=True,
            progress=False, **kw,
        )  # fmt: skip
        assert torch.equal(default, head) and df.equals(df_head) and "head" in df.columns
        torch.testing.assert_close(neuron, head, rtol=0, atol=1e-12)  # K = 1: the same patches
        assert list(df_neuron.columns) == [c.replace("head", "neuron") for c in df.columns]


def test_a_bad_level_is_refused_before_any_work():
    converted = make_converted("gelu", torch.float64, normalization_type="LN")
    with pytest.raises(ValueError, match=r"level must be 'neuron' or 'head'.*'neurons'"):
        # not tokens, no cache: the level is refused first
        get_act_patch_neuron_heads(converted, "text", {}, metric, level="neurons")
    with pytest.raises(ValueError, match=r"level must be 'neuron' or 'head'"):
        PatchingOptions(level="heads")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"level must be 'neuron' or 'head'"):
        neuron_head_patch_index(converted, "z", level="all")  # type: ignore[arg-type]
    with pytest.raises(IndexError, match=r"neuron indices in \[0, 24\)"):
        neuron_head_patch_index(converted, "z", heads=[4 * 24 - 1])  # a head index, not a neuron
    clean, corrupted = _tokens()
    _, cache = converted.run_with_cache(clean, names_filter=head_names_filter("z"))
    with pytest.raises(ValueError, match=r"does not use the patching option\(s\) \['level'\]"):
        get_act_patch_outputs(
            converted, corrupted, cache, metric, options=PatchingOptions(level="head")
        )


def test_the_views_z_ranking_says_what_it_ranks_for_any_k(gelu_pair):
    """``rank_by="z"`` ranks neurons by their activation (the sum of their ``K`` heads' ``z``);
    at head level with ``K > 1`` the caption says a head is one part of it."""
    from tl_attnonly.vis import neuron_head_attention_view

    _, converted = gelu_pair
    tokens = _tokens()[0][:1]
    _, cache = converted.run_with_cache(tokens)
    str_tokens = [str(int(t)) for t in tokens[0]]
    by_neuron = neuron_head_attention_view(cache, 0, str_tokens, top_k=2)
    by_head = neuron_head_attention_view(cache, 0, str_tokens, top_k=2, level="head")
    assert "neurons ranked by max |z| over tokens (the neuron's activation" in by_neuron.caption
    assert "heads ranked by max |z| over tokens (one head's part of its neuron's" in by_head.caption
    assert "K = 1" not in by_neuron.caption + by_head.caption
