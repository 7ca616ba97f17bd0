"""``tl-attnonly demo`` on a TransformerBridge (``--bridge`` on TL 3.x; the default on TL 4.x)
and :mod:`tl_attnonly.bridge.demo` (verification against the unconverted bridge, the report).

Runs on TL 3.9 and 4.3. The demo's own test on TL 3.x (HookedTransformer path) is in
tests/test_report.py.
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from bridge_models import make_bridge, make_tokens

import tl_attnonly._compat as compat
from tl_attnonly import ConversionOptions
from tl_attnonly.bridge import demo as bridge_demo
from tl_attnonly.bridge import neuron_head_layers
from tl_attnonly.cli import main

TL4 = pytest.mark.skipif(compat.HAS_HOOKED_TRANSFORMER, reason="TransformerLens 4.x behaviour")


def _verdicts(output: str) -> dict[str, float]:
    found = re.findall(r"^\s*PASS\s+(float\d+)\s+max \|Δlogits\| = (\S+)", output, re.MULTILINE)
    return {dtype: float(value) for dtype, value in found}


@pytest.mark.slow
def test_demo_bridge_flag_verifies_and_writes_the_report(tmp_path, capsys):
    report = tmp_path / "out" / "demo.html"
    assert main(["demo", "--bridge", "--no-progress", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "as a TransformerBridge" in out and "2 layers x 512 neuron-heads (silu" in out
    verdicts = _verdicts(out)
    assert set(verdicts) == {"float32", "float64"}, out
    assert verdicts["float32"] <= 1e-4 * 25 and verdicts["float64"] <= 1e-10
    page = report.read_text(encoding="utf-8")
    assert len(re.findall(r"Plotly\.newPlot\(", page)) == 2  # one heatmap per layer
    assert "Equivalence with the unconverted bridge" in page and "float64" in page
    assert "* plotly.js v" in page  # inlined: opens offline
    assert not re.search(r"<script[^>]*\ssrc=", page)


@pytest.mark.slow
def test_demo_without_hooked_transformer_runs_the_bridge_path(monkeypatch, capsys):
    """What a fresh install gets on TransformerLens 4.x (simulated on 3.x)."""
    from tl_attnonly import cli

    monkeypatch.setattr(cli, "_has_hooked_transformer", lambda: False)
    assert main(["demo", "--no-progress", "--report", ""]) == 0
    out = capsys.readouterr().out
    assert "TransformerLens 4.x has no HookedTransformer" in out
    assert set(_verdicts(out)) == {"float32", "float64"}
    assert "Report written" not in out


def test_bridge_demo_refuses_smollm2(capsys):
    assert main(["demo", "--bridge", "--model", "smollm2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "runs the bundled model only" in err and "tl_attnonly.convert(bridge)" in err


# ---------------------------------------------------------------- verification


def _load(arch: str):
    return lambda dtype: make_bridge(arch, dtype)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma"])
def test_verify_bridge_conversion_passes_exact_and_approximate(arch):
    """SwiGLU (exact): against the unconverted bridge; GELU-new and GeGLU (4 fitted heads): against
    the unconverted bridge with the heads' activation, which the conversion matches to rounding
    while the unconverted bridge itself differs by the fit's error."""
    verdicts = bridge_demo.verify_bridge_conversion(_load(arch), make_tokens())
    assert [v.dtype for v in verdicts] == [torch.float32, torch.float64]
    assert all(v.passed for v in verdicts)
    fp64 = verdicts[1]
    assert fp64.max_abs_diff <= 1e-10
    if arch == "llama":
        assert fp64.reference == "unconverted bridge"
        assert fp64.approximation_diff == fp64.max_abs_diff
    else:
        assert fp64.reference == "unconverted bridge with the heads' activation"
        assert fp64.approximation_diff > 1e3 * max(fp64.max_abs_diff, 1e-15)
    assert list(fp64.table["activation"][:2]) == ["logits", "resid_pre"]


def test_verify_bridge_conversion_fails_on_a_wrong_conversion(monkeypatch):
    """A converted bridge whose neuron-heads compute something else fails the verdict."""
    convert = bridge_demo.convert_bridge

    def convert_then_perturb(bridge, options=None, progress=True):
        convert(bridge, options, progress=progress)
        bridge.blocks[1].mlp.hook_z.add_hook(lambda z, hook: z * 1.001)
        return bridge

    monkeypatch.setattr(bridge_demo, "convert_bridge", convert_then_perturb)
    verdicts = bridge_demo.verify_bridge_conversion(_load("llama"), make_tokens())
    assert not any(v.passed for v in verdicts)


def test_verify_bridge_conversion_refuses_a_conversion_that_did_not_take(monkeypatch):
    monkeypatch.setattr(bridge_demo, "convert_bridge", lambda bridge, options, progress: bridge)
    monkeypatch.setattr(bridge_demo, "neuron_head_layers", lambda bridge: [_Layer()] * 2)
    with pytest.raises(RuntimeError, match=r"did not fire \(blocks\.0\.mlp\.hook_pattern"):
        bridge_demo.verify_bridge_conversion(_load("llama"), make_tokens(), dtypes=[torch.float64])


class _Layer:
    coefficients = ConversionOptions().coefficients("silu")


def test_self_weights_are_the_pattern_of_the_most_active_heads():
    bridge = make_bridge("llama")
    import tl_attnonly

    tl_attnonly.convert(bridge)
    _, cache = bridge.run_with_cache(make_tokens(batch=1))
    weights, heads = bridge_demo.neuron_head_self_weights(cache, 1, top_k=5)
    z = cache["blocks.1.mlp.hook_z"][0, :, :, 0].abs().amax(0)
    assert heads == z.topk(5).indices.tolist()
    torch.testing.assert_close(
        weights, cache["blocks.1.mlp.hook_pattern"][0, heads, :, 0].float()
    )
    assert neuron_head_layers(bridge)[1].n_neuron_heads == 48


@TL4
def test_report_module_refuses_at_import_with_the_bridge_route_on_tl4():
    """tl_attnonly.report's own refusal (it was inside the module docstring, so TL's error came
    instead, without the bridge route)."""
    with pytest.raises(ImportError, match=r"^tl_attnonly\.report needs TransformerLens"):
        importlib.import_module("tl_attnonly.report")


@pytest.mark.skipif(not compat.HAS_HOOKED_TRANSFORMER, reason="refuses at import on TL 4.x")
def test_report_module_docstring_has_no_code():
    import tl_attnonly.report as report_module

    assert "HAS_HOOKED_TRANSFORMER" not in (report_module.__doc__ or "")


@pytest.mark.parametrize("argv", [["convert", "bundled", "out"], ["verify", "bundled"]])
def test_convert_and_verify_refuse_without_hooked_transformer(monkeypatch, capsys, tmp_path, argv):
    """On TransformerLens 4.x (simulated on 3.x; the 4.x CI venv runs the real thing) the commands
    that save or verify HookedTransformer models end in a usage error that names the bridge
    route, before loading anything and without a traceback."""
    from tl_attnonly import cli

    monkeypatch.setattr(cli, "_has_hooked_transformer", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "TransformerLens 4.x removed" in err and "tl_attnonly.convert(bridge)" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
