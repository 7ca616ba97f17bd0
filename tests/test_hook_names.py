"""Hook-name helpers (tl_attnonly.hooks): every name they build exists in a converted model."""

from __future__ import annotations

import pytest
from conftest import make_model
from transformer_lens.utilities import get_act_name

from tl_attnonly import convert
from tl_attnonly.hooks import (
    ATTN_HEAD_HOOKS,
    NEURON_HOOK_SHAPES,
    HeadRef,
    block_act_name,
    head_act_name,
    hook_kind,
    neuron_act_name,
    neuron_hook_kind,
)


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "gated"])
def converted(request):
    return convert(make_model(n_layers=2, use_attn_result=True, gated_mlp=request.param))


def test_every_helper_name_is_a_hook_of_the_model(converted):
    converted.set_use_neuron_result(True)
    hooks = set(converted.hook_dict)
    for layer in range(2):
        for kind in NEURON_HOOK_SHAPES:
            if kind == "pre_linear" and not converted.cfg.gated_mlp:
                assert neuron_act_name(kind, layer) not in hooks  # gated MLPs only
                continue
            assert neuron_act_name(kind, layer) in hooks
            assert head_act_name(kind, layer, "neuron") == neuron_act_name(kind, layer)
        for kind in ATTN_HEAD_HOOKS:
            name = head_act_name(kind, layer, "attn")
            assert name == get_act_name(kind, layer) and name in hooks
        for kind in ("resid_pre", "resid_mid", "resid_post"):
            assert block_act_name(kind, layer) == get_act_name(kind, layer) in hooks
    converted.set_use_neuron_result(False)


def test_aliases_and_head_refs():
    assert neuron_hook_kind("scores") == "attn_scores" and neuron_hook_kind("z") == "z"
    assert head_act_name("scores", 1, "attn") == "blocks.1.attn.hook_attn_scores"
    assert HeadRef("neuron", 2, 7).act_name("z") == "blocks.2.mlp.hook_z"
    assert hook_kind("blocks.2.mlp.hook_attn_scores") == "attn_scores"
    assert hook_kind(block_act_name("resid_post", 0)) == "resid_post"
    with pytest.raises(ValueError, match="not a per-layer hook name"):
        hook_kind("hook_embed")
    assert HeadRef("attn", 0, 1).act_name("q") == "blocks.0.attn.hook_q"
    with pytest.raises(ValueError, match="Unknown neuron-head activation"):
        neuron_hook_kind("resid_post")
    with pytest.raises(ValueError, match="head_kind must be"):
        head_act_name("z", 0, "mlp")
