"""Fuzz: random configs x random run_with_cache arguments, converted vs original.

Each example draws a TransformerLens config (decoder or encoder; normalisation, positions,
parallel attention, GQA, attention direction, gated MLP, mixture of experts, attention results,
split inputs, depth, widths, dtype; SiLU, whose neuron-heads are exact) and one value of every
``run_with_cache`` argument of :mod:`test_cache_contract`, and checks that module's contract
(:func:`test_cache_contract.check_case`): the original's keys and values, derived entries equal to
stored ones, TransformerLens's refusals raised alike.

Default run: a few dozen examples (slow-marked). The long run::

    TL_ATTNONLY_CACHE_FUZZ_EXAMPLES=1500 pytest -m slow tests/test_cache_fuzz.py

What it found became the regression tests at the end of this file, each named for its finding.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from conftest import make_model
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_cache_contract import DIMENSIONS, allowed, check_case, make_encoder_from, word_tokenizer

from tl_attnonly import ConversionOptions, convert

#: Examples per run: a few dozen by default; the long run sets the variable (module docstring).
MAX_EXAMPLES = int(os.environ.get("TL_ATTNONLY_CACHE_FUZZ_EXAMPLES", "40"))

pytestmark = pytest.mark.filterwarnings("ignore:HookedEncoder is deprecated:DeprecationWarning")


@st.composite
def configs(draw) -> dict:
    """``make_config`` overrides of a decoder or an encoder (``"encoder": True``)."""
    encoder = draw(st.booleans()) if draw(st.integers(0, 3)) == 0 else False
    n_heads = draw(st.sampled_from([1, 2, 4]))
    cfg: dict = dict(
        n_layers=draw(st.integers(1, 3)),
        d_model=draw(st.sampled_from([8, 16])),
        n_heads=n_heads,
        d_head=draw(st.sampled_from([4, 8])),
        d_mlp=draw(st.sampled_from([4, 12, 24])),
        dtype=draw(st.sampled_from([torch.float64, torch.float32])),
    )
    if encoder:
        return dict(cfg, encoder=True)
    cfg["normalization_type"] = draw(st.sampled_from(["LN", "LNPre", "RMS", "RMSPre", None]))
    if draw(st.booleans()):
        cfg.update(positional_embedding_type="rotary", rotary_dim=4)
    kind = draw(st.sampled_from(["plain", "gated", "moe"]))
    if kind == "gated":
        cfg["gated_mlp"] = True
    elif kind == "moe":
        cfg.update(num_experts=draw(st.sampled_from([2, 3])), experts_per_token=1)
        cfg["dtype"] = torch.float32  # TL's router stays float32 (see test_cache_contract)
    else:
        cfg["parallel_attn_mlp"] = draw(st.booleans())
    if n_heads > 1 and draw(st.booleans()):
        cfg["n_key_value_heads"] = n_heads // 2
    cfg["attention_dir"] = draw(st.sampled_from(["causal", "bidirectional"]))
    cfg["use_attn_result"] = draw(st.booleans())
    cfg["use_hook_mlp_in"] = draw(st.booleans())
    cfg["use_split_qkv_input"] = draw(st.booleans())
    cfg["kind"] = kind
    return cfg


@st.composite
def cases(draw, kind: str, dtype: torch.dtype) -> dict:
    """One value of every run_with_cache argument, TransformerLens allowing the combination."""
    case = dict(model=kind, dtype="fp64" if dtype == torch.float64 else "fp32")
    for name, values in DIMENSIONS.items():
        if name not in case:  # a value allowed with those drawn so far
            choices = [v for v in values if allowed({**case, name: v})]
            assume(choices)
            case[name] = draw(st.sampled_from(choices))
    assert allowed(case)
    return case


def build(cfg: dict):
    cfg = dict(cfg)
    fused = cfg.pop("fused", True)
    if cfg.pop("encoder", False):
        original = make_encoder_from(cfg)
    else:
        cfg.pop("kind")
        original = make_model("silu", **cfg)
        original.set_tokenizer(word_tokenizer())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = convert(original, conversion=ConversionOptions(fused=fused))
    return original, converted


@pytest.mark.slow
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_configs_and_run_with_cache_arguments(data):
    cfg = data.draw(configs(), label="config")
    kind = "encoder" if cfg.get("encoder") else cfg["kind"]
    case = data.draw(cases(kind, cfg["dtype"]), label="case")
    cfg["fused"] = case["fused"]
    original, converted = build(cfg)
    check_case(case, original, converted)


# ---------------------------------------------------------------------------- regression tests
# What the sweeps found (test_cache_contract's pairwise cases and this fuzz), one test each, on
# the smallest model that shows it. Each failed before the fix in tl_attnonly/derived_cache.py.
def _pair(n_layers: int = 3):
    original = make_model("silu", torch.float64, n_layers=n_layers, normalization_type="LN")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return original, convert(original)


def _tokens(batch: int = 2):
    return torch.randint(0, 50, (batch, 6), generator=torch.Generator().manual_seed(0))


def _assert_matches(original_cache, converted_cache):
    neuron_only = [k for k in converted_cache.keys() if k not in original_cache.keys()]
    assert all(".mlp.hook_" in k and k.split(".")[-1] in NEURON_HOOKS for k in neuron_only)
    for name in original_cache.keys():
        torch.testing.assert_close(
            converted_cache[name], original_cache[name], rtol=1e-9, atol=1e-9
        )


NEURON_HOOKS = ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z")


def test_start_at_layer_residual_input_raised_stop_iteration():
    original, converted = _pair()
    residual = original(_tokens(), stop_at_layer=1)
    _, expected = original.run_with_cache(residual, start_at_layer=1)
    _, cache = converted.run_with_cache(residual, start_at_layer=1)
    _assert_matches(expected, cache)
    assert "blocks.0.mlp.hook_pattern" not in cache.keys()  # layer 0 did not run
    assert "blocks.1.mlp.hook_pattern" in cache.keys()


def test_start_at_final_layer_raised_stop_iteration():
    original, converted = _pair()
    residual = original(_tokens(), stop_at_layer=3)
    _, expected = original.run_with_cache(residual, start_at_layer=3)
    _, cache = converted.run_with_cache(residual, start_at_layer=3)
    assert list(cache.keys()) == list(expected.keys())  # no layer ran: no neuron-head entries


def test_stop_at_layer_0_raised_stop_iteration():
    original, converted = _pair()
    _, expected = original.run_with_cache(_tokens(), stop_at_layer=0)
    _, cache = converted.run_with_cache(_tokens(), stop_at_layer=0)
    assert list(cache.keys()) == list(expected.keys())


def test_stop_at_layer_listed_neuron_heads_of_layers_that_never_ran():
    original, converted = _pair()
    _, expected = original.run_with_cache(_tokens(), stop_at_layer=1)
    _, cache = converted.run_with_cache(_tokens(), stop_at_layer=1)
    _assert_matches(expected, cache)
    assert not [k for k in cache.keys() if not k.startswith(("blocks.0.", "hook_"))]
    for name in cache.keys():  # every listed entry can be read
        cache[name]


def test_reset_hooks_end_false_returned_a_copy_that_later_runs_did_not_fill():
    original, converted = _pair()
    first, second = _tokens(), _tokens() + 1
    caches = []
    try:
        for model in (original, converted):
            _, cache = model.run_with_cache(first, reset_hooks_end=False)
            model(second)  # TL: the caching hooks are still attached and overwrite the cache
            caches.append(cache)
    finally:
        original.reset_hooks()
        converted.reset_hooks()
    _assert_matches(*caches)
    _, fresh = original.run_with_cache(second)
    name = "blocks.1.hook_resid_post"
    torch.testing.assert_close(caches[1][name], fresh[name])


def test_names_filter_tuple_was_accepted_where_transformer_lens_refuses_it():
    original, converted = _pair(1)
    for model in (original, converted):
        with pytest.raises(ValueError, match="names_filter must be"):
            model.run_with_cache(_tokens(), names_filter=("hook_embed",))
        model.reset_hooks()


def test_remove_batch_dim_refusal_raised_value_error_not_assertion_error():
    """TL's test_remove_batch_dim_fails_if_batch_gt_1 expects AssertionError."""
    for model in _pair(1):
        _, cache = model.run_with_cache(_tokens(batch=2))
        with pytest.raises(AssertionError):
            cache.remove_batch_dim()


def test_moe_pos_slice_on_an_expert_with_no_tokens_fails_in_transformer_lens_and_alike():
    """Found by the fuzz: pos_slice on a mixture-of-experts expert that no token was routed to
    raises IndexError in TransformerLens's caching hook. The original does so on its expert
    hooks (``experts.e.hook_pre``: [routed tokens, d_mlp]), the converted model on the experts'
    neuron-head hooks too (routed tokens where positions are): the same rule, the same error, so
    the contract test leaves MoE x pos_slice out."""
    original = make_model(
        "silu", torch.float32, normalization_type="LN", num_experts=2, experts_per_token=1
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = convert(original)
    one_token = _tokens(batch=1)[:, :1]  # one token: one of the two experts gets none
    for model, kind in ((original, "hook_pre"), (converted, "hook_pre"), (converted, "hook_z")):
        with pytest.raises(IndexError):
            model.run_with_cache(
                one_token, names_filter=lambda n, k=kind: ".experts." in n and n.endswith(k),
                pos_slice=-1,
            )
        model.reset_hooks()
    # without pos_slice, both models cache the empty expert's entries
    _, cache = converted.run_with_cache(one_token, names_filter=lambda n: ".experts." in n)
    assert any(cache[name].numel() == 0 for name in cache.keys())
