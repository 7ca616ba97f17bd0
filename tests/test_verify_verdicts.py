"""verify_conversion: a PASS/FAIL verdict per dtype, for exact and approximate activations, on
both model kinds (an AttnOnlyTransformer against its HookedTransformer, TL 3.x; a converted
TransformerBridge against an unconverted bridge of the same weights, TL 3.x and 4.x)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, make_tokens
from kinds import make_bridge, make_hf, make_hooked
from kinds import make_tokens as make_kind_tokens

from tl_attnonly import convert
from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER
from tl_attnonly.adapt import analysis_model
from tl_attnonly.components.neuron_head_base import NeuronHeadBase
from tl_attnonly.verify import verify_conversion

DTYPES = (torch.float32, torch.float64)
KINDS = ("hooked", "bridge")


@pytest.mark.parametrize("act_fn", ["silu", "gelu_new", "relu"])
def test_a_correct_conversion_passes_in_both_dtypes(act_fn):
    model = make_model(act_fn, normalization_type="LN")
    # ReLU at the default relu_k (1e6) is exact on this input: the approximation is made
    # visible at the earlier default, relu_k = 100
    converted = convert(model, relu_k=100.0) if act_fn == "relu" else convert(model)
    verdicts = verify_conversion(model, converted, make_tokens())
    assert [v.dtype for v in verdicts] == list(DTYPES)
    assert all(v.passed for v in verdicts), verdicts
    for v in verdicts:
        assert 0 <= v.max_abs_diff <= v.tolerance
        if act_fn == "silu":
            assert v.reference == "original" and v.approximation_diff == v.max_abs_diff
        else:
            # the approximation costs more than the conversion: the verdict checks the latter
            assert v.reference == "original with the heads' activation"
            factor = 1e3 if v.dtype == torch.float64 else 2  # float32 rounding ~1e-6
            assert v.approximation_diff > factor * v.max_abs_diff
    # both models are back in their own dtype, and still usable with autograd
    assert model.cfg.dtype == converted.cfg.dtype == torch.float64
    for param in [*model.parameters(), *converted.parameters()]:
        assert param.dtype == torch.float64 and not param.is_inference()


@pytest.mark.parametrize("act_fn", ["silu", "gelu_new"])
def test_a_wrong_conversion_fails(act_fn):
    model = make_model(act_fn, normalization_type="LN")
    converted = convert(model)
    with torch.no_grad():
        # a small slip in one coordinate (a uniform shift would vanish in LayerNorm)
        converted.blocks[1].mlp.b_out[0] += 1e-2
    verdicts = verify_conversion(model, converted, make_tokens())
    assert not any(v.passed for v in verdicts)
    assert all(v.max_abs_diff > v.tolerance for v in verdicts)


def test_an_explicit_tolerance_is_used():
    model = make_model("gelu_new")
    converted = convert(model)
    with torch.no_grad():
        converted.blocks[0].mlp.W_out[0, 0] += 1e-6  # a tiny slip
    loose = verify_conversion(model, converted, make_tokens(), tolerance=1.0)
    assert [v.tolerance for v in loose] == [1.0, 1.0] and all(v.passed for v in loose)
    default = verify_conversion(model, converted, make_tokens())
    assert not default[1].passed  # float64's default tolerance sees it


def test_refuses_an_unconverted_model():
    model = make_model("silu")
    with pytest.raises(TypeError, match="tl_attnonly.convert"):
        verify_conversion(model, model, make_tokens())


@pytest.mark.parametrize("zoo_name", ["llama", "reglu_ln"])
def test_gated_conversions_pass(zoo_name):
    from conftest import GATED_ZOO

    overrides = dict(GATED_ZOO[zoo_name])
    act_fn = overrides.pop("act_fn", "silu")
    model = make_model(act_fn, **overrides)
    verdicts = verify_conversion(model, convert(model), make_tokens())
    assert all(v.passed for v in verdicts), verdicts


# ------------------------------------------------------------------ both model kinds
def _pair(kind: str, family: str):
    """``(original, converted)`` of the same random weights: a HookedTransformer and its
    AttnOnlyTransformer (TL 3.x), or two bridges, one converted in place."""
    if kind == "hooked":
        if not HAS_HOOKED_TRANSFORMER:
            pytest.skip("HookedTransformer: TransformerLens 3.x")
        hf, config = make_hf(family)
        original = make_hooked(family, hf, config)
        return original, convert(original)
    return make_bridge(family, convert=False), make_bridge(family)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ["llama_gqa", "gpt2", "gemma"])
def test_both_kinds_pass_against_their_reference(kind, family):
    """SwiGLU (LLaMA) and SiLU (GPT-2): exact, against the model before conversion; GeGLU (Gemma,
    4 fitted heads per neuron): against it with the heads' activation, which the conversion matches
    to rounding while the model itself differs by the fit's error."""
    original, converted = _pair(kind, family)
    verdicts = verify_conversion(original, converted, make_kind_tokens())
    assert [v.dtype for v in verdicts] == list(DTYPES)
    assert all(v.passed for v in verdicts), verdicts
    fp64 = verdicts[1]
    assert fp64.max_abs_diff <= 1e-10
    name = {"hooked": "original", "bridge": "unconverted bridge"}[kind]
    if family == "gemma":
        assert fp64.reference == f"{name} with the heads' activation"
        assert fp64.approximation_diff > 1e3 * max(fp64.max_abs_diff, 1e-15)
    else:
        assert fp64.reference == name
        assert fp64.approximation_diff <= fp64.max_abs_diff
    table = fp64.table
    assert list(table["activation"]) == [
        "logits", "resid_pre", "attn_out", "resid_mid", "mlp pre", "mlp post", "mlp_out",
        "resid_post",
    ]  # fmt: skip
    assert (table["n_hooks"][1:] == 2).all() and (table["max_abs_value"] > 0).all()
    # both models are back in their own dtype, and still usable with autograd
    for model in (original, converted):
        assert analysis_model(model, neuron_heads=False).cfg.dtype == torch.float64
        assert all(p.dtype == torch.float64 and not p.is_inference() for p in model.parameters())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ["llama_gqa", "gemma"])
def test_a_perturbed_conversion_fails_on_both_kinds(kind, family):
    """Neuron-heads that compute something else (layer 1's z off by 0.1 %) fail every dtype."""
    original, converted = _pair(kind, family)
    converted.blocks[1].mlp.hook_z.add_hook(lambda z, hook: z * 1.001, is_permanent=True)
    verdicts = verify_conversion(original, converted, make_kind_tokens())
    assert [v.passed for v in verdicts] == [False, False]
    assert all(v.max_abs_diff > v.tolerance for v in verdicts)


@pytest.mark.parametrize("kind", KINDS)
def test_the_fused_path_is_checked_too(kind, monkeypatch):
    """Without a hook a neuron-head layer may take its fused path (no per-head tensors); a slip
    there alone fails the verdict (the run with the heads hooked is right)."""
    original, converted = _pair(kind, "llama_gqa")
    fused = NeuronHeadBase._fused_activation

    def slipped(self, x):
        return fused(self, x) * 1.001

    monkeypatch.setattr(NeuronHeadBase, "_fused_activation", slipped)
    verdicts = verify_conversion(original, converted, make_kind_tokens())
    assert [v.passed for v in verdicts] == [False, False]
    # the table comes from the run with the heads hooked: that one is right
    assert verdicts[1].approximation_diff <= 1e-10


@pytest.mark.parametrize("kind", KINDS)
def test_a_layer_whose_heads_did_not_run_raises(kind, monkeypatch):
    """A converted model whose layer 1 computes its output without its neuron-heads, even with a
    hook on them (the right numbers, but no hook_z fires), raises, naming the layer, instead of
    giving a verdict."""
    original, converted = _pair(kind, "gpt2")
    layer = analysis_model(converted).neuron_heads[1]
    monkeypatch.setattr(layer, "_uses_head_path", lambda: False)
    with pytest.raises(RuntimeError, match=r"did not fire in blocks\.1\.mlp:"):
        verify_conversion(original, converted, make_kind_tokens(), dtypes=[torch.float64])


def test_refuses_what_checks_nothing():
    """A bridge converted in place compared with itself, or with another converted bridge, and
    an unconverted bridge as the converted model: refused before any work."""
    original, converted = _pair("bridge", "gpt2")
    tokens = make_kind_tokens()
    with pytest.raises(TypeError, match="same object"):
        verify_conversion(converted, converted, tokens)
    with pytest.raises(TypeError, match="original must be the model before conversion"):
        verify_conversion(make_bridge("gpt2"), converted, tokens)
    with pytest.raises(TypeError, match=r"tl_attnonly\.convert"):
        verify_conversion(original, make_bridge("gpt2", convert=False), tokens)
