"""Types and argument checks shared across the package: one home for each.

* :data:`Metric`: what patching and attribution differentiate or evaluate.
* :data:`HeadsLike`: a selection of head indices.
* :data:`Kinds` and :func:`check_kinds`: which kinds of head (``"attn"``, ``"neuron"``).
* :func:`require_neuron_heads`: refuse, with directions, a model that is not converted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Union

import torch
from jaxtyping import Float

from tl_attnonly.neuron_head_model import NeuronHeadModelMixin

#: A patching metric: logits ``[batch, pos, d_vocab]`` -> a scalar.
Metric = Callable[[Float[torch.Tensor, "batch pos d_vocab"]], Float[torch.Tensor, ""]]

#: Head indices: one, several, a tensor of them, or ``None`` (all / ranked).
HeadsLike = Union[int, Sequence[int], torch.Tensor, None]

#: The kinds of head: the model's own attention heads and the neuron-heads.
HeadKind = Literal["attn", "neuron"]
HEAD_KINDS: tuple[HeadKind, ...] = ("attn", "neuron")

#: A non-empty subset of :data:`HEAD_KINDS`, e.g. ``("attn", "neuron")`` or ``("neuron",)``.
Kinds = Sequence[str]


def check_kinds(kinds: Kinds) -> tuple[HeadKind, ...]:
    """``kinds`` in the package's order (attention heads first), or a ``ValueError``.

    Raises:
        ValueError: For a string (``"attn"`` instead of ``("attn",)``), an empty selection or an
            unknown kind.
    """
    if isinstance(kinds, str) or not kinds or set(kinds) - set(HEAD_KINDS):
        raise ValueError(f"kinds must be a non-empty subset of ('attn', 'neuron'), got {kinds!r}.")
    return tuple(kind for kind in HEAD_KINDS if kind in kinds)


def require_neuron_heads(model: object) -> NeuronHeadModelMixin:
    """``model`` if it has structured neuron-heads, else a ``TypeError`` that says what to do.

    Args:
        model: Anything; accepted: an :class:`~tl_attnonly.AttnOnlyTransformer` or
            :class:`~tl_attnonly.AttnOnlyEncoder`.

    Returns:
        ``model``, typed as a converted model.
    """
    if isinstance(model, NeuronHeadModelMixin):
        return model
    from tl_attnonly.literal.transformer import LiteralTransformer

    if isinstance(model, LiteralTransformer):
        raise TypeError(
            "The analysis tools work on the structured form; a LiteralTransformer has no "
            "structured neuron-heads. Analyse tl_attnonly.convert(model) instead, or use the "
            "literal model's hooks (same names: blocks.{l}.mlp.hook_pattern, ...) with "
            "run_with_cache / run_with_hooks and the tl_attnonly.hooks presets."
        )
    raise TypeError(
        f"{type(model).__name__} has no neuron-heads: convert it first "
        "(tl_attnonly.convert(model)) and use the converted model (and its caches)."
    )


__all__ = [
    "HEAD_KINDS",
    "HeadKind",
    "HeadsLike",
    "Kinds",
    "Metric",
    "check_kinds",
    "require_neuron_heads",
]
