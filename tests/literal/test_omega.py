"""The omega/dtype error table of the literal form (tl_attnonly.omega)."""

from __future__ import annotations

import copy
import math
import warnings

import pandas as pd
import plotly.graph_objects as go
import pytest
import torch
from test_literal import make_model, make_tokens

from tl_attnonly.activations import DEFAULT_RELU_K, FIT_RANGE
from tl_attnonly.literal import to_literal
from tl_attnonly.omega import (
    COLUMNS,
    DEFAULT_OMEGA,
    error_table_markdown,
    max_masked_attention,
    omega_error_table,
    omega_requirement,
    plot_omega_error,
)

warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")

OMEGAS = (2, 8, 16, 32, 64, 1e3, 1e4, 1e5)
DTYPES = ("float64", "float32", "bfloat16", "float16")


@pytest.fixture(scope="module")
def table() -> pd.DataFrame:
    model = make_model("LN", dtype=torch.float32)
    return omega_error_table(model, make_tokens(), omegas=OMEGAS, dtypes=DTYPES)


def test_table_shape_and_columns(table):
    assert list(table.columns) == list(COLUMNS)
    assert len(table) == len(OMEGAS) * len(DTYPES)
    assert list(dict.fromkeys(table["dtype"])) == list(DTYPES)


def test_error_decreases_with_omega_until_rounding(table):
    for dtype, part in table.groupby("dtype"):
        errs = part.loc[~part["nonfinite"], "max_abs_err"].tolist()
        floor = min(errs)
        assert errs[0] > 100 * floor, dtype  # omega = 2 is far from exact
        reached = False
        for prev, cur in zip(errs[:-1], errs[1:], strict=True):
            if not reached:
                assert cur <= prev * (1 + 1e-6), (dtype, errs)  # monotone before the floor
            reached = reached or cur <= 2 * floor
        assert reached and errs[-1] <= 2 * floor, (dtype, errs)  # ... and stays at the floor
        # the floor is the dtype's own rounding error (original model in that dtype), not omega's
        baseline = part["baseline_max_abs_err"].iloc[0]
        assert floor <= max(10 * baseline, 1e-13), (dtype, floor, baseline)


def test_fp64_and_fp32_reach_tolerance(table):
    at_default = table[table["omega"] == 1e4].set_index("dtype")["max_abs_err"]
    assert at_default["float64"] <= 1e-8
    assert at_default["float32"] <= 1e-3
    big = table[(table["omega"] >= 1e3) & ~table["overflow"]]
    assert (big["max_leak"] == 0).all()  # the leak underflows to exactly 0


def test_overflow_is_reported_only_where_it_happens(table):
    over = table[table["overflow"]]
    assert list(zip(over["dtype"], over["omega"], strict=True)) == [("float16", 1e5)]
    assert over["nonfinite"].all() and over["max_abs_err"].isna().all()
    assert "overflows" in over["warning"].iloc[0]
    assert math.isinf(over["omega_in_dtype"].iloc[0])
    assert not table.loc[~table["overflow"], "nonfinite"].any()


def test_plot_and_markdown(table):
    fig = plot_omega_error(table)
    assert isinstance(fig, go.Figure)
    names = [trace.name for trace in fig.data]
    assert sum(name in DTYPES for name in names) == len(DTYPES)
    assert any("NaN output" in name for name in names)
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    text = error_table_markdown(table)
    assert text.count("\n") == len(OMEGAS) + 2
    assert "NaN (overflow)" in text


def test_max_masked_attention_sees_leaks():
    from tl_attnonly.literal import to_literal

    model = make_model("LN")
    tokens = make_tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert max_masked_attention(to_literal(model, omega=2.0), tokens) > 0.1
    assert max_masked_attention(to_literal(model), tokens) == 0.0


def test_relu_at_the_default_relu_k_and_the_rounding_of_its_scores():
    """ReLU's default scores (``1e6 x``, up to 2e7) minus omega are rounded in the model's dtype:
    nothing in float64/float32 (exact to rounding, no warning); in bfloat16 the rounding
    (``eps * 2e7 = 1.6e5``) swamps the default omega, which ``to_literal`` says, and an omega
    above it gives back the model's own bfloat16 error (measured: 1.8 at omega = 1e4, 4.6e-2 at
    2e5, the original model in bfloat16 6.2e-2)."""
    model, tokens = make_model("LN", act_fn="relu"), make_tokens()
    reference = model(tokens)
    err = {}
    for dtype, omega in [
        (torch.float64, DEFAULT_OMEGA),
        (torch.float32, DEFAULT_OMEGA),
        (torch.bfloat16, 2e5),
    ]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            literal = to_literal(model, dtype=dtype, omega=omega)
        err[dtype] = (literal(tokens).double() - reference).abs().max().item()
    baseline = {
        dtype: (copy.deepcopy(model).to(dtype, print_details=False)(tokens).double() - reference)
        .abs()
        .max()
        .item()
        for dtype in (torch.float32, torch.bfloat16)
    }
    assert err[torch.float64] <= 1e-12  # measured 3.0e-15
    assert err[torch.float32] <= 2 * baseline[torch.float32]  # 1.4e-6 vs 1.4e-6
    assert err[torch.bfloat16] <= 2 * baseline[torch.bfloat16]
    max_score = DEFAULT_RELU_K * FIT_RANGE
    # float32: the scores' rounding costs 2.4 of omega; bfloat16: 1.6e5
    assert (
        omega_requirement(torch.float32, 13, max_score=max_score)
        < omega_requirement(torch.float32, 13) + 3
    )
    assert omega_requirement(torch.bfloat16, 13, max_score=max_score) > DEFAULT_OMEGA
    with pytest.warns(UserWarning, match="lose up to eps"):
        bad = to_literal(model, dtype=torch.bfloat16)
    assert (bad(tokens).double() - reference).abs().max().item() > 0.5
