"""The bundled model as a Hugging Face GPT-2 and a TransformerBridge (TL 3.x and 4.x).

On TL 3.x the Hugging Face model's logits equal the HookedTransformer's (fp64, 1e-10) and TL's
own GPT-2 weight conversion maps its weights back to the bundled state dict exactly; on both
versions the bridge's logits equal the Hugging Face forward's, and the converted bridge's the
unconverted bridge's.
"""

from __future__ import annotations

import pytest
import torch

import tl_attnonly
from tl_attnonly import bundled
from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER
from tl_attnonly.bridge import is_converted_bridge, neuron_head_layers

needs_hooked = pytest.mark.skipif(
    not HAS_HOOKED_TRANSFORMER, reason="compares with HookedTransformer (TransformerLens 3.x)"
)
TOL = {torch.float32: 1e-4, torch.float64: 1e-10}
PROMPTS = [
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n",
    "import os\nprint(os.getcwd())\n",
]


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    """Two prompts, the first padded-free; plus one full-context (n_ctx = 128) random row."""
    tokenizer = bundled.load_bundled_tokenizer()
    rows = [[tokenizer.bos_token_id] + tokenizer.encode(p)[:30] for p in PROMPTS]
    length = min(len(r) for r in rows)
    short = torch.tensor([r[:length] for r in rows])
    return short


@pytest.fixture(scope="module")
def long_tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 3072, (2, 128), generator=generator)


@needs_hooked
def test_tl_gpt2_conversion_inverts_it_exactly():
    """TransformerLens's convert_gpt2_weights of the Hugging Face model gives back the bundled
    state dict bit for bit (so tl_to_hf_gpt2_state_dict is its exact inverse)."""
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    model = bundled.load_bundled_model()
    hf = bundled.load_bundled_hf_model()
    back = convert_gpt2_weights(hf, model.cfg)
    back["unembed.b_U"] = hf.lm_head.bias  # TL's GPT-2 conversion has no b_U (zeros)
    stored = bundled._read_state_dict(bundled.BUNDLED_MODEL_NAME)
    expected = {k: v for k, v in stored.items() if not k.endswith((".IGNORE", ".mask"))}
    assert set(back) == set(expected)
    for key, value in expected.items():
        assert torch.equal(back[key], value), key


@needs_hooked
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_hf_logits_equal_hooked_transformer(dtype, tokens, long_tokens):
    model = bundled.load_bundled_model(dtype=dtype)
    hf = bundled.load_bundled_hf_model(dtype=dtype)
    with torch.no_grad():
        for toks in (tokens, long_tokens):
            expected = model(toks)
            assert expected.abs().max() > 1
            torch.testing.assert_close(hf(toks).logits, expected, rtol=0, atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_bridge_logits_equal_hf_forward(dtype, tokens, long_tokens):
    hf = bundled.load_bundled_hf_model(dtype=dtype)
    bridge = bundled.load_bundled_bridge(dtype=dtype)
    assert bridge.cfg.n_layers == 2 and bridge.cfg.d_vocab == 3072
    with torch.no_grad():
        for toks in (tokens, long_tokens):
            torch.testing.assert_close(bridge(toks), hf(toks).logits, rtol=0, atol=TOL[dtype])


def test_bridge_takes_strings_like_the_hooked_transformer():
    bridge = bundled.load_bundled_bridge()
    toks = bridge.to_tokens(PROMPTS[0])
    tokenizer = bundled.load_bundled_tokenizer()
    assert toks[0].tolist() == [tokenizer.bos_token_id] + tokenizer.encode(PROMPTS[0])
    if HAS_HOOKED_TRANSFORMER:
        assert torch.equal(toks, bundled.load_bundled_model().to_tokens(PROMPTS[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_converted_bundled_bridge_equals_unconverted(dtype, tokens, long_tokens):
    bridge = bundled.load_bundled_bridge(dtype=dtype)
    with torch.no_grad():
        reference = [bridge(t) for t in (tokens, long_tokens)]
        tl_attnonly.convert(bridge)
        assert is_converted_bridge(bridge)
        assert [layer.n_neuron_heads for layer in neuron_head_layers(bridge)] == [512, 512]
        for toks, ref in zip((tokens, long_tokens), reference):
            torch.testing.assert_close(bridge(toks), ref, rtol=0, atol=TOL[dtype])


def test_refuses_a_config_gpt2_cannot_hold(monkeypatch):
    config = bundled._read_config(bundled.BUNDLED_MODEL_NAME)
    monkeypatch.setattr(
        bundled,
        "_read_config",
        lambda name: dict(config, normalization_type="RMS", act_fn="solu_ln"),
    )
    with pytest.raises(NotImplementedError, match=r"normalization_type='RMS'.*act_fn='solu_ln'"):
        bundled.bundled_hf_config()


def test_state_dict_conversion_names_missing_and_leftover_weights():
    state = bundled._read_state_dict(bundled.BUNDLED_MODEL_NAME)
    missing = {k: v for k, v in state.items() if k != "blocks.1.mlp.b_in"}
    with pytest.raises(KeyError, match=r"blocks\.1\.mlp\.b_in is missing"):
        bundled.tl_to_hf_gpt2_state_dict(missing, 2, 4)
    extra = dict(state, **{"blocks.0.mlp.W_gate": state["blocks.0.mlp.W_in"]})
    with pytest.raises(KeyError, match=r"no place in GPT-2's layout: \['blocks\.0\.mlp\.W_gate'\]"):
        bundled.tl_to_hf_gpt2_state_dict(extra, 2, 4)


def test_load_bundled_model_on_tl4_says_to_use_the_bridge(monkeypatch):
    import tl_attnonly._compat as compat

    monkeypatch.setattr(compat, "HAS_HOOKED_TRANSFORMER", False)
    with pytest.raises(ImportError, match=r"load_bundled_bridge\(\)"):
        bundled.load_bundled_model()


def test_all_head_refs_takes_a_converted_bridge():
    """``all_head_refs`` lists a converted bridge's heads as its analysis adapter's (the bridge
    has no ``n_neuron_heads`` of its own), and refuses an unconverted one by name."""
    from tl_attnonly.adapt import analysis_model
    from tl_attnonly.hooks import all_head_refs

    bridge = bundled.load_bundled_bridge()
    with pytest.raises(TypeError, match="convert it first"):
        all_head_refs(bridge)
    assert len(all_head_refs(bridge, kinds=("attn",))) == 2 * 4
    tl_attnonly.convert(bridge)
    refs = all_head_refs(bridge, layers=[1])
    assert refs == all_head_refs(analysis_model(bridge), layers=[1])
    assert len(refs) == 4 + 512 and refs[-1].label() == "L1N511"
