"""AttnOnlyEncoder: BERT-style HookedEncoders (post-LN, bidirectional) with neuron-head MLPs."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import make_config, make_model
from transformer_lens import HookedEncoder

import tl_attnonly.hub as hub
from tl_attnonly.components import GatedNeuronHeadMLP, NeuronHeadMLP
from tl_attnonly.hooked.encoder import AttnOnlyEncoder, convert_encoder
from tl_attnonly.options import ConversionOptions

pytestmark = pytest.mark.filterwarnings("ignore:HookedEncoder is deprecated:DeprecationWarning")

D_VOCAB = 53
BATCH, POS = 3, 9


def make_encoder_config(act_fn: str = "gelu", dtype=torch.float64, **overrides):
    kwargs = dict(
        d_vocab=D_VOCAB,
        n_ctx=16,
        attention_dir="bidirectional",
        normalization_type="LN",
        original_architecture="BertForMaskedLM",
    )
    kwargs.update(overrides)
    return make_config(act_fn, dtype, **kwargs)


def make_encoder(act_fn: str = "gelu", dtype=torch.float64, seed: int = 0, **overrides):
    """A random BERT-like encoder. HookedEncoder leaves its weights uninitialised: set them all."""
    model = HookedEncoder(make_encoder_config(act_fn, dtype, **overrides), move_to_device=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            if name.endswith(".w"):  # LayerNorm scales
                p.copy_(1.0 + 0.2 * noise)
            elif name.split(".")[-1].startswith("b"):  # biases
                p.copy_(0.2 * noise)
            elif name.endswith("W_in"):  # pre-activations over roughly [-6, 6]
                p.copy_(0.6 * noise)
            else:
                p.copy_(noise / p.shape[-2] ** 0.5 if p.ndim >= 2 else noise)
    return model.eval()


def make_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, D_VOCAB, (BATCH, POS), generator=g)
    token_type_ids = torch.randint(0, 2, (BATCH, POS), generator=g)
    mask = torch.ones(BATCH, POS, dtype=torch.long)
    mask[1, 6:] = 0  # right padding, as BERT tokenizers pad
    mask[2, 3:] = 0
    return tokens, token_type_ids, mask


def hidden(model, tokens, token_type_ids, mask):
    with torch.no_grad():
        return model.encoder_output(tokens, token_type_ids, mask)


def real_max_diff(a, b, mask):
    return float((a - b)[mask.bool()].abs().max())


def test_silu_encoder_is_exact():
    """SiLU is one exact neuron-head: hidden states, MLM logits and MLP posts agree to fp64."""
    model = make_encoder("silu")
    converted = convert_encoder(model)
    tokens, tt, mask = make_inputs()
    assert isinstance(converted, AttnOnlyEncoder) and isinstance(converted, HookedEncoder)
    assert all(isinstance(block.mlp, NeuronHeadMLP) for block in converted.blocks)
    torch.testing.assert_close(
        hidden(converted, tokens, tt, mask), hidden(model, tokens, tt, mask), rtol=0, atol=1e-12
    )
    with torch.no_grad():
        torch.testing.assert_close(
            converted(tokens, token_type_ids=tt, one_zero_attention_mask=mask),
            model(tokens, token_type_ids=tt, one_zero_attention_mask=mask),
            rtol=0,
            atol=1e-11,
        )


def _mlp_error_bound(model: HookedEncoder, act_err: float) -> list[float]:
    """Per layer: |Δ mlp_out| <= act_err * max_j sum_i |W_out[i, j]| when the inputs agree."""
    return [act_err * float(block.mlp.W_out.detach().abs().sum(0).max()) for block in model.blocks]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gelu_method,K", [("fit", None), ("fit", 1), ("paper", None)])
def test_gelu_encoder_within_stated_bound(dtype, gelu_method, K):
    """Each converted MLP is within act_err * ||W_out||_(inf) of the original given the same input,
    and the final hidden states are within 20x the worst layer bound (post-LN amplification of
    this small random model), plus float32 rounding."""
    model = make_encoder("gelu", dtype)
    converted = convert_encoder(model, gelu_method=gelu_method, n_heads_per_neuron=K)
    act_err = converted.coefficients.max_abs_error()
    assert act_err > 0
    tokens, tt, mask = make_inputs()
    with torch.no_grad():
        _, cache = model.run_with_cache(
            tokens, return_type=None, token_type_ids=tt, one_zero_attention_mask=mask
        )
    rounding = 1e-5 if dtype == torch.float32 else 1e-12
    bounds = _mlp_error_bound(model, act_err)
    for layer, block in enumerate(converted.blocks):
        mlp_in = block.ln1(cache[f"blocks.{layer}.hook_resid_mid"])
        with torch.no_grad():
            out = block.mlp(mlp_in)
        assert out.dtype == dtype
        err = real_max_diff(out, cache[f"blocks.{layer}.hook_mlp_out"], mask)
        assert err <= bounds[layer] + rounding, (layer, err, bounds[layer])
    diff = real_max_diff(hidden(converted, tokens, tt, mask), hidden(model, tokens, tt, mask), mask)
    assert 0 < diff <= 20 * max(bounds) + rounding, (diff, max(bounds))


def test_default_fit_beats_the_paper_on_hidden_states():
    model = make_encoder("gelu")
    tokens, tt, mask = make_inputs()
    ref = hidden(model, tokens, tt, mask)
    paper = real_max_diff(
        hidden(convert_encoder(model, gelu_method="paper"), tokens, tt, mask), ref, mask
    )
    fit = real_max_diff(hidden(convert_encoder(model), tokens, tt, mask), ref, mask)
    assert fit < paper / 10, (fit, paper)


def test_padding_is_masked_like_the_original():
    """Bidirectional attention with right padding: each sentence's hidden states equal those of the
    same sentence run alone, and equal the original model's."""
    model = make_encoder("gelu")
    converted = convert_encoder(model, n_heads_per_neuron=2)
    tokens, tt, mask = make_inputs()
    batched = hidden(converted, tokens, tt, mask)
    for i in range(BATCH):
        n = int(mask[i].sum())
        alone = hidden(converted, tokens[i : i + 1, :n], tt[i : i + 1, :n], None)
        torch.testing.assert_close(batched[i, :n], alone[0], rtol=0, atol=1e-12)
    # padding changes the result when ignored, so the mask test above can fail
    unmasked = hidden(converted, tokens, tt, None)
    assert (unmasked[1, :6] - batched[1, :6]).abs().max() > 1e-6


def test_hooks_are_the_decoder_hooks():
    model = make_encoder("gelu")
    converted = convert_encoder(model, n_heads_per_neuron=3)
    tokens, tt, mask = make_inputs()
    n_heads = converted.n_neuron_heads
    assert n_heads == 3 * model.cfg.d_mlp == converted.n_heads_per_neuron * model.cfg.d_mlp
    with torch.no_grad():
        _, cache = converted.run_with_cache(
            tokens, return_type=None, token_type_ids=tt, one_zero_attention_mask=mask
        )
        _, ref_cache = model.run_with_cache(
            tokens, return_type=None, token_type_ids=tt, one_zero_attention_mask=mask
        )
    for layer in range(model.cfg.n_layers):
        prefix = f"blocks.{layer}.mlp."
        assert cache[prefix + "hook_pattern"].shape == (BATCH, n_heads, POS, 2)
        assert cache[prefix + "hook_attn_scores"].shape == (BATCH, n_heads, POS, 2)
        for name in ("hook_q", "hook_k", "hook_v", "hook_z"):
            assert cache[prefix + name].shape == (BATCH, POS, n_heads, 1), name
        torch.testing.assert_close(
            cache[prefix + "hook_pattern"].sum(-1),
            torch.ones_like(cache[prefix + "hook_pattern"][..., 0]),
        )
        post = cache[prefix + "hook_z"].reshape(BATCH, POS, model.cfg.d_mlp, 3).sum(-1)
        torch.testing.assert_close(post, cache[prefix + "hook_post"], rtol=0, atol=1e-12)
    # identical input to the first MLP: same pre-activations bit for bit
    assert torch.equal(cache["blocks.0.mlp.hook_pre"], ref_cache["blocks.0.mlp.hook_pre"])


def test_neuron_results_and_hook_guard():
    model = make_encoder("gelu")
    converted = convert_encoder(model, n_heads_per_neuron=2)
    tokens, tt, mask = make_inputs()
    with pytest.raises(ValueError, match="set_use_neuron_result"):
        converted.add_hook("blocks.0.mlp.hook_result", lambda x, hook: x)
    converted.set_use_neuron_result(True)
    with torch.no_grad():
        _, cache = converted.run_with_cache(
            tokens, return_type=None, token_type_ids=tt, one_zero_attention_mask=mask
        )
    result = cache["blocks.1.mlp.hook_result"]  # [batch, pos, n_neuron_heads, d_model]
    assert result.shape == (BATCH, POS, converted.n_neuron_heads, model.cfg.d_model)
    torch.testing.assert_close(
        result.sum(-2) + converted.blocks[1].mlp.b_out,
        cache["blocks.1.hook_mlp_out"],
        rtol=0,
        atol=1e-12,
    )


def test_original_untouched_and_round_trip():
    model = make_encoder("gelu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted = convert_encoder(model, n_heads_per_neuron=2)
    with torch.no_grad():
        converted.blocks[0].mlp.W_in.add_(1.0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert type(model.blocks[0].mlp).__name__ == "MLP"
    back = convert_encoder(model).to_hooked_encoder()
    assert type(back) is HookedEncoder and type(back.blocks[0].mlp).__name__ == "MLP"
    tokens, tt, mask = make_inputs()
    assert torch.equal(hidden(back, tokens, tt, mask), hidden(model, tokens, tt, mask))


def test_gated_encoder_converts_exactly():
    """HookedEncoder builds its MLPs with TL's MLPFactory too: a SwiGLU encoder converts exactly."""
    model = make_encoder("silu", gated_mlp=True)
    converted = convert_encoder(model)
    assert all(isinstance(block.mlp, GatedNeuronHeadMLP) for block in converted.blocks)
    tokens, tt, mask = make_inputs()
    torch.testing.assert_close(
        hidden(converted, tokens, tt, mask), hidden(model, tokens, tt, mask), rtol=0, atol=1e-12
    )


def test_refuses_what_it_cannot_convert():
    with pytest.raises(TypeError, match="convert_encoder"):
        convert_encoder(make_model("silu"))
    with pytest.raises(ValueError, match="solu_ln|act_fn|activation|supported"):
        convert_encoder(make_encoder("solu_ln"))


def test_save_load_round_trip(tmp_path):
    converted = convert_encoder(make_encoder("gelu", torch.float32), n_heads_per_neuron=2)
    converted.save_pretrained(tmp_path / "enc")
    loaded = AttnOnlyEncoder.load(tmp_path / "enc")
    assert type(loaded) is AttnOnlyEncoder
    assert loaded.conversion == converted.conversion
    assert loaded.coefficients == converted.coefficients
    tokens, tt, mask = make_inputs()
    assert torch.equal(hidden(loaded, tokens, tt, mask), hidden(converted, tokens, tt, mask))


def test_dtype_move():
    converted = convert_encoder(make_encoder("gelu", torch.float32))
    converted.to(torch.float64, print_details=False)
    tokens, tt, mask = make_inputs()
    assert converted.cfg.dtype == torch.float64
    assert hidden(converted, tokens, tt, mask).dtype == torch.float64


def test_from_pretrained_goes_through_tl_loading(monkeypatch):
    """HookedEncoder.from_pretrained builds AttnOnlyEncoder itself and loads the weights into it."""
    enc_module = sys.modules["transformer_lens.HookedEncoder"]
    monkeypatch.setattr(hub, "hub_unreachable", lambda timeout=0: None)  # TL's loading is faked
    source = make_encoder("gelu", torch.float32)
    state = {k: v.clone() for k, v in source.state_dict().items()}
    monkeypatch.setattr(enc_module.loading, "get_official_model_name", lambda name: name)
    monkeypatch.setattr(
        enc_module.loading,
        "get_pretrained_model_config",
        lambda name, dtype=torch.float32, **kw: make_encoder_config("gelu", dtype),
    )
    monkeypatch.setattr(
        enc_module.loading,
        "get_pretrained_state_dict",
        lambda *a, **k: {k2: v.clone() for k2, v in state.items()},
    )
    model = AttnOnlyEncoder.from_pretrained("fake-bert", device="cpu", n_heads_per_neuron=2)
    assert isinstance(model, AttnOnlyEncoder)
    assert model.conversion == ConversionOptions(n_heads_per_neuron=2)
    tokens, tt, mask = make_inputs()
    expected = hidden(convert_encoder(source, n_heads_per_neuron=2), tokens, tt, mask)
    assert torch.equal(hidden(model, tokens, tt, mask), expected)
    # the pending options do not leak into later constructions
    assert AttnOnlyEncoder(make_encoder_config(), move_to_device=False).conversion == (
        ConversionOptions()
    )


def test_gelu_activation_in_bert_is_erf_gelu():
    """BERT's 'gelu' is the erf GELU, which is what the fitted heads approximate."""
    mlp = make_encoder("gelu").blocks[0].mlp
    x = torch.linspace(-6, 6, 101, dtype=torch.float64)
    torch.testing.assert_close(mlp.act_fn(x), F.gelu(x), rtol=0, atol=0)
