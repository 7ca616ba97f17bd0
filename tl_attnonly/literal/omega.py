"""Omega (Theorem 9): how large it must be, what to warn, and the measured error table.

Theorem 9 replaces every mask by ``-omega`` entries of ``W_QK``; the paper shows the error vanishes
as omega grows. :func:`omega_requirement` and :func:`omega_warnings` say how large omega must be
for a dtype (:func:`~tl_attnonly.literal.to_literal` warns with them).
:func:`~tl_attnonly.literal.error_tables.omega_error_table` (in
:mod:`~tl_attnonly.literal.error_tables`, above the builder) measures the error on a given model
and input; :func:`plot_omega_error` draws the table.

Reading the table: ``max_abs_err`` falls as omega grows, until it reaches the rounding floor of
the dtype (``baseline_max_abs_err``, the original model's own error in that dtype, is the same
order). ``max_leak`` is the attention mass that masked keys still receive. ``overflow`` marks an
omega that is not finite in the dtype (float16 above 65504): then ``-inf * 0 = NaN`` enters every
score and the logits are NaN (``nonfinite``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Int

if TYPE_CHECKING:  # pandas and plotly load only when a table or figure is made
    import pandas as pd
    import plotly.graph_objects as go

    from tl_attnonly.literal.transformer import LiteralTransformer

#: Default omega. Penalties go only on disallowed pairs, so a large omega costs no accuracy on the
#: allowed ones; 1e4 makes the leak ``n_keys * exp(score_range - omega)`` underflow to exactly 0 in
#: every float dtype for score ranges up to ~9000, and stays 6.5x below float16's largest finite
#: value (65504), where ``-omega`` would become ``-inf`` and ``-inf * 0 = NaN`` every score.
DEFAULT_OMEGA = 1e4
#: Spread of real attention scores assumed when judging whether an omega is large enough.
TYPICAL_SCORE_RANGE = 32.0


def omega_requirement(
    dtype: torch.dtype,
    n_keys: int,
    tol: float | None = None,
    score_range: float = TYPICAL_SCORE_RANGE,
    max_score: float = 0.0,
) -> float:
    """Smallest omega for which masked keys keep less than ``tol`` of the attention.

    A query with ``n_keys`` keys leaks at most ``n_keys * exp(score_range - omega)`` to masked
    keys, where ``score_range`` bounds how far a masked key's real score may exceed the best
    allowed one.

    A neuron-head's masked keys have its own score ``s = b x + d`` (every real key is 1), so
    a masked score is ``s - omega``, computed in the dtype: rounded to the dtype's grid at
    ``|s|``, it loses up to ``eps * |s|`` of omega. The default ``relu_k = 1e6`` makes
    ``|s| = 1e6 |x|`` (2e7 at ``|x| = 20``): nothing in float32 (2.4), but in bfloat16
    (``eps = 2^-7``) 1.6e5, far above the default omega of 1e4 (masked keys then take a share of
    the attention, logit errors of order 1). Hence the ``eps * max_score`` term: in bfloat16 use
    ``omega >= 2e5`` or ``relu_k <= 6e4`` (error 4.6e-6) with ReLU; in float16 also keep
    ``relu_k * |x| <= 65504`` (``relu_k <= 3e3`` at ``|x| <= 20``), or the scores overflow.

    Args:
        dtype: Dtype of the model; ``tol`` defaults to its rounding unit ``eps / 2``.
        n_keys: Keys per query (``1 + max_len``).
        tol: Acceptable leaked mass.
        score_range: Assumed spread of real scores.
        max_score: Largest ``|score|`` of a head whose masked keys share its allowed key's score
            (neuron-heads: :func:`~tl_attnonly.activations.max_score_magnitude`); 0 ignores it.

    Returns:
        ``score_range + log(n_keys / tol) + eps(dtype) * max_score``.
    """
    if tol is None:
        tol = torch.finfo(dtype).eps / 2
    return score_range + math.log(n_keys / tol) + torch.finfo(dtype).eps * max_score


def omega_warnings(
    omega: float,
    dtype: torch.dtype,
    n_keys: int,
    tol: float | None = None,
    max_score: float = 0.0,
) -> list[str]:
    """Why ``omega`` is a bad choice for ``dtype`` (empty if it is fine).

    Args:
        omega: The penalty.
        dtype: Dtype the literal model will run in.
        n_keys: Keys per query.
        tol: Acceptable leaked attention mass (default: the dtype's rounding unit).
        max_score: Largest neuron-head score (see :func:`omega_requirement`).

    Returns:
        Messages: overflow (omega is ``inf`` in ``dtype``) and/or too small for ``tol``.
    """
    out = []
    finfo = torch.finfo(dtype)
    if not math.isfinite(torch.tensor(float(omega), dtype=dtype).item()):
        out.append(
            f"omega={omega:g} overflows {dtype} (largest finite value {finfo.max:g}): -omega "
            "becomes -inf, -inf * 0 = NaN enters every score and every output is NaN. Use "
            f"omega <= {finfo.max / 4:g} (default {DEFAULT_OMEGA:g})."
        )
    need = omega_requirement(dtype, n_keys, tol, max_score=max_score)
    if omega < need:
        shown_tol = tol if tol is not None else finfo.eps / 2
        lost = finfo.eps * max_score
        rounding = (
            f" Neuron-head scores reach {max_score:.3g}; rounded in {dtype}, masked scores "
            f"(score - omega) lose up to eps * {max_score:.3g} = {lost:.3g} of omega: use a "
            "larger omega, a smaller relu_k, or float32."
            if lost >= 1
            else ""
        )
        out.append(
            f"omega={omega:g} may be too small for a tolerance of {shown_tol:.2g} in {dtype} with "
            f"{n_keys} keys: masked keys can keep up to n_keys * exp({TYPICAL_SCORE_RANGE:g} - "
            f"omega) of the attention; omega >= {need:.1f} is needed (default {DEFAULT_OMEGA:g})."
            + rounding
        )
    return out


#: Omegas measured by default: from far too small to past float16's overflow.
DEFAULT_OMEGAS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 1e3, 1e4, 65504, 1e5)
#: Dtypes measured by default.
DEFAULT_DTYPES: tuple[str, ...] = ("float64", "float32", "bfloat16", "float16")

COLUMNS = (
    "dtype",
    "omega",
    "omega_in_dtype",
    "overflow",
    "max_abs_err",
    "mean_abs_err",
    "baseline_max_abs_err",
    "max_leak",
    "nonfinite",
    "warning",
)


def logits_and_leak(
    model: LiteralTransformer, tokens: Int[torch.Tensor, "batch pos"]
) -> tuple[torch.Tensor, float]:
    """Logits, and the largest attention mass any query gives to keys its head must not see."""
    worst = [0.0]

    def make_hook(module: Any):
        def hook(pattern: torch.Tensor, hook: Any) -> None:
            allowed = module.allowed_pattern(pattern.shape[-1]).to(pattern.device)
            value = (pattern.double() * (~allowed).double()).sum(-1).max().item()
            worst[0] = max(worst[0], value) if math.isfinite(value) else math.nan

        return hook

    hooks: list[tuple[str | Callable[..., Any], Callable[..., Any]]] = [
        (f"{name}.hook_pattern", make_hook(module)) for name, module in model.sublayers()
    ]
    with torch.no_grad():
        logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
    return logits, worst[0]


def max_masked_attention(
    model: LiteralTransformer, tokens: Int[torch.Tensor, "batch pos"]
) -> float:
    """Largest attention mass any query gives to keys its head must not see.

    Args:
        model: A literal model.
        tokens: ``[batch, pos]``.

    Returns:
        ``max`` over sublayers, heads, batch and queries of the pattern's sum over disallowed
        keys (0 when every leak underflows; NaN if a pattern is not finite).
    """
    return logits_and_leak(model, tokens)[1]


def plot_omega_error(df: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Draw :func:`omega_error_table`: max |logit error| against omega, one line per dtype.

    Dashed lines show each dtype's baseline (the original model's own rounding error); crosses at
    the top mark omegas whose output is not finite (overflow).

    Args:
        df: The table.
        title: Figure title.

    Returns:
        A log-log plotly figure.
    """
    import plotly.graph_objects as go

    fig = go.Figure()
    finite_errs = df["max_abs_err"][df["max_abs_err"] > 0].dropna()
    top = float(finite_errs.max()) * 10 if len(finite_errs) else 1.0
    floor = 1e-17
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    for i, (dtype, part) in enumerate(df.groupby("dtype", sort=False)):
        color = palette[i % len(palette)]
        ok = part[~part["nonfinite"]]
        fig.add_trace(
            go.Scatter(
                x=ok["omega"],
                y=ok["max_abs_err"].clip(lower=floor),
                mode="lines+markers",
                name=f"{dtype}",
                line={"color": color},
                customdata=ok[["max_leak", "baseline_max_abs_err"]].to_numpy(),
                hovertemplate=(
                    "omega=%{x:g}<br>max |err|=%{y:.2e}<br>leak=%{customdata[0]:.2e}"
                    "<br>baseline=%{customdata[1]:.2e}<extra>" + str(dtype) + "</extra>"
                ),
            )
        )
        baseline = float(part["baseline_max_abs_err"].iloc[0])
        fig.add_trace(
            go.Scatter(
                x=[part["omega"].min(), part["omega"].max()],
                y=[max(baseline, floor)] * 2,
                mode="lines",
                line={"color": color, "dash": "dash", "width": 1},
                name=f"{dtype} baseline (original model in {dtype})",
                hoverinfo="skip",
            )
        )
        bad = part[part["nonfinite"]]
        if len(bad):
            fig.add_trace(
                go.Scatter(
                    x=bad["omega"],
                    y=[top] * len(bad),
                    mode="markers",
                    marker={"symbol": "x", "size": 12, "color": color},
                    name=f"{dtype}: NaN output (omega overflows)",
                )
            )
    fig.update_xaxes(type="log", title="omega")
    fig.update_yaxes(type="log", title="max |logit error| vs original (float64)")
    fig.update_layout(
        title=title or "Literal form: error against omega (Theorem 9)", template="plotly_white"
    )
    return fig


def error_table_markdown(df: pd.DataFrame, column: str = "max_abs_err") -> str:
    """A markdown table of ``column``: rows omega, columns dtype (``NaN`` marks overflow).

    Args:
        df: From :func:`omega_error_table`.
        column: Which column to show.

    Returns:
        Markdown text, with a last row giving each dtype's baseline.
    """
    import pandas as pd

    wide = df.pivot(index="omega", columns="dtype", values=column)
    dtypes = list(dict.fromkeys(df["dtype"]))
    wide = wide[dtypes]
    lines = ["| omega | " + " | ".join(dtypes) + " |", "|---:|" + "---:|" * len(dtypes)]
    for omega, row in wide.iterrows():
        cells = ["NaN (overflow)" if pd.isna(v) else f"{v:.1e}" for v in row]
        lines.append(f"| {omega:g} | " + " | ".join(cells) + " |")
    base = df.groupby("dtype", sort=False)["baseline_max_abs_err"].first()
    lines.append(
        "| original model in dtype | " + " | ".join(f"{base[d]:.1e}" for d in dtypes) + " |"
    )
    return "\n".join(lines)


__all__ = [
    "COLUMNS",
    "DEFAULT_DTYPES",
    "DEFAULT_OMEGA",
    "DEFAULT_OMEGAS",
    "TYPICAL_SCORE_RANGE",
    "error_table_markdown",
    "max_masked_attention",
    "omega_requirement",
    "omega_warnings",
    "plot_omega_error",
]
