"""The TransformerLens-suite harness (tests/tl_suite): file selection and hub-error skipping.

The harness itself runs TransformerLens's tests (``python tests/tl_suite/run.py``); these check
the two rules it applies to them, offline and in milliseconds.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

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


def test_selection_takes_files_naming_the_swapped_classes_outside_bridge_and_benchmarks(tmp_path):
    files = {
        "tests/unit/test_a.py": "from transformer_lens import HookedTransformer",
        "tests/unit/test_config_only.py": "from transformer_lens import HookedTransformerConfig",
        "tests/integration/test_enc.py": "model = HookedEncoder(cfg)",
        "tests/integration/model_bridge/test_b.py": "HookedTransformer",
        "tests/acceptance/benchmarks/test_c.py": "HookedTransformer",
        "tests/unit/test_make_docs.py": "HookedTransformer",
        "tests/unit/helper.py": "HookedTransformer",
        "tests/mps/test_d.py": "HookedTransformer",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert run.select_test_files(tmp_path) == [
        "tests/unit/test_a.py",
        "tests/integration/test_enc.py",
    ]


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
