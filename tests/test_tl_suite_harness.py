"""The TransformerLens-suite harness (tests/tl_suite): file selection and hub-error skipping.

The harness itself runs TransformerLens's tests (``python tests/tl_suite/run.py``); these check
the two rules it applies to them, offline and in milliseconds.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SUITE = Path(__file__).parent / "tl_suite"
sys.path.insert(0, str(SUITE))  # the plugin imports allowlist.py beside it


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"tl_suite_{name}", SUITE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run = _load("run")
tl_suite_plugin = _load("tl_suite_plugin")


def test_selection_takes_files_naming_the_swapped_classes_outside_bridge_and_benchmarks(
    tmp_path,
):
    files = {
        "tests/unit/test_a.py": "from transformer_lens import HookedTransformer",
        "tests/unit/test_config_only.py": "from transformer_lens import HookedTransformerConfig",
        "tests/integration/test_enc.py": "model = HookedEncoder(cfg)",
        "tests/integration/model_bridge/test_b.py": "HookedTransformer",
        "tests/acceptance/benchmarks/test_c.py": "HookedTransformer",
        "tests/unit/test_make_docs.py": "HookedTransformer",
        "tests/unit/helper.py": "HookedTransformer",
        "tests/mps/test_d.py": "HookedTransformer",
        "tests/unit/scripts/test_e.py": "HookedTransformer",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert run.select_test_files(tmp_path) == [
        "tests/unit/test_a.py",
        "tests/integration/test_enc.py",
    ]


def test_tl4_selection_runs_the_listed_files_the_sdist_has(tmp_path, capsys):
    from tl4_selection import SELECTED

    present = SELECTED[:2]
    for name in present:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("def test_x(): pass")
    assert run.select_bridge_test_files(tmp_path) == list(present)
    assert f"{len(SELECTED) - 2} selected file(s) are not in this sdist" in capsys.readouterr().err


def test_tl4_everything_takes_every_test_file_but_benchmarks_docs_and_scripts(tmp_path):
    for name in (
        "tests/unit/model_bridge/test_a.py",
        "tests/integration/test_b.py",
        "tests/unit/benchmarks/test_c.py",
        "tests/unit/test_make_docs.py",
        "tests/unit/helper.py",
        "tests/mps/test_d.py",
        "tests/unit/scripts/test_e.py",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert run.select_bridge_test_files(tmp_path, everything=True) == [
        "tests/unit/model_bridge/test_a.py",
        "tests/integration/test_b.py",
    ]


def test_tl4_allowlist_names_selected_files_only():
    """Every allow-listed TL 4 test is in a file the run selects (an entry elsewhere is dead)."""
    from allowlist_tl4 import ALLOWED_FAILURES
    from tl4_selection import SELECTED

    assert {nodeid.split("::")[0] for nodeid in ALLOWED_FAILURES} <= set(SELECTED)
    assert all(
        reason.startswith(("By design", "Fails on the original too"))
        for reason in ALLOWED_FAILURES.values()
    )


def test_an_entry_that_passes_is_stale_unless_its_failure_is_the_cpu_s_rounding():
    """A listed test that passes fails the run (remove the entry), except an entry in the
    allow-list's ``ROUNDING``: a rounding difference that lands on a logit on some CPUs only
    (Granite's [2.0] failed on an AVX-512 EPYC machine and passed on the earlier one)."""
    import allowlist
    import allowlist_tl4

    for module in (allowlist, allowlist_tl4):
        assert module.ROUNDING <= set(module.ALLOWED_FAILURES)  # each one listed, with a reason
    current = allowlist_tl4 if tl_suite_plugin.ALLOWLIST.endswith("_tl4.py") else allowlist
    plain = next(n for n in current.ALLOWED_FAILURES if n not in current.ROUNDING)
    assert tl_suite_plugin.stale(plain, {"passed"})
    assert not tl_suite_plugin.stale(plain, {"passed", "failed"})
    assert not tl_suite_plugin.stale(plain, {"passed", "skipped"})
    for nodeid in current.ROUNDING:
        assert not tl_suite_plugin.stale(nodeid, {"passed"})
    assert allowlist_tl4.ROUNDING  # the Granite entry


def _raised_from(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as err:
            raise outer from err
    except BaseException as err:
        return err


def test_hub_errors_are_recognised_through_the_exception_chain():
    class LocalEntryNotFoundError(Exception):  # huggingface_hub's, by name
        pass

    assert tl_suite_plugin.needs_hub(LocalEntryNotFoundError("no file"))
    assert tl_suite_plugin.needs_hub(
        _raised_from(RuntimeError("could not load"), LocalEntryNotFoundError("x"))
    )
    assert tl_suite_plugin.needs_hub(
        OSError("We couldn't connect to 'https://huggingface.co' to load this file")
    )


@pytest.mark.parametrize(
    "error",
    [AssertionError("Unexpected key"), StopIteration(), KeyError("hook_embed"), OSError("disk")],
)
def test_other_errors_are_failures(error):
    assert not tl_suite_plugin.needs_hub(error)
    assert not tl_suite_plugin.needs_hub(_raised_from(ValueError("wrapped"), error))


def test_tl_attnonly_s_own_hub_failure_counts_as_needing_the_hub():
    """AttnOnlyTransformer.from_pretrained fails fast offline with tl_attnonly.hub's error, before
    TransformerLens reaches the hub client: the harness must skip those tests too (TL's files that
    call from_pretrained at module level failed to collect before)."""
    from tl_attnonly.hub import HubUnavailableError

    error = HubUnavailableError("solu-1l", "the hub is unreachable", "load it locally")
    assert tl_suite_plugin.needs_hub(error)
    collected = f"tl_attnonly.hub.{type(error).__name__}: {error}"  # a collection error's text
    assert any(text in collected for text in tl_suite_plugin.HUB_TEXT)


# --- the TransformerLens 4 run: every bridge the tests build is converted ---------------------

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "bridge"))
bridge_conversion = _load("bridge_conversion")


def _llama():
    """An unconverted random LLaMA (SwiGLU, GQA) bridge, built with the harness off."""
    from kinds import make_bridge

    return make_bridge("llama_gqa", convert=False)


def test_a_bridge_built_while_installed_is_converted_and_counted():
    from kinds import make_bridge, make_tokens

    from tl_attnonly.bridge import is_converted_bridge

    before = sum(bridge_conversion.OUTCOMES.values())
    with bridge_conversion.installed():
        built = make_bridge("llama_gqa", convert=False)  # the harness converts it
    assert is_converted_bridge(built)
    assert sum(bridge_conversion.OUTCOMES.values()) == before + 1
    assert bridge_conversion.OUTCOMES[("LlamaForCausalLM", "converted")] >= 1
    assert not is_converted_bridge(_llama())  # uninstalled: TransformerLens's constructor again
    tokens = make_tokens()
    torch.testing.assert_close(built(tokens), _llama()(tokens), rtol=0, atol=1e-10)


def test_a_refused_bridge_is_left_as_built_and_the_refusal_counted():
    """A GPT-2 with a tanh MLP has no neuron-head form: conversion refuses it (ValueError, by
    design); the bridge stays as TransformerLens built it and the reason is counted."""
    import transformers
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

    from tl_attnonly.bridge import is_converted_bridge

    config = transformers.GPT2Config(
        vocab_size=64, n_layer=1, n_embd=16, n_head=2, n_positions=16, activation_function="tanh"
    )
    with bridge_conversion.installed():
        bridge = build_bridge_from_module(
            transformers.GPT2LMHeadModel(config).eval(), "GPT2LMHeadModel", hf_config=config
        )
    assert not is_converted_bridge(bridge)
    refusals = [o for (arch, o) in bridge_conversion.OUTCOMES if arch == "GPT2LMHeadModel"]
    assert any(o.startswith("not converted (refused): ValueError") for o in refusals)
    assert any("refused" in line for line in bridge_conversion.summary())


def test_weight_processing_converts_the_bridge_again():
    """``enable_compatibility_mode()`` makes a gated bridge MLP compute itself from processed
    weights, and a converted bridge then raises on its next forward pass (by design,
    docs/bridge.md). The harness converts it again, as the message says: the forward pass runs
    the neuron-heads and equals the unconverted bridge in compatibility mode."""
    from kinds import make_tokens

    import tl_attnonly
    from tl_attnonly.bridge import is_converted_bridge

    tokens = make_tokens()
    reference = _llama()
    reference.enable_compatibility_mode(disable_warnings=True)
    with bridge_conversion.installed():
        bridge = _llama()
        bridge.enable_compatibility_mode(disable_warnings=True)
        logits, cache = bridge.run_with_cache(tokens)
    assert is_converted_bridge(bridge)
    assert "blocks.0.mlp.hook_pattern" in cache.keys()
    torch.testing.assert_close(logits, reference(tokens), rtol=0, atol=1e-10)

    unaided = tl_attnonly.convert(_llama())
    unaided.enable_compatibility_mode(disable_warnings=True)
    with pytest.raises(RuntimeError, match="ran without its neuron-heads"):
        unaided(tokens)
