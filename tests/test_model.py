"""AttnOnlyTransformer as a HookedTransformer: TL tooling, weight processing, save/load, dtypes."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from conftest import make_config, make_model
from transformer_lens import HookedTransformer, SVDInterpreter
from transformer_lens import HookedTransformer as HT

import tl_attnonly.hub as hub
from tl_attnonly import AttnOnlyTransformer, ConversionOptions, convert

PROCESS = dict(fold_ln=True, center_writing_weights=True, center_unembed=True)


def test_tl_weight_properties_and_tools_unchanged(tokens):
    model = make_model("silu", torch.float64, normalization_type="LN")
    converted = convert(model)
    for name in ("W_in", "b_in", "W_out", "b_out", "W_Q", "W_O", "W_U", "W_E"):
        assert torch.equal(getattr(model, name), getattr(converted, name)), name
    for layer in range(model.cfg.n_layers):
        torch.testing.assert_close(
            model.accumulated_bias(layer, mlp_input=True),
            converted.accumulated_bias(layer, mlp_input=True),
        )
    _, cache = model.run_with_cache(tokens)
    _, conv_cache = converted.run_with_cache(tokens)
    torch.testing.assert_close(cache.get_neuron_results(1), conv_cache.get_neuron_results(1))
    resid, labels = cache.get_full_resid_decomposition(expand_neurons=True, return_labels=True)
    conv_resid, conv_labels = conv_cache.get_full_resid_decomposition(
        expand_neurons=True, return_labels=True
    )
    assert labels == conv_labels
    torch.testing.assert_close(resid, conv_resid)
    # SVDInterpreter only runs in float32 (TL mixes dtypes in it)
    model.to(torch.float32, print_details=False)
    converted.to(torch.float32, print_details=False)
    svd = SVDInterpreter(model).get_singular_vectors("w_in", layer_index=0, num_vectors=3)
    conv_svd = SVDInterpreter(converted).get_singular_vectors("w_in", layer_index=0, num_vectors=3)
    torch.testing.assert_close(svd, conv_svd)


@pytest.mark.parametrize("norm", ["LN", "RMS"])
def test_processing_after_conversion_equals_processing_before(norm, tokens):
    """process_weights_ on the converted model == convert(processed model) == processed original."""
    model = make_model("silu", torch.float64, normalization_type=norm)
    converted_then_processed = convert(model)
    converted_then_processed.process_weights_(**PROCESS)
    processed = make_model("silu", torch.float64, normalization_type=norm)
    processed.process_weights_(**PROCESS)
    processed_then_converted = convert(processed)
    assert converted_then_processed.cfg.normalization_type == processed.cfg.normalization_type
    expected = processed(tokens)
    torch.testing.assert_close(converted_then_processed(tokens), expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(processed_then_converted(tokens), expected, rtol=0, atol=1e-10)
    # and the processing itself kept the function (up to the per-position shift of center_unembed);
    # TL's fold_ln alone moves fp64 logits by ~5e-7, on the original model too.
    original = model(tokens).log_softmax(-1)
    torch.testing.assert_close(expected.log_softmax(-1), original, rtol=0, atol=1e-5)


def test_from_pretrained_goes_through_tl_loading(monkeypatch, tokens):
    """TL's own from_pretrained builds AttnOnlyTransformer and processes its weights."""
    ht_module = sys.modules["transformer_lens.HookedTransformer"]
    monkeypatch.setattr(hub, "hub_unreachable", lambda timeout=0: None)  # TL's loading is faked

    source = make_model("gelu_new", torch.float32, normalization_type="LN")
    state = {k: v.clone() for k, v in source.state_dict().items()}

    def fake_config(name, fold_ln=False, dtype=torch.float32, **kwargs):
        cfg = make_config("gelu_new", dtype, normalization_type="LNPre" if fold_ln else "LN")
        cfg.original_architecture = "GPT2LMHeadModel"
        return cfg

    monkeypatch.setattr(ht_module.loading, "get_official_model_name", lambda name: name)
    monkeypatch.setattr(ht_module.loading, "get_pretrained_model_config", fake_config)
    monkeypatch.setattr(
        ht_module.loading,
        "get_pretrained_state_dict",
        lambda *a, **k: {k2: v.clone() for k2, v in state.items()},
    )
    reference = HT.from_pretrained("fake-model", device="cpu")
    model = AttnOnlyTransformer.from_pretrained("fake-model", device="cpu", n_heads_per_neuron=2)
    assert isinstance(model, AttnOnlyTransformer)
    assert model.cfg.normalization_type == "LNPre"
    assert model.n_heads_per_neuron == 2
    expected = convert(reference, n_heads_per_neuron=2)(tokens)
    torch.testing.assert_close(model(tokens), expected, rtol=0, atol=1e-5)
    unprocessed = AttnOnlyTransformer.from_pretrained_no_processing("fake-model", device="cpu")
    assert unprocessed.cfg.normalization_type == "LN"
    assert unprocessed.conversion == ConversionOptions()


@pytest.mark.parametrize("act_fn", ["silu", "gelu"])
def test_save_load_round_trip_is_exact(act_fn, tmp_path, tokens):
    model = convert(make_model(act_fn, torch.float32), n_heads_per_neuron=None)
    model.save_pretrained(tmp_path / "m")
    loaded = AttnOnlyTransformer.load(tmp_path / "m")
    assert loaded.conversion == model.conversion
    assert loaded.coefficients == model.coefficients
    assert loaded.cfg.dtype == model.cfg.dtype
    for (name, p), (name2, q) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert name == name2 and torch.equal(p, q), name
    assert torch.equal(loaded(tokens), model(tokens))
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        AttnOnlyTransformer.load(tmp_path / "nothing-here")


def test_dtype_moves_and_overflow_warning(tokens):
    model = convert(make_model("silu", torch.float32))
    model.to(torch.float64, print_details=False)
    assert model.cfg.dtype == torch.float64
    assert model(tokens).dtype == torch.float64
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model.to(torch.bfloat16, print_details=False)  # SiLU: nothing overflows
    assert model(tokens).dtype == torch.bfloat16
    # Scores of relu_k=1e4 (up to 2e5) overflow float16, harmlessly: no warning (see
    # tests/test_input_validation.py for the warnings that are due).
    relu = convert(make_model("relu", torch.float32), relu_k=1e4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        relu.to(torch.float16, print_details=False)


def test_model_is_a_hooked_transformer():
    converted = convert(make_model())
    assert isinstance(converted, HookedTransformer)
    assert not converted.cfg.attn_only
    assert converted.n_neuron_heads == converted.cfg.d_mlp
    assert all(
        name in converted.hook_dict
        for name in ("blocks.0.mlp.hook_pattern", "blocks.0.hook_resid_mid")
    )


def test_load_refuses_the_wrong_model_class(tmp_path):
    from tl_attnonly import AttnOnlyEncoder

    convert(make_model()).save_pretrained(tmp_path / "decoder")
    with pytest.raises(TypeError, match="AttnOnlyTransformer.load"):
        AttnOnlyEncoder.load(tmp_path / "decoder")
