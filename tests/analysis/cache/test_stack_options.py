"""StackOptions: the stacking functions give identical results with options= and with keywords."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tokens
from models import facts, make_converted

from tl_attnonly.analysis import (
    StackOptions,
    decompose_resid_heads,
    stack_all_head_results,
    stack_neuron_head_results,
)


@pytest.fixture(scope="module")
def cache():
    model = make_converted("gelu", torch.float64, normalization_type="LN")
    assert facts(model).n_heads_per_neuron > 1
    with torch.no_grad():
        _, cache = model.run_with_cache(make_tokens())
    return cache


def _direction(cache):
    torch.manual_seed(0)
    return torch.randn(cache.model.cfg.d_model, 2, dtype=torch.float64)


# Every option at a non-default value (chunk_size small enough to take several chunks).
def _keywords(cache, remainder=True):
    kw = dict(
        pos_slice=-1,
        apply_ln=True,
        project_output_onto=_direction(cache),
        max_bytes=2**30,
        chunk_size=3,
        progress=False,
    )
    if remainder:
        kw["incl_remainder"] = True
    return kw


CASES = [
    (stack_all_head_results, dict(layer=1, mlp_input=True, kinds=("attn", "neuron")), True),
    (stack_neuron_head_results, dict(layer=None), True),
    (decompose_resid_heads, dict(layer=1, mlp_input=True), False),
]


@pytest.mark.parametrize("function, args, remainder", CASES, ids=[c[0].__name__ for c in CASES])
def test_options_and_keywords_give_identical_results(cache, function, args, remainder):
    kw = _keywords(cache, remainder)
    by_keyword, labels_kw = function(cache, return_labels=True, **args, **kw)
    by_options, labels_opt = function(cache, return_labels=True, **args, options=StackOptions(**kw))
    torch.testing.assert_close(by_options, by_keyword, rtol=0, atol=0)
    assert labels_opt == labels_kw
    # A keyword replaces the option of the same name.
    mixed = function(cache, **args, options=StackOptions(**{**kw, "pos_slice": None}), pos_slice=-1)
    torch.testing.assert_close(mixed, by_keyword, rtol=0, atol=0)
    # The options matter (the test can fail): without them the stack differs.
    plain = function(cache, **args)
    assert plain.shape != by_keyword.shape


def test_defaults_match_an_empty_options_object(cache):
    torch.testing.assert_close(
        stack_all_head_results(cache, options=StackOptions()),
        stack_all_head_results(cache),
        rtol=0,
        atol=0,
    )


def test_unknown_and_unused_options_are_refused(cache):
    with pytest.raises(TypeError, match="unexpected keyword argument.*'pos_slic'"):
        stack_all_head_results(cache, pos_slic=-1)
    with pytest.raises(TypeError, match="incl_remainder"):
        decompose_resid_heads(cache, incl_remainder=True)
    with pytest.raises(ValueError, match="does not use the stack option.*incl_remainder"):
        decompose_resid_heads(cache, options=StackOptions(incl_remainder=True))
    with pytest.raises(TypeError, match="takes a tl_attnonly.analysis.StackOptions"):
        stack_all_head_results(cache, options={"pos_slice": -1})
    with pytest.raises(TypeError, match="Unknown stack option"):
        StackOptions().with_overrides(chunk=3)
