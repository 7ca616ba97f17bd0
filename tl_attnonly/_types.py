"""Types and argument checks shared across the package: one home for each.

* :data:`Metric`: what patching and attribution differentiate or evaluate.
* :data:`HeadsLike`: a selection of head indices.
* :data:`Kinds` and :func:`check_kinds`: which kinds of head (``"attn"``, ``"neuron"``).
* :func:`require_neuron_heads`: refuse, with directions, a model that is not converted
  (:func:`is_converted` says whether it is).

This is the bottom layer: it imports nothing from the package at run time
(``tests/test_import_graph.py`` checks it). Model-reading checks live above it, in
:mod:`tl_attnonly.adapt` (:func:`~tl_attnonly.adapt.require_additive_residual`: refuse the
tools that need a plain sum where the residual stream itself is normalised after each sublayer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import torch
from jaxtyping import Float

_D = TypeVar("_D", bound="DataclassInstance")  # an options dataclass
_Tokens = TypeVar("_Tokens", bound="torch.Tensor | None")

if TYPE_CHECKING:  # for annotations only: this module imports nothing of the package above it
    from _typeshed import DataclassInstance


class CoefficientsLike(Protocol):
    """Per-head neuron-head coefficients (:class:`~tl_attnonly.NeuronHeadCoefficients` or any
    object with these five sequences, one entry per head)."""

    @property
    def b(self) -> Sequence[float]: ...
    @property
    def d(self) -> Sequence[float]: ...
    @property
    def f(self) -> Sequence[float]: ...
    @property
    def e(self) -> Sequence[float]: ...
    @property
    def g(self) -> Sequence[float]: ...


#: A patching metric: logits ``[batch, pos, d_vocab]`` -> a scalar.
Metric = Callable[[Float[torch.Tensor, "batch pos d_vocab"]], Float[torch.Tensor, ""]]

#: ``fwd_hooks`` of ``run_with_hooks``: (hook name or name filter, hook function) pairs.
FwdHooks = list[tuple[str | Callable[..., Any], Callable[..., Any]]]

#: Head indices: one, several, a tensor of them, or ``None`` (all / ranked).
HeadsLike = int | Sequence[int] | torch.Tensor | None

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


def check_tokens(tokens: object) -> None:
    """Refuse tokens that are not a 2-d tensor ``[batch, pos]`` (e.g. a string or one prompt).

    Raises:
        TypeError: If ``tokens`` is not a 2-d tensor.
    """
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2:
        raise TypeError(
            "Pass tokens as int tensors [batch, pos] (model.to_tokens(...)); clean and corrupted "
            "runs must have the same shape."
        )


def check_token_pair(clean: torch.Tensor, corrupted: torch.Tensor) -> None:
    """Refuse clean and corrupted tokens that are not int tensors ``[batch, pos]`` of one shape.

    Raises:
        TypeError: If either is not a 2-d tensor.
        ValueError: If their shapes differ.
    """
    check_tokens(clean)
    check_tokens(corrupted)
    if clean.shape != corrupted.shape:
        raise ValueError(
            f"clean {tuple(clean.shape)} and corrupted {tuple(corrupted.shape)} tokens must have "
            "the same shape (pad the prompts to one length)."
        )


def on_model_device(model: torch.nn.Module, tokens: _Tokens) -> _Tokens:
    """``tokens`` (``[batch, pos]``, or ``None``) on the device of the model's first parameter,
    its embedding's: where ``HookedTransformer.forward`` moves a batch's tokens (block 0's
    device under ``n_devices``). A ``TransformerBridge`` does not move them, and the analysis
    keeps its scores and masks on the tokens' device: tokens built on the CPU (a tokenizer's, a
    dataset's) then run on a model on a GPU as they do on the CPU. Not tensors: unchanged (the
    caller's checks refuse them)."""
    device = next(model.parameters()).device
    if not isinstance(tokens, torch.Tensor) or tokens.device == device:
        return tokens
    return tokens.to(device)  # type: ignore[return-value]


def tokens_on_model_device(
    model: torch.nn.Module, clean: _Tokens, corrupted: _Tokens
) -> tuple[_Tokens, _Tokens]:
    """Clean and corrupted tokens on the model's device (:func:`on_model_device`)."""
    return on_model_device(model, clean), on_model_device(model, corrupted)


def replace_options(options: _D, changes: dict[str, Any], unknown_message: str) -> _D:
    """A copy of the options dataclass ``options`` with ``changes`` applied: the one
    ``with_overrides`` of the package's options objects.

    Args:
        options: A dataclass instance (``LiteralOptions``, ``PatchingOptions``, ...).
        changes: Field name -> new value.
        unknown_message: The ``TypeError``'s message for names that are not fields, formatted
            with ``unknown`` (the sorted unknown names) and ``names`` (the fields).

    Raises:
        TypeError: For a name that is not a field.
    """
    names = [f.name for f in dataclasses.fields(options)]
    unknown = sorted(set(changes) - set(names))
    if unknown:
        raise TypeError(unknown_message.format(unknown=unknown, names=names))
    return dataclasses.replace(options, **changes)


__all__ = [
    "replace_options",
    "HEAD_KINDS",
    "CoefficientsLike",
    "FwdHooks",
    "HeadKind",
    "HeadsLike",
    "Kinds",
    "Metric",
    "check_kinds",
    "check_token_pair",
    "check_tokens",
    "on_model_device",
    "tokens_on_model_device",
]
