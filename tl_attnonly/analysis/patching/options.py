"""How a patching run is batched, bounded and shown: :class:`PatchingOptions`.

The patching functions (:func:`~tl_attnonly.analysis.get_act_patch_neuron_heads`,
:func:`~tl_attnonly.analysis.get_act_patch_outputs`, the ``path_patch_*`` functions and
:func:`~tl_attnonly.analysis.attribute_then_patch`) take one ``options=PatchingOptions(...)`` and,
as before, each option by keyword (``progress=False``), which replaces the one in ``options``::

    fast = PatchingOptions(patches_per_pass=64, progress=False)
    effects, labels = get_act_patch_outputs(model, corrupted, cache, metric, options=fast)
    effects, labels = get_act_patch_outputs(model, corrupted, cache, metric, progress=True)

An option a function does not use is refused (``ValueError``) rather than ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tl_attnonly._types import replace_options
from tl_attnonly.analysis.patching.resume import PATCH_BUDGET


@dataclass(frozen=True)
class PatchingOptions:
    """Options shared by the patching functions.

    Attributes:
        patches_per_pass: Patches run together in one batched forward pass; ``None``: as many as
            ``max_bytes`` allows (``path_patch_sweep``'s default is 16).
        max_bytes: Memory budget of one batched pass (the repeated inputs and activations).
        progress: Show a tqdm progress bar.
        per_position: Patch each position separately (a ``[..., pos]`` result) instead of all
            positions at once (activation and output patching only).
        positions: With ``per_position``, only these positions (default: all).

    Values are checked where they are used (e.g. ``patches_per_pass`` against ``max_bytes``).
    """

    patches_per_pass: int | None = None
    max_bytes: int = PATCH_BUDGET
    progress: bool = True
    per_position: bool = False
    positions: Sequence[int] | None = None

    def with_overrides(self, **changes: Any) -> PatchingOptions:
        """A copy with the given fields replaced (``f(..., options=o, progress=False)``).

        Raises:
            TypeError: For a name that is not an option, listing the options.
        """
        return replace_options(
            self,
            changes,
            "Unknown patching option(s) {unknown}; the options are {names} "
            "(tl_attnonly.analysis.PatchingOptions).",
        )


def resolve_patching_options(
    function: str,
    options: PatchingOptions | None,
    overrides: Mapping[str, Any],
    *,
    supported: Iterable[str],
    default: PatchingOptions | None = None,
) -> PatchingOptions:
    """``options`` (or ``default``) with the keyword ``overrides``, checked for ``function``.

    Raises:
        TypeError: If ``options`` is not a :class:`PatchingOptions`, or a keyword is neither one
            of ``function``'s parameters nor an option.
        ValueError: If an option that ``function`` does not use differs from its default.
    """
    if options is not None and not isinstance(options, PatchingOptions):
        raise TypeError(
            f"{function}(..., options=...) takes a tl_attnonly.analysis.PatchingOptions, got "
            f"{type(options).__name__}."
        )
    base = options if options is not None else (default or PatchingOptions())
    names = {f.name for f in dataclasses.fields(PatchingOptions)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(
            f"{function}() got unexpected keyword argument(s) {unknown}. Options go by keyword "
            f"or in options=PatchingOptions(...): {sorted(names)}."
        )
    resolved = base.with_overrides(**overrides)
    unused = sorted(
        f.name
        for f in dataclasses.fields(PatchingOptions)
        if f.name not in set(supported) and getattr(resolved, f.name) != f.default
    )
    if unused:
        raise ValueError(
            f"{function}() does not use the patching option(s) {unused}; leave them at their "
            "defaults."
        )
    return resolved


__all__ = ["PatchingOptions", "resolve_patching_options"]
