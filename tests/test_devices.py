"""Devices: conversion keeps every tensor where it is, so TL's ``n_devices`` split keeps working.

TransformerLens splits a model's layers over CUDA devices (``cfg.n_devices > 1``); the forward
pass moves the residual stream to ``get_device_for_block_index(l, cfg)`` before block ``l``. A
converted model (copied or sharing weights), and the MLP model rebuilt from it, must put every
tensor on the device the original's is on. Without two GPUs the same logic is checked with the
meta device standing in for a second device; the real split runs where two CUDA devices exist.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_config, make_model, make_tokens, randomize_
from transformer_lens import HookedEncoder, HookedTransformer
from transformer_lens.utilities import get_device_for_block_index

from tl_attnonly import AttnOnlyTransformer, convert

pytestmark = pytest.mark.filterwarnings("ignore:HookedEncoder is deprecated:DeprecationWarning")


def devices(module: torch.nn.Module) -> dict[str, torch.device]:
    named = [*module.named_parameters(), *module.named_buffers()]
    return {name: tensor.device for name, tensor in named}


def _split_onto_meta(model: torch.nn.Module, modules: list[str]) -> torch.nn.Module:
    """Move some submodules to the meta device: a stand-in for a second device, on CPU."""
    for name in modules:
        model.get_submodule(name).to("meta")
    return model


GATED = dict(
    normalization_type="RMS", gated_mlp=True, positional_embedding_type="rotary", rotary_dim=4
)


@pytest.mark.parametrize(
    "act_fn, overrides",
    [("gelu_new", dict(normalization_type="LN")), ("silu", GATED)],
    ids=["plain", "gated"],
)
def test_conversion_keeps_each_tensor_on_its_device(act_fn, overrides):
    model = _split_onto_meta(make_model(act_fn, **overrides), ["blocks.1", "unembed"])
    expected = devices(model)
    assert {d.type for d in expected.values()} == {"cpu", "meta"}
    copied = convert(model)
    assert devices(copied) == expected
    shared = convert(model, share_weights=True)
    assert devices(shared) == expected
    assert devices(copied.to_hooked_transformer()) == expected
    # the CPU part holds real copies of the original's values
    for name, tensor in copied.state_dict().items():
        if not tensor.is_meta:
            assert torch.equal(tensor, model.state_dict()[name]), name


def test_encoder_conversion_keeps_each_tensor_on_its_device():
    cfg = make_config("gelu", n_layers=2, normalization_type="LN")
    encoder = HookedEncoder(cfg).eval()
    _split_onto_meta(encoder, ["blocks.1"])
    expected = devices(encoder)
    converted = convert(encoder)
    assert devices(converted) == expected
    assert devices(converted.to_hooked_encoder()) == expected


def test_n_devices_in_the_config_converts_runs_and_loads_on_cpu(tmp_path):
    """``n_devices = 2`` on CPU (TL keeps everything on the CPU): kept by conversion; a model
    saved so loads on a machine without two GPUs, on one device."""
    cfg = make_config("silu", torch.float64, n_layers=4, normalization_type="LN")
    cfg.n_devices = 2  # set after construction: the config refuses it without 2 GPUs
    model = randomize_(HookedTransformer(cfg)).eval()
    converted = convert(model)
    assert converted.cfg.n_devices == 2
    tokens = make_tokens()
    torch.testing.assert_close(converted(tokens), model(tokens), rtol=0, atol=1e-10)
    converted.save_pretrained(tmp_path / "m")
    loaded = AttnOnlyTransformer.load(tmp_path / "m")
    assert loaded.cfg.n_devices == 1
    assert torch.equal(loaded(tokens), converted(tokens))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize(
    "act_fn, gated, tol", [("gelu_new", False, 1e-3), ("silu", True, 1e-10)], ids=["gelu", "swiglu"]
)
def test_split_over_two_gpus(act_fn, gated, tol, tmp_path):
    """A model split over two GPUs the way TL's forward expects (block ``l`` on
    ``get_device_for_block_index(l)``): the converted model is split the same, with the same
    logits, cache and derived entries on each block's device."""
    overrides = dict(n_layers=4, normalization_type="LN", device="cuda", n_devices=2)
    cfg = make_config(act_fn, torch.float64, gated_mlp=gated, **overrides)
    model = HookedTransformer(cfg)
    model.embed.to(get_device_for_block_index(0, cfg))
    model.pos_embed.to(get_device_for_block_index(0, cfg))
    for layer, block in enumerate(model.blocks):
        block.to(get_device_for_block_index(layer, cfg))
    model.ln_final.to(get_device_for_block_index(cfg.n_layers - 1, cfg))
    model.unembed.to(get_device_for_block_index(cfg.n_layers - 1, cfg))
    model = randomize_(model).eval()
    block_devices = {b.mlp.W_in.device for b in model.blocks}
    assert len(block_devices) == 2, block_devices
    tokens = make_tokens().to(get_device_for_block_index(0, cfg))
    expected = model(tokens)
    for converted in (convert(model), convert(model, share_weights=True)):
        assert devices(converted) == devices(model)
        torch.testing.assert_close(converted(tokens), expected, rtol=0, atol=tol)
        _, cache = converted.run_with_cache(tokens)
        _, stored = converted.run_with_cache(tokens, derive=False)
        for layer, block in enumerate(converted.blocks):
            name = f"blocks.{layer}.mlp.hook_pattern"
            assert cache[name].device == block.mlp.W_in.device
            assert torch.equal(cache[name], stored[name])
    back = convert(model).to_hooked_transformer()
    assert devices(back) == devices(model)
    torch.testing.assert_close(back(tokens), expected, rtol=0, atol=1e-12)  # GPU kernels may vary
    # A saved split model loads split again by TL's own move_model_modules_to_device.
    convert(model).save_pretrained(tmp_path / "m")
    loaded = AttnOnlyTransformer.load(tmp_path / "m")
    assert loaded.cfg.n_devices == 2
    assert {p.device.type for p in loaded.parameters()} == {"cuda"}


def test_tokens_move_to_the_device_of_the_models_first_parameter():
    """``tokens_on_model_device``: what the analysis entry points and the datasets apply, so
    that tokens built on the CPU run on a model elsewhere (the meta device stands in for a GPU
    here; ``tests/test_cuda.py`` runs the entry points on one)."""
    from tl_attnonly._types import tokens_on_model_device

    model = torch.nn.Linear(2, 2).to("meta")
    clean, corrupted = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    moved = tokens_on_model_device(model, clean, corrupted)
    assert [t.device.type for t in moved] == ["meta", "meta"]
    assert tokens_on_model_device(model, None, None) == (None, None)
    here = torch.zeros(2, 3, dtype=torch.long, device="meta")
    assert tokens_on_model_device(model, here, here)[0] is here  # no copy on the same device
    assert tokens_on_model_device(model, [[1]], None)[0] == [[1]]  # the caller's check refuses
