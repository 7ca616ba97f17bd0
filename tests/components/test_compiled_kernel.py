"""The compiled fused kernel (``ConversionOptions(compiled=True)``): the head path to the fused
path's bound, used where it can be built, and the eager path with one warning where it cannot."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from conftest import fused_magnitude, make_config, make_model, make_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from tl_attnonly import ConversionOptions, convert
from tl_attnonly.activations import head_coefficients
from tl_attnonly.components import GatedNeuronHeadMLP, NeuronHeadMLP, _fused_kernel
from tl_attnonly.components.neuron_heads import FUSED_ERROR_ULPS

#: A few coefficient sets (each compiles its own kernel): fitted GELU at K = 4 and 6, tanh GELU
#: at K = 2, one-head ReLU (b != 1), the paper's one-head GELU; with bias-token values or not.
COEFFICIENTS = {
    "gelu_new_K4": head_coefficients("gelu_new", n_heads=4),
    "gelu_K6": head_coefficients("gelu", n_heads=6),
    "gelu_pytorch_tanh_K2": head_coefficients("gelu_pytorch_tanh", n_heads=2),
    "relu": head_coefficients("relu"),
    "paper": head_coefficients("gelu_new", gelu_method="paper"),
}


def _compile_error() -> str | None:
    """Why ``torch.compile`` cannot build a CPU kernel here (``None``: it can)."""
    if shutil.which("g++") is None and shutil.which("clang++") is None:
        return "no C++ compiler"
    try:
        torch.compile(lambda x: torch.sigmoid(2.0 * x) * x)(torch.randn(3))
    except Exception as error:  # the package falls back the same way (tested below)
        return f"{type(error).__name__}: {error}"
    return None


_COMPILE_ERROR = _compile_error()
needs_compiler = pytest.mark.skipif(
    _COMPILE_ERROR is not None,
    reason=f"torch.compile cannot build a CPU kernel here ({_COMPILE_ERROR})",
)


def _no_fallback(fn):
    """Run ``fn`` with warnings recorded; fail if the compiled kernel fell back to eager."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    fallbacks = [w for w in caught if "torch.compile could not build" in str(w.message)]
    assert not fallbacks, fallbacks[0].message
    assert "cpu" not in _fused_kernel._FAILED
    return out


@needs_compiler
@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    name=st.sampled_from(sorted(COEFFICIENTS)),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    gated=st.booleans(),
    batch=st.integers(1, 3),
    pos=st.integers(1, 9),
    d_mlp=st.sampled_from([1, 3, 24, 257, 1031]),
    scale=st.sampled_from([0.01, 1.0, 10.0, 40.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_compiled_path_is_the_head_path_to_the_fused_bound(
    name, dtype, gated, batch, pos, d_mlp, scale, seed
):
    coefficients = COEFFICIENTS[name]
    cfg = make_config(coefficients.activation, dtype, d_mlp=d_mlp, gated_mlp=gated)
    layer = (GatedNeuronHeadMLP if gated else NeuronHeadMLP)(cfg, coefficients)
    layer.compiled = True
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, pos, d_mlp, generator=g, dtype=torch.float64) * scale).to(dtype)
    u = torch.randn(batch, pos, d_mlp, generator=g, dtype=torch.float64).to(dtype)
    inputs = {"hook_pre": x, "hook_pre_linear": u} if gated else {"hook_pre": x}
    with torch.no_grad():
        if gated:
            compiled = _no_fallback(lambda: layer._fused_sum(x, u))
        else:
            compiled = _no_fallback(lambda: layer._fused_post(x))
        head = layer._sum_heads(layer.derive_activation("z", **inputs))
    bound = FUSED_ERROR_ULPS * torch.finfo(dtype).eps * fused_magnitude(coefficients, x)
    if gated:
        bound = bound * u.abs()
    assert compiled.dtype == dtype and compiled.shape == x.shape
    excess = (compiled - head).abs() - bound
    assert excess.max() <= 0, f"{(compiled - head).abs().max()} exceeds the bound"


def _fails_on_first_call(fn, *args, **kwargs):
    def kernel(*inputs):
        raise RuntimeError("no C++ compiler here\nsecond line")

    return kernel


def _refuses_at_once(fn, *args, **kwargs):
    raise RuntimeError("no C++ compiler here: torch.compile is not supported on this platform")


@pytest.mark.parametrize("compile_", [_fails_on_first_call, _refuses_at_once])
def test_a_kernel_that_cannot_be_built_warns_once_and_the_eager_path_runs(monkeypatch, compile_):
    monkeypatch.setattr(torch, "compile", compile_)
    monkeypatch.setattr(_fused_kernel, "_KERNELS", {})
    monkeypatch.setattr(_fused_kernel, "_FAILED", set())
    layer = NeuronHeadMLP(make_config("gelu_new", torch.float64, d_mlp=40))
    x = torch.randn(2, 5, 40, dtype=torch.float64) * 3
    with torch.no_grad():
        eager = layer._fused_post(x)
        layer.compiled = True
        with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler here") as caught:
            first = layer._fused_post(x)
        assert len(caught) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no second warning, no second try
            second = layer._fused_post(x)
    assert torch.equal(first, eager) and torch.equal(second, eager)
    assert _fused_kernel._FAILED == {"cpu"}


@needs_compiler
@pytest.mark.parametrize(
    "act_fn, overrides",
    [
        ("gelu_new", dict(normalization_type="LN")),
        ("gelu_pytorch_tanh", dict(normalization_type="RMS", gated_mlp=True)),
    ],
    ids=["gelu_new_K4", "geglu_K4"],
)
def test_compiled_model_is_the_eager_fused_model_and_hooks_still_see_heads(act_fn, overrides):
    """``ConversionOptions(compiled=True)``: the same logits as the eager fused model (fp64,
    1e-12), gradients through the eager path, and a hooked run still goes through the heads."""
    model = make_model(act_fn, torch.float64, **overrides)
    eager = convert(model)
    compiled = convert(model, conversion=ConversionOptions(compiled=True))
    assert all(mlp.compiled for mlp in compiled.neuron_heads)
    assert not any(mlp.compiled for mlp in eager.neuron_heads)
    tokens = make_tokens()
    with torch.no_grad():
        expected = eager(tokens)
        got = _no_fallback(lambda: compiled(tokens))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    loss = compiled(tokens, return_type="loss")  # autograd: the eager path
    loss.backward()
    assert compiled.blocks[0].mlp.W_in.grad is not None
    _, cache = compiled.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    assert cache["blocks.0.mlp.hook_pattern"].shape[-1] == 2


def test_compiled_option_is_checked_and_saved():
    with pytest.raises(ValueError, match="compiled must be True or False"):
        ConversionOptions(compiled="yes")  # type: ignore[arg-type]
    options = ConversionOptions().with_overrides(compiled=True)
    assert options.compiled and ConversionOptions.from_dict(options.to_dict()) == options
    assert not ConversionOptions.from_dict({"fused": True}).compiled  # saves before the option


def test_moe_layer_sets_compiled_on_every_expert():
    moe = dict(normalization_type="RMS", gated_mlp=True, num_experts=4, experts_per_token=2)
    converted = convert(
        make_model("gelu_new", torch.float64, **moe), conversion=ConversionOptions(compiled=True)
    )
    layer = converted.blocks[0].mlp
    assert layer.compiled and all(expert.compiled for expert in layer.expert_list())
    layer.compiled = False
    assert not any(expert.compiled for expert in layer.expert_list())
