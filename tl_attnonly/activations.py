"""Rewrite an MLP neuron's activation function as a sum of "neuron-heads".

Huben & Morris (2023, arXiv 2309.08593) observe that an MLP neuron can be simulated by attention
heads of internal dimension 1 that attend only to their own position and to a "bias token". For a
neuron with pre-activation ``x`` one such head computes::

    h(x) = (f*x + e) * sigmoid(b*x + d) + g * (1 - sigmoid(b*x + d))

(attention score ``b*x + d`` on itself vs ``0`` on the bias token, value ``f*x + e`` on itself and
``g`` on the bias token). A neuron with activation ``act`` is rewritten as ``K`` such heads whose
outputs sum to (approximately) ``act(x)``:

* ``silu``: exact with one head (``x * sigmoid(x)``).
* ``relu``: one head ``x * sigmoid(k*x)`` (= ``SiLU(k x) / k``); max error ``W(1/e) / k``
  (``~0.2785 / k``), see :func:`relu_sigmoid_max_error`: 2.8e-7 at the default ``k = 1e6``
  (:data:`DEFAULT_RELU_K`), so ReLU is exact to rounding.
* ``gelu``, ``gelu_new``, ``gelu_fast``, ``gelu_pytorch_tanh``: minimax fits with ``K = 1..6`` heads
  (``scripts/fit_activation_heads.py``, stored in ``data/activation_fits.json``), or the paper's
  one-head ``x * sigmoid(1.702 x)`` (``gelu_method="paper"``).

All fits satisfy ``sum f = 1``, ``sum e = 0``, ``sum g = 0`` and ``b > 0``, so the sum of heads
tends to ``x`` as ``x -> +inf`` and to ``0`` as ``x -> -inf``: the error stays bounded (and tends
to 0) outside the fitted range ``|x| <= FIT_RANGE``.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import pandas as pd
import torch
from jaxtyping import Float

from tl_attnonly._compat import TL_ACTIVATIONS

if TYPE_CHECKING:
    from tl_attnonly._types import CoefficientsLike

SUPPORTED_ACTIVATIONS: tuple[str, ...] = (
    "silu",
    "relu",
    "gelu",
    "gelu_new",
    "gelu_fast",
    "gelu_pytorch_tanh",
)
"""Activation names (TransformerLens ``act_fn`` strings) that can be rewritten as neuron-heads."""

GELU_VARIANTS: tuple[str, ...] = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh")
"""The GELU-family activations, which use fitted coefficients."""

METHODS: tuple[str, ...] = ("exact", "sigmoid_k", "paper", "fit")
"""Possible values of :attr:`NeuronHeadCoefficients.method`."""

# The smallest K whose fit has max |error| <= 1e-4 on |x| <= FIT_RANGE for every GELU variant
# (K=3: ~2.5e-4 / 2.0e-4; K=4: ~1.1e-5 for gelu, ~2.1e-5 for the tanh variants).
DEFAULT_GELU_HEADS: int = 4
MAX_GELU_HEADS: int = 6
DEFAULT_RELU_K: float = 1e6
"""Default ``relu_k``: ``x sigmoid(1e6 x)`` is within ``0.2785 / 1e6 = 2.8e-7`` of ``relu(x)``
everywhere, under the 1e-6 that makes ReLU exact to rounding (3.6 times under it; ``3e5`` would
leave 7% margin, ``2.8e5`` none). 1e6 is exact in float32 (bfloat16 rounds it to 999424, error
2.8e-7). The score ``1e6 x`` saturates the sigmoid for ``|x| > 4e-5``; an infinite score is
harmless in the structured form. float16 cannot hold 1e6: there the slope is held at 65504
(:func:`representable_slopes`, error 4.3e-6, under float16's rounding). The literal form in
float16 and bfloat16 needs a smaller ``relu_k`` or a larger omega (see
:func:`tl_attnonly.literal.omega.omega_requirement`)."""
MIN_RELU_K: float = 1.0
"""Smallest accepted ``relu_k``: below it ``x sigmoid(k x)`` is no approximation of ReLU (max
error ``0.2785 / k`` > 0.28)."""
FIT_RANGE: float = 20.0
PAPER_GELU_SLOPE: float = 1.702
"""Slope of the paper's one-head GELU approximation ``x * sigmoid(1.702 x)``."""

FP16_MAX: float = 65504.0
"""Largest finite float16 value."""

# W(1/e) (Lambert W): max_{t>0} t * sigmoid(-t), attained at t = 1 + W(1/e). Hence
# max_x |x * sigmoid(k x) - relu(x)| = W(1/e) / k.
RELU_SIGMOID_ERROR_CONSTANT: float = 0.27846454276107380

_FITS_PATH = Path(__file__).resolve().parent / "data" / "activation_fits.json"


@functools.lru_cache(maxsize=1)
def _load_fits() -> dict[str, Any]:
    """Load ``data/activation_fits.json`` once (the returned dict must not be mutated)."""
    with open(_FITS_PATH, encoding="utf-8") as fh:
        return json.load(fh)


def fit_metadata() -> dict[str, Any]:
    """Return (a copy of) the ``meta`` block of the stored GELU fits (range, grid, script, ...)."""
    return json.loads(json.dumps(_load_fits()["meta"]))


def relu_sigmoid_max_error(relu_k: float) -> float:
    """Exact worst-case error of the one-head ReLU approximation.

    Args:
        relu_k: The sigmoid slope ``k`` in ``x * sigmoid(k x)``.

    Returns:
        ``max_x |x * sigmoid(k x) - relu(x)| = W(1/e) / k`` (about ``0.2785 / k``).
    """
    return RELU_SIGMOID_ERROR_CONSTANT / float(relu_k)


def representable_slopes(slopes: tuple[float, ...], dtype: torch.dtype) -> tuple[float, ...]:
    """The score slopes ``b`` (all > 0) as ``dtype`` can hold them: each at most its largest
    finite value.

    Only the default ``relu_k = 1e6`` in float16 (largest finite value 65504) is affected: held
    at 65504, its scores saturate the sigmoid for ``|x| > 2e-4`` (error ``0.2785 / 65504 =
    4.3e-6``, under float16's own rounding), where an infinite slope would make the score of
    ``x = 0`` NaN (``inf * 0``).
    """
    largest = torch.finfo(dtype).max
    return tuple(min(float(b), largest) for b in slopes)


def _unsupported(act_fn: str) -> ValueError:
    extra = ""
    if act_fn in ("solu", "solu_ln"):
        extra = " (SoLU's softmax mixes all neurons of a layer, so it is not a per-neuron function)"
    return ValueError(
        f"Activation {act_fn!r} cannot be rewritten as neuron-heads{extra}. "
        f"Supported activations: {', '.join(SUPPORTED_ACTIVATIONS)}."
    )


@dataclass(frozen=True)
class NeuronHeadCoefficients:
    """Coefficients of the ``K`` neuron-heads that together simulate one activation function.

    Head ``k`` computes ``(f[k] x + e[k]) s_k + g[k] (1 - s_k)`` with
    ``s_k = sigmoid(b[k] x + d[k])``; the neuron's output is the sum over heads.

    Attributes:
        activation: TransformerLens ``act_fn`` name being approximated (or reproduced exactly).
        method: ``"exact"`` (silu), ``"sigmoid_k"`` (relu), ``"paper"`` (GELU,
            ``x sigmoid(1.702x)``) or ``"fit"`` (GELU, minimax fit from
            ``data/activation_fits.json``).
        b: Attention-score slopes, one per head (all ``> 0``).
        d: Attention-score offsets (score of the bias token is 0).
        f: Value slopes on the neuron's own position.
        e: Value offsets on the neuron's own position.
        g: Values on the bias token.
        relu_k: The sigmoid slope ``k`` for ``method == "sigmoid_k"``, else ``None``.
    """

    activation: str
    method: str
    b: tuple[float, ...]
    d: tuple[float, ...]
    f: tuple[float, ...]
    e: tuple[float, ...]
    g: tuple[float, ...]
    relu_k: float | None = None

    def __post_init__(self) -> None:
        for name in ("b", "d", "f", "e", "g"):
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))
        if self.relu_k is not None:
            object.__setattr__(self, "relu_k", float(self.relu_k))
        lengths = {len(getattr(self, name)) for name in ("b", "d", "f", "e", "g")}
        if len(lengths) != 1 or not self.b:
            raise ValueError("b, d, f, e, g must be non-empty and have one entry per head")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if not all(v > 0 for v in self.b):
            raise ValueError("all b (attention-score slopes) must be > 0")

    @property
    def n_heads(self) -> int:
        """Number of heads ``K``."""
        return len(self.b)

    @property
    def coef_l1(self) -> float:
        """``sum_k |f_k| + |e_k| + |g_k|`` (governs low-precision evaluation error)."""
        return math.fsum(abs(v) for v in self.f + self.e + self.g)

    def evaluate(self, x: Float[torch.Tensor, "..."]) -> Float[torch.Tensor, "..."]:
        """Sum of the ``K`` head outputs, computed in ``x``'s dtype and on ``x``'s device.

        Slopes ``b`` beyond ``x``'s dtype are held at its largest finite value
        (:func:`representable_slopes`), as the neuron-head layers do.

        Args:
            x: Neuron pre-activations (floating point, any shape).

        Returns:
            Tensor of the same shape and dtype as ``x``.
        """
        if not torch.is_floating_point(x):
            raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")

        def coef(values: tuple[float, ...]) -> torch.Tensor:
            return torch.tensor(values, dtype=x.dtype, device=x.device)

        xk = x.unsqueeze(-1)
        s = torch.sigmoid(xk * coef(representable_slopes(self.b, x.dtype)) + coef(self.d))
        out = (xk * coef(self.f) + coef(self.e)) * s
        if any(self.g):
            out = out + coef(self.g) * (1 - s)
        return out.sum(dim=-1)

    def reference(self, x: Float[torch.Tensor, "..."]) -> Float[torch.Tensor, "..."]:
        """The true activation function (TransformerLens implementation) applied to ``x``."""
        return TL_ACTIVATIONS[self.activation](x)

    def max_abs_error(self, x_range: float = FIT_RANGE, n: int = 200001) -> float:
        """Max ``|evaluate(x) - reference(x)|`` on ``n`` points evenly spaced on ``|x| <= x_range``.

        Computed in float64 on the CPU (and cached). For ``method == "sigmoid_k"`` the two exact
        maximisers ``x = +-(1 + W(1/e)) / k`` are added to the grid (the error peak is narrower
        than the grid spacing for large ``k``).
        """
        return _max_abs_error(self, float(x_range), int(n))

    def evaluation_error_bound(self, x: Float[torch.Tensor, "..."]) -> Float[torch.Tensor, "..."]:
        """First-order bound on the rounding error of :meth:`evaluate` in ``x``'s dtype.

        Bounds ``|evaluate(x) - evaluate_exact(x)|``, where ``evaluate_exact`` uses exact arithmetic
        (in practice float64) on the same ``x`` values, by::

            u * sum_k (|f_k x| + |e_k| + |g_k|) * (K + 9 + 1.5 |d_k|),   u = eps(dtype) / 2

        (coefficient rounding, ``3u (|b x| + |d|)`` on the score, which moves the sigmoid by at most
        ``sigmoid' * that <= 3u (0.224 + 0.5 |d|)``, ``4u`` for the sigmoid itself, ``3u`` on the
        value, ``u`` per product and ``(K - 1) u`` for the sum). For float32 (``u = 6e-8``) this is
        about 15-25 times ``6e-8 * (|x| sum|f| + sum|e| + sum|g|)``; measured errors stay below ~5
        times that.

        Args:
            x: Pre-activations (floating point); the bound is computed in float64.

        Returns:
            Elementwise bound, float64, same shape as ``x``.
        """
        u = torch.finfo(x.dtype).eps / 2
        ax = x.detach().to(torch.float64).abs().unsqueeze(-1)

        def coef(values: tuple[float, ...]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float64, device=x.device).abs()

        magnitude = coef(self.f) * ax + coef(self.e) + coef(self.g)
        return u * (magnitude * (self.n_heads + 9 + 1.5 * coef(self.d))).sum(dim=-1)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict; :meth:`from_dict` inverts it exactly."""
        out: dict[str, Any] = {}
        for fld in fields(self):
            value = getattr(self, fld.name)
            out[fld.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NeuronHeadCoefficients:
        """Rebuild coefficients from :meth:`to_dict` output (extra keys are ignored)."""
        names = {fld.name for fld in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        for key in ("b", "d", "f", "e", "g"):
            kwargs[key] = tuple(float(v) for v in kwargs[key])
        return cls(**kwargs)


@functools.lru_cache(maxsize=512)
def _max_abs_error(coeffs: NeuronHeadCoefficients, x_range: float, n: int) -> float:
    x = torch.linspace(-x_range, x_range, n, dtype=torch.float64)
    if coeffs.method == "sigmoid_k" and coeffs.relu_k is not None:
        peak = (1.0 + RELU_SIGMOID_ERROR_CONSTANT) / coeffs.relu_k
        if peak <= x_range:
            x = torch.cat([x, torch.tensor([-peak, peak], dtype=torch.float64)])
    # a block of points at a time: the K-head evaluation of all n points at once is ~8 MB
    return max(
        float((coeffs.evaluate(block) - coeffs.reference(block)).abs().max())
        for block in x.split(_ERROR_GRID_BLOCK)
    )


#: Points per block of :func:`_max_abs_error` (bounds its float64 scratch memory).
_ERROR_GRID_BLOCK = 16384


def check_relu_k(relu_k: Any) -> None:
    """Refuse a ``relu_k`` that is not a finite number >= :data:`MIN_RELU_K`.

    Raises:
        ValueError: Naming the value, the accepted range and the error it would give.
    """
    if (
        isinstance(relu_k, bool)
        or not isinstance(relu_k, numbers.Real)
        or not math.isfinite(relu_k)
        or relu_k < MIN_RELU_K
    ):
        raise ValueError(
            f"relu_k must be a finite number >= {MIN_RELU_K:g} (the ReLU head x*sigmoid(relu_k x) "
            f"has max error 0.2785 / relu_k; default {DEFAULT_RELU_K:g}, max error "
            f"{relu_sigmoid_max_error(DEFAULT_RELU_K):.1e}), got {relu_k!r}."
        )


def _single_head(
    activation: str, method: str, b: float, relu_k: float | None = None
) -> NeuronHeadCoefficients:
    return NeuronHeadCoefficients(
        activation, method, (b,), (0.0,), (1.0,), (0.0,), (0.0,), relu_k=relu_k
    )


def _check_single_head(act_fn: str, n_heads: int | None, what: str) -> None:
    if n_heads is not None and (isinstance(n_heads, bool) or n_heads != 1):
        raise ValueError(f"{what} for {act_fn!r} uses exactly 1 head; valid n_heads: None or 1")


def head_coefficients(
    act_fn: str,
    n_heads: int | None = None,
    relu_k: float = DEFAULT_RELU_K,
    gelu_method: str = "fit",
) -> NeuronHeadCoefficients:
    """Neuron-head coefficients for a TransformerLens activation function.

    Args:
        act_fn: TransformerLens ``act_fn`` name; one of :data:`SUPPORTED_ACTIVATIONS`.
        n_heads: Number of heads. ``silu``/``relu`` and ``gelu_method="paper"``: ``None`` or 1.
            GELU fits: 1..6, default :data:`DEFAULT_GELU_HEADS`.
        relu_k: Sigmoid slope for ``relu`` (``x * sigmoid(relu_k x)``); must be finite and
            >= :data:`MIN_RELU_K`.
        gelu_method: ``"fit"`` (minimax fit) or ``"paper"`` (``x * sigmoid(1.702 x)``).

    Returns:
        The coefficients.

    Raises:
        ValueError: For unsupported activations (e.g. ``solu``, ``solu_ln``, ``xielu``, ``relu2``),
            an invalid ``n_heads``, ``relu_k`` or ``gelu_method``.
    """
    if act_fn == "silu":
        _check_single_head(act_fn, n_heads, "The exact silu rewrite")
        return _single_head("silu", "exact", 1.0)
    if act_fn == "relu":
        _check_single_head(act_fn, n_heads, "The x*sigmoid(k x) rewrite")
        check_relu_k(relu_k)
        return _single_head("relu", "sigmoid_k", float(relu_k), relu_k=float(relu_k))
    if act_fn in GELU_VARIANTS:
        if gelu_method == "paper":
            _check_single_head(act_fn, n_heads, "The paper's x*sigmoid(1.702x) rewrite")
            return _single_head(act_fn, "paper", PAPER_GELU_SLOPE)
        if gelu_method != "fit":
            raise ValueError(f"gelu_method must be 'fit' or 'paper', got {gelu_method!r}")
        k = DEFAULT_GELU_HEADS if n_heads is None else n_heads
        if (
            isinstance(k, bool)
            or not isinstance(k, numbers.Integral)
            or not 1 <= k <= MAX_GELU_HEADS
        ):
            raise ValueError(
                f"n_heads for {act_fn!r} must be an integer in 1..{MAX_GELU_HEADS}, got {n_heads!r}"
            )
        fit = _load_fits()["fits"][act_fn][str(int(k))]
        return NeuronHeadCoefficients(
            act_fn, "fit", fit["b"], fit["d"], fit["f"], fit["e"], fit["g"]
        )
    raise _unsupported(act_fn)


def activation_error_table(
    act_fn: str | None = None, max_heads: int = MAX_GELU_HEADS, x_range: float = FIT_RANGE
) -> pd.DataFrame:
    """Max absolute error of the neuron-head rewrite, per activation and number of heads.

    Args:
        act_fn: One activation (default: all of :data:`SUPPORTED_ACTIVATIONS`).
        max_heads: Largest K listed for the GELU fits (1..6).
        x_range: Errors are measured on ``|x| <= x_range`` (float64, 200001 points).

    Returns:
        DataFrame with columns ``activation, method, n_heads, max_abs_error, coef_l1, relu_k``:
        one row per GELU variant and K plus the paper's one-head row, ``k = 100, 1e4`` and the
        default :data:`DEFAULT_RELU_K` for ``relu`` (``relu_k`` column; NaN elsewhere) and one
        (exact, error ~0) row for ``silu``.
    """
    if act_fn is not None and act_fn not in SUPPORTED_ACTIVATIONS:
        raise _unsupported(act_fn)
    if isinstance(max_heads, bool) or not 1 <= max_heads <= MAX_GELU_HEADS:
        raise ValueError(f"max_heads must be in 1..{MAX_GELU_HEADS}, got {max_heads!r}")
    names = SUPPORTED_ACTIVATIONS if act_fn is None else (act_fn,)
    coeff_list: list[NeuronHeadCoefficients] = []
    for name in names:
        if name == "silu":
            coeff_list.append(head_coefficients("silu"))
        elif name == "relu":
            # the earlier default (100), one between, the default
            coeff_list += [head_coefficients("relu", relu_k=k) for k in (1e2, 1e4, DEFAULT_RELU_K)]
        else:
            coeff_list += [head_coefficients(name, k) for k in range(1, max_heads + 1)]
            coeff_list.append(head_coefficients(name, gelu_method="paper"))
    rows = [
        {
            "activation": c.activation,
            "method": c.method,
            "n_heads": c.n_heads,
            "max_abs_error": c.max_abs_error(x_range),
            "coef_l1": c.coef_l1,
            "relu_k": float("nan") if c.relu_k is None else c.relu_k,
        }
        for c in coeff_list
    ]
    return pd.DataFrame(rows)


class ScoreMagnitude(NamedTuple):
    """Largest magnitudes a neuron-head produces on ``|x| <= x_range``."""

    score: float
    """max ``|b x + d|`` (attention score on the neuron's own position)."""
    value: float
    """max of ``|f x + e|`` and ``|g|`` (attention values)."""


def max_score_magnitude(coeffs: CoefficientsLike, x_range: float = FIT_RANGE) -> ScoreMagnitude:
    """Max ``|b x + d|`` and max ``|f x + e|`` (or ``|g|``) over ``|x| <= x_range``, all heads.

    Both are affine in ``x``, so the maxima are at ``x = +-x_range``. Used to warn about float16
    overflow (:data:`FP16_MAX` = 65504).
    """
    r = abs(float(x_range))
    score = max(abs(b) * r + abs(d) for b, d in zip(coeffs.b, coeffs.d))
    value = max(abs(f) * r + abs(e) for f, e in zip(coeffs.f, coeffs.e))
    value = max([value] + [abs(g) for g in coeffs.g])
    return ScoreMagnitude(score, value)


def fp16_safe(coeffs: NeuronHeadCoefficients, x_range: float = FIT_RANGE) -> bool:
    """Whether all attention scores and values stay below the float16 max on ``|x| <= x_range``."""
    mags = max_score_magnitude(coeffs, x_range)
    return mags.score < FP16_MAX and mags.value < FP16_MAX


__all__ = [
    "DEFAULT_GELU_HEADS",
    "DEFAULT_RELU_K",
    "FIT_RANGE",
    "FP16_MAX",
    "GELU_VARIANTS",
    "MAX_GELU_HEADS",
    "MIN_RELU_K",
    "METHODS",
    "PAPER_GELU_SLOPE",
    "RELU_SIGMOID_ERROR_CONSTANT",
    "SUPPORTED_ACTIVATIONS",
    "NeuronHeadCoefficients",
    "ScoreMagnitude",
    "activation_error_table",
    "check_relu_k",
    "fit_metadata",
    "fp16_safe",
    "head_coefficients",
    "max_score_magnitude",
    "relu_sigmoid_max_error",
    "representable_slopes",
]
