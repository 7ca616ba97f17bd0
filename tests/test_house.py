"""The shape of the house: rooms of one idea, layers that do not reach up, a typed protocol.

Static checks with :mod:`ast` over the package's files (the import graph itself, cycles and
private names, is ``tests/test_import_graph.py``):

* no module of ``tl_attnonly`` is over :data:`MAX_LINES` lines;
* ``tl_attnonly.bridge`` imports nothing from ``analysis``, ``vis``, ``report`` or ``verify``
  (the bridge form is below the tools, as the HookedTransformer form is);
* no module under ``analysis/``, ``vis/``, ``report`` or ``cli/`` imports a component class
  (they read a model through :mod:`tl_attnonly.protocol`, never through its classes);
* no internal discovery function takes more than :data:`MAX_PARAMETERS` parameters (what
  travels together travels as one task value); public TransformerLens-style signatures are
  exempt;
* every public name of the last release's modules (``tests/data/public_names_round4.json``, each
  module's ``__all__`` at the round's start) still imports from that module, and every
  ``from tl_attnonly... import ...`` in the README's and the docs' code imports.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import tl_attnonly
from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER

ROOT = Path(tl_attnonly.__file__).parent
REPO = ROOT.parent
PACKAGE = "tl_attnonly"
MAX_LINES = 550
MAX_PARAMETERS = 8


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


FILES: dict[str, Path] = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _import_froms(module: str) -> Iterator[tuple[str, str]]:
    """``(imported module, name)`` of every ``from tl_attnonly... import name`` in ``module``,
    at any depth (``TYPE_CHECKING`` blocks and functions included); ``import a.b`` gives
    ``(a.b, "")``."""
    path = FILES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    yield alias.name, ""
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                yield target, alias.name


def test_no_module_is_over_the_limit() -> None:
    long = {m: n for m, p in FILES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by idea): {long}"


#: What the bridge form must not import: the tools above it.
ABOVE_BRIDGE = ("tl_attnonly.analysis", "tl_attnonly.vis", "tl_attnonly.report",
                "tl_attnonly.verify", "tl_attnonly.cli")  # fmt: skip


def test_bridge_imports_no_tool() -> None:
    bad = sorted(
        f"{m} imports {t}"
        for m in FILES
        if _in(m, ("tl_attnonly.bridge",))
        for t, name in _import_froms(m)
        if _in(t, ABOVE_BRIDGE) or (f"{t}.{name}" in FILES and _in(f"{t}.{name}", ABOVE_BRIDGE))
    )
    assert not bad, "tl_attnonly.bridge reaches up:\n" + "\n".join(bad)


#: Where component classes live: the neuron-head layers of both forms.
COMPONENT_MODULES = ("tl_attnonly.components", "tl_attnonly.bridge.modules",
                     "tl_attnonly.bridge.expert_modules", "tl_attnonly.bridge.experts")  # fmt: skip
#: The tools, which read models only through the protocol.
TOOLS = ("tl_attnonly.analysis", "tl_attnonly.vis", "tl_attnonly.report", "tl_attnonly.cli")


def _is_class_name(name: str) -> bool:
    return bool(name) and name[0].isupper() and not name.isupper()


def test_tools_import_no_component_class() -> None:
    bad = sorted(
        f"{m} imports {name} from {t}"
        for m in FILES
        if _in(m, TOOLS)
        for t, name in _import_froms(m)
        if (_in(t, COMPONENT_MODULES) and (not name or _is_class_name(name)))
        or (f"{t}.{name}" in FILES and _in(f"{t}.{name}", COMPONENT_MODULES))
    )
    assert not bad, "tools that look at component classes:\n" + "\n".join(bad)


def _public_names() -> set[str]:
    """Names in ``__all__`` of the discovery package and of ``tl_attnonly.analysis``."""
    names: set[str] = set()
    for module in ("tl_attnonly.analysis", "tl_attnonly.analysis.discovery"):
        tree = ast.parse(FILES[module].read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                names |= set(ast.literal_eval(node.value))
    return names


def _parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    named = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    named = [p for p in named if p not in ("self", "cls")]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def _internal_functions(module: str, public: set[str]) -> Iterator[tuple[str, int]]:
    tree = ast.parse(FILES[module].read_text())
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, functions) and node.name not in public:
            yield node.name, _parameter_count(node)
        elif isinstance(node, ast.ClassDef) and node.name not in public:
            for item in node.body:
                if isinstance(item, functions):
                    yield f"{node.name}.{item.name}", _parameter_count(item)


def test_internal_discovery_functions_take_few_parameters() -> None:
    public = _public_names()
    bad = sorted(
        f"{m}.{name}: {n}"
        for m in FILES
        if _in(m, ("tl_attnonly.analysis.discovery",))
        for name, n in _internal_functions(m, public)
        if n > MAX_PARAMETERS
    )
    assert not bad, (
        f"internal discovery functions over {MAX_PARAMETERS} parameters (pass the task value):\n"
        + "\n".join(bad)
    )


def test_the_checks_see_what_they_check() -> None:
    """The checkers themselves: they find relative and function-level imports, and count."""
    edges = set(_import_froms("tl_attnonly.analysis.discovery"))
    assert any(t.startswith("tl_attnonly.analysis.discovery") for t, _ in edges)
    fn = ast.parse("def f(self, a, b=1, *c, d, **e): pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    assert _parameter_count(fn) == 5
    assert _is_class_name("GatedNeuronHeadMLP") and not _is_class_name("routed_slots")
    assert not _is_class_name("SUPPORTED")


PUBLIC_NAMES: dict[str, list[str]] = json.loads(
    (Path(__file__).parent / "data" / "public_names_round4.json").read_text()
)


def _needs_hooked(module: str) -> bool:
    return any(
        module == m or module.startswith(m + ".")
        for m in ("tl_attnonly.literal", "tl_attnonly.omega", "tl_attnonly.model",
                  "tl_attnonly.encoder", "tl_attnonly.hooked.model", "tl_attnonly.hooked.encoder")
    )  # fmt: skip


@pytest.mark.parametrize("module_name", sorted(PUBLIC_NAMES))
def test_last_rounds_public_names_still_import(module_name: str) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            module = importlib.import_module(module_name)
    except ImportError:
        if not HAS_HOOKED_TRANSFORMER:
            pytest.skip(f"{module_name} needs HookedTransformer (TransformerLens 3.x)")
        raise
    missing = [name for name in PUBLIC_NAMES[module_name] if not hasattr(module, name)]
    assert not missing, f"{module_name} no longer has {missing}"


_FENCE = re.compile(r"```(?:python|py)\n(.*?)```", re.S)


def _documented_imports() -> list[tuple[str, str, str]]:
    """``(document, module, name)`` of every ``from tl_attnonly... import name`` in a Python code
    block of the README or the docs."""
    found = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in _FENCE.findall(doc.read_text()):
            try:
                tree = ast.parse(block)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
                    for alias in node.names:
                        found.append((doc.name, node.module or "", alias.name))
    return found


DOCUMENTED = _documented_imports()


def test_documents_import_something() -> None:
    assert len(DOCUMENTED) > 20


@pytest.mark.parametrize(("doc", "module_name", "name"), DOCUMENTED)
def test_documented_imports_work(doc: str, module_name: str, name: str) -> None:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        if not HAS_HOOKED_TRANSFORMER:
            pytest.skip(f"{module_name} needs HookedTransformer (TransformerLens 3.x)")
        raise
    if not hasattr(module, name):
        importlib.import_module(f"{module_name}.{name}")  # a submodule
