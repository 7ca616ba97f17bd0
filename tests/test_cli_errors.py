"""The command line answers fast, explains bad input, and gives verify a verdict and exit code."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tl_attnonly
from tl_attnonly import _compat, cli
from tl_attnonly.bundled import load_bundled_bridge, load_bundled_model, load_bundled_tokenizer
from tl_attnonly.cli import EXIT_FAIL, EXIT_USAGE, build_parser, main

#: convert saves HookedTransformer models and refuses on TransformerLens 4.x, naming the bridge
#: route; verify checks a bridge there (and with --bridge on 3.x), so these parts are 3.x only.
TL3_ONLY = pytest.mark.skipif(
    not _compat.HAS_HOOKED_TRANSFORMER,
    reason="HookedTransformer paths of convert / verify: TransformerLens 3.x",
)

ROOT = Path(__file__).resolve().parent.parent
_IMPORTS = """
import sys
from tl_attnonly.cli import main
try:
    main({argv!r})
except SystemExit as exc:
    print("exit", exc.code)
print("heavy", sorted(m for m in ("torch", "transformer_lens") if m in sys.modules))
"""


def _run_cli_in_fresh_python(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _IMPORTS.format(argv=argv)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "argv, code",
    [
        (["--help"], 0),
        (["verify", "--help"], 0),
        (["dmeo"], 2),  # a typo: argparse's usage error
        (["convert", "gpt2"], 2),  # OUT_DIR missing
    ],
    ids=["help", "verify-help", "typo", "missing-argument"],
)
def test_help_and_usage_errors_import_neither_torch_nor_transformer_lens(argv, code):
    result = _run_cli_in_fresh_python(argv)
    assert f"exit {code}" in result.stdout, result.stdout + result.stderr
    assert "heavy []" in result.stdout, result.stdout + result.stderr
    assert "usage: tl-attnonly" in result.stdout + result.stderr


def test_every_option_has_help_text():
    def actions(parser: argparse.ArgumentParser):
        for action in parser._actions:
            yield action
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    assert choice.help, f"command {choice.dest} has no help"
                for sub in action.choices.values():
                    yield from actions(sub)

    found = list(actions(build_parser()))
    assert len(found) > 10
    for action in found:
        assert action.help, f"{action.option_strings or action.dest} has no help text"


def test_convert_function_is_not_shadowed_by_its_module():
    import tl_attnonly.convert  # noqa: F401  (the submodule, imported explicitly)

    assert callable(tl_attnonly.convert) and tl_attnonly.convert.__module__ == "tl_attnonly.convert"
    assert (
        cli.CONVERSION_FILE
        == __import__(
            "tl_attnonly.hooked.neuron_head_model", fromlist=["CONVERSION_FILE"]
        ).CONVERSION_FILE
    )


# ------------------------------------------------------------------------------------------------
# convert without the hub
# ------------------------------------------------------------------------------------------------
def test_unreachable_hub_is_detected_quickly(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    start = time.perf_counter()
    why = cli._hub_unreachable(timeout=2.0)
    assert why is not None and "127.0.0.1:9" in why
    assert time.perf_counter() - start < 5


@pytest.fixture
def no_hub(monkeypatch):
    calls = []

    def from_pretrained(name, **kwargs):
        calls.append(name)
        raise AssertionError("from_pretrained must not be reached without the hub")

    from transformer_lens import HookedTransformer

    from tl_attnonly import AttnOnlyTransformer

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(cli, "_hub_unreachable", lambda timeout=0: "huggingface.co: no route")
    monkeypatch.setattr(AttnOnlyTransformer, "from_pretrained", from_pretrained)
    monkeypatch.setattr(HookedTransformer, "from_pretrained", from_pretrained)
    return calls


@TL3_ONLY
def test_convert_offline_says_what_to_do(no_hub, tmp_path, capsys):
    assert main(["convert", "gpt2", str(tmp_path / "out")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert no_hub == []
    assert "no route" in err
    for advice in ("HF_HUB_OFFLINE=1", "tl-attnonly verify DIR", "tl-attnonly demo"):
        assert advice in err
    assert "Traceback" not in err and len(err.splitlines()) < 10


@TL3_ONLY
def test_convert_with_hf_hub_offline_and_no_cache_says_what_to_do(monkeypatch, tmp_path, capsys):
    from tl_attnonly import AttnOnlyTransformer

    def from_pretrained(name, **kwargs):
        raise OSError(f"We couldn't connect to the hub to load {name}")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(AttnOnlyTransformer, "from_pretrained", from_pretrained)
    assert main(["convert", "gpt2", str(tmp_path / "out")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "not in the cache" in err and "tl-attnonly demo" in err


@TL3_ONLY
def test_unknown_model_name_suggests_close_ones(no_hub, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_hub_unreachable", lambda timeout=0: None)  # the hub answers
    assert main(["verify", "gtp2"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "'gtp2' is not a directory, a local model (bundled, smollm2, minilm), nor a model" in err
    assert "'gpt2'" in err
    assert len(err) < 600  # not TransformerLens's list of every model
    assert no_hub == []


@TL3_ONLY
def test_convert_without_the_hub_fails_before_importing_transformer_lens(tmp_path):
    code = _IMPORTS.format(argv=["convert", "gpt2", str(tmp_path / "out")])
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": ""},
    )
    assert "heavy []" in result.stdout, result.stdout + result.stderr
    assert "did not answer" in result.stderr and "HF_HUB_OFFLINE=1" in result.stderr


# ------------------------------------------------------------------------------------------------
# verify: bad paths, PASS, FAIL
# ------------------------------------------------------------------------------------------------
def test_verify_missing_path(tmp_path, capsys):
    missing = tmp_path / "no-such-dir"
    assert main(["verify", str(missing)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"No such directory: {str(missing)!r}" in err and len(err) < 400


def test_verify_unconverted_model_directory(tmp_path, capsys):
    load_bundled_tokenizer().save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert main(["verify", str(tmp_path)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "not a converted model" in err and "conversion.json" in err
    assert "tl-attnonly convert NAME OUT_DIR" in err


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("converted")
    tl_attnonly.convert(load_bundled_model()).save_pretrained(path)
    return path


@TL3_ONLY
def test_verify_pass(saved_dir, capsys):
    assert main(["verify", str(saved_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Verifying the converted ")
    assert "tolerance relative: 1e-4 (float32) / 1e-10 (float64)" in out
    lines = [line.split() for line in out.splitlines() if line.strip().startswith("PASS ")]
    assert [line[1] for line in lines] == ["float32", "float64"]
    assert out.rstrip().endswith("PASS")


@TL3_ONLY
def test_verify_refuses_a_negative_tolerance(saved_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["verify", str(saved_dir), "--tolerance", "-1"])
    assert exc.value.code == EXIT_USAGE
    assert "must be >= 0" in capsys.readouterr().err


@TL3_ONLY
def test_verify_fails_a_broken_conversion(monkeypatch, capsys):
    from transformer_lens import HookedTransformer

    real_convert = tl_attnonly.convert

    def broken_convert(model, **kwargs):
        converted = real_convert(model)
        with torch.no_grad():
            converted.blocks[0].mlp.W_out[:, 0] *= 1.01  # one neuron's output, 1% off
        return converted

    monkeypatch.setattr(cli, "_hub_unreachable", lambda timeout=0: None)
    monkeypatch.setattr(
        HookedTransformer, "from_pretrained", lambda name, **kw: load_bundled_model()
    )
    monkeypatch.setattr(tl_attnonly, "convert", broken_convert)
    assert main(["verify", "gpt2"]) == EXIT_FAIL
    out = capsys.readouterr().out
    assert "  FAIL  float32" in out and "  FAIL  float64" in out
    assert out.rstrip().endswith(
        "FAIL: the converted model does not compute what the original does."
    )


# ------------------------------------------------------------------------------------------------
# verify a TransformerBridge (TransformerLens 4.x; --bridge on 3.x), and convert on 4.x
# ------------------------------------------------------------------------------------------------
#: How each line runs the bridge path: --bridge, and on 3.x also as 4.x does (no
#: HookedTransformer, simulated).
BRIDGE_ROUTES = ["--bridge", "no HookedTransformer"] if _compat.HAS_HOOKED_TRANSFORMER else [""]


def _bridge_route(monkeypatch, route: str) -> list[str]:
    if route == "no HookedTransformer":
        monkeypatch.setattr(cli, "_has_hooked_transformer", lambda: False)
    return ["--bridge"] if route == "--bridge" else []


def _verdict_lines(out: str) -> list[list[str]]:
    return [
        line.split() for line in out.splitlines() if line.strip().startswith(("PASS ", "FAIL "))
    ]


@pytest.mark.parametrize("route", BRIDGE_ROUTES)
def test_verify_a_local_model_as_a_bridge(monkeypatch, capsys, route):
    argv = ["verify", "bundled", "--prompt", "x = [i for i in range(3)]\n"]
    assert main(argv + _bridge_route(monkeypatch, route)) == 0
    out = capsys.readouterr().out
    assert out.startswith("Verifying the converted bundled, ") and "as a TransformerBridge" in out
    assert "2 layers, 512 neuron-heads/layer (silu, 1 head(s)/neuron, method 'exact')" in out
    assert "float32: max |converted - unconverted bridge|" in out
    lines = _verdict_lines(out)
    assert [line[:2] for line in lines] == [["PASS", "float32"], ["PASS", "float64"]]
    assert float(lines[1][5]) < 1e-12  # max |Δlogits| in float64: SiLU neuron-heads are exact
    assert out.rstrip().endswith("PASS")


def test_verify_a_bridge_fails_a_broken_conversion(monkeypatch, capsys):
    from tl_attnonly.cli import bridge_demo

    real_convert = bridge_demo.convert_bridge

    def convert_then_perturb(bridge, *args, **kwargs):
        converted = real_convert(bridge, *args, **kwargs)
        with torch.no_grad():
            bridge.blocks[0].mlp.out.weight[:, 0] *= 1.01  # one neuron's output, 1% off
        return converted

    monkeypatch.setattr(bridge_demo, "convert_bridge", convert_then_perturb)
    argv = ["verify", "bundled"] + _bridge_route(monkeypatch, BRIDGE_ROUTES[0])
    assert main(argv) == EXIT_FAIL
    out = capsys.readouterr().out
    assert [line[:2] for line in _verdict_lines(out)] == [["FAIL", "float32"], ["FAIL", "float64"]]
    assert out.rstrip().endswith(
        "FAIL: the converted model does not compute what the original does."
    )


def test_verify_a_bridge_by_model_name_boots_it_per_dtype(monkeypatch, capsys):
    from transformer_lens.model_bridge import TransformerBridge

    calls = []

    def boot(name, dtype=torch.float32, **kwargs):
        calls.append((name, dtype))
        return load_bundled_bridge(dtype=dtype)

    monkeypatch.setattr(cli, "_hub_unreachable", lambda timeout=0: None)
    monkeypatch.setattr(TransformerBridge, "boot_transformers", boot)
    argv = ["verify", "GPT2"] + _bridge_route(monkeypatch, BRIDGE_ROUTES[0])
    assert main(argv) == 0
    assert {name for name, _ in calls} == {"gpt2"}  # TransformerLens's official name
    assert {dtype for _, dtype in calls} == {torch.float32, torch.float64}
    assert "gpt2, booted with TransformerBridge.boot_transformers" in capsys.readouterr().out


def test_verify_a_bridge_refuses_a_saved_directory_before_loading(monkeypatch, tmp_path, capsys):
    (tmp_path / "conversion.json").write_text("{}")
    argv = ["verify", str(tmp_path)] + _bridge_route(monkeypatch, BRIDGE_ROUTES[0])
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "holds a saved AttnOnlyTransformer" in err and "tl-attnonly verify MODEL" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("route", BRIDGE_ROUTES)
def test_verify_minilm_as_a_bridge_says_it_is_an_encoder(monkeypatch, capsys, route):
    assert main(["verify", "minilm"] + _bridge_route(monkeypatch, route)) == EXIT_USAGE
    assert "minilm is an encoder" in capsys.readouterr().err


def test_convert_without_hooked_transformer_says_why_and_what_to_do(monkeypatch, tmp_path, capsys):
    """What `convert` answers on TransformerLens 4.x (simulated on 3.x), before loading anything:
    what it saves needs HookedTransformer, a converted bridge has nothing of its own to save, and
    where to go instead."""
    monkeypatch.setattr(cli, "_has_hooked_transformer", lambda: False)
    monkeypatch.setattr(tl_attnonly.bundled, "load_bundled_bridge", None)  # never reached
    assert main(["convert", "bundled", str(tmp_path / "out")]) == EXIT_USAGE
    err = capsys.readouterr().err
    for text in (
        "needs HookedTransformer",
        "nothing to save beyond the original checkpoint",
        "tl_attnonly.convert(bridge)",
        "`tl-attnonly verify MODEL`",
        "transformer-lens>=3,<4",
    ):
        assert text in err
    assert not (tmp_path / "out").exists() and "Traceback" not in err


def test_every_public_name_resolves_lazily():
    assert set(tl_attnonly.__all__) - {"__version__", "convert"} == set(tl_attnonly._LAZY)
    for name in tl_attnonly.__all__:
        assert getattr(tl_attnonly, name) is not None, name
    assert set(tl_attnonly.__all__) <= set(dir(tl_attnonly))
