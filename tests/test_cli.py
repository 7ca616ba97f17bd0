"""The convert / verify subcommands (the demo is tested in test_report.py)."""

from __future__ import annotations

import re

import pytest
from transformer_lens import HookedTransformer

from tl_attnonly import AttnOnlyTransformer, cli, convert
from tl_attnonly.bundled import load_bundled_model
from tl_attnonly.cli import main


def _max_logit_diff(output: str) -> float:
    match = re.search(r"^\s*logits\s+\d+\s+(\S+)", output, flags=re.MULTILINE)
    assert match, output
    return float(match.group(1))


@pytest.fixture
def fake_hub(monkeypatch):
    """TransformerLens's from_pretrained without a hub: every name is the bundled model."""
    calls = []

    def fake_ht(name, **kwargs):
        calls.append(("HookedTransformer", name, kwargs))
        return load_bundled_model()

    def fake_attn_only(name, **kwargs):
        calls.append(("AttnOnlyTransformer", name, kwargs))
        options = {k: kwargs[k] for k in ("n_heads_per_neuron", "relu_k", "gelu_method")}
        return convert(load_bundled_model(), **options)

    monkeypatch.setattr(cli, "_hub_unreachable", lambda timeout=0: None)
    monkeypatch.setattr(HookedTransformer, "from_pretrained", fake_ht)
    monkeypatch.setattr(AttnOnlyTransformer, "from_pretrained", fake_attn_only)
    return calls


def test_convert_then_verify_offline(fake_hub, tmp_path, capsys):
    out = tmp_path / "converted"
    assert main(["convert", "gpt2", str(out), "--relu-k", "50"]) == 0
    assert fake_hub == [
        (
            "AttnOnlyTransformer",
            "gpt2",
            {"n_heads_per_neuron": None, "relu_k": 50.0, "gelu_method": None},
        )
    ]
    loaded = AttnOnlyTransformer.load(out)
    assert loaded.conversion.relu_k == 50.0
    capsys.readouterr()
    # a saved directory verifies against the MLP model rebuilt from its own weights
    assert main(["verify", str(out), "--prompt", "import os\nprint(os.getcwd())\n"]) == 0
    assert len(fake_hub) == 1, "verifying a directory must not load anything by name"
    assert _max_logit_diff(capsys.readouterr().out) < 1e-4


def test_verify_by_model_name(fake_hub, capsys):
    assert main(["verify", "gpt2", "--prompt", "x = [i for i in range(3)]"]) == 0
    assert fake_hub[0][:2] == ("HookedTransformer", "gpt2")
    assert _max_logit_diff(capsys.readouterr().out) < 1e-4
