"""The fused neuron-head path (no hooks) against the head path: one function, rounding apart."""

from __future__ import annotations

import pytest
import torch
from conftest import fused_magnitude, make_config, make_model, make_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from tl_attnonly import convert
from tl_attnonly.activations import head_coefficients
from tl_attnonly.components import GatedNeuronHeadMLP
from tl_attnonly.components.neuron_heads import FUSED_ERROR_ULPS, NeuronHeadMLP

COEFFICIENTS = {
    "silu": head_coefficients("silu"),
    "relu": head_coefficients("relu"),
    "relu_k3": head_coefficients("relu", relu_k=3.0),
    "paper": head_coefficients("gelu_new", gelu_method="paper"),
    **{f"gelu_K{k}": head_coefficients("gelu", n_heads=k) for k in range(1, 7)},
    **{f"gelu_new_K{k}": head_coefficients("gelu_new", n_heads=k) for k in range(1, 7)},
}


def _layer(name: str, dtype: torch.dtype, d_mlp: int) -> NeuronHeadMLP:
    coefficients = COEFFICIENTS[name]
    return NeuronHeadMLP(make_config(coefficients.activation, dtype, d_mlp=d_mlp), coefficients)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    name=st.sampled_from(sorted(COEFFICIENTS)),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    batch=st.integers(1, 3),
    pos=st.integers(1, 9),
    d_mlp=st.sampled_from([1, 2, 3, 5, 24, 257, 1031]),
    scale=st.sampled_from([0.01, 0.3, 1.0, 3.0, 10.0, 40.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_fused_path_is_the_head_path_to_a_measured_bound(
    name, dtype, batch, pos, d_mlp, scale, seed
):
    layer = _layer(name, dtype, d_mlp)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, pos, d_mlp, generator=g, dtype=torch.float64) * scale).to(dtype)
    with torch.no_grad():
        fused = layer._fused_post(x)
        head = layer._sum_heads(layer.derive_activation("z", hook_pre=x))
    bound = FUSED_ERROR_ULPS * torch.finfo(dtype).eps * fused_magnitude(layer.coefficients, x)
    excess = (fused - head).abs() - bound
    assert excess.max() <= 0, f"{(fused - head).abs().max()} exceeds the bound"


#: Gated layers need bias-token values summing to 0 (every built-in fit has them).
GATED_COEFFICIENTS = {name: c for name, c in COEFFICIENTS.items() if sum(c.g) == 0}


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    name=st.sampled_from(sorted(GATED_COEFFICIENTS)),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    batch=st.integers(1, 3),
    pos=st.integers(1, 9),
    d_mlp=st.sampled_from([1, 2, 3, 24, 257, 1031]),
    scale=st.sampled_from([0.01, 0.3, 1.0, 10.0, 40.0, 1e3]),
    u_scale=st.sampled_from([0.01, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
)
def test_gated_fused_path_is_the_head_path_to_the_same_bound(
    name, dtype, batch, pos, d_mlp, scale, u_scale, seed
):
    """Gated: ``|fused - head| <= FUSED_ERROR_ULPS eps |u| sum_k (|f_k g| + |e_k| + 2 |g_k|)``."""
    coefficients = GATED_COEFFICIENTS[name]
    cfg = make_config(coefficients.activation, dtype, d_mlp=d_mlp, gated_mlp=True)
    layer = GatedNeuronHeadMLP(cfg, coefficients)
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(batch, pos, d_mlp, generator=g, dtype=torch.float64) * scale).to(dtype)
    u = (torch.randn(batch, pos, d_mlp, generator=g, dtype=torch.float64) * u_scale).to(dtype)
    with torch.no_grad():
        fused = layer._fused_sum(gate, u)
        z = layer.derive_activation("z", hook_pre=gate, hook_pre_linear=u)
        head = layer._sum_heads(z)
    eps = torch.finfo(dtype).eps
    bound = FUSED_ERROR_ULPS * eps * u.abs() * fused_magnitude(coefficients, gate)
    excess = (fused - head).abs() - bound
    assert excess.max() <= 0, f"{(fused - head).abs().max()} exceeds the bound"
    gate.requires_grad_(True)  # autograd: the out-of-place pass, the same values
    torch.testing.assert_close(layer._fused_sum(gate, u).detach(), fused, rtol=0, atol=0)


def test_gated_fused_path_makes_no_per_head_tensor():
    """GeGLU at K = 4: no temporary of ``K * d_mlp`` elements per row for the whole input."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestOutput(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    LargestOutput.largest = max(LargestOutput.largest, t.numel())
            return out

    coefficients = head_coefficients("gelu_pytorch_tanh", n_heads=4)
    cfg = make_config("gelu_pytorch_tanh", torch.float32, d_mlp=512, gated_mlp=True)
    layer = GatedNeuronHeadMLP(cfg, coefficients)
    gate, u = torch.randn(2, 8, 64, 512).unbind(0)  # 512 rows: several chunks
    with torch.no_grad(), LargestOutput():
        layer._fused_sum(gate, u)
    # a per-head tensor would have 4 * gate.numel() elements
    assert LargestOutput.largest <= gate.numel(), LargestOutput.largest


def test_chunks_cover_every_row_once():
    """Inputs spanning several fused chunks, and a non-contiguous one, give the unchunked sum."""
    layer = _layer("gelu_K4", torch.float64, 300)
    x = torch.randn(5, 37, 300, dtype=torch.float64) * 3
    with torch.no_grad():
        chunked = layer._fused_post(x)
        strided = layer._fused_post(x.transpose(0, 1).contiguous().transpose(0, 1))
    x.requires_grad_(True)
    whole = layer._fused_post(x)  # autograd: one out-of-place pass, no chunks
    torch.testing.assert_close(chunked, whole.detach(), rtol=0, atol=1e-13)
    assert torch.equal(chunked, strided)
    expected = layer.coefficients.evaluate(x.detach())
    torch.testing.assert_close(chunked, expected, rtol=0, atol=1e-12)


def test_fused_path_keeps_gradients():
    model = make_model("gelu_new", torch.float64, normalization_type="LN")
    fused = convert(model)
    head = convert(model)
    head.set_use_neuron_result(False)
    for mlp in head.neuron_heads:
        mlp.fused = False
    tokens = make_tokens()
    loss_fused = fused(tokens, return_type="loss")
    loss_head = head(tokens, return_type="loss")
    loss_fused.backward()
    loss_head.backward()
    for (name, p_fused), p_head in zip(fused.named_parameters(), head.parameters()):
        torch.testing.assert_close(p_fused.grad, p_head.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_silu_forward_is_the_originals_bit_for_bit(dtype):
    """Exact SiLU heads use the original's own ``F.silu`` when nothing is hooked."""
    model = make_model("silu", dtype, normalization_type="LN")
    converted = convert(model)
    for batch, pos in [(1, 1), (1, 5), (2, 10), (3, 7)]:
        tokens = make_tokens(batch, pos, seed=batch * pos)
        assert torch.equal(converted(tokens), model(tokens))
