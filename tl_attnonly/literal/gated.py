"""Gated MLPs in the literal form: ``g * u`` from plain softmax heads (beyond the paper).

A gated neuron (TransformerLens's ``GatedMLP``) computes ``act(g) * u + b_in`` with ``g = x W_gate``
and ``u = x W_in``. A softmax head's output is linear in its values and its pattern depends on one
score per key, so ``act(g) * u`` is not one head. It is three sublayers of plain heads:

1. **linear heads** (Theorem 7): write ``g`` and ``u`` into hidden coordinates;
2. **product heads** (:func:`product_heads`, below): one head per neuron whose score on its own
   token is the bilinear form ``eps * g * u`` (query ``eps * g``, key ``u``) and 0 on the bias
   token, with value ``4 / eps`` on the token; its output minus the constant ``2 / eps`` (written
   by a bias head) is ``(2 / eps) tanh(eps g u / 2)``, which is ``g u`` up to
   ``eps^2 |g u|^3 / 12`` (:func:`product_error_bound`);
3. **activation heads** (:func:`gated_activation_heads`): Theorem 3's heads with the value
   multiplied through by ``u``: head ``k`` has score ``b_k g + d_k`` on its token (0 on the bias
   token) and value ``f_k (g u) + (e_k - g_k) u``, so the heads sum to ``act(g) u`` (exactly for
   SiLU: one head, score ``g``, value ``g u``; for GELU within the fit's bound times ``|u|``);

then the ``W_out`` heads (Theorem 7) as in the plain split layout. Floating point limits ``eps``
from below: the two terms ``(4 / eps) sigmoid(eps g u)`` and ``2 / eps`` cancel, leaving a
rounding error of order ``(2 / eps) * unit roundoff``. :func:`default_product_eps` balances the
two errors for a dtype; :func:`product_error_table` measures them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tl_attnonly.literal.layout import ResidualLayout
from tl_attnonly.literal.theorems import SublayerHeads

if TYPE_CHECKING:
    import pandas as pd

    from tl_attnonly._types import CoefficientsLike

#: ``|g u|`` up to which :func:`default_product_eps` balances truncation against rounding.
DEFAULT_PRODUCT_RANGE = 100.0
#: Rounding model: the product heads' output carries about ``ROUNDING_FACTOR * (2 / eps) * u``
#: of rounding error, ``u`` the dtype's unit roundoff (measured: see :func:`product_error_table`).
ROUNDING_FACTOR = 3.0
#: The eps values measured by default in :func:`product_error_table`.
DEFAULT_EPS_GRID: tuple[float, ...] = (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8)


def product_error_bound(eps: float, p: float) -> float:
    """Truncation error of the product heads, exact arithmetic: ``eps^2 |p|^3 / 12``.

    For every real ``p``, ``0 <= |p| - (2/eps) |tanh(eps p / 2)| <= eps^2 |p|^3 / 12``
    (from ``x - x^3/3 <= tanh(x) <= x`` for ``x >= 0``).
    """
    return eps**2 * abs(p) ** 3 / 12


def rounding_error_estimate(eps: float, dtype: torch.dtype) -> float:
    """Rounding error of the product heads in ``dtype``: about ``3 (2 / eps) u`` (see the table)."""
    unit = torch.finfo(dtype).eps / 2
    return ROUNDING_FACTOR * (2 / eps) * unit


def default_product_eps(dtype: torch.dtype, product_range: float = DEFAULT_PRODUCT_RANGE) -> float:
    """The eps minimising truncation + rounding for ``|g u| <= product_range`` in ``dtype``.

    Minimises ``eps^2 P^3 / 12 + ROUNDING_FACTOR (2 / eps) u``: ``eps = (12 ROUNDING_FACTOR u)^(1/3)
    / P``. float64, ``P = 100``: 1.6e-7 (estimated total error 6e-9); float32: 1.3e-4 (4e-3).

    Args:
        dtype: Dtype the literal model runs in.
        product_range: The largest ``|g u|`` to design for.
    """
    if product_range <= 0:
        raise ValueError(f"product_range must be positive, got {product_range}")
    unit = torch.finfo(dtype).eps / 2
    return (12 * ROUNDING_FACTOR * unit) ** (1 / 3) / product_range


def product_heads(layout: ResidualLayout, eps: float) -> SublayerHeads:
    """The product sublayer: ``~ g_i u_i`` into the product coordinates, one head per neuron.

    **Proposition.** Head ``i`` attends over its own token (score ``eps g_i u_i``: query
    ``eps g_i``, key ``u_i``, both read from the hidden coordinates) and the bias token (key 0,
    score 0), with value ``4 / eps`` on real tokens and 0 on the bias token; a bias head (self
    only, value 1) writes ``-2 / eps``. Their sum written to product coordinate ``i`` is
    ``(4/eps) sigmoid(eps g u) - 2/eps = (2/eps) tanh(eps g u / 2)``, within
    ``eps^2 |g u|^3 / 12`` of ``g u`` (:func:`product_error_bound`), of the same sign, and never
    larger in magnitude.

    Args:
        layout: A gated split layout.
        eps: The score scale.

    Returns:
        ``d_mlp + 1`` heads of internal dimension 1 (masks: self + bias token; self).
    """
    if not layout.gated:
        raise ValueError("product_heads needs a gated layout (ResidualLayout(..., gated=True)).")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    M, R, real = layout.d_mlp, layout.d_resid, layout.real_rows
    idx = torch.arange(M)
    W_Q = torch.zeros(M + 1, R, 1, dtype=torch.float64)
    W_K, W_V = torch.zeros_like(W_Q), torch.zeros_like(W_Q)
    W_O = torch.zeros(M + 1, 1, R, dtype=torch.float64)
    W_Q[idx, layout.pre_dims.start + idx, 0] = eps
    W_K[idx, layout.linear_dims.start + idx, 0] = 1.0
    W_V[:M, real, 0] = 4.0 / eps
    W_O[idx, 0, layout.product_dims.start + idx] = 1.0
    W_V[M, real, 0] = 1.0  # the bias head: value 1 on real tokens ...
    W_O[M, 0, layout.product_dims] = -2.0 / eps  # ... times -2/eps on every product coordinate
    head_kind = torch.tensor([0] * M + [1])
    return SublayerHeads(W_Q, W_K, W_V, W_O, ("self_bias", "self"), head_kind)


def gated_activation_heads(coefficients: CoefficientsLike, layout: ResidualLayout) -> SublayerHeads:
    """The activation sublayer of a gated MLP: ``act(g_i) u_i`` into post coordinate ``i``.

    Theorem 3's ``K`` heads per neuron with the value multiplied by the linear branch: head
    ``(i, k)`` has score ``b_k g_i + d_k`` on its own token and 0 on the bias token; its value is
    ``f_k p_i + (e_k - g_k) u_i`` on its token (``p_i ~ g_i u_i`` from :func:`product_heads`) and
    0 on the bias token. The neuron's heads sum to
    ``sum_k sigmoid(b_k g + d_k) (f_k g + e_k - g_k) u = (act(g) - sum_k g_k) u``; every
    shipped coefficient set has ``sum_k g_k = 0`` (refused otherwise), so the sum is ``act(g) u``
    (SiLU: ``b = f = 1``, ``d = e = g = 0``, exact).

    Args:
        coefficients: Per-head ``b, d, f, e, g`` (a ``NeuronHeadCoefficients``).
        layout: A gated split layout.

    Returns:
        ``d_mlp * K`` heads (head ``i * K + k``), mask: self + bias token.

    Raises:
        NotImplementedError: If ``sum_k g_k != 0``.
    """
    b, d, f, e, g = (torch.tensor(getattr(coefficients, n), dtype=torch.float64) for n in "bdfeg")
    if abs(float(g.sum())) > 1e-12:
        raise NotImplementedError(
            f"The gated literal form needs neuron-head coefficients with sum_k g_k = 0 (got "
            f"{float(g.sum()):.3g}): a constant bias-token value times u is not a constant."
        )
    M, K, R, real = layout.d_mlp, len(b), layout.d_resid, layout.real_rows
    H = M * K
    neuron = torch.arange(H) // K
    head = torch.arange(H) % K
    W_Q = torch.zeros(H, R, 1, dtype=torch.float64)
    W_K, W_V = torch.zeros_like(W_Q), torch.zeros_like(W_Q)
    W_O = torch.zeros(H, 1, R, dtype=torch.float64)
    W_Q[torch.arange(H), layout.pre_dims.start + neuron, 0] = b[head]
    W_Q[:, real, 0] = d[head][:, None]
    W_K[:, real, 0] = 1.0  # key 1 on every real token, 0 on the bias token
    W_V[torch.arange(H), layout.product_dims.start + neuron, 0] = f[head]
    W_V[torch.arange(H), layout.linear_dims.start + neuron, 0] = (e - g)[head]
    W_O[torch.arange(H), 0, layout.post_dims.start + neuron] = 1.0
    return SublayerHeads(W_Q, W_K, W_V, W_O, ("self_bias",), torch.zeros(H, dtype=torch.long))


def product_through_heads(g: Tensor, u: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """What the product heads compute for ``(g, u)`` in ``dtype``, op for op as in the module.

    Query ``eps * g``, key ``u``, score ``q k`` against the bias token's 0, softmax over the two,
    the self weight times ``4 / eps`` plus the bias head's ``-2 / eps``.
    """
    g, u = g.to(dtype), u.to(dtype)
    q = g * torch.tensor(eps, dtype=dtype)
    scores = torch.stack([q * u, torch.zeros_like(q)], dim=-1)
    weight = torch.softmax(scores, dim=-1)[..., 0]
    return weight * torch.tensor(4.0 / eps, dtype=dtype) + torch.tensor(-2.0 / eps, dtype=dtype)


def product_error_table(
    eps_values: Sequence[float] = DEFAULT_EPS_GRID,
    dtypes: Sequence[str] = ("float64", "float32"),
    product_ranges: Sequence[float] = (20.0, 200.0),
    n_samples: int = 20_001,
) -> pd.DataFrame:
    """Measured ``max |heads(g, u) - g u|`` of the product heads, over eps, dtype and ``|g u|``.

    The pairs ``(g, u)`` have ``g u`` spread evenly over ``[-P, P]`` (``g = sqrt|p|`` times a
    sign, ``u = p / g``, in float64); the heads run in the dtype (:func:`product_through_heads`).

    Returns:
        One row per (dtype, P, eps): ``max_abs_err``, ``truncation_bound`` (``eps^2 P^3 / 12``),
        ``rounding_estimate`` (:func:`rounding_error_estimate`) and ``default`` (whether this eps
        is :func:`default_product_eps` for the dtype, appended as an extra row).
    """
    import pandas as pd

    records = []
    for name in dtypes:
        dtype = getattr(torch, name)
        default = default_product_eps(dtype)
        for P in product_ranges:
            p = torch.linspace(-P, P, n_samples, dtype=torch.float64)
            g = p.abs().sqrt().clamp(min=1e-3) * torch.where(p < 0, -1.0, 1.0).double()
            u = p / g
            exact = g * u
            for eps in [*eps_values, default]:
                out = product_through_heads(g, u, eps, dtype).double()
                records.append(
                    {
                        "dtype": name,
                        "product_range": P,
                        "eps": eps,
                        "default": eps == default,
                        "max_abs_err": float((out - exact).abs().max()),
                        "truncation_bound": product_error_bound(eps, P),
                        "rounding_estimate": rounding_error_estimate(eps, dtype),
                    }
                )
    return pd.DataFrame.from_records(records)


def check_product_range(eps: float, product_range: float, dtype: torch.dtype) -> str | None:
    """A warning if ``eps`` is far from balancing the two errors for ``dtype``, else ``None``."""
    bound = product_error_bound(eps, product_range) + rounding_error_estimate(eps, dtype)
    best_eps = default_product_eps(dtype, product_range)
    best = product_error_bound(best_eps, product_range) + rounding_error_estimate(best_eps, dtype)
    if bound <= 10 * best:
        return None
    return (
        f"product_eps={eps:g} gives an estimated product error of {bound:.2g} for |g u| <= "
        f"{product_range:g} in {dtype}, over 10x the best ({best:.2g} at eps={best_eps:.2g}); "
        "pass product_eps=None to choose it automatically."
    )


__all__ = [
    "DEFAULT_EPS_GRID",
    "DEFAULT_PRODUCT_RANGE",
    "ROUNDING_FACTOR",
    "check_product_range",
    "default_product_eps",
    "gated_activation_heads",
    "product_error_bound",
    "product_error_table",
    "product_heads",
    "product_through_heads",
    "rounding_error_estimate",
]
