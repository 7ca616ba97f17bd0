"""An optional compiled kernel for the fused neuron-head activation (``torch.compile``).

The K heads of a neuron evaluate one fixed scalar function of the pre-activation,
``sum_k (f_k x + e_k - g_k) sigmoid(b_k x + d_k) + sum_k g_k``. Eager PyTorch evaluates it as a
handful of passes over ``K`` times the input (in cache-sized chunks, see
:meth:`~tl_attnonly.components.neuron_head_base.NeuronHeadBase._fused_activation`); a compiled
kernel reads each pre-activation once, keeps the K terms in registers and writes the sum once.

Compilation needs what ``torch.compile``'s default backend (inductor) needs: a C++ compiler on
the CPU, Triton on a GPU. Nothing here is required: where the kernel cannot be built, the caller
warns once and uses the eager path, which computes the same function to the same bound.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from tl_attnonly.activations import NeuronHeadCoefficients

__all__ = ["compiled_kernel", "kernel_failed"]

#: Compiled kernels by (coefficients, gated).
_KERNELS: dict[tuple[NeuronHeadCoefficients, bool], Callable[..., torch.Tensor]] = {}
#: Device types on which compilation failed (the eager path is used there from then on).
_FAILED: set[str] = set()


def _terms(c: NeuronHeadCoefficients) -> tuple[tuple[float, float, float, float], ...]:
    """``(b_k, d_k, f_k, e_k - g_k)`` per head, as Python floats (constants of the kernel).

    A slope beyond float16 (the default ``relu_k = 1e6``) stays as it is: inductor computes
    float16 pointwise code in float32, where ``1e6 * 0 = 0`` (the eager path, which computes in
    float16, holds it at 65504 instead: :func:`~tl_attnonly.activations.representable_slopes`).
    """
    return tuple(
        (float(b), float(d), float(f), float(e) - float(g))
        for b, d, f, e, g in zip(c.b, c.d, c.f, c.e, c.g)
    )


def _build(c: NeuronHeadCoefficients, gated: bool) -> Callable[..., torch.Tensor]:
    terms = _terms(c)
    g_sum = float(sum(c.g))

    def activation(x: torch.Tensor) -> torch.Tensor:
        out = None
        for b, d, f, ce in terms:
            term = (f * x + ce) * torch.sigmoid(b * x + d)
            out = term if out is None else out + term
        assert out is not None
        return out + g_sum if g_sum != 0 else out

    def gated_activation(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return activation(x) * u

    return torch.compile(gated_activation if gated else activation)


def compiled_kernel(
    coefficients: NeuronHeadCoefficients, device: torch.device, gated: bool = False
) -> Callable[..., torch.Tensor] | None:
    """The compiled fused activation for ``coefficients``, or ``None`` where compiling failed.

    Args:
        coefficients: The layer's per-head coefficients.
        device: Where the inputs live; ``None`` is returned for a device type on which a kernel
            failed to build before (see :func:`kernel_failed`).
        gated: ``False``: ``kernel(x)`` is the activation ``[..., d_mlp] -> [..., d_mlp]``.
            ``True``: ``kernel(g, u)`` is the activation of the gate times the linear branch.

    Returns:
        A function of tensors; ``torch.compile`` builds it on its first call (which may raise:
        the caller then calls :func:`kernel_failed` and uses the eager path).
    """
    if device.type in _FAILED:
        return None
    key = (coefficients, gated)
    if key not in _KERNELS:
        _KERNELS[key] = _build(coefficients, gated)
    return _KERNELS[key]


def kernel_failed(device: torch.device, error: BaseException) -> None:
    """Record that compiling failed on ``device``'s type and warn (once per device type)."""
    if device.type in _FAILED:
        return
    _FAILED.add(device.type)
    warnings.warn(
        f"torch.compile could not build the fused neuron-head kernel on {device.type} "
        f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); the "
        "eager fused path is used instead (the same function, to the same bound). It needs a C++ "
        "compiler on the CPU or Triton on a GPU; set ConversionOptions(compiled=False) (or "
        "layer.compiled = False) to silence this.",
        RuntimeWarning,
        stacklevel=3,
    )
