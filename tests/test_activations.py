"""Tests for tl_attnonly.activations: neuron-head rewrites of activation functions."""

import json
import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from tl_attnonly.activations import (
    DEFAULT_GELU_HEADS,
    DEFAULT_RELU_K,
    FIT_RANGE,
    FP16_MAX,
    GELU_VARIANTS,
    MAX_GELU_HEADS,
    PAPER_GELU_SLOPE,
    RELU_SIGMOID_ERROR_CONSTANT,
    SUPPORTED_ACTIVATIONS,
    NeuronHeadCoefficients,
    activation_error_table,
    fit_metadata,
    fp16_safe,
    head_coefficients,
    max_score_magnitude,
    relu_sigmoid_max_error,
    representable_slopes,
)

KS = range(1, MAX_GELU_HEADS + 1)
# Max errors (float64, |x| <= 20) reached by the stored fits at the default K; the goal was 1e-4.
DEFAULT_K_ERROR_REACHED = {
    "gelu": 1.2e-5,
    "gelu_new": 2.1e-5,
    "gelu_fast": 2.1e-5,
    "gelu_pytorch_tanh": 2.1e-5,
}


def _all_coefficients() -> list[NeuronHeadCoefficients]:
    out = [head_coefficients("silu"), head_coefficients("relu")]
    out.append(head_coefficients("relu", relu_k=7.5))
    for name in GELU_VARIANTS:
        out += [head_coefficients(name, k) for k in KS]
        out.append(head_coefficients(name, gelu_method="paper"))
    return out


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """These small CPU workloads are fastest single-threaded (restored afterwards)."""
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n_threads)


@pytest.fixture(scope="module")
def gelu_errors() -> dict[str, list[float]]:
    """Recomputed max errors on |x| <= FIT_RANGE for every GELU variant and K = 1..6."""
    return {
        name: [head_coefficients(name, k).max_abs_error() for k in KS] for name in GELU_VARIANTS
    }


def test_supported_activations_constant():
    assert SUPPORTED_ACTIVATIONS == (
        "silu",
        "relu",
        "gelu",
        "gelu_new",
        "gelu_fast",
        "gelu_pytorch_tanh",
    )
    assert DEFAULT_RELU_K == 1e6
    assert FIT_RANGE == 20.0


@pytest.mark.parametrize("name", GELU_VARIANTS)
def test_default_heads_meet_goal(name, gelu_errors):
    coeffs = head_coefficients(name)
    assert coeffs.n_heads == DEFAULT_GELU_HEADS
    assert coeffs.method == "fit"
    err = gelu_errors[name][DEFAULT_GELU_HEADS - 1]
    assert err <= 1e-4
    assert err <= DEFAULT_K_ERROR_REACHED[name]


def test_default_heads_is_smallest_meeting_goal(gelu_errors):
    assert all(gelu_errors[name][DEFAULT_GELU_HEADS - 1] <= 1e-4 for name in GELU_VARIANTS)
    assert any(gelu_errors[name][DEFAULT_GELU_HEADS - 2] > 1e-4 for name in GELU_VARIANTS)


@pytest.mark.parametrize("name", GELU_VARIANTS)
def test_errors_non_increasing_with_k(name, gelu_errors):
    errs = gelu_errors[name]
    for k in range(1, len(errs)):
        assert errs[k] <= errs[k - 1] * (1 + 1e-9), (name, k + 1, errs)
    # the richer family beats the paper family sum_k c_k x sigmoid(b_k x) (K=2: 5.2e-3,
    # K=4: 9.4e-4, K=6: 3.5e-4)
    assert errs[1] < 5.2e-3 and errs[3] < 9.4e-4 and errs[5] < 3.5e-4


@pytest.mark.parametrize("name", GELU_VARIANTS)
def test_stored_fits_consistent(name, gelu_errors):
    from tl_attnonly.activations import _load_fits

    stored = _load_fits()["fits"][name]
    assert sorted(stored, key=int) == [str(k) for k in KS]
    for k in KS:
        entry = stored[str(k)]
        coeffs = head_coefficients(name, k)
        assert coeffs.n_heads == k
        assert entry["max_abs_error"] == pytest.approx(gelu_errors[name][k - 1], rel=1e-6)
        assert entry["coef_l1"] == pytest.approx(coeffs.coef_l1, rel=1e-12)
        # exact constraints: h -> x (x -> +inf), h -> 0 (x -> -inf)
        assert math.fsum(coeffs.f) == pytest.approx(1.0, abs=1e-12)
        assert math.fsum(coeffs.e) == pytest.approx(0.0, abs=1e-12)
        assert math.fsum(coeffs.g) == pytest.approx(0.0, abs=1e-12)
        assert all(b > 0 for b in coeffs.b)
        assert coeffs.coef_l1 < 10.0


def test_fit_metadata():
    meta = fit_metadata()
    assert meta["range"] == [-FIT_RANGE, FIT_RANGE]
    assert meta["grid"]["n"] == 200001
    assert meta["script"] == "scripts/fit_activation_heads.py"


@pytest.mark.parametrize("name", GELU_VARIANTS)
def test_paper_one_head(name, gelu_errors):
    coeffs = head_coefficients(name, gelu_method="paper")
    assert coeffs.method == "paper"
    assert coeffs.n_heads == 1
    assert coeffs.b == (PAPER_GELU_SLOPE,)
    err = coeffs.max_abs_error()
    assert 0.015 <= err <= 0.025
    assert gelu_errors[name][0] < err  # the fitted slope (~1.773) beats 1.702


def test_silu_exact_fp64():
    coeffs = head_coefficients("silu")
    assert coeffs.method == "exact" and coeffs.n_heads == 1
    x = torch.linspace(-50, 50, 100001, dtype=torch.float64)
    ref = F.silu(x)
    rel = (coeffs.evaluate(x) - ref).abs() / ref.abs().clamp_min(1e-300)
    assert rel.max().item() <= 1e-15
    assert coeffs.max_abs_error() <= 1e-14


@pytest.mark.parametrize("k", [10.0, DEFAULT_RELU_K, 1000.0])
def test_relu_error_is_0_2785_over_k(k):
    coeffs = head_coefficients("relu", relu_k=k)
    assert coeffs.method == "sigmoid_k" and coeffs.relu_k == k and coeffs.b == (k,)
    err = coeffs.max_abs_error()
    assert round(err * k, 4) == pytest.approx(0.2785, abs=1e-4)  # 3 significant digits
    assert err == pytest.approx(relu_sigmoid_max_error(k), rel=1e-9)


def test_default_relu_k_is_exact_to_rounding():
    """The default ReLU head ``x sigmoid(k x)`` is within 1e-6 of ReLU: the bound, and the error
    measured on a grid dense enough to resolve its peak at ``|x| = 1.28 / k`` (spacing 1e-10 on
    ``|x| <= 1e-4``, plus ``|x| <= 20``), in float64 and float32."""
    assert relu_sigmoid_max_error(DEFAULT_RELU_K) <= 1e-6
    coeffs = head_coefficients("relu")
    assert coeffs.relu_k == DEFAULT_RELU_K
    near = torch.linspace(-1e-4, 1e-4, 2_000_001, dtype=torch.float64)
    x = torch.cat([near, torch.linspace(-FIT_RANGE, FIT_RANGE, 400_001, dtype=torch.float64)])
    err = (coeffs.evaluate(x) - F.relu(x)).abs().max().item()
    assert err <= 1e-6
    assert err == pytest.approx(relu_sigmoid_max_error(DEFAULT_RELU_K), rel=1e-3)  # the peak
    x32 = x.float()  # float32: the same peak (rounding adds ~1e-13 there, 0 at |x| >= 1e-4)
    assert (coeffs.evaluate(x32).double() - F.relu(x32.double())).abs().max().item() <= 1e-6


def test_default_relu_k_in_float16_is_held_at_its_largest_value():
    """float16 cannot hold 1e6: the slope is held at 65504, so ``x = 0`` gives 0, not NaN
    (``inf * 0``), and the error is ``0.2785 / 65504``."""
    coeffs = head_coefficients("relu")
    assert representable_slopes(coeffs.b, torch.float16) == (FP16_MAX,)
    assert representable_slopes(coeffs.b, torch.float32) == coeffs.b
    x = torch.cat([torch.linspace(-1, 1, 2001), torch.linspace(-1e-3, 1e-3, 20001)]).half()
    assert (x == 0).any()
    y = coeffs.evaluate(x)
    assert torch.isfinite(y).all()
    err = (y.double() - F.relu(x.double())).abs().max().item()
    # measured 4.23e-6; 6e-8 is float16's spacing near the peak (|x| = 2e-5)
    assert relu_sigmoid_max_error(FP16_MAX) / 2 <= err <= relu_sigmoid_max_error(FP16_MAX) + 6e-8


def test_relu_error_constant_is_lambert_w():
    special = pytest.importorskip("scipy.special")
    assert RELU_SIGMOID_ERROR_CONSTANT == pytest.approx(
        float(special.lambertw(1 / math.e).real), rel=1e-15
    )


@pytest.mark.parametrize("name", GELU_VARIANTS)
def test_gelu_error_bounded_far_outside_fit_range(name, gelu_errors):
    x = torch.linspace(-1000, 1000, 100001, dtype=torch.float64)
    x = torch.cat([x, torch.tensor([-1e6, -1e4, 1e4, 1e6], dtype=torch.float64)])
    for k in KS:
        coeffs = head_coefficients(name, k)
        y = coeffs.evaluate(x)
        assert torch.isfinite(y).all()
        err = (y - coeffs.reference(x)).abs().max().item()
        # the error decays outside |x| <= 20: no larger than inside (up to rounding at 1e6)
        assert err <= gelu_errors[name][k - 1] * 1.01 + 1e-9, (name, k, err)


def test_relu_silu_bounded_far_outside_fit_range():
    x = torch.linspace(-1000, 1000, 400001, dtype=torch.float64)
    relu = head_coefficients("relu")
    assert (relu.evaluate(x) - F.relu(x)).abs().max().item() <= relu_sigmoid_max_error(
        DEFAULT_RELU_K
    )
    silu = head_coefficients("silu")
    assert (silu.evaluate(x) - F.silu(x)).abs().max().item() <= 1e-12


@pytest.mark.parametrize("name", ["solu", "solu_ln", "xielu", "relu2", "swish", "GELU", ""])
def test_unsupported_activation_raises(name):
    with pytest.raises(ValueError, match="(?i)supported") as info:
        head_coefficients(name)
    assert repr(name) in str(info.value)
    assert "gelu_pytorch_tanh" in str(info.value)


@pytest.mark.parametrize("n_heads", [0, -1, 7, 2.5, True])
def test_invalid_gelu_n_heads_raises(n_heads):
    with pytest.raises(ValueError, match=r"1\.\.6"):
        head_coefficients("gelu", n_heads=n_heads)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"act_fn": "silu", "n_heads": 2},
        {"act_fn": "relu", "n_heads": 3},
        {"act_fn": "gelu", "n_heads": 2, "gelu_method": "paper"},
        {"act_fn": "gelu", "gelu_method": "remez"},
        {"act_fn": "relu", "relu_k": 0.0},
        {"act_fn": "relu", "relu_k": -5.0},
        {"act_fn": "relu", "relu_k": float("inf")},
        {"act_fn": "relu", "relu_k": float("nan")},
    ],
)
def test_invalid_options_raise(kwargs):
    with pytest.raises(ValueError):
        head_coefficients(**kwargs)


def test_numpy_integer_n_heads_accepted():
    np = pytest.importorskip("numpy")
    assert head_coefficients("gelu", n_heads=np.int64(3)) == head_coefficients("gelu", n_heads=3)


def test_single_head_methods_accept_one():
    assert head_coefficients("silu", n_heads=1) == head_coefficients("silu")
    assert head_coefficients("relu", n_heads=1).n_heads == 1
    assert head_coefficients("gelu_new", n_heads=1, gelu_method="paper").n_heads == 1


@pytest.mark.parametrize("coeffs", _all_coefficients(), ids=lambda c: f"{c.activation}-{c.method}")
def test_to_dict_round_trip(coeffs):
    data = coeffs.to_dict()
    assert NeuronHeadCoefficients.from_dict(data) == coeffs
    restored = NeuronHeadCoefficients.from_dict(json.loads(json.dumps(data)))
    assert restored == coeffs
    assert restored.to_dict() == data


def test_invalid_coefficients_rejected():
    with pytest.raises(ValueError):
        NeuronHeadCoefficients("gelu", "fit", (1.0, 2.0), (0.0,), (1.0,), (0.0,), (0.0,))
    with pytest.raises(ValueError):
        NeuronHeadCoefficients("gelu", "fit", (-1.0,), (0.0,), (1.0,), (0.0,), (0.0,))
    with pytest.raises(ValueError):
        NeuronHeadCoefficients("gelu", "magic", (1.0,), (0.0,), (1.0,), (0.0,), (0.0,))


@pytest.mark.parametrize(
    "coeffs",
    [head_coefficients("silu"), head_coefficients("relu"), head_coefficients("relu", relu_k=10.0)]
    + [head_coefficients(name, k) for name in GELU_VARIANTS for k in (DEFAULT_GELU_HEADS, 6)],
    ids=lambda c: f"{c.activation}-K{c.n_heads}",
)
def test_fp32_matches_fp64_within_bound(coeffs):
    x32 = torch.linspace(-FIT_RANGE, FIT_RANGE, 40001, dtype=torch.float32)
    x64 = x32.to(torch.float64)  # the same values
    y32 = coeffs.evaluate(x32)
    assert y32.dtype == torch.float32
    diff = (y32.to(torch.float64) - coeffs.evaluate(x64)).abs()
    bound = coeffs.evaluation_error_bound(x32)
    assert (diff <= bound).all(), (diff / bound).max().item()
    # and the bound itself is small (coef_l1 <= 8): below 1e-4 anywhere on |x| <= 20
    assert bound.max().item() < 1e-4


def test_evaluate_keeps_shape_and_dtype():
    coeffs = head_coefficients("gelu")
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0)).to(dtype)
        y = coeffs.evaluate(x)
        assert y.shape == x.shape and y.dtype == dtype
        ref = coeffs.reference(x.to(torch.float64))
        assert (y.to(torch.float64) - ref).abs().max().item() < 0.05
    with pytest.raises(TypeError):
        coeffs.evaluate(torch.arange(5))


def test_max_score_magnitude_and_fp16():
    for coeffs in _all_coefficients():
        x = torch.linspace(-FIT_RANGE, FIT_RANGE, 2001, dtype=torch.float64).unsqueeze(-1)
        b, d, f, e, g = (
            torch.tensor(v, dtype=torch.float64)
            for v in (coeffs.b, coeffs.d, coeffs.f, coeffs.e, coeffs.g)
        )
        mags = max_score_magnitude(coeffs)
        assert mags.score == pytest.approx((x * b + d).abs().max().item(), rel=1e-12)
        value = max((x * f + e).abs().max().item(), g.abs().max().item())
        assert mags.value == pytest.approx(value, rel=1e-12)
        score, _ = mags  # a plain (score, value) tuple
        assert score == mags.score
        # (the default ReLU's scores, 2e7 at |x| = 20, pass float16's 65504)
        assert fp16_safe(coeffs) == (coeffs.relu_k != DEFAULT_RELU_K)
    sharp = head_coefficients("relu", relu_k=1e4)
    assert max_score_magnitude(sharp).score == pytest.approx(2e5)
    assert not fp16_safe(sharp)
    assert fp16_safe(sharp, x_range=FP16_MAX / 1e4 * 0.99)


def test_activation_error_table():
    table = activation_error_table()
    assert isinstance(table, pd.DataFrame)
    assert list(table.columns)[:5] == [
        "activation",
        "method",
        "n_heads",
        "max_abs_error",
        "coef_l1",
    ]
    assert len(table) == 1 + 3 + len(GELU_VARIANTS) * (MAX_GELU_HEADS + 1)
    silu = table[table.activation == "silu"]
    assert len(silu) == 1 and silu.max_abs_error.iloc[0] < 1e-14
    gelu = table[(table.activation == "gelu") & (table.method == "fit")]
    assert list(gelu.n_heads) == list(KS)
    assert gelu.max_abs_error.is_monotonic_decreasing
    relu = table[table.activation == "relu"]
    assert (relu.max_abs_error * relu.relu_k).round(4).eq(0.2785).all()

    small = activation_error_table("gelu_new", max_heads=3)
    assert list(small.method) == ["fit", "fit", "fit", "paper"]
    with pytest.raises(ValueError, match="(?i)supported"):
        activation_error_table("solu")
