"""The literal form of gated MLPs: product heads, activation heads, whole models, hooks."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import GATED_ZOO, make_model, make_tokens

from tl_attnonly import convert
from tl_attnonly.activations import head_coefficients
from tl_attnonly.literal import to_literal
from tl_attnonly.literal.error_tables import gated_literal_error_table
from tl_attnonly.literal.gated import (
    default_product_eps,
    product_error_bound,
    product_error_table,
    product_through_heads,
    rounding_error_estimate,
)

MAX_LEN = 10


def gated(name: str, dtype: torch.dtype = torch.float64, **extra) -> torch.nn.Module:
    overrides = {**GATED_ZOO[name], **extra}
    act_fn = overrides.pop("act_fn", "silu")
    return make_model(act_fn, dtype, 0, **overrides)


def test_product_heads_stay_within_the_stated_bound():
    table = product_error_table(n_samples=4001)
    assert set(table["dtype"]) == {"float64", "float32"} and table["default"].sum() == 4
    bound = table["truncation_bound"] + table["rounding_estimate"]
    assert (table["max_abs_err"] <= bound).all(), table[table["max_abs_err"] > bound]
    auto64 = table[(table["dtype"] == "float64") & table["default"]]
    assert (auto64["max_abs_err"] < 2e-8).all()  # |g u| <= 20 and <= 200
    # truncation dominates for large eps, rounding for small: the error is not monotone in eps
    f64 = table[(table["dtype"] == "float64") & (table["product_range"] == 20.0)]
    best = f64.loc[f64["max_abs_err"].idxmin(), "eps"]
    assert f64["eps"].min() < best < f64["eps"].max()


def test_product_heads_are_odd_and_never_overshoot_in_float64():
    p = torch.linspace(-50, 50, 1001, dtype=torch.float64)
    g = torch.full_like(p, 2.0)
    out = product_through_heads(g, p / 2, 1e-3, torch.float64)
    torch.testing.assert_close(out, -out.flip(0), rtol=0, atol=1e-12)
    assert (out.abs() <= p.abs() + 1e-12).all()  # (2/eps) tanh(eps p / 2) shrinks towards 0
    assert ((p - out).abs() <= product_error_bound(1e-3, 50) + 1e-12).all()


def test_eps_is_chosen_per_dtype_and_a_poor_one_warns():
    e64, e32 = default_product_eps(torch.float64), default_product_eps(torch.float32)
    assert e64 < e32 and default_product_eps(torch.float64, 10.0) == pytest.approx(10 * e64)
    assert rounding_error_estimate(e64, torch.float64) < 1e-8
    model = gated("llama")
    with pytest.warns(UserWarning, match="product_eps=0.01"):
        to_literal(model, layout="split", max_len=MAX_LEN, product_eps=1e-2)
    with pytest.raises(ValueError, match="positive"):
        to_literal(model, layout="split", max_len=MAX_LEN, product_eps=0.0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "phi3"])
@pytest.mark.parametrize("mask", ["omega", "ordinary"])
def test_swiglu_whole_model_float64_within_1e_6(name, mask):
    model = gated(name)
    tokens = make_tokens(pos=MAX_LEN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the automatic eps and the default omega: no warning
        literal = to_literal(model, layout="split", mask=mask, max_len=MAX_LEN)
    assert literal.summary()["sublayers_per_layer"] == 5
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
        ours, ours_cache = literal.run_with_cache(tokens)
    assert (ours - logits).abs().max() < 1e-6
    for layer in range(model.cfg.n_layers):
        for hook in ("hook_pre", "hook_pre_linear", "hook_post"):
            name_ = f"blocks.{layer}.mlp.{hook}"
            assert (ours_cache[name_] - cache[name_]).abs().max() < 1e-6, name_
        resid = ours_cache[f"blocks.{layer}.hook_resid_post"]
        assert (resid[..., model.cfg.d_model : literal.layout.pos_start] == 0).all()


def test_swiglu_float32_is_approximate_with_a_measured_bound():
    model = gated("llama")
    tokens = make_tokens(pos=MAX_LEN)
    literal = to_literal(model, layout="split", max_len=MAX_LEN, dtype=torch.float32)
    with torch.no_grad():
        err = (literal(tokens).double() - model(tokens)).abs().max()
    assert 1e-6 < err < 2e-3  # measured 2.3e-4; float32 rounding alone gives 6.8e-7


def test_geglu_and_reglu_carry_the_activation_fit_error():
    tokens = make_tokens(pos=MAX_LEN)
    for model, limit in ((gated("llama", act_fn="gelu"), 1e-3), (gated("reglu_ln"), 2e-2)):
        literal = to_literal(model, layout="split", max_len=MAX_LEN)
        structured = convert(model)
        with torch.no_grad():
            ref, ours, theirs = model(tokens), literal(tokens), structured(tokens)
        assert (ours - ref).abs().max() < limit
        # the literal form adds only the product error to the structured form's fit error
        assert (ours - theirs).abs().max() < 1e-6


def test_convert_literal_accepts_gated_in_split_layout():
    model = gated("llama")
    literal = convert(model, form="literal", layout="split", max_len=MAX_LEN)
    tokens = make_tokens(pos=MAX_LEN)
    with torch.no_grad():
        assert (literal(tokens) - model(tokens)).abs().max() < 1e-6


def test_hook_edits_mean_what_they_mean_in_transformer_lens():
    model = gated("llama")
    literal = to_literal(model, layout="split", max_len=MAX_LEN)
    tokens = make_tokens(pos=MAX_LEN)
    b_in = model.blocks[0].mlp.b_in.detach()

    def gate_off(post, hook):  # neurons 3..7 output only TL's b_in
        post = post.clone()
        post[..., 3:8] = b_in[3:8]
        return post

    with torch.no_grad():
        expected = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.hook_post", gate_off)])
        ours = literal.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.hook_post", gate_off)])
    assert (ours - expected).abs().max() < 1e-6
    assert (expected - model(tokens)).abs().max() > 1e-3  # the edit did something

    for hook in ("hook_pre", "hook_pre_linear"):
        with pytest.raises(NotImplementedError, match="hook_resid_hidden"):
            literal.run_with_hooks(
                tokens, fwd_hooks=[(f"blocks.0.mlp.{hook}", lambda x, hook: x * 2)]
            )


def test_refusals_name_the_option():
    with pytest.raises(NotImplementedError, match="layout='split'"):
        to_literal(gated("llama"), max_len=MAX_LEN)
    coefficients = head_coefficients("silu", 1)
    moe = make_model("silu", num_experts=2, experts_per_token=1, gated_mlp=True)
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        to_literal(moe, layout="split", coefficients=coefficients, max_len=MAX_LEN)
    bad = head_coefficients("gelu", 2)
    bad = type(bad)(bad.activation, bad.method, bad.b, bad.d, bad.f, bad.e, (0.5, 0.0))
    with pytest.raises(NotImplementedError, match="sum_k g_k"):
        to_literal(gated("llama", act_fn="gelu"), layout="split", coefficients=bad, max_len=4)


def test_whole_model_error_table_over_eps_and_dtype():
    table = gated_literal_error_table(
        gated("llama"), make_tokens(pos=6), eps_values=(1e-3, None), max_len=6
    )
    assert list(table["dtype"]) == ["float64", "float64", "float32", "float32"]
    auto64 = table[(table["dtype"] == "float64") & table["auto"]].iloc[0]
    coarse64 = table[(table["dtype"] == "float64") & ~table["auto"]].iloc[0]
    assert auto64["max_abs_err"] < 1e-6 < coarse64["max_abs_err"]
    assert (table["max_abs_err"] >= table["baseline_max_abs_err"]).all()
