"""save_pretrained / load keep data whole: no silent redefinition."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from conftest import make_model

import tl_attnonly
import tl_attnonly._version
import tl_attnonly.activations as activations
from tl_attnonly import AttnOnlyTransformer, convert
from tl_attnonly.hooked.conversion_record import SavedModelError


def _bundled_tokenizer():
    from transformers import PreTrainedTokenizerFast

    from tl_attnonly.bundled import bundled_model_dir

    return PreTrainedTokenizerFast.from_pretrained(str(bundled_model_dir()), local_files_only=True)


def test_failed_save_leaves_the_previous_save_whole(tmp_path, monkeypatch, tokens):
    a = convert(make_model("silu", torch.float32, seed=1))
    b = convert(make_model("gelu_new", torch.float32, seed=2))
    a.save_pretrained(tmp_path / "m")

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        b.save_pretrained(tmp_path / "m")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary directory left
    loaded = AttnOnlyTransformer.load(tmp_path / "m")
    assert loaded.cfg.act_fn == "silu"  # model A's config, with model A's weights
    assert torch.equal(loaded(tokens), a(tokens))


def test_save_over_an_old_save_drops_its_tokenizer_and_keeps_foreign_files(tmp_path, tokens):
    with_tokenizer = convert(make_model("silu", torch.float32))
    with_tokenizer.tokenizer = _bundled_tokenizer()
    with_tokenizer.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "tokenizer").is_dir()
    (tmp_path / "m" / "NOTES.txt").write_text("mine")

    without = convert(make_model("silu", torch.float32, seed=3))
    assert without.tokenizer is None
    without.save_pretrained(tmp_path / "m")
    assert not (tmp_path / "m" / "tokenizer").exists()
    assert (tmp_path / "m" / "NOTES.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    loaded = AttnOnlyTransformer.load(tmp_path / "m")
    assert loaded.tokenizer is None
    assert torch.equal(loaded(tokens), without(tokens))


def test_load_refuses_a_config_that_contradicts_the_saved_coefficients(tmp_path):
    convert(make_model("gelu_new", torch.float32)).save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["act_fn"] = "silu"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="act_fn='silu'.*'gelu_new'"):
        AttnOnlyTransformer.load(tmp_path / "m")


def test_load_refuses_options_that_contradict_the_saved_coefficients(tmp_path):
    convert(make_model("relu", torch.float32), relu_k=50.0).save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "conversion.json"
    conversion = json.loads(path.read_text())
    conversion["options"]["relu_k"] = 200.0
    path.write_text(json.dumps(conversion))
    with pytest.raises(ValueError, match="relu_k"):
        AttnOnlyTransformer.load(tmp_path / "m")


def _other_fits(model):
    """The package's fit file with this model's fit changed (as a later package version's)."""
    fits = json.loads(json.dumps(activations._load_fits()))
    fit = fits["fits"][model.coefficients.activation][str(model.n_heads_per_neuron)]
    fit["f"] = [v * 1.5 for v in fit["f"]]
    return fits


def test_load_refuses_coefficients_that_are_not_the_packages_own(tmp_path, monkeypatch):
    model = convert(make_model("gelu_new", torch.float64))
    model.save_pretrained(tmp_path / "m")
    fits = _other_fits(model)
    monkeypatch.setattr(activations, "_load_fits", lambda: fits)
    assert convert(make_model("gelu_new")).coefficients != model.coefficients
    with pytest.raises(SavedModelError, match="not this package's own for gelu_new"):
        AttnOnlyTransformer.load(tmp_path / "m")


def test_a_save_by_another_version_is_rebuilt_from_its_own_coefficients(
    tmp_path, monkeypatch, tokens
):
    model = convert(make_model("gelu_new", torch.float64))
    monkeypatch.setattr(tl_attnonly._version, "__version__", "0.0.9")  # read when saving
    model.save_pretrained(tmp_path / "m")
    monkeypatch.undo()
    fits = _other_fits(model)  # this version's fit differs from the saving version's
    monkeypatch.setattr(activations, "_load_fits", lambda: fits)
    with pytest.warns(UserWarning, match="saved by tl_attnonly 0.0.9"):
        loaded = AttnOnlyTransformer.load(tmp_path / "m")
    assert loaded.coefficients == model.coefficients
    assert torch.equal(loaded(tokens), model(tokens))


def test_load_does_not_reseed_the_global_rngs(tmp_path):
    model = convert(make_model("silu", torch.float32, seed=7))
    assert model.cfg.seed == 7
    model.save_pretrained(tmp_path / "m")
    torch.manual_seed(12345)
    random.seed(12345)
    np.random.seed(12345)
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    loaded = AttnOnlyTransformer.load(tmp_path / "m")
    assert loaded.cfg.seed == 7
    assert torch.equal(torch.get_rng_state(), states[0])
    assert random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2])


def test_convert_and_back_keep_requires_grad():
    model = make_model("silu", torch.float32)
    model.embed.W_E.requires_grad_(False)
    model.blocks[1].mlp.W_in.requires_grad_(False)
    converted = convert(model)
    assert not converted.embed.W_E.requires_grad
    assert not converted.blocks[1].mlp.W_in.requires_grad
    assert converted.blocks[0].mlp.W_in.requires_grad and converted.unembed.W_U.requires_grad
    back = converted.to_hooked_transformer()
    assert not back.embed.W_E.requires_grad and not back.blocks[1].mlp.W_in.requires_grad
    assert back.blocks[0].mlp.W_in.requires_grad
