"""Options are validated before any work; overflow warnings fire exactly when outputs overflow."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import make_model, make_tokens

from tl_attnonly import ConversionOptions, convert
from tl_attnonly.activations import NeuronHeadCoefficients, head_coefficients
from tl_attnonly.literal import to_literal
from tl_attnonly.options import overflow_warning

warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")


@pytest.mark.parametrize("relu_k", [1e-30, 0.5, 0.0, -1.0, math.nan, math.inf, True, "100"])
@pytest.mark.parametrize("act_fn", ["relu", "gelu", "silu"])
def test_bad_relu_k_is_refused_whatever_the_activation(relu_k, act_fn):
    model = make_model(act_fn)
    with pytest.raises(ValueError, match="relu_k must be a finite number >= 1"):
        convert(model, relu_k=relu_k)
    with pytest.raises(ValueError, match="relu_k"):
        ConversionOptions(relu_k=relu_k)


def test_other_options_are_checked_when_made():
    with pytest.raises(ValueError, match="n_heads_per_neuron"):
        ConversionOptions(n_heads_per_neuron=0)
    with pytest.raises(ValueError, match="n_heads_per_neuron"):
        ConversionOptions(n_heads_per_neuron=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gelu_method"):
        ConversionOptions(gelu_method="tanh")
    assert ConversionOptions(relu_k=1.0).relu_k == 1.0


def test_large_relu_k_in_float16_does_not_warn_and_stays_finite():
    """Scores b x reach 2e5 > 65504: they saturate the sigmoid, and nothing else overflows."""
    tokens = make_tokens()
    model = make_model("relu", torch.float32)
    converted = convert(model, relu_k=1e4)
    expected = converted(tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        converted.to(torch.float16, print_details=False)
    for hooks in ([], [("blocks.0.mlp.hook_k", lambda k, hook: k.clone())]):
        logits = converted.run_with_hooks(tokens, fwd_hooks=hooks)
        assert torch.isfinite(logits).all()
        assert (logits.float() - expected).abs().max() < 0.1


def test_default_relu_k_with_huge_pre_activations_in_float16_stays_finite_with_hooks():
    """|pre| > 655 makes relu_k=100 scores inf; a hook on hook_k must not turn them into NaN."""
    tokens = make_tokens()
    model = make_model("relu", torch.float32)
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.W_in.mul_(300)
    converted = convert(model).to(torch.float16, print_details=False)
    _, cache = converted.run_with_cache(tokens, names_filter="blocks.0.mlp.hook_attn_scores")
    assert torch.isinf(cache["blocks.0.mlp.hook_attn_scores"]).any()
    plain = converted(tokens)
    for hook in (lambda k, hook: k.clone(), lambda k, hook: k * 1.0):
        hooked = converted.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.hook_k", hook)])
        assert torch.isfinite(hooked).all()
        assert torch.equal(hooked, plain)


def test_overflow_warning_fires_when_values_overflow():
    silu = head_coefficients("silu")
    assert overflow_warning(silu, torch.float16) is None
    big_values = NeuronHeadCoefficients("silu", "exact", (1.0,), (0.0,), (4e3,), (0.0,), (0.0,))
    assert "values reach 8e+04" in overflow_warning(big_values, torch.float16)
    assert overflow_warning(big_values, torch.float32) is None
    # the literal form's softmax turns an inf score into NaN: there scores count
    sharp = head_coefficients("relu", relu_k=1e4)
    assert overflow_warning(sharp, torch.float16) is None
    assert "scores/values" in overflow_warning(sharp, torch.float16, scores=True)


@pytest.mark.parametrize("omega", [0, -1.0, math.nan, math.inf, -math.inf, True, "1e4"])
def test_bad_omega_is_refused(omega):
    with pytest.raises(ValueError, match="omega must be"):
        to_literal(make_model(), omega=omega)


def test_huge_omega_builds_in_float64():
    model, tokens = make_model(), make_tokens()
    literal = to_literal(model, omega=1e300)
    torch.testing.assert_close(literal(tokens), model(tokens), rtol=0, atol=1e-9)


def test_literal_form_given_text_says_to_tokenise():
    literal = to_literal(make_model())
    with pytest.raises(TypeError, match="token ids.*to_tokens"):
        literal("def f(x):")
