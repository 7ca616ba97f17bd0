"""Modules that moved keep their old import paths: each old module gives the public names of the
new one (the same objects) and warns, naming the new path, at the line that imports it."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER

#: Old path -> new path.
MOVED = {
    "tl_attnonly.cli_common": "tl_attnonly.cli.common",
    "tl_attnonly.cli_convert": "tl_attnonly.cli.convert",
    "tl_attnonly.cli_demo": "tl_attnonly.cli.demo",
    "tl_attnonly.bridge.demo": "tl_attnonly.cli.bridge_demo",
    "tl_attnonly.model": "tl_attnonly.hooked.model",
    "tl_attnonly.encoder": "tl_attnonly.hooked.encoder",
    "tl_attnonly.neuron_head_model": "tl_attnonly.hooked.neuron_head_model",
    "tl_attnonly.derived_cache": "tl_attnonly.hooked.derived_cache",
    "tl_attnonly.saving": "tl_attnonly.hooked.saving",
    "tl_attnonly.conversion_record": "tl_attnonly.hooked.conversion_record",
}
#: New modules that import TransformerLens 3.x's HookedTransformer (or its config), absent on 4.x.
NEEDS_HOOKED = {
    "tl_attnonly.hooked.model",
    "tl_attnonly.hooked.encoder",
    "tl_attnonly.hooked.neuron_head_model",
    "tl_attnonly.hooked.saving",
}
ON_TL3 = pytest.mark.skipif(not HAS_HOOKED_TRANSFORMER, reason="needs TransformerLens 3.x")
CASES = [pytest.param(o, n, marks=[ON_TL3] if n in NEEDS_HOOKED else []) for o, n in MOVED.items()]


def _fresh_import(old: str, monkeypatch: pytest.MonkeyPatch) -> list[warnings.WarningMessage]:
    """Import ``old`` as if for the first time; the warnings it gave."""
    monkeypatch.delitem(sys.modules, old, raising=False)
    parent, _, leaf = old.rpartition(".")
    if leaf in vars(sys.modules[parent]):  # not hasattr: the package would import it lazily
        monkeypatch.delattr(sys.modules[parent], leaf)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        __import__(old)  # a frame-less import: the warning's frame is this test's
    return caught


@pytest.mark.parametrize(("old", "new"), CASES)
def test_old_path_gives_the_moved_names_and_warns(old, new, monkeypatch):
    moved = importlib.import_module(new)
    caught = _fresh_import(old, monkeypatch)
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert [str(w.message) for w in deprecations] == [f"{old} is deprecated: import from {new}."]
    assert deprecations[0].filename == __file__  # stacklevel: the importing line
    module = sys.modules[old]
    assert sorted(module.__all__) == sorted(moved.__all__)
    for name in moved.__all__:
        assert getattr(module, name) is getattr(moved, name), name
    namespace: dict = {}
    exec(f"from {old} import *", namespace)  # noqa: S102 - the star import itself
    assert set(moved.__all__) <= set(namespace)


def test_the_console_entry_point_is_the_cli_package():
    from tl_attnonly import cli

    assert cli.__name__ == "tl_attnonly.cli" and hasattr(cli, "__path__")
    assert callable(cli.main) and cli.main.__module__ == "tl_attnonly.cli"
