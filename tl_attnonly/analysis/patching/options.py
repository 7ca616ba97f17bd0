"""How a patching run is batched, bounded and shown: :class:`PatchingOptions`.

The patching functions (:func:`~tl_attnonly.analysis.get_act_patch_neuron_heads`,
:func:`~tl_attnonly.analysis.get_act_patch_outputs`, the ``path_patch_*`` functions and
:func:`~tl_attnonly.analysis.attribute_then_patch`) take one ``options=PatchingOptions(...)`` and,
as before, each option by keyword (``progress=False``), which replaces the one in ``options``::

    fast = PatchingOptions(patches_per_pass=64, progress=False)
    effects, labels = get_act_patch_outputs(model, corrupted, cache, metric, options=fast)
    effects, labels = get_act_patch_outputs(model, corrupted, cache, metric, progress=True)

An option a function does not use is refused (``ValueError``) rather than ignored.
``level`` (a neuron's ``K`` heads patched together or one head at a time) is used by
:func:`~tl_attnonly.analysis.get_act_patch_neuron_heads` only (``get_act_patch_outputs`` and
``attribute_then_patch`` take their own ``level=`` argument).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tl_attnonly._types import replace_options
from tl_attnonly.analysis.patching.resume import PATCH_BUDGET

#: The values of :attr:`PatchingOptions.level` other than ``None`` (``None``: by ``K``).
PATCH_LEVELS = ("neuron", "head")


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
        level: How neuron-heads are patched (by
            :func:`~tl_attnonly.analysis.get_act_patch_neuron_heads`): ``"neuron"``: the ``K``
            heads of a neuron together (for ``z``: the neuron's ``hook_post``), one patch per
            neuron; ``"head"``: one neuron-head at a time. ``None`` (default): ``"neuron"`` where
            a neuron has ``K > 1`` heads, ``"head"`` where ``K = 1`` (there the two are the same
            patches).

    Values are checked where they are used (e.g. ``patches_per_pass`` against ``max_bytes``);
    ``level`` when the options are made (``ValueError`` naming the allowed values).
    """

    patches_per_pass: int | None = None
    max_bytes: int = PATCH_BUDGET
    progress: bool = True
    per_position: bool = False
    positions: Sequence[int] | None = None
    level: Literal["neuron", "head"] | None = None

    def __post_init__(self) -> None:
        patch_level(self.level, 1)  # refuse a bad level when the options are made

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


def patch_level(level: str | None, n_heads_per_neuron: int) -> Literal["neuron", "head"]:
    """``level`` checked, and its default (``None``) resolved: ``"neuron"`` for neurons of
    ``n_heads_per_neuron > 1`` heads, ``"head"`` for one head per neuron.

    Raises:
        ValueError: For a level other than ``"neuron"``, ``"head"`` and ``None``, naming them.
    """
    if level is None:
        return "neuron" if n_heads_per_neuron > 1 else "head"
    if level not in PATCH_LEVELS:
        raise ValueError(
            f"The patching option level must be 'neuron' or 'head' (or None: 'neuron' where a "
            f"neuron has K > 1 heads, 'head' where K = 1), got {level!r}."
        )
    return "neuron" if level == "neuron" else "head"


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


__all__ = ["PATCH_LEVELS", "PatchingOptions", "patch_level", "resolve_patching_options"]
