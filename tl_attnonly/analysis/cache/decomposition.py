"""Stacks, decompositions and direct logit attribution over every head (attention heads and
neuron-heads) of a cached run.

The residual stream of an :class:`~tl_attnonly.AttnOnlyTransformer` decomposes into heads only
(attention heads and neuron-heads), the embeddings and the output biases; see
:mod:`.views` for the per-layer results these functions stack. Each function returns
the stack, or ``(stack, labels)`` with ``return_labels=True``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from jaxtyping import Float, Int
from transformer_lens import ActivationCache
from transformer_lens.utilities import Slice, SliceInput

import tl_attnonly.analysis.post_norm as post_norm
from tl_attnonly._types import Kinds, check_kinds
from tl_attnonly.adapt import require_additive_residual
from tl_attnonly.analysis.cache.options import StackOptions, resolve_stack_options
from tl_attnonly.analysis.cache.views import (
    DEFAULT_CHUNK,
    cache_model,
    component_chunks,
    stack_components,
)

if TYPE_CHECKING:
    from tl_attnonly.protocol import AttnOnlyModel

#: The options decompose_resid_heads uses: all but incl_remainder (it lists embed, pos_embed and
#: bias itself).
_DECOMPOSE_OPTIONS = (
    "pos_slice",
    "apply_ln",
    "project_output_onto",
    "max_bytes",
    "chunk_size",
    "progress",
)


def _logit_directions(
    model: AttnOnlyModel, tokens, incorrect_tokens
) -> Float[torch.Tensor, "*batch_and_pos d_model"]:
    """``W_U[:, tokens]`` (minus ``W_U[:, incorrect_tokens]``), times ``ln_final.w`` if any.

    The final norm is ``w * normalised + b``: a component's direct effect on the logits is its
    normalised value times ``w``, dotted with the unembedding column.
    """
    directions = model.tokens_to_residual_directions(tokens)
    if incorrect_tokens is not None:
        incorrect = model.tokens_to_residual_directions(incorrect_tokens)
        if incorrect.shape != directions.shape:
            raise ValueError(
                f"tokens and incorrect_tokens must have the same shape, got directions of shape "
                f"{tuple(directions.shape)} and {tuple(incorrect.shape)}."
            )
        directions = directions - incorrect
    w = None if model.ln_final is None else model.ln_final.w
    return directions if w is None else directions * w


def _refuse_nonlinear_head(model: AttnOnlyModel) -> None:
    """Refuse direct logit attribution on an encoder: its logits are no linear map of the stream.

    Raises:
        NotImplementedError: Saying why, and what works.
    """
    if model.is_encoder:
        raise NotImplementedError(
            "head_logit_attrs (direct logit attribution) needs logits that are a linear map of "
            "the final residual stream, but this encoder's masked-LM head (a dense layer, GELU "
            "and a LayerNorm before the unembedding) is not linear, so no split of a logit into "
            "components sums exactly. What works: decompose_resid_heads (the final hidden states "
            "as a sum of heads, embeddings and bias, each norm's scale from the run), with "
            "project_output_onto=<direction> for a direction in the residual stream."
        )


# ------------------------------------------------------------------------------------------------
# public stacking / decomposition / DLA
# ------------------------------------------------------------------------------------------------
@overload
def stack_neuron_head_results(
    cache: ActivationCache,
    layer: int | None = -1,
    *,
    return_labels: Literal[False] = False,
    options: StackOptions | None = None,
    **overrides: Any,
) -> torch.Tensor: ...
@overload
def stack_neuron_head_results(
    cache: ActivationCache,
    layer: int | None = -1,
    *,
    return_labels: Literal[True],
    options: StackOptions | None = None,
    **overrides: Any,
) -> tuple[torch.Tensor, list[str]]: ...
def stack_neuron_head_results(
    cache: ActivationCache,
    layer: int | None = -1,
    *,
    return_labels: bool = False,
    options: StackOptions | None = None,
    **overrides: Any,
) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
    """Every neuron-head's result in layers before ``layer``, stacked.

    The neuron-head analogue of ``ActivationCache.stack_neuron_results`` (for ``K = 1`` the two
    are equal). Arguments as in :func:`stack_all_head_results`.

    Returns:
        ``[layer * n_neuron_heads (+1), batch, pos, d_model]``, and labels ``L{l}N{i}`` /
        ``L{l}N{i}.{k}`` if ``return_labels``.
    """
    resolved = resolve_stack_options("stack_neuron_head_results", options, overrides)
    stack, labels = stack_components(cache, layer, resolved, kinds=("neuron",))
    return (stack, labels) if return_labels else stack


@overload
def stack_all_head_results(
    cache: ActivationCache,
    layer: int | None = -1,
    *,
    kinds: Kinds = ("attn", "neuron"),
    mlp_input: bool = False,
    return_labels: Literal[False] = False,
    options: StackOptions | None = None,
    **overrides: Any,
) -> torch.Tensor: ...
@overload
def stack_all_head_results(
    cache: ActivationCache,
    layer: int | None = -1,
    *,
    kinds: Kinds = ("attn", "neuron"),
    mlp_input: bool = False,
    return_labels: Literal[True],
    options: StackOptions | None = None,
    **overrides: Any,
) -> tuple[torch.Tensor, list[str]]: ...
def stack_all_head_results(
    cache: ActivationCache,
    layer: int | None = -1,
    *,
    kinds: Kinds = ("attn", "neuron"),
    mlp_input: bool = False,
    return_labels: bool = False,
    options: StackOptions | None = None,
    **overrides: Any,
) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
    """``stack_head_results`` over all heads: attention heads and neuron-heads.

    Equals TransformerLens's ``cache.stack_head_results`` for the attention heads, but computes
    them from ``z`` layer by layer (:func:`get_attn_head_results`) instead of storing them in the
    cache; neuron-head results are computed from ``z`` in chunks of ``chunk_size`` heads.

    Args:
        cache: Cache of an :class:`~tl_attnonly.AttnOnlyTransformer` run (see
            :func:`tl_attnonly.hooks.decomposition_names_filter`).
        layer: Heads in layers strictly before ``layer``; ``-1``/``None``/``n_layers``: all.
        kinds: ``("attn", "neuron")`` (default), ``("attn",)`` or ``("neuron",)``.
        mlp_input: Also include the attention heads of ``layer`` (they feed its MLP).
        return_labels: Also return the labels (``L{l}H{h}``, ``L{l}N{i}``, ``L{l}N{i}.{k}``).
        options: A :class:`~tl_attnonly.analysis.StackOptions`: ``pos_slice``, ``apply_ln``,
            ``incl_remainder``, ``project_output_onto``, ``max_bytes``, ``chunk_size``,
            ``progress`` (see its attributes).
        **overrides: Any of those options by keyword (``pos_slice=-1``); it replaces the one
            in ``options``.

    Raises:
        TypeError: For a keyword that is neither a parameter nor an option.

    Returns:
        ``[n_components, batch, pos, d_model]`` (pos dropped for an int ``pos_slice``; last axis
        ``n_outputs`` or squeezed when projecting), and the labels if ``return_labels``.
    """
    resolved = resolve_stack_options("stack_all_head_results", options, overrides)
    stack, labels = stack_components(cache, layer, resolved, mlp_input=mlp_input, kinds=kinds)
    return (stack, labels) if return_labels else stack


@overload
def decompose_resid_heads(
    cache: ActivationCache,
    layer: int | None = None,
    *,
    mlp_input: bool = False,
    return_labels: Literal[False] = False,
    options: StackOptions | None = None,
    **overrides: Any,
) -> torch.Tensor: ...
@overload
def decompose_resid_heads(
    cache: ActivationCache,
    layer: int | None = None,
    *,
    mlp_input: bool = False,
    return_labels: Literal[True],
    options: StackOptions | None = None,
    **overrides: Any,
) -> tuple[torch.Tensor, list[str]]: ...
def decompose_resid_heads(
    cache: ActivationCache,
    layer: int | None = None,
    *,
    mlp_input: bool = False,
    return_labels: bool = False,
    options: StackOptions | None = None,
    **overrides: Any,
) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
    """The residual stream as a sum of heads, embeddings and biases: nothing else.

    ``sum(stack, 0)`` equals ``resid_pre[layer]`` (``resid_mid[layer]`` with ``mlp_input``;
    ``resid_post`` of the last block for ``layer = n_layers``). Components: every attention head
    and every neuron-head of earlier layers, ``embed``, ``pos_embed`` (if the model has one) and
    ``bias`` (every layer's output bias ``b_O``: the attention ``b_O`` and the MLP's ``b_out``,
    plus ``b_in @ W_out`` for gated MLPs, whose ``b_in`` is added after the product). A plain
    neuron-head's result includes its value bias and its bias-token value (they pass through its
    pattern), so ``bias`` holds only the output biases.

    For ``K = 1`` this equals TransformerLens's ``cache.get_full_resid_decomposition(
    expand_neurons=True)``, labels included (neuron ``i`` is neuron-head ``i``); this function also
    splits GELU neurons into their ``K`` heads and keeps the bias in the model's dtype.

    **A residual post-LN** (GPT-1, BERT-style encoders, OPT's ``do_layer_norm_before=False``:
    ``LN1(resid_pre + attn_out)``, ``LN2(mid + mlp_out)``, an encoder's ``LN(embeddings)``
    first). Each norm is taken with its scale from the run (its ``hook_scale``, as
    TransformerLens's ``logit_attrs`` takes the final norm's), which makes it affine:
    ``LN(x) = w * (x - mean(x)) / sigma + b``. The decomposed stream is the one after every norm
    that ran before it: block ``layer``'s input (``hook_resid_pre``); with ``mlp_input`` the
    MLP's input ``LN1(resid_pre + attn_out)`` (a bridge's ``blocks.{layer}.ln1.hook_out``,
    GPT-1's ``hook_resid_mid``; a ``HookedEncoder``'s ``hook_resid_post - hook_mlp_out``, its
    ``hook_resid_mid`` being the sum before ``ln1``); for ``layer = n_layers`` the last block's
    output, the final hidden states (``blocks.{n-1}.ln2.hook_out``; a ``HookedEncoder``'s
    ``hook_normalized_resid_post``). Each head's row is its result carried through
    ``w * x_c / sigma`` of every norm after it (its own sublayer's included); ``embed``,
    ``pos_embed`` and an encoder's ``token_type_embed`` likewise (through the embeddings' norm
    first); ``bias`` holds every output bias and every norm's bias ``b``, each carried through the
    norms after it (so it varies by position). The rows sum to the stream exactly; they are one
    run's linearisation, not what a head would add in another run.

    Args:
        cache, layer, mlp_input, return_labels, options, overrides: As in
            :func:`stack_all_head_results`; every option but ``incl_remainder`` (this
            decomposition lists the embeddings and biases itself). A residual post-LN takes no
            ``apply_ln`` (its stream is already a norm's output).

    Raises:
        TypeError: For the keyword ``incl_remainder``.
        ValueError: For ``options`` with ``incl_remainder=True``; ``apply_ln=True`` on a residual
            post-LN.
        KeyError: If a norm's scale is not cached (use
            :func:`tl_attnonly.hooks.decomposition_names_filter`).

    Returns:
        ``[n_components, batch, pos, d_model]`` (see :func:`stack_all_head_results` for the
        shape options), and the labels if ``return_labels``.
    """
    resolved = resolve_stack_options(
        "decompose_resid_heads", options, overrides, supported=_DECOMPOSE_OPTIONS
    )
    stack, labels = stack_components(
        cache, layer, resolved, mlp_input=mlp_input, incl_embeds_and_bias=True
    )
    return (stack, labels) if return_labels else stack


@overload
def head_logit_attrs(
    cache: ActivationCache,
    tokens: str
    | int
    | Int[torch.Tensor, ""]
    | Int[torch.Tensor, "batch"]  # noqa: F821
    | Int[torch.Tensor, "batch pos"],
    incorrect_tokens: None | str | int | torch.Tensor = None,
    *,
    pos_slice: None | SliceInput | Slice = None,
    kinds: Kinds = ("attn", "neuron"),
    incl_embeds_and_bias: bool = False,
    return_labels: Literal[False] = False,
    chunk_size: int = DEFAULT_CHUNK,
    progress: bool = False,
) -> torch.Tensor: ...
@overload
def head_logit_attrs(
    cache: ActivationCache,
    tokens: str
    | int
    | Int[torch.Tensor, ""]
    | Int[torch.Tensor, "batch"]  # noqa: F821
    | Int[torch.Tensor, "batch pos"],
    incorrect_tokens: None | str | int | torch.Tensor = None,
    *,
    pos_slice: None | SliceInput | Slice = None,
    kinds: Kinds = ("attn", "neuron"),
    incl_embeds_and_bias: bool = False,
    return_labels: Literal[True],
    chunk_size: int = DEFAULT_CHUNK,
    progress: bool = False,
) -> tuple[torch.Tensor, list[str]]: ...
def head_logit_attrs(
    cache: ActivationCache,
    tokens: str
    | int
    | Int[torch.Tensor, ""]
    | Int[torch.Tensor, "batch"]  # noqa: F821
    | Int[torch.Tensor, "batch pos"],
    incorrect_tokens: None | str | int | torch.Tensor = None,
    *,
    pos_slice: None | SliceInput | Slice = None,
    kinds: Kinds = ("attn", "neuron"),
    incl_embeds_and_bias: bool = False,
    return_labels: bool = False,
    chunk_size: int = DEFAULT_CHUNK,
    progress: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
    """Direct logit attribution of every head (attention heads and neuron-heads).

    Each component's result is centred and divided by the cached final LayerNorm scale (as in
    TransformerLens's ``cache.logit_attrs``), then dotted with ``ln_final.w * W_U[:, token]``
    (or the difference of two unembedding columns when ``incorrect_tokens`` is given),
    ``chunk_size`` neuron-heads at a time, so ``[n_neuron_heads, batch, pos, d_model]`` is never
    built. Unlike ``cache.logit_attrs``, the final norm's weight ``ln_final.w`` is applied, so the
    numbers are right on a model whose final LayerNorm/RMSNorm is not folded (``fold_ln=False``,
    e.g. :func:`tl_attnonly.bundled.load_bundled_model`); after ``fold_ln`` the weight is 1 and
    the two agree.

    With ``incl_embeds_and_bias=True`` the rows are exactly those of
    :func:`decompose_resid_heads` at the unembed, so they sum to the logit (difference) minus
    the constant terms ``ln_final.b @ W_U[:, token] + b_U[token]``. On a decoder with a residual
    post-LN (GPT-1: no final norm, the unembedding reads the last block's output) the rows are
    :func:`decompose_resid_heads`'s at ``layer = n_layers`` (each norm's scale from the run)
    dotted with ``W_U[:, token]``; they sum to the logit less ``b_U[token]``. An encoder's
    masked-LM head (a dense layer, GELU and a LayerNorm before the unembedding) is not linear:
    refused. On a model that soft-caps
    its logits (Gemma 2's ``final_logit_softcapping``, ``cfg.output_logits_soft_cap = c``: the
    logits are ``c * tanh(u / c)``) they attribute ``u``, the logit before the cap: the cap is
    not linear, so no split of the capped logit into heads sums exactly; it is increasing, so a
    head that raises ``u`` raises the logit.

    Args:
        cache: Cache of an :class:`~tl_attnonly.AttnOnlyTransformer` run (see
            :func:`tl_attnonly.hooks.decomposition_names_filter`).
        tokens: Tokens to attribute to, as for ``ActivationCache.logit_attrs``: shaped like the
            cache's ``[batch, pos]`` after ``pos_slice`` (e.g. ``[batch]`` with
            ``pos_slice=-1``).
        incorrect_tokens: Optional; attribute the logit difference ``tokens - incorrect_tokens``.
        pos_slice: Positions to attribute at; ``-1`` for the last.
        kinds: ``("attn", "neuron")`` (default), ``("attn",)`` or ``("neuron",)``.
        incl_embeds_and_bias: Also attribute ``embed``, ``pos_embed`` and ``bias``.
        return_labels: Also return the labels.
        chunk_size: Neuron-heads materialised at once.
        progress: Show a progress bar over neuron-head chunks.

    Raises:
        NotImplementedError: On an encoder (its masked-LM head is not linear), and on models
            whose residual stream is no sum (:func:`tl_attnonly.adapt.require_additive_residual`).

    Returns:
        ``[n_components, batch, pos]`` (pos dropped for an int ``pos_slice``), and the labels if
        ``return_labels``.
    """
    model = cache_model(cache)
    check_kinds(kinds)
    pos_slice = pos_slice if isinstance(pos_slice, Slice) else Slice(pos_slice)
    norms = None
    if post_norm.residual_post_norm(model):
        _refuse_nonlinear_head(model)
        norms = post_norm.ResidualNorms(cache, model, model.cfg.n_layers, False, pos_slice)
    else:
        require_additive_residual(model, "head_logit_attrs (direct logit attribution)")
    directions = _logit_directions(model, tokens, incorrect_tokens)
    parts, labels = [], []
    chunks = component_chunks(
        cache,
        model.cfg.n_layers,
        False,
        kinds,
        pos_slice,
        incl_embeds_and_bias,
        chunk_size,
        progress,
        norms,
    )
    for chunk, chunk_labels in chunks:
        if norms is not None and model.ln_final is None:  # GPT-1: the unembedding reads it
            scaled = chunk
        else:
            scaled = cache.apply_ln_to_stack(chunk, layer=-1, pos_slice=pos_slice)
        parts.append((scaled * directions).sum(dim=-1))
        labels += chunk_labels
    attrs = torch.cat(parts, dim=0)
    return (attrs, labels) if return_labels else attrs


__all__ = [
    "decompose_resid_heads",
    "head_logit_attrs",
    "stack_all_head_results",
    "stack_neuron_head_results",
]
