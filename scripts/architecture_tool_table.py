"""Which analysis tool runs on which architecture: every tool on every bridge zoo model, measured.

For every model of the bridge zoo (``tests/bridge/zoo.py``: tiny random Hugging Face models, built
offline, wrapped with ``build_bridge_from_module`` and converted with ``tl_attnonly.convert``;
float32, one thread) each tool of :data:`TOOLS` is run once on a tiny task: ``[2, 6]`` random
tokens against a copy with two positions changed, and a last-position logit difference as the
metric. A cell is ``yes`` when the tool returns and, where a cheap check of its contract exists
(exact circuit runs, patching against a plain hook, decompositions that sum), keeps it. It is the
refusal's first sentence when the tool raises ``NotImplementedError``, ``ValueError`` or
``TypeError`` from inside ``tl_attnonly`` (a refusal). Any other exception, one of those three
raised elsewhere, or a broken contract is recorded as ``error: ...``: a defect, which
``tests/bridge/test_architecture_tools.py`` fails on unless it lists it. One cell's failure never
stops the others.

The table goes in ``docs/architecture_tools.md`` between the markers :data:`BEGIN` and :data:`END`.

Usage (from the repository root)::

    python scripts/architecture_tool_table.py            # print the section
    python scripts/architecture_tool_table.py --write    # and replace it in the docs page
    python scripts/architecture_tool_table.py --only llama,gemma2   # some rows (not --write)
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "bridge"))

from zoo import ZOO  # noqa: E402
from zoo_tools import (  # noqa: E402
    REFUSALS,
    TOOLS,
    Task,
    build_converted,
    cell,
    error_text,
    first_sentence,
    raised_by_the_package,
    refusal_text,
    tokens,
)

#: The docs page that holds the table, and the markers around it.
DOCS = ROOT / "docs" / "architecture_tools.md"
BEGIN = "<!-- architecture-tool-table: begin (scripts/architecture_tool_table.py --write) -->"
END = "<!-- architecture-tool-table: end -->"
#: Cells that are not measured: the model does not convert (its reason is in the "converts" cell).
NOT_RUN = "—"


#: A row: column ("converts" and every tool) -> cell text (``"yes"``, a reason, or NOT_RUN).
Row = dict[str, str]
CONVERTS = "converts"


def row(name: str) -> tuple[Row, dict[str, float]]:
    """Zoo model ``name``'s cells, and the seconds each tool took."""
    spec = ZOO[name]
    converts = "yes"
    if spec.broken:
        converts = "bridge fails: " + first_sentence(spec.broken)
    else:
        try:
            bridge = build_converted(name)
        except REFUSALS as refusal:  # a refusal raised inside tl_attnonly, as for the tools
            refused = raised_by_the_package(refusal)
            converts = "refused: " + refusal_text(refusal) if refused else error_text(refusal)
        except Exception as error:  # noqa: BLE001 - recorded, the other rows go on
            converts = error_text(error)
    cells, seconds = {CONVERTS: converts}, {}
    for column, (_, tool) in TOOLS.items():
        if converts != "yes":
            cells[column] = NOT_RUN
            continue
        clean, corrupted = tokens()
        start = time.perf_counter()
        cells[column] = cell(tool, Task(bridge, clean, corrupted))
        seconds[column] = time.perf_counter() - start
    return cells, seconds


def measure(names: list[str]) -> dict[str, Row]:
    """zoo model -> its row; each row's time goes to stderr."""
    rows = {}
    for name in names:
        start = time.perf_counter()
        rows[name], seconds = row(name)
        slowest = max(seconds.items(), key=lambda item: item[1], default=("-", 0.0))
        print(
            f"{name}: {time.perf_counter() - start:.1f} s (slowest: {slowest[0]} "
            f"{slowest[1]:.1f} s)",
            file=sys.stderr,
        )
    return rows


def is_error(text: str) -> bool:
    """Whether a cell is a defect (an exception that is not a refusal, or a wrong result)."""
    return text.startswith("error: ")


def table(rows: dict[str, Row]) -> str:
    """The Markdown table, then its reasons numbered in order of first appearance."""
    notes: dict[str, int] = {}

    def ref(text: str) -> str:
        if text in ("yes", NOT_RUN):
            return text
        number = notes.setdefault(text, len(notes) + 1)
        return f"{'**error**' if is_error(text) else 'no'} ({number})"

    columns = [CONVERTS, *TOOLS]
    lines = [
        "| zoo model | architecture | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for name, cells in rows.items():
        values = " | ".join(ref(cells[column]) for column in columns)
        lines.append(f"| {name} | {ZOO[name].architecture} | {values} |")
    lines.append("")
    lines.extend(f"{number}. {text}" for text, number in notes.items())
    return "\n".join(lines)


def parse_table(section_text: str) -> dict[str, Row]:
    """The rows of a section written by :func:`section`, each reason number resolved to its
    text (so two tables compare cell by cell whatever their numbering)."""
    notes = dict(re.findall(r"^(\d+)\. (.*)$", section_text, re.MULTILINE))
    lines = [line for line in section_text.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        found = {}
        for column, text in zip(header[2:], cells[2:]):
            number = re.fullmatch(r"(?:no|\*\*error\*\*) \((\d+)\)", text)
            found[column] = notes[number.group(1)] if number else text
        rows[cells[0]] = found
    return rows


def section_version(section_text: str) -> str:
    """The TransformerLens version a section was generated with."""
    found = re.search(r"^TransformerLens (\S+), ", section_text, re.MULTILINE)
    if found is None:
        raise ValueError("The section has no 'TransformerLens X.Y.Z, ...' line.")
    return found.group(1)


def tl_version() -> str:
    from importlib.metadata import version

    return version("transformer-lens")


def section(body: str) -> str:
    """The docs section between the markers: the command, the versions, the legend, the table."""
    import transformers

    tools = "; ".join(f"**{column}**: {what}" for column, (what, _) in TOOLS.items())
    return "\n".join(
        [
            BEGIN,
            "",
            "```bash",
            "python scripts/architecture_tool_table.py --write",
            "```",
            "",
            f"TransformerLens {tl_version()}, transformers {transformers.__version__}, "
            f"torch {torch.__version__}; float32, one thread.",
            "",
            f"Columns: **{CONVERTS}**: `tl_attnonly.convert`; {tools}.",
            "",
            "Cells: `yes` (ran, and kept its contract where one is checked); `no (n)` (refused: "
            "reason n below, the refusal's first sentence); **error** (n) (an exception that is "
            "not a refusal, or a result that breaks the tool's contract: a defect); "
            f"`{NOT_RUN}` (not run: the model does not convert).",
            "",
            body,
            "",
            END,
        ]
    )


def replace_section(text: str, new: str) -> str:
    """``text`` with the part from :data:`BEGIN` to :data:`END` replaced by ``new``."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + new + text[end:]


def documented_section() -> str:
    """The section as the docs page holds it now."""
    text = DOCS.read_text(encoding="utf-8")
    return text[text.index(BEGIN) : text.index(END) + len(END)]


def documented_table() -> str:
    """The documented table and its reasons, as :func:`table` writes them."""
    text = documented_section()
    return text[text.index("| zoo model") : text.index(END)].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the table in {DOCS.name}")
    parser.add_argument("--only", default="", help="comma-separated zoo models (default: all)")
    args = parser.parse_args(argv)
    if args.write and args.only:
        parser.error("--write regenerates every row; drop --only")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    names = args.only.split(",") if args.only else list(ZOO)
    start = time.perf_counter()
    new = section(table(measure(names)))
    print(f"{len(names)} zoo models, {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print(new)
    if args.write:
        DOCS.write_text(replace_section(DOCS.read_text(encoding="utf-8"), new), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
