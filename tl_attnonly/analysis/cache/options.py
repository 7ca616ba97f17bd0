"""How a stack of heads is cut, scaled and bounded: :class:`StackOptions`.

:func:`~tl_attnonly.analysis.stack_all_head_results`,
:func:`~tl_attnonly.analysis.stack_neuron_head_results` and
:func:`~tl_attnonly.analysis.decompose_resid_heads` take one ``options=StackOptions(...)`` and,
as before, each option by keyword (``pos_slice=-1``), which replaces the one in ``options``::

    last = StackOptions(pos_slice=-1, apply_ln=True)
    stack = stack_all_head_results(cache, options=last)
    stack = stack_all_head_results(cache, options=last, progress=True)

An option a function does not use is refused (``ValueError``) rather than ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformer_lens.utilities import Slice, SliceInput

from tl_attnonly._types import replace_options

#: Default memory budget (bytes) for a stacked tensor of per-head results.
STACK_BUDGET = 2 * 2**30

#: Default number of neuron-heads materialised at once (``chunk * batch * pos * d_model``).
DEFAULT_CHUNK = 1024


@dataclass(frozen=True, eq=False)
class StackOptions:
    """Options shared by the stacking functions.

    Attributes:
        pos_slice: Positions to keep (TransformerLens ``Slice`` semantics).
        apply_ln: Apply the LayerNorm scale cached at the input of ``layer`` (TransformerLens's
            ``apply_ln_to_stack``).
        incl_remainder: Append ``resid - sum(heads)`` (embeddings and biases), labelled
            ``"remainder"`` (not :func:`~tl_attnonly.analysis.decompose_resid_heads`, which
            lists those components itself).
        project_output_onto: ``[d_model]`` or ``[d_model, n_outputs]`` directions to project
            each component onto (after ``apply_ln``).
        max_bytes: Refuse to build a larger stack; see the error for ways to narrow it.
        chunk_size: Neuron-heads materialised at once.
        progress: Show a progress bar over neuron-head chunks.
    """

    pos_slice: None | SliceInput | Slice = None
    apply_ln: bool = False
    incl_remainder: bool = False
    project_output_onto: torch.Tensor | None = None
    max_bytes: int = STACK_BUDGET
    chunk_size: int = DEFAULT_CHUNK
    progress: bool = False

    def with_overrides(self, **changes: Any) -> StackOptions:
        """A copy with the given fields replaced (``f(..., options=o, progress=True)``).

        Raises:
            TypeError: For a name that is not an option, listing the options.
        """
        return replace_options(
            self,
            changes,
            "Unknown stack option(s) {unknown}; the options are {names} "
            "(tl_attnonly.analysis.StackOptions).",
        )


def _is_default(value: Any, default: Any) -> bool:
    if default is None or isinstance(value, (torch.Tensor, Slice)):
        return value is default
    return bool(value == default)


def resolve_stack_options(
    function: str,
    options: StackOptions | None,
    overrides: Mapping[str, Any],
    *,
    supported: Iterable[str] | None = None,
) -> StackOptions:
    """``options`` (or the defaults) with the keyword ``overrides``, checked for ``function``.

    Raises:
        TypeError: If ``options`` is not a :class:`StackOptions`, or a keyword is neither one of
            ``function``'s parameters nor an option it uses.
        ValueError: If an option in ``options`` that ``function`` does not use differs from its
            default.
    """
    if options is not None and not isinstance(options, StackOptions):
        raise TypeError(
            f"{function}(..., options=...) takes a tl_attnonly.analysis.StackOptions, got "
            f"{type(options).__name__}."
        )
    names = {f.name for f in dataclasses.fields(StackOptions)}
    if supported is not None:
        names &= set(supported)
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(
            f"{function}() got unexpected keyword argument(s) {unknown}. Options go by keyword "
            f"or in options=StackOptions(...): {sorted(names)}."
        )
    resolved = (options or StackOptions()).with_overrides(**overrides)
    if supported is not None:
        unused = sorted(
            f.name
            for f in dataclasses.fields(StackOptions)
            if f.name not in set(supported)
            and not _is_default(getattr(resolved, f.name), f.default)
        )
        if unused:
            raise ValueError(
                f"{function}() does not use the stack option(s) {unused}; leave them at their "
                "defaults."
            )
    return resolved


__all__ = ["DEFAULT_CHUNK", "STACK_BUDGET", "StackOptions", "resolve_stack_options"]
