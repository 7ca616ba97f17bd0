"""TransformerBridge zoo: every architecture builds offline, runs, and converts exactly, within the
activation's bound, or is refused with a clear error (see ``zoo.py`` for the models)."""

from __future__ import annotations

import pytest
import torch
from zoo import (
    REFUSALS,
    ZOO,
    bridge_convert_available,
    build_bridge,
    build_hf_model,
    convert_zoo_bridge,
    dtype_params,
    tokens,
)

ALL = list(ZOO)
WORKING = [name for name in ZOO if not ZOO[name].broken]
BROKEN = [name for name in ZOO if ZOO[name].broken]
DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize(("name", "dtype"), dtype_params(WORKING))
def test_unconverted_bridge_matches_hf_model(name, dtype):
    """The bridge's logits are the wrapped HF model's, and its hooks fire."""
    bridge = build_bridge(name, dtype)
    toks = tokens()
    with torch.no_grad():
        hf_logits = bridge.original_model(toks).logits
        logits, cache = bridge.run_with_cache(toks)
    assert logits.dtype == dtype
    assert logits.shape == (*toks.shape, ZOO[name].kwargs.get("vocab_size", 128))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(logits, hf_logits, rtol=0, atol=tol)
    for layer in range(bridge.cfg.n_layers):
        assert any(key.startswith(f"blocks.{layer}.mlp.") for key in cache.keys())
    # The random draw must put MLP inputs off the nearly linear region around 0.
    assert logits.std() > 0.1


@pytest.mark.parametrize("name", BROKEN)
def test_broken_bridges_still_fail(name):
    """Architectures recorded as broken in TransformerLens itself: when TL fixes one, this fails
    and the zoo entry's ``broken`` note must be removed."""
    bridge = build_bridge(name)
    with pytest.raises(Exception):  # noqa: B017 - any failure of TL's own bridge
        bridge(tokens())


# --- conversion -----------------------------------------------------------------------------

needs_convert = pytest.mark.skipif(
    not bridge_convert_available(), reason="this tl_attnonly has no TransformerBridge conversion"
)

#: What the conversion must do with each zoo model: "exact", "approximate", or a substring of
#: the refusal's message. Derived from the MLP kind and the activation; the overrides are the
#: bridge components with no neuron-head form (yet).
_REFUSED_COMPONENTS: dict[str, str] = {}


def expected(name: str) -> str:
    spec = ZOO[name]
    if name in _REFUSED_COMPONENTS:
        return _REFUSED_COMPONENTS[name]
    if spec.act in ("relu2", "xielu"):
        return {"relu2": "ReLUSquared", "xielu": "XIELU"}[spec.act]
    return "exact" if spec.act == "silu" else "approximate"


CONVERTIBLE = [n for n in WORKING if expected(n) in ("exact", "approximate")]
REFUSED = [n for n in WORKING if n not in CONVERTIBLE]

#: Logit tolerance of exact (SiLU) conversion.
EXACT_TOL = {torch.float32: 1e-4, torch.float64: 1e-10}
#: Rounding slack per neuron of the head path (fp32 / fp64).
SLACK = {torch.float32: 1e-5, torch.float64: 1e-12}
#: Approximate conversion: max |dlogit| <= LOGIT_FACTOR * the heads' max activation error (the
#: convention of tests/test_convert.py; measured factors are 1.6-50 on this zoo, see
#: docs/bridge_zoo.md).
LOGIT_FACTOR = 100
#: ReLU zoo models (OPT) at the default relu_k (1e6, activation error 2.8e-7): max |dlogit|
#: (measured 0 in fp64 and fp32; 9.1e-3 at relu_k = 100).
RELU_LOGIT_TOL = 1e-5
RELU = [n for n in CONVERTIBLE if ZOO[n].act == "relu"]
#: What the head-path test converts ReLU with: at the default relu_k the error is 0 on the zoo's
#: inputs, which would leave the bound unprobed, so it is probed at the earlier default, 100.
RELU_PROBE = {"relu_k": 100.0}


@needs_convert
@pytest.mark.parametrize(("name", "dtype"), dtype_params(CONVERTIBLE))
def test_converted_bridge_matches_unconverted(name, dtype):
    """Head path (``fused=False``: every neuron's heads are evaluated): the logits, and layer 0's
    ``hook_post`` per neuron (same input in both), within the activation's bound."""
    bridge = build_bridge(name, dtype)
    toks = tokens()
    with torch.no_grad():
        reference, cache = bridge.run_with_cache(toks)
    probe = RELU_PROBE if name in RELU else {}
    converted = convert_zoo_bridge(bridge, fused=False, **probe)
    with torch.no_grad():
        logits, conv_cache = converted.run_with_cache(toks)
    # (a mixture of experts: blocks.0.mlp.experts.{e}.hook_pattern, see test_moe_bridge.py)
    assert any(
        k.startswith("blocks.0.mlp.") and k.endswith("hook_pattern") for k in conv_cache.keys()
    ), "the MLPs must run as neuron-heads"
    dlogit = (logits - reference).abs().max().item()
    post_err = (conv_cache["blocks.0.mlp.hook_post"] - cache["blocks.0.mlp.hook_post"]).abs()
    if expected(name) == "exact":
        assert dlogit <= EXACT_TOL[dtype], dlogit
        assert post_err.max().item() <= EXACT_TOL[dtype]
        return
    from tl_attnonly.bridge import neuron_head_layers

    layer = neuron_head_layers(converted)[0]
    # (plus the activation's distance from the one the heads fit: BLOOM's GELU, 2.5e-10)
    act_error = layer.coefficients.max_abs_error() + getattr(layer, "activation_deviation", 0)
    assert act_error > 0
    pre = cache["blocks.0.mlp.hook_pre"]
    assert pre.abs().max() < 20, "test inputs must stay in the fitted range"
    u = cache.cache_dict.get("blocks.0.mlp.hook_pre_linear")
    scale = u.abs() if u is not None and ZOO[name].mlp == "gated" else torch.ones_like(post_err)
    assert bool((post_err <= act_error * scale + SLACK[dtype] * (1 + scale)).all()), (
        f"layer 0 hook_post off by {post_err.max().item():.3g}, bound {act_error:.3g} x |u|"
    )
    assert post_err.max().item() >= act_error / 50, "inputs must probe the approximation"
    assert dlogit <= LOGIT_FACTOR * act_error, (dlogit, act_error)


@needs_convert
@pytest.mark.parametrize("name", CONVERTIBLE)
def test_default_conversion_fused_path(name):
    """Default options (fused path) in fp64: SiLU bit-identical logits; the rest within bound."""
    dtype = torch.float32 if ZOO[name].no_fp64 else torch.float64
    bridge = build_bridge(name, dtype)
    toks = tokens()
    with torch.no_grad():
        reference = bridge(toks)
        logits = convert_zoo_bridge(bridge)(toks)
    if expected(name) == "exact":
        assert torch.equal(logits, reference)
    else:
        from tl_attnonly.bridge import neuron_head_layers

        act_error = neuron_head_layers(bridge)[0].coefficients.max_abs_error()
        assert (logits - reference).abs().max().item() <= LOGIT_FACTOR * act_error


@needs_convert
@pytest.mark.parametrize(("name", "dtype"), dtype_params(RELU))
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "heads"])
def test_relu_at_the_default_relu_k_is_exact_to_rounding(name, dtype, fused):
    """ReLU at the default relu_k (1e6): logits within 1e-5 of the unconverted bridge."""
    from tl_attnonly.activations import DEFAULT_RELU_K
    from tl_attnonly.bridge import neuron_head_layers

    bridge = build_bridge(name, dtype)
    toks = tokens()
    with torch.no_grad():
        reference = bridge(toks)
        logits = convert_zoo_bridge(bridge, fused=fused)(toks)
    assert neuron_head_layers(bridge)[0].coefficients.relu_k == DEFAULT_RELU_K
    assert (logits - reference).abs().max().item() <= RELU_LOGIT_TOL


@needs_convert
@pytest.mark.parametrize("name", REFUSED)
def test_refusal_is_clear_and_changes_nothing(name):
    """A model that cannot be converted is refused before anything changes, with an error that
    names what is unsupported."""
    bridge = build_bridge(name)
    toks = tokens()
    with torch.no_grad():
        reference = bridge(toks)
    with pytest.raises(REFUSALS) as info:
        convert_zoo_bridge(bridge)
    message = str(info.value)
    assert expected(name) in message, message
    assert "blocks." in message, "the error must name the layer"
    assert "Supported" in message or "supported" in message, "the error must say what works"
    with torch.no_grad():
        assert torch.equal(bridge(toks), reference)
    assert not any("hook_pattern" in key for key in bridge.hook_dict if ".mlp." in key)


@needs_convert
def test_twice_bridged_model_is_refused_naming_the_layer():
    """Bridging one HF model twice is legal (both bridges reproduce its logits) but nests
    ``LinearBridge`` in ``LinearBridge``; converting either is refused, and the refusal must
    name the layer like every other refusal (it did not: "The MLP's gate projection is a
    LinearBridge; ..." with no ``blocks.{l}.mlp``)."""
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    model, config = build_hf_model("llama", torch.float64)
    with torch.no_grad():
        reference = model(tokens()).logits
    first = build_bridge_from_module(model, "LlamaForCausalLM", hf_config=config)
    second = build_bridge_from_module(model, "LlamaForCausalLM", hf_config=config)
    with torch.no_grad():
        assert torch.equal(second(tokens()), reference)
        assert torch.equal(first(tokens()), reference)
    for bridge in (second, first):
        with pytest.raises(REFUSALS) as info:
            convert_zoo_bridge(bridge)
        assert "blocks.0.mlp" in str(info.value), str(info.value)
