"""verify_conversion: a PASS/FAIL verdict per dtype, for exact and approximate activations."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_tokens

from tl_attnonly import convert
from tl_attnonly.verify import verify_conversion

DTYPES = (torch.float32, torch.float64)


@pytest.mark.parametrize("act_fn", ["silu", "gelu_new", "relu"])
def test_a_correct_conversion_passes_in_both_dtypes(act_fn):
    model = make_model(act_fn, normalization_type="LN")
    converted = convert(model)
    verdicts = verify_conversion(model, converted, make_tokens())
    assert [v.dtype for v in verdicts] == list(DTYPES)
    assert all(v.passed for v in verdicts), verdicts
    for v in verdicts:
        assert 0 <= v.max_abs_diff <= v.tolerance
        if act_fn == "silu":
            assert v.reference == "original" and v.approximation_diff == v.max_abs_diff
        else:
            # the approximation costs more than the conversion: the verdict checks the latter
            assert v.reference == "original with the heads' activation"
            factor = 1e3 if v.dtype == torch.float64 else 2  # float32 rounding ~1e-6
            assert v.approximation_diff > factor * v.max_abs_diff
    # both models are back in their own dtype, and still usable with autograd
    assert model.cfg.dtype == converted.cfg.dtype == torch.float64
    for param in [*model.parameters(), *converted.parameters()]:
        assert param.dtype == torch.float64 and not param.is_inference()


@pytest.mark.parametrize("act_fn", ["silu", "gelu_new"])
def test_a_wrong_conversion_fails(act_fn):
    model = make_model(act_fn, normalization_type="LN")
    converted = convert(model)
    with torch.no_grad():
        # a small slip in one coordinate (a uniform shift would vanish in LayerNorm)
        converted.blocks[1].mlp.b_out[0] += 1e-2
    verdicts = verify_conversion(model, converted, make_tokens())
    assert not any(v.passed for v in verdicts)
    assert all(v.max_abs_diff > v.tolerance for v in verdicts)


def test_an_explicit_tolerance_is_used():
    model = make_model("gelu_new")
    converted = convert(model)
    with torch.no_grad():
        converted.blocks[0].mlp.W_out[0, 0] += 1e-6  # a tiny slip
    loose = verify_conversion(model, converted, make_tokens(), tolerance=1.0)
    assert [v.tolerance for v in loose] == [1.0, 1.0] and all(v.passed for v in loose)
    default = verify_conversion(model, converted, make_tokens())
    assert not default[1].passed  # float64's default tolerance sees it


def test_refuses_an_unconverted_model():
    model = make_model("silu")
    with pytest.raises(TypeError, match="tl_attnonly.convert"):
        verify_conversion(model, model, make_tokens())


@pytest.mark.parametrize("zoo_name", ["llama", "reglu_ln"])
def test_gated_conversions_pass(zoo_name):
    from conftest import GATED_ZOO

    overrides = dict(GATED_ZOO[zoo_name])
    act_fn = overrides.pop("act_fn", "silu")
    model = make_model(act_fn, **overrides)
    verdicts = verify_conversion(model, convert(model), make_tokens())
    assert all(v.passed for v in verdicts), verdicts
