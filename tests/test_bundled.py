"""Tests for the bundled tiny model (``tl_attnonly.bundled``)."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import pytest
import torch
from transformer_lens import HookedTransformer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tl_attnonly import bundled

# Hand-written Python that is not part of the training data (the Python standard library).
HELD_OUT_CODE = '''from pathlib import Path


class Inventory:
    """Keep track of items and their quantities."""

    def __init__(self, path):
        self.path = Path(path)
        self.items = {}

    def add(self, name, count=1):
        if count < 0:
            raise ValueError("count must be non-negative")
        self.items[name] = self.items.get(name, 0) + count
        return self.items[name]
'''


def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in this test")


@pytest.fixture(scope="module")
def training_info() -> dict:
    return json.loads((bundled.bundled_model_dir() / "training.json").read_text())


@pytest.fixture(scope="module")
def model() -> HookedTransformer:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        mp.setattr(socket.socket, "connect", _no_network)
        mp.setattr(socket, "create_connection", _no_network)
        return bundled.load_bundled_model()


def test_bundled_model_dir_contents():
    model_dir = bundled.bundled_model_dir()
    assert model_dir.name == bundled.BUNDLED_MODEL_NAME
    for name in ("config.json", "model.safetensors", "tokenizer.json", "training.json"):
        assert (model_dir / name).is_file(), name


def test_missing_bundle_raises_helpful_error():
    with pytest.raises(
        FileNotFoundError, match="'no-such-model'.*Bundled models: .*'tiny-stdlib-silu'"
    ):
        bundled.bundled_model_dir("no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        bundled.load_bundled_model("no-such-model")


def test_bundled_models_are_package_data():
    # shipped inside the package (so in the wheel), and listed by name
    assert bundled.BUNDLED_MODEL_NAME in bundled.bundled_model_names()
    for name in bundled.bundled_model_names():
        model_dir = bundled.bundled_model_dir(name)
        assert model_dir.parent.parent.parent == Path(bundled.__file__).parent


def test_model_loads_offline_with_saved_config(model):
    cfg = json.loads((bundled.bundled_model_dir() / "config.json").read_text())
    assert isinstance(model, HookedTransformer)
    assert not model.training
    for key, value in cfg.items():
        assert getattr(model.cfg, key) == value, key
    assert model.cfg.act_fn == "silu"
    assert model.cfg.d_vocab == len(model.tokenizer)
    assert model.cfg.d_vocab_out == model.cfg.d_vocab
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32, name
        assert torch.isfinite(param).all(), name


def test_loading_does_not_reseed_global_rng():
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    bundled.load_bundled_model(dtype="float32")
    assert torch.equal(torch.rand(3), expected)


def test_tokenizer_round_trips_python_code():
    model_dir = str(bundled.bundled_model_dir())
    text = HELD_OUT_CODE + "\tx = 'caf\u00e9 \u2603'  # tab, non-ASCII\n"
    for tok in (
        bundled.load_bundled_tokenizer(),  # what load_bundled_model attaches
        PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True),
        AutoTokenizer.from_pretrained(model_dir, local_files_only=True),
    ):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        assert len(ids) < len(text) / 2  # BPE actually merges common code fragments
        assert tok.bos_token == tok.eos_token == tok.pad_token == "<|endoftext|>"
        assert tok.bos_token_id == 0
        assert tok.model_max_length == 128


def test_probe_loss_matches_training_record(model, training_info):
    probe = training_info["probe"]
    loss = model(probe["text"], return_type="loss").item()
    assert loss == pytest.approx(probe["loss"], abs=1e-3)


def test_held_out_loss_far_below_baselines(model, training_info):
    results = training_info["results"]
    uniform = math.log(model.cfg.d_vocab)
    assert results["uniform"] == pytest.approx(uniform)
    tokens = model.to_tokens(HELD_OUT_CODE)
    # The snippet must fit in the context window (to_tokens would silently truncate it).
    assert tokens.shape[1] == len(model.tokenizer(HELD_OUT_CODE)["input_ids"]) < model.cfg.n_ctx
    assert tokens[0, 0].item() == model.tokenizer.bos_token_id
    loss = model(tokens, return_type="loss").item()
    # The model must beat a unigram model of the training tokens, not just the uniform baseline,
    # and land within 1.5 nats of its recorded validation loss on held-out stdlib files.
    assert loss < results["unigram_val_cross_entropy"] - 1.0
    assert loss < results["final_val_loss"] + 1.5
    assert loss < uniform - 4.0


def test_forward_and_generate_with_string_input(model):
    prompt = "def main():\n    "
    logits = model(prompt)
    n_tokens = model.to_tokens(prompt).shape[1]
    assert logits.shape == (1, n_tokens, model.cfg.d_vocab)
    assert torch.isfinite(logits).all()
    out = model.generate(prompt, max_new_tokens=8, do_sample=False, verbose=False)
    assert isinstance(out, str)
    assert out.startswith(prompt)
    assert len(out) > len(prompt)
    # Greedy decoding is deterministic.
    assert model.generate(prompt, max_new_tokens=8, do_sample=False, verbose=False) == out
