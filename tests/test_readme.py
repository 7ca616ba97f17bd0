"""The README is the front door: its links lead somewhere, its commands are what CI runs, and
its Python blocks run as written (offline; a block that needs the model hub or TransformerLens
3.x says so in its first line and has an alternative beside it), and the first runs on what the
first command installs (the newest TransformerLens, 4.x).

``mkdocs build --strict`` (``scripts/build_docs.sh``) checks the links of the pages in ``docs/``;
the README is not one of them, so its links are checked here.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
#: Link targets that another branch adds (the TransformerBridge page); drop once it has landed.
NOT_YET: set[str] = set()


def _relative_links(text: str) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and t.split("#")[0]]


def test_readme_links_and_images_resolve():
    links = _relative_links(README)
    assert "docs/assets/neuron_head_pattern.png" in links  # the picture
    missing = [t for t in links if not (ROOT / t).exists() and t not in NOT_YET]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_is_a_front_door():
    assert len(README.splitlines()) <= 250


def test_the_readme_test_command_is_what_ci_runs():
    command = (
        'python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 "transformer-lens>=3.9,<4" '
        '&& .venv/bin/pip install -e ".[test]" && .venv/bin/python -m pytest -q'
    )
    assert command in README
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "# The README's test command:\n.venv/bin/python -m pytest -q\n" in ci
    assert '.venv/bin/pip install -q "transformer-lens>=3.9,<4"\n' in ci  # the same line
    demo = (
        "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install -e "
        ". && .venv/bin/tl-attnonly demo"
    )
    assert demo in README


# ---------------------------------------------------------------------------------------------
# The README's Python blocks run as written (each on its own, in a fresh interpreter, offline)
# ---------------------------------------------------------------------------------------------

#: First-line markers of blocks that cannot run everywhere; each such block has an alternative
#: that can, right after it.
HUB = "# needs the model hub"
TL3 = "# needs TransformerLens 3"
#: Calls that reach the model hub, and names that exist on TransformerLens 3.x only.
HUB_CALLS = {"from_pretrained", "boot_transformers"}
TL3_NAMES = {"load_bundled_model", "HookedTransformer", "AttnOnlyTransformer", "convert_encoder"}

#: Runs a block statement by statement; an expression statement whose comment starts with a
#: shape (``x.shape  # [batch, n_neuron_heads, pos, 2]: ...``) must have that shape (its rank, and
#: every dimension written as a number).
_DRIVER = r"""
import ast, re, sys
import torch
source = sys.stdin.read()
lines = source.splitlines()
namespace = {"__name__": "__main__"}
for node in ast.parse(source).body:
    if not isinstance(node, ast.Expr):
        exec(compile(ast.Module([node], []), "<README>", "exec"), namespace)
        continue
    value = eval(compile(ast.Expression(node.value), "<README>", "eval"), namespace)
    comment = lines[node.end_lineno - 1][node.end_col_offset:].strip()
    match = re.match(r"#\s*\[([^\]]*)\]", comment)
    if match is None:
        continue
    dims = [d.strip() for d in match.group(1).split(",")]
    shape = list(value if isinstance(value, torch.Size) else value.shape)
    ok = len(shape) == len(dims) and all(
        not d.isdigit() or int(d) == n for d, n in zip(dims, shape)
    )
    assert ok, f"line {node.lineno}: shape {shape}, the README says [{match.group(1)}]"
    print("shape checked:", lines[node.end_lineno - 1].strip())
"""


def _python_blocks() -> list[tuple[int, str]]:
    """``(line number, code)`` of every fenced Python block of the README, in order."""
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```$", README, flags=re.S | re.M):
        blocks.append((README[: match.start()].count("\n") + 2, match.group(1)))
    return blocks


BLOCKS = _python_blocks()


def _names_and_calls(code: str) -> tuple[set[str], set[str]]:
    """Names a block imports or uses, and the attributes or functions it calls."""
    names, calls = set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.alias):
            names.add(node.name.rsplit(".", 1)[-1])
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Call):
            func = node.func
            calls.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return names, calls


def test_the_readme_has_python_blocks_that_parse():
    assert len(BLOCKS) >= 4
    for line, code in BLOCKS:
        compile(code, f"README.md:{line}", "exec")


@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_blocks_that_cannot_run_everywhere_say_so_with_an_alternative_beside_them(line, code):
    names, calls = _names_and_calls(code)
    first = code.splitlines()[0]
    if calls & HUB_CALLS:
        assert first.startswith(HUB), f"README.md:{line} reaches the hub; mark it {HUB!r}"
    if names & TL3_NAMES:
        assert first.startswith(TL3), f"README.md:{line} needs HookedTransformer; mark it {TL3!r}"
    if first.startswith((HUB, TL3)):
        after = [c for n, c in BLOCKS if n > line]
        assert after, f"README.md:{line} has no alternative after it"
        assert not after[0].splitlines()[0].startswith((HUB, TL3)), (
            f"README.md:{line}: the block after it must run offline on TransformerLens 3 and 4"
        )


def test_the_first_example_runs_on_transformer_lens_4():
    """The first command installs the newest TransformerLens (4.x): the first example must need
    neither HookedTransformer nor the model hub."""
    line, code = BLOCKS[0]
    names, calls = _names_and_calls(code)
    assert not code.startswith((HUB, TL3)), f"README.md:{line}"
    assert not names & TL3_NAMES and not calls & HUB_CALLS, f"README.md:{line}"


@pytest.mark.slow  # a fresh interpreter per block: about 20 s each on 2 cores
@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_readme_python_block_runs_as_written(line, code, tmp_path):
    if code.startswith(HUB):
        pytest.skip("needs the model hub; the tests run offline")
    if code.startswith(TL3) and not HAS_HOOKED_TRANSFORMER:
        pytest.skip("needs HookedTransformer (TransformerLens 3.x)")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", _DRIVER],
        input=code,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        # The output goes to the captured stdout, not the failure message: on TransformerLens 4.x
        # conftest.py turns a failure whose message says HookedTransformer is missing into a skip,
        # and an unmarked block that needs it must fail.
        print(result.stdout, result.stderr[-5000:], sep="\n")
        pytest.fail(f"README.md:{line}: the block exits {result.returncode} (output above)")
