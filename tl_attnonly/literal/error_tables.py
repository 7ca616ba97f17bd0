"""Whole-model error tables of the literal form (each builds :func:`~.literal.to_literal`).

* :func:`omega_error_table`: per omega and dtype (Theorem 9's mask), see
  :mod:`tl_attnonly.literal.omega`;
* :func:`gated_literal_error_table`: gated MLPs, per product eps and dtype, see
  :mod:`tl_attnonly.literal.gated`.

They live above the builder (which imports :mod:`~tl_attnonly.literal.omega` and
:mod:`~tl_attnonly.literal.gated` for its checks), so no module of :mod:`tl_attnonly.literal`
imports one that imports it.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Int
from torch import Tensor

from tl_attnonly.activations import max_score_magnitude
from tl_attnonly.hooks import neuron_act_name
from tl_attnonly.literal.build import to_literal
from tl_attnonly.literal.gated import default_product_eps
from tl_attnonly.literal.omega import (
    COLUMNS,
    DEFAULT_DTYPES,
    DEFAULT_OMEGAS,
    logits_and_leak,
    omega_warnings,
)
from tl_attnonly.options import ConversionOptions

if TYPE_CHECKING:
    import pandas as pd
    from transformer_lens import HookedTransformer


def _dtype(d: str | torch.dtype) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    dt = getattr(torch, str(d).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"Unknown dtype {d!r}")
    return dt



def _max_neuron_score(model: HookedTransformer, literal_kwargs: dict[str, Any]) -> float:
    """The largest neuron-head score of the literal model ``to_literal(model, **literal_kwargs)``
    builds (its rounding eats into omega, see :func:`~tl_attnonly.literal.omega_requirement`)."""
    options = literal_kwargs.get("options")
    coefficients = literal_kwargs.get("coefficients", getattr(options, "coefficients", None))
    if coefficients is None:
        conversion = literal_kwargs.get("conversion") or ConversionOptions()
        coefficients = conversion.coefficients(model.cfg.act_fn)
    return max_score_magnitude(coefficients).score


def omega_error_table(
    model: HookedTransformer,
    tokens: Int[torch.Tensor, "batch pos"],
    omegas: Sequence[float] = DEFAULT_OMEGAS,
    dtypes: Sequence[str | torch.dtype] = DEFAULT_DTYPES,
    **literal_kwargs: Any,
) -> pd.DataFrame:
    """Error of the literal form against the original model, per omega and dtype.

    For each omega the literal model is built once (in float64, as
    :func:`~tl_attnonly.literal.to_literal` always does) and cast to each dtype.

    Args:
        model: The original TransformerLens model (not modified).
        tokens: Input ``[batch, pos]``.
        omegas: Omega values to try.
        dtypes: Dtypes to run the literal model (and the baseline) in: names (``"float16"``)
            or ``torch.dtype``.
        **literal_kwargs: Passed to :func:`~tl_attnonly.literal.to_literal` (``layout``,
            ``mask``, ``coefficients``, ``tol``, ...).

    Returns:
        One row per (dtype, omega) with columns

        * ``dtype``, ``omega``;
        * ``omega_in_dtype``: the value omega takes in the dtype (``inf`` once it overflows);
        * ``overflow``: omega is not finite in the dtype;
        * ``max_abs_err``, ``mean_abs_err``: literal logits in the dtype vs original in float64
            (NaN when the output is not finite);
        * ``baseline_max_abs_err``: the original model in the dtype vs float64, i.e. the error the
            dtype alone causes;
        * ``max_leak``: largest attention mass on masked keys (see :func:`max_masked_attention`);
        * ``nonfinite``: some literal logit is NaN or inf;
        * ``warning``: what :func:`~tl_attnonly.literal.to_literal` warns for this omega and dtype.
    """
    import pandas as pd


    reference_model = copy.deepcopy(model).to(torch.float64, print_details=False)
    with torch.no_grad():
        reference = reference_model(tokens).double()
    dts = [_dtype(name) for name in dtypes]
    baselines = {}
    for dt in dts:
        baseline_model = copy.deepcopy(model).to(dt, print_details=False)
        with torch.no_grad():
            baselines[dt] = (baseline_model(tokens).double() - reference).abs().max().item()
        del baseline_model
    uses_omega = literal_kwargs.get("mask", "omega") != "ordinary"
    max_score = _max_neuron_score(model, literal_kwargs)
    rows = []
    for omega in omegas:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # re-derived per dtype below
            built = to_literal(reference_model, omega=omega, dtype=torch.float64, **literal_kwargs)
        for dt in dts:
            literal = built if dt == torch.float64 else copy.deepcopy(built).to(dt)
            messages = (
                omega_warnings(
                    omega, dt, built.layout.n_pos, literal_kwargs.get("tol"), max_score=max_score
                )
                if uses_omega
                else []
            )
            logits, leak = logits_and_leak(literal, tokens)
            logits = logits.double()
            finite = bool(torch.isfinite(logits).all())
            err = (logits - reference).abs()
            in_dtype = torch.tensor(float(omega), dtype=dt).item()
            rows.append(
                {
                    "dtype": str(dt).replace("torch.", ""),
                    "omega": float(omega),
                    "omega_in_dtype": in_dtype,
                    "overflow": not math.isfinite(in_dtype),
                    "max_abs_err": err.max().item() if finite else math.nan,
                    "mean_abs_err": err.mean().item() if finite else math.nan,
                    "baseline_max_abs_err": baselines[dt],
                    "max_leak": leak,
                    "nonfinite": not finite,
                    "warning": " | ".join(messages),
                }
            )
            del literal
    order = {str(dt).replace("torch.", ""): i for i, dt in enumerate(dts)}
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    df = df.sort_values(["dtype", "omega"], key=lambda c: c.map(order) if c.name == "dtype" else c)
    return df.reset_index(drop=True)



def gated_literal_error_table(
    model: HookedTransformer,
    tokens: Tensor,
    eps_values: Sequence[float | None] = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8, None),
    dtypes: Sequence[str] = ("float64", "float32"),
    **literal_kwargs: Any,
) -> pd.DataFrame:
    """Whole-model error of the gated literal form, per product eps and dtype.

    The literal model (``layout="split"``) is built in float64 for each eps and cast to each
    dtype; its logits are compared with the original model run in float64.

    Args:
        model: A TransformerLens ``HookedTransformer`` with a gated MLP (not modified).
        tokens: Input ``[batch, pos]``.
        eps_values: Product eps values; ``None`` = the automatic choice for each dtype.
        dtypes: Dtype names to run in.
        **literal_kwargs: Passed to :func:`~tl_attnonly.literal.to_literal`.

    Returns:
        One row per (dtype, eps): ``eps`` (the value used), ``auto``, ``max_abs_err``,
        ``mean_abs_err``, ``baseline_max_abs_err`` (the original model in the dtype vs float64),
        ``max_abs_product`` (largest ``|g u|`` over layers, neurons and tokens).
    """
    import copy
    import warnings

    import pandas as pd


    reference_model = copy.deepcopy(model).to(torch.float64, print_details=False)
    with torch.no_grad():
        reference, cache = reference_model.run_with_cache(
            tokens, names_filter=lambda n: n.endswith(("mlp.hook_pre", "mlp.hook_pre_linear"))
        )
    n_layers = reference_model.cfg.n_layers
    max_product = max(
        float((cache[neuron_act_name("pre", i)] * cache[neuron_act_name("pre_linear", i)])
              .abs().max())
        for i in range(n_layers)
    )  # fmt: skip
    records = []
    for name in dtypes:
        dtype = getattr(torch, name)
        baseline_model = copy.deepcopy(model).to(dtype, print_details=False)
        with torch.no_grad():
            baseline = float((baseline_model(tokens).double() - reference).abs().max())
        del baseline_model
        for eps in eps_values:
            used = default_product_eps(dtype) if eps is None else float(eps)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a poor eps is what the table is for
                literal = to_literal(
                    reference_model, layout="split", dtype=torch.float64, product_eps=used,
                    **literal_kwargs,
                ).to(dtype)  # fmt: skip
            with torch.no_grad():
                err = (literal(tokens).double() - reference).abs()
            records.append(
                {
                    "dtype": name,
                    "eps": used,
                    "auto": eps is None,
                    "max_abs_err": float(err.max()),
                    "mean_abs_err": float(err.mean()),
                    "baseline_max_abs_err": baseline,
                    "max_abs_product": max_product,
                }
            )
            del literal
    return pd.DataFrame.from_records(records)


__all__ = ["gated_literal_error_table", "omega_error_table"]
