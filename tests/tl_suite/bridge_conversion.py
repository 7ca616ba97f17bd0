"""Convert every ``TransformerBridge`` TransformerLens 4's own tests build (the TL 4 run).

TransformerLens 4 has no ``HookedTransformer`` to swap a class for: its tests build
``TransformerBridge``\\ s (``boot_transformers``, ``build_bridge_from_module``, ``boot_native``,
``boot_tl_legacy`` or ``TransformerBridge(...)`` directly), and every one of those routes ends in
``TransformerBridge.__init__``. :func:`install` wraps that constructor **in the test process
only** (``tl_suite_plugin`` calls it; nothing here is imported by ``tl_attnonly``): once a bridge
is built, :func:`tl_attnonly.convert` converts it in place, so the test then runs on a bridge
whose every MLP runs as neuron-heads. No forward pass or other model method is patched; the
bridge's class is unchanged.

TransformerLens's ``process_weights`` (also run by ``enable_compatibility_mode``) makes a gated
bridge MLP compute itself from the processed weights, bypassing whatever it wraps; a converted
bridge then raises on its next forward pass and says to convert again (``docs/bridge.md``). The
harness does what that message says, as a user would: after ``process_weights`` /
``enable_compatibility_mode`` returns on a bridge it converted, it converts the bridge again.

A bridge whose conversion is refused (a mixture of experts, an MLP kind or activation with no
neuron-head form, a mock model with no MLP, ...) stays as TransformerLens built it; every
outcome is counted (:data:`OUTCOMES`) and printed at the end of the run, so the run shows how
many of the suite's bridges it converted and why the others were not.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

#: Set on a bridge this harness converted (read back when its weights are processed).
MARK = "_tl_suite_converted"

#: ``(architecture, outcome) -> count``; outcome is ``"converted"`` or ``"not converted: ..."``.
OUTCOMES: Counter[tuple[str, str]] = Counter()

#: The test running now (set by the plugin), and ``nodeid -> outcomes`` of the bridges each test
#: (its fixtures included) built: what ``run.py --record`` writes out.
CURRENT: list[str] = [""]
BY_TEST: dict[str, Counter[str]] = {}

#: Exception types with which ``tl_attnonly.convert`` refuses a bridge, by design.
REFUSALS = (NotImplementedError, ValueError, TypeError)


def _architecture(bridge: Any) -> str:
    cfg = getattr(bridge, "cfg", None)
    return str(getattr(cfg, "architecture", None) or type(bridge).__name__)


def _reason(error: BaseException) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    kind = "refused" if isinstance(error, REFUSALS) else "error"
    return f"not converted ({kind}): {type(error).__name__}: {first[:160]}"


def convert(bridge: Any) -> bool:
    """Convert ``bridge`` in place; count the outcome. Whether it was converted."""
    import tl_attnonly

    try:
        tl_attnonly.convert(bridge)
    except Exception as error:  # refused (by design) or a bridge conversion cannot read
        _count(bridge, _reason(error))
        bridge.__dict__.pop(MARK, None)
        return False
    bridge.__dict__[MARK] = True
    _count(bridge, "converted")
    return True


def _count(bridge: Any, outcome: str) -> None:
    OUTCOMES[(_architecture(bridge), outcome)] += 1
    BY_TEST.setdefault(CURRENT[0], Counter())[outcome.split(":")[0]] += 1


def _convert_after(method: Any) -> Any:
    """``method`` of a bridge, followed (outermost call only) by converting the bridge again
    if this harness had converted it."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = self.__dict__.get("_tl_suite_depth", 0)
        self.__dict__["_tl_suite_depth"] = depth + 1
        try:
            result = method(self, *args, **kwargs)
        finally:
            self.__dict__["_tl_suite_depth"] = depth
        if depth == 0 and self.__dict__.get(MARK):
            convert(self)
        return result

    return wrapper


def install() -> Callable[[], None]:
    """Wrap ``TransformerBridge``'s constructor (convert after building) and its weight
    processing (convert again after), in this process. Returns what undoes it."""
    from transformer_lens.model_bridge import TransformerBridge

    names = ("__init__", "process_weights", "enable_compatibility_mode")
    originals = {name: TransformerBridge.__dict__[name] for name in names}
    build = originals["__init__"]

    @functools.wraps(build)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        build(self, *args, **kwargs)
        convert(self)

    TransformerBridge.__init__ = __init__  # type: ignore[method-assign]
    for name in names[1:]:
        setattr(TransformerBridge, name, _convert_after(originals[name]))

    def uninstall() -> None:
        for name, method in originals.items():
            setattr(TransformerBridge, name, method)

    return uninstall


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """:func:`install` for the duration of a ``with`` block (the harness's own tests)."""
    uninstall = install()
    try:
        yield
    finally:
        uninstall()


def summary() -> list[str]:
    """One line per (architecture, outcome), most frequent first, and the totals."""
    converted = sum(n for (_, outcome), n in OUTCOMES.items() if outcome == "converted")
    total = sum(OUTCOMES.values())
    lines = [f"tl_suite: {converted} of {total} bridges built by the tests were converted"]
    for (arch, outcome), n in sorted(OUTCOMES.items(), key=lambda item: (-item[1], item[0])):
        lines.append(f"  {n:5d}  {arch}: {outcome}")
    return lines
