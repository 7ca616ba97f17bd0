"""Hook edits of the neuron-heads take effect however they are made (in place or returned)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_tokens

from tl_attnonly import convert
from tl_attnonly.hooks import neuron_act_name

LAYER, NEURON = 1, 5


def _run(converted, name, hook):
    return converted.run_with_hooks(make_tokens(), fwd_hooks=[(neuron_act_name(name, LAYER), hook)])


def _returned(edit):
    def hook(act, hook):
        act = act.clone()
        edit(act)
        return act

    return hook


def _in_place(edit):
    def hook(act, hook):
        edit(act)

    return hook


MODELS = {
    "silu": dict(act_fn="silu"),
    "gelu_new": dict(act_fn="gelu_new"),
    "geglu": dict(act_fn="gelu_new", gated_mlp=True),
}


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize(
    "edit",
    [
        lambda k: k.__setitem__((slice(None), slice(None), [NEURON], slice(None)), 0),
        lambda k: k.__setitem__((slice(None), slice(None), NEURON, slice(None)), 0),
        lambda k: k[:, 3:, NEURON].mul_(-2),
    ],
    ids=["list-index", "int-index", "mul_"],
)
def test_key_edits_in_place_equal_returned_edits(kind, edit):
    converted = convert(make_model(dtype=torch.float64, normalization_type="LN", **MODELS[kind]))
    reference = converted(make_tokens())
    returned = _run(converted, "k", _returned(edit))
    in_place = _run(converted, "k", _in_place(edit))
    assert (returned - reference).abs().max() > 1e-3  # the edit matters
    assert torch.equal(in_place, returned)


def test_unedited_keys_change_nothing():
    converted = convert(make_model("gelu_new", torch.float64, normalization_type="LN"))
    converted.blocks[LAYER].mlp.fused = False
    reference = converted(make_tokens())
    assert torch.equal(_run(converted, "k", lambda k, hook: k.clone()), reference)
    assert torch.equal(_run(converted, "k", lambda k, hook: None), reference)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_post_edits_in_place_reach_the_output_with_neuron_results(kind):
    converted = convert(make_model(dtype=torch.float64, normalization_type="LN", **MODELS[kind]))
    converted.set_use_neuron_result(True)

    def edit(post):
        post[:, :, NEURON] = 2.0

    reference = converted(make_tokens())
    returned = _run(converted, "post", _returned(edit))
    in_place = _run(converted, "post", _in_place(edit))
    assert (returned - reference).abs().max() > 1e-3
    torch.testing.assert_close(in_place, returned, rtol=0, atol=1e-12)
    assert torch.equal(_run(converted, "post", lambda post, hook: None), reference)


@pytest.mark.parametrize("act_fn", ["silu", "gelu_new"])
def test_editing_post_in_place_leaves_the_cached_z_alone(act_fn):
    converted = convert(make_model(act_fn, torch.float64, normalization_type="LN"))
    names = [neuron_act_name("z", LAYER), neuron_act_name("post", LAYER)]
    _, clean = converted.run_with_cache(make_tokens(), names_filter=names)
    with converted.hooks(fwd_hooks=[(names[1], _in_place(lambda post: post.zero_()))]):
        _, edited = converted.run_with_cache(make_tokens(), names_filter=names)
    assert torch.equal(edited[names[0]], clean[names[0]])
    assert edited[names[1]].abs().max() == 0
