"""The public API: every public module lists its names in ``__all__``, and every listed name
imports (so the import paths that exist keep working when modules move)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import tl_attnonly


def _public_modules() -> list[str]:
    names = ["tl_attnonly"]
    for info in pkgutil.walk_packages(tl_attnonly.__path__, prefix="tl_attnonly."):
        parts = info.name.split(".")[1:]
        if not any(part.startswith("_") for part in parts):
            names.append(info.name)
    return sorted(names)


PUBLIC_MODULES = _public_modules()


def test_the_package_tree_is_found():
    from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER

    if not HAS_HOOKED_TRANSFORMER:  # walk_packages cannot import tl_attnonly.literal there
        pytest.skip("needs HookedTransformer (TransformerLens 3.x)")
    for name in ("tl_attnonly.literal.theorems", "tl_attnonly.vis.export", "tl_attnonly.omega"):
        assert name in PUBLIC_MODULES


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_name_in_all_imports(module_name):
    module = importlib.import_module(module_name)
    assert hasattr(module, "__all__"), f"{module_name} has no __all__"
    names = list(module.__all__)
    assert len(names) == len(set(names)), f"{module_name}.__all__ lists a name twice"
    missing = [name for name in names if not hasattr(module, name)]
    assert not missing, f"{module_name}.__all__ lists names it does not define: {missing}"
    namespace: dict = {}
    exec(f"from {module_name} import *", namespace)  # noqa: S102 - the star import itself
    assert set(names) <= set(namespace)


@pytest.mark.parametrize(
    ("old_path", "name"),
    [
        ("tl_attnonly.literal", "theorem3_neuron_head"),
        ("tl_attnonly.literal", "omega_warnings"),
        ("tl_attnonly.omega", "omega_error_table"),
        ("tl_attnonly.vis", "save_figure"),
        ("tl_attnonly.vis", "neuron_head_attention_view"),
        ("tl_attnonly", "LiteralOptions"),
        ("tl_attnonly.analysis.cache", "stack_all_head_results"),
        ("tl_attnonly.analysis.cache", "head_logit_attrs"),
    ],
)
def test_import_paths_from_before_the_split_still_work(old_path, name):
    assert getattr(importlib.import_module(old_path), name) is not None
