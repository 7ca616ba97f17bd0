"""convert(..., share_weights=True): the converted model's tensors are the original's."""

from __future__ import annotations

import pytest
import torch
from conftest import ZOO, make_model, make_tokens
from transformer_lens import HookedEncoder, HookedTransformerConfig

from tl_attnonly import convert


def _storages(module: torch.nn.Module) -> set[int]:
    tensors = list(module.parameters()) + list(module.buffers())
    return {t.untyped_storage().data_ptr() for t in tensors}


pytestmark = pytest.mark.filterwarnings("ignore:HookedEncoder is deprecated:DeprecationWarning")


@pytest.mark.parametrize("name", ["ln_learned", "rms_rotary", "parallel_neox", "gqa"])
@pytest.mark.parametrize("act_fn", ["silu", "gelu_new"])
def test_shared_conversion_equals_the_copy_and_holds_no_new_tensor(name, act_fn):
    model = make_model(act_fn, torch.float64, **ZOO[name])
    shared = convert(model, share_weights=True)
    copied = convert(model)
    tokens = make_tokens()
    assert torch.equal(shared(tokens), copied(tokens))
    assert _storages(shared) <= _storages(model)  # no byte of weights allocated
    assert not any(t.is_meta for t in [*shared.parameters(), *shared.buffers()])
    for (name_s, p_s), (name_o, p_o) in zip(shared.named_parameters(), model.named_parameters()):
        assert name_s == name_o and p_s is p_o


def test_edits_show_in_both_models():
    model = make_model("gelu_new", torch.float64, normalization_type="LN")
    shared = convert(model, share_weights=True)
    tokens = make_tokens()
    before = shared(tokens)
    with torch.no_grad():
        model.blocks[1].mlp.W_out.mul_(2)  # edit the original
    after = shared(tokens)
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, convert(model)(tokens), rtol=0, atol=1e-12)
    with torch.no_grad():
        shared.blocks[0].attn.W_Q.zero_()  # edit the converted model
    assert model.blocks[0].attn.W_Q.abs().max() == 0


def test_gated_and_encoder_models_share_too():
    gated = make_model("silu", torch.float64, normalization_type="RMS", gated_mlp=True)
    shared = convert(gated, share_weights=True)
    assert _storages(shared) <= _storages(gated)
    assert torch.equal(shared(make_tokens()), convert(gated)(make_tokens()))
    cfg = HookedTransformerConfig(
        n_layers=1, d_model=16, n_heads=2, d_head=8, d_mlp=24, d_vocab=61, n_ctx=12,
        act_fn="gelu", normalization_type="LN", seed=0, dtype=torch.float64, device="cpu",
    )  # fmt: skip
    encoder = HookedEncoder(cfg).eval()
    with torch.no_grad():  # HookedEncoder leaves its weights uninitialised
        for p in encoder.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    shared_encoder = convert(encoder, share_weights=True)
    assert _storages(shared_encoder) <= _storages(encoder)
    tokens = make_tokens()
    assert torch.equal(shared_encoder(tokens), convert(encoder)(tokens))


def test_literal_form_refuses_sharing():
    with pytest.raises(ValueError, match="share_weights"):
        convert(make_model("silu"), form="literal", share_weights=True)
