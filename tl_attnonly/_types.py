"""Types and argument checks shared across the package: one home for each.

* :data:`Metric`: what patching and attribution differentiate or evaluate.
* :data:`HeadsLike`: a selection of head indices.
* :data:`Kinds` and :func:`check_kinds`: which kinds of head (``"attn"``, ``"neuron"``).
* :func:`require_neuron_heads`: refuse, with directions, a model that is not converted
  (:func:`is_converted` says whether it is).

This is the bottom layer: it imports nothing from the package at run time
(``tests/test_import_graph.py`` checks it).
* :func:`require_additive_residual`: refuse decompositions on post-norm models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeGuard, TypeVar

import torch
from jaxtyping import Float

_D = TypeVar("_D", bound="DataclassInstance")  # an options dataclass

if TYPE_CHECKING:  # for annotations only: this module imports nothing of the package above it
    from _typeshed import DataclassInstance

    from tl_attnonly.neuron_head_model import NeuronHeadModelMixin


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


def is_converted(model: object) -> TypeGuard[NeuronHeadModelMixin]:
    """Whether ``model`` has structured neuron-heads (a converted decoder or encoder).

    Duck-typed on what the converted models' mixin (:class:`~tl_attnonly.neuron_head_model.
    NeuronHeadModelMixin`) defines, ``neuron_heads`` and ``set_use_neuron_result``, so this bottom
    module needs no import of the model classes.
    """
    cls = type(model)
    return isinstance(getattr(cls, "neuron_heads", None), property) and callable(
        getattr(cls, "set_use_neuron_result", None)
    )


def _is_transformer_bridge(model: object) -> bool:
    """Whether ``model`` is a TransformerLens ``TransformerBridge`` (by its classes: this module
    imports nothing above it; the same test as ``_compat.is_transformer_bridge``)."""
    return any(
        cls.__name__ == "TransformerBridge" and cls.__module__.startswith("transformer_lens.")
        for cls in type(model).__mro__
    )


def require_neuron_heads(model: object) -> NeuronHeadModelMixin:
    """``model`` if it has structured neuron-heads, else a ``TypeError`` that says what to do.

    A ``TransformerBridge`` (converted or not) is refused with directions: the analysis tools read
    an :class:`~tl_attnonly.AttnOnlyTransformer`'s structure; a converted bridge exposes the same
    hooks and per-layer head weights, used directly (see ``docs/bridge.md``).

    Args:
        model: Anything; accepted: an :class:`~tl_attnonly.AttnOnlyTransformer` or
            :class:`~tl_attnonly.AttnOnlyEncoder`.

    Returns:
        ``model``, typed as a converted model.
    """
    if _is_transformer_bridge(model):
        tools = (
            "the analysis tools (tl_attnonly.analysis, tl_attnonly.vis, tl_attnonly.report) "
            "work on an AttnOnlyTransformer (TransformerLens 3.x: "
            "tl_attnonly.convert(hooked_transformer)) and do not read a bridge yet."
        )
        converted = any(
            getattr(m, "is_bridge_neuron_heads", False) for m in model.modules()  # type: ignore[attr-defined]
        )
        first = (
            f"This TransformerBridge is converted, but {tools}"
            if converted
            else "This TransformerBridge is not converted (tl_attnonly.convert(bridge) converts "
            f"it in place), and {tools}"
        )
        raise TypeError(
            f"{first} On a converted bridge use its hooks with run_with_cache / run_with_hooks: "
            "blocks.{l}.mlp.hook_pattern [batch, head, pos, (self, bias)], hook_z, hook_q, "
            "hook_v, hook_result (set use_neuron_result on the layers), and the head weights of "
            "tl_attnonly.bridge.neuron_head_layers(bridge)[l] (W_Q, W_V, W_O, coefficients, "
            "derive_activation)."
        )
    if is_converted(model):
        if any(getattr(mlp, "is_mixture_of_experts", False) for mlp in model.neuron_heads):
            raise NotImplementedError(
                "The analysis tools work on dense neuron-head layers; this model's MLPs are "
                "mixtures of experts (NeuronHeadMoE), whose experts see only the tokens routed to "
                "them. Use the experts' hooks directly (blocks.{l}.mlp.experts.{e}.hook_pattern, "
                "hook_z, ...; router: blocks.{l}.mlp.hook_expert_weights / hook_expert_indices) "
                "with run_with_cache / run_with_hooks."
            )
        return model
    if getattr(model, "is_literal_form", False):
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


def require_additive_residual(model: object, what: str) -> None:
    """Refuse ``what`` on a model whose residual stream is not a sum of head outputs.

    A BERT-style encoder (post-LN: ``LN(resid + sublayer_out)``, embeddings through ``embed.ln``)
    or a decoder that normalises each sublayer's output before adding it (OLMo 2/3,
    ``use_normalization_before_and_after``) has no decomposition of the residual stream into head
    results, so a decomposition or direct logit attribution would be wrong.

    Raises:
        NotImplementedError: Naming the model's kind and what works instead.
    """
    from transformer_lens import HookedEncoder

    from tl_attnonly._compat import POST_NORM_ARCHITECTURES

    cfg = model.cfg  # type: ignore[attr-defined]
    if isinstance(model, HookedEncoder):
        reason = (
            "a BERT-style encoder normalises the residual stream after every sublayer "
            "(LN(resid + attn_out), LN(resid_mid + mlp_out)) and after the embeddings"
        )
    elif cfg.use_normalization_before_and_after or (
        cfg.original_architecture in POST_NORM_ARCHITECTURES
    ):
        reason = (
            f"this model ({cfg.original_architecture or 'use_normalization_before_and_after'}) "
            "normalises each sublayer's output before adding it to the residual stream"
        )
    else:
        return
    raise NotImplementedError(
        f"{what} needs a residual stream that is a sum of head outputs, but {reason}, so it is "
        "not one. What works: per-head results (stack_all_head_results without incl_remainder, "
        "get_neuron_head_results), activation patching, and attribution_patch with a metric on "
        "the output (for sentence embeddings: metric_input=the final hidden states, "
        "patching_metric=pooled_cosine_metric(mask))."
    )


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
    "is_converted",
    "require_additive_residual",
    "require_neuron_heads",
]
