"""docs/architecture_tools.md: which analysis tool runs on which zoo architecture, regenerated.

``scripts/architecture_tool_table.py`` runs every tool on every zoo model (``zoo.py``) and writes
a table of ``yes``, refusals (their first sentence) and defects (``error: ...``). Here:

* the whole table is regenerated (slow: about 30 s alone on one core, 60-120 s on a shared
  machine) and must equal the documented one on the TransformerLens line it was generated with.
  On the other line every cell must equal it except the cells of :data:`LINE_DIFFERENCES`, each
  with its reason. So a tool that starts or stops refusing, or starts failing, fails the test
  until the table is regenerated (``python scripts/architecture_tool_table.py --write``);
* no cell may be an error outside :data:`KNOWN_ERRORS` (each a defect, with what is known);
* quick: a few rows regenerated, and the cell logic (refusal, defect, wrong result) on fake tools.
"""

from __future__ import annotations

import importlib.util
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import torch
from zoo_tools import cell, check_contract, first_sentence

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "architecture_tool_table.py"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("architecture_tool_table", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


T = _load()

#: (zoo model, column) -> why a cell differs between TransformerLens 3.9 and 4.3 (either way).
LINE_DIFFERENCES: dict[tuple[str, str], str] = {}

#: (zoo model, column) -> a defect known when the table was generated (an error cell). An error
#: cell not listed here fails the test: fix the tool, or list it here with what is known. None
#: now: the last ones (expert layers in the dense decompositions, XGLM's unhooked positions,
#: Gemma 2's final soft cap in the DLA check, TL 3.9's EXAONE-4 norms, OPT's and XGLM's MLP width,
#: GPT-1's residual post-LN) were fixed or became refusals with their reasons.
KNOWN_ERRORS: dict[tuple[str, str], str] = {}


def line(tl: str) -> str:
    """The TransformerLens line of a version (``"3.9.0"`` -> ``"3"``)."""
    return tl.split(".")[0]


def documented() -> tuple[str, dict[str, dict[str, str]]]:
    """The documented table's TransformerLens version and rows."""
    text = T.documented_section()
    return T.section_version(text), T.parse_table(text)


def differences(
    expected: dict[str, dict[str, str]], found: dict[str, dict[str, str]], allowed: set
) -> list[str]:
    """Cells that differ (``model / column: documented -> now``), except ``allowed`` ones."""
    out = []
    for name, cells in found.items():
        if name not in expected:
            out.append(f"{name}: not in the documented table")
            continue
        for column, text in cells.items():
            was = expected[name].get(column)
            if was != text and (name, column) not in allowed:
                out.append(f"{name} / {column}: documented {was!r} -> now {text!r}")
    return out


def check_rows(rows: dict[str, dict[str, str]]) -> None:
    """``rows`` agree with the documented table (module docstring) and hold no unknown error."""
    tl, expected = documented()
    same_line = line(tl) == line(version("transformer-lens"))
    allowed = set() if same_line else set(LINE_DIFFERENCES)
    changed = differences(expected, rows, allowed)
    assert not changed, (
        f"The tool table changed (documented on TransformerLens {tl}); regenerate it with "
        "`python scripts/architecture_tool_table.py --write` on that line:\n" + "\n".join(changed)
    )
    errors = {
        (name, column): text
        for name, cells in rows.items()
        for column, text in cells.items()
        if T.is_error(text) and (name, column) not in KNOWN_ERRORS
    }
    assert not errors, "Cells with an unexpected error (a defect, not a refusal):\n" + "\n".join(
        f"{key}: {text}" for key, text in errors.items()
    )


@pytest.mark.slow
def test_the_documented_table_is_regenerated_exactly():
    """Every zoo model, every tool: the documented table cell for cell and, on its line, its text
    (the reasons' numbering too)."""
    torch.set_num_threads(1)
    rows = T.measure(list(T.ZOO))
    check_rows(rows)
    tl, _ = documented()
    if line(tl) == line(version("transformer-lens")):
        assert T.table(rows).strip() == T.documented_table()


def test_some_rows_are_regenerated():
    """Quick: an encoder (some tools run, some refuse) and a bridge that fails (no tool runs)."""
    rows = T.measure(["bert", "codegen"])
    assert "yes" in rows["bert"].values() and set(rows["bert"].values()) != {"yes"}
    assert set(rows["codegen"]) == {T.CONVERTS, *T.TOOLS}
    assert rows["codegen"][T.CONVERTS].startswith("bridge fails: ")
    assert set(rows["codegen"].values()) == {rows["codegen"][T.CONVERTS], T.NOT_RUN}
    check_rows(rows)


def _refuse(_task: Any) -> None:
    from tl_attnonly.adapt import analysis_model

    analysis_model(object())  # refused by tl_attnonly, naming what it takes


def _crash(_task: Any) -> None:
    raise RuntimeError("Something broke. Details.")


def _library_value_error(_task: Any) -> None:
    import json

    json.loads("not json")  # a ValueError raised by another library: a defect


def _call_does_not_fit(_task: Any) -> None:
    len(1, 2)  # type: ignore[call-arg]  # a TypeError of a call here, not raised by tl_attnonly


def _wrong(_task: Any) -> None:
    check_contract(torch.ones(2), torch.zeros(2), "the sum is off")


def _package_value_error(_task: Any) -> None:
    from tl_attnonly.analysis import neuron_level

    neuron_level(torch.zeros(3), ["L0H0"])  # refused by tl_attnonly: 1 label for 3 rows


@pytest.mark.parametrize(
    "tool, expected",
    [
        (lambda task: None, "yes"),
        (_refuse, "TypeError: Expected a TransformerLens model (AttnOnlyTransformer, "),
        (_crash, "error: RuntimeError: Something broke."),
        (_library_value_error, "error: JSONDecodeError: "),
        (_call_does_not_fit, "error: TypeError: "),
        (_wrong, "error: wrong result: the sum is off (beyond 0.0001 of the values' scale)."),
        (_package_value_error, "ValueError: 1 labels for 3 rows."),
    ],
)
def test_cells_tell_refusals_from_defects(tool, expected):
    """A refusal is one of three exceptions raised by tl_attnonly; anything else is a defect."""
    text = cell(tool, task=None)
    assert text.startswith(expected), text
    assert T.is_error(text) == expected.startswith("error: ")


def test_a_tool_that_hangs_is_an_error_and_the_table_goes_on(monkeypatch):
    import time

    import zoo_tools

    monkeypatch.setattr(zoo_tools, "CELL_SECONDS", 0.2)
    start = time.perf_counter()
    assert cell(lambda task: time.sleep(5), task=None).startswith("error: CellTimeout: ")
    assert time.perf_counter() - start < 2
    assert cell(lambda task: None, task=None) == "yes"


def test_a_tool_that_starts_or_stops_refusing_fails_the_check():
    """A documented ``yes`` that becomes a refusal, and a documented refusal that becomes ``yes``:
    both are reported."""
    _, expected = documented()
    refusing = {**expected["llama"], "summaries": "NotImplementedError: No."}
    assert differences(expected, {"llama": refusing}, set()) == [
        "llama / summaries: documented 'yes' -> now 'NotImplementedError: No.'"
    ]
    with pytest.raises(AssertionError, match="The tool table changed"):
        check_rows({"llama": refusing})
    refused = [
        (name, column)
        for name, cells in expected.items()
        for column, text in cells.items()
        if text not in ("yes", T.NOT_RUN) and not T.is_error(text) and column in T.TOOLS
    ]
    assert refused, "the documented table has refusals"
    name, column = refused[0]
    running = {**expected[name], column: "yes"}
    assert len(differences(expected, {name: running}, set())) == 1


def test_the_table_round_trips_and_numbers_each_reason_once():
    rows = {
        "llama": {T.CONVERTS: "yes", **dict.fromkeys(T.TOOLS, "yes")},
        "gemma2": {T.CONVERTS: "yes", **dict.fromkeys(T.TOOLS, "ValueError: No (a, b).")},
        "codegen": {T.CONVERTS: "bridge fails: TL's bridge fails", **dict.fromkeys(T.TOOLS, "—")},
        "opt": {T.CONVERTS: "yes", **dict.fromkeys(T.TOOLS, "error: KeyError: x")},
    }
    body = T.table(rows)
    assert body.count("1. ValueError: No (a, b).") == 1
    assert "| gemma2 | Gemma2ForCausalLM | yes | no (1) |" in body
    assert "| opt | OPTForCausalLM | yes | **error** (3) |" in body
    text = T.section(body)
    assert T.parse_table(text) == rows
    assert T.section_version(text) == version("transformer-lens")


def test_first_sentence():
    assert first_sentence("A b (e.g. c). Then more.") == "A b (e.g. c)."
    assert first_sentence("blocks.0.mlp is x.\n  Use `y`.") == "blocks.0.mlp is x."
    assert first_sentence("a | b") == "a / b"
