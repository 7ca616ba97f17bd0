"""Run the notebooks offline and write each as one self-contained HTML page.

Usage (from the repository root)::

    python scripts/build_notebook_pages.py                  # writes docs/notebooks/*.html
    python scripts/build_notebook_pages.py --out-dir OUT
    python scripts/build_notebook_pages.py --ipynb          # docs/notebooks/*.ipynb, executed

``--ipynb`` writes the executed notebooks themselves (live widgets dropped), which the
documentation site renders (``scripts/build_docs.sh``, mkdocs-jupyter). A notebook that cannot run
here (``--skip NAME``) is written without outputs, with a first cell that says so.

The notebooks are stored without outputs; these pages show them executed, figures included, to a
reader who does not run them. Plotly figures are stored with an HTML representation (the notebooks
set ``plotly.io.renderers.default = "plotly_mimetype+notebook"``, which inlines plotly.js once),
and circuitsvis views carry their own JavaScript, so the pages open offline. Progress bars are
live widgets in Jupyter; they are dropped from the pages. ``tests/test_notebooks.py`` builds the
same pages and checks that every figure is in them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS_DIR = ROOT / "notebooks"
DEFAULT_OUT_DIR = ROOT / "docs" / "notebooks"
#: Plotly renderers: the mimetype for Jupyter, and HTML (plotly.js inlined once).
PLOTLY_RENDERER = "plotly_mimetype+notebook"
#: Outputs that only a live Jupyter frontend can draw (tqdm.auto's progress-bar widgets).
LIVE_ONLY = "application/vnd.jupyter.widget-view+json"
#: Cells with this tag are not run here (nor by the tests): cells that need what CI does not run,
#: such as the real SmolLM2 cells of notebook 08. Jupyter runs them as usual.
SKIP_TAG = "skip-execution"


def offline_env() -> dict[str, str]:
    """Environment for the kernel: no hub access, this checkout's package first, and plotly
    figures stored with an HTML representation (for notebooks that do not set it themselves)."""
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PLOTLY_RENDERER": PLOTLY_RENDERER,
    }


def execute(path: Path, timeout: int = 180) -> nbformat.NotebookNode:
    """Run ``path`` top to bottom (in its own directory) and return it with its outputs.

    Cells tagged :data:`SKIP_TAG` are left without outputs.

    Raises:
        nbclient.exceptions.CellExecutionError: On the first cell that fails.
    """
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        skip_cells_with_tag=SKIP_TAG,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    return nb


def drop_live_only_outputs(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Remove the outputs that are widgets (progress bars) and their saved state; return ``nb``.

    With widget state, nbconvert's page would load a widget manager from a CDN.
    """
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if LIVE_ONLY not in o.get("data", {})]
    return nb


def to_html(nb: nbformat.NotebookNode) -> str:
    """One HTML page of an executed notebook (nbconvert's lab template, live widgets dropped)."""
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(drop_live_only_outputs(nb))
    return body


def not_executed(path: Path, reason: str) -> nbformat.NotebookNode:
    """``path`` without outputs, opened by a cell that says it was not run and why."""
    nb = nbformat.read(path, as_version=4)
    note = (
        f"**Shown without outputs:** this notebook was not run when this page was built "
        f"({reason}). Run it yourself, or see the notebooks' list for what it needs."
    )
    nb.cells.insert(0, nbformat.v4.new_markdown_cell(note))
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="where to write")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    parser.add_argument(
        "--ipynb",
        action="store_true",
        help="write the executed notebooks (.ipynb, live widgets dropped), not HTML pages",
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="NAME=REASON",
        help="with --ipynb: write notebook NAME (its stem) without running it; REASON is shown",
    )
    parser.add_argument(
        "--only-skipped",
        action="store_true",
        help="with --ipynb: write only the notebooks named by --skip (run nothing)",
    )
    args = parser.parse_args(argv)
    skip = dict(item.partition("=")[::2] for item in args.skip)
    os.environ.update(offline_env())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(NOTEBOOKS_DIR.glob("*.ipynb")):
        if args.only_skipped and path.stem not in skip:
            continue
        start = time.perf_counter()
        if args.ipynb:
            if path.stem in skip:
                nb = not_executed(path, skip[path.stem] or "skipped")
            else:
                nb = drop_live_only_outputs(execute(path, args.timeout))
            out = args.out_dir / path.name
            nbformat.write(nb, out)
            size = out.stat().st_size
        else:
            page = to_html(execute(path, args.timeout))
            out = args.out_dir / f"{path.stem}.html"
            out.write_text(page, encoding="utf-8")
            size = len(page)
        seconds = time.perf_counter() - start
        print(f"{out} ({size / 1e6:.1f} MB, {seconds:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
