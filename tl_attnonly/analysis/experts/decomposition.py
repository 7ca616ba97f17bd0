"""Mixtures of experts in the residual decomposition: each expert's weighted contribution.

A mixture-of-experts layer writes, at token ``t``, ``sum_slot w[t, slot] * expert_{e(t, slot)}
(x_t)`` (the routed experts: the top-k indices ``e`` and weights ``w`` the block passes to its
experts, hooked at ``blocks.{l}.mlp.hook_routing_indices`` and ``hook_routing_weights`` on a
converted bridge; on an :class:`~tl_attnonly.AttnOnlyTransformer`'s MoE, TransformerLens's
``hook_expert_indices`` and the top-k of its ``hook_expert_weights``) plus what its shared
experts write (Qwen2-MoE's ``shared_expert``, scaled by the sigmoid of its ``shared_expert_gate``;
DeepSeek's ``shared_experts``). Each of those is one component
here: expert ``e``'s routing weight times its output (zero at the tokens not routed to it), and
each shared expert's output as the block adds it. They sum to the layer's output
(``blocks.{l}.hook_mlp_out``) up to the floating-point order of the sum.

Routing is the run's own: every run (a patched one too) routes its tokens from its own residual
stream, so the decomposition of two runs may use different experts at the same token.

* :func:`expert_components`: one layer's components ``[n_experts + n_shared, batch, pos,
  d_model]``, labels ``L{l}E{e}`` and ``L{l}S`` (``L{l}S:{name}`` with several shared experts).
* :func:`decompose_resid_experts`: the residual stream of a model with mixtures of experts as a
  sum: attention heads, then per layer the dense neuron-heads or the expert components, then
  ``embed``, ``pos_embed`` and ``bias`` (:func:`~tl_attnonly.analysis.decompose_resid_heads`,
  which reads an expert layer so).
* :func:`expert_logit_attrs`: direct logit attribution of those components (the final norm's
  cached scale and weight, as :func:`~tl_attnonly.analysis.head_logit_attrs`).
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int
from transformer_lens.utilities import Slice, SliceInput

from tl_attnonly.adapt import model_of_cache, require_additive_residual
from tl_attnonly.analysis.experts.components import (
    ROUTING_WEIGHTS_HOOK,
    expert_components,
    routing_weights_hook_name,
)


def decompose_resid_experts(
    cache: Any,
    layer: int | None = None,
    *,
    mlp_input: bool = False,
    pos_slice: None | SliceInput | Slice = None,
) -> tuple[Float[torch.Tensor, "n_components *batch_and_pos d_model"], list[str]]:
    """The residual stream of a model with mixtures of experts, as a sum of components.

    Components, in TransformerLens's ``get_full_resid_decomposition`` order: every attention head
    of earlier layers (``L{l}H{h}``; with ``mlp_input`` those of ``layer`` too), then layer by
    layer the MLP's components (a mixture of experts: :func:`expert_components`; a dense layer,
    such as DeepSeek's first ones: its neuron-heads), then ``embed``, ``pos_embed`` (where the
    model has one) and ``bias`` (every attention layer's ``b_O`` and every dense MLP's output
    bias; an expert's output bias is inside its weighted contribution). ``sum(stack, 0)`` equals
    ``resid_pre[layer]`` (``resid_mid[layer]`` with ``mlp_input``; the last ``resid_post`` for
    ``layer = n_layers``) up to floating-point rounding.

    Args:
        cache: A ``run_with_cache`` cache (every hook) of a converted model with experts.
        layer: Components of layers before it; ``None``/``-1``/``n_layers``: all.
        mlp_input: Also the attention heads of ``layer`` (they feed its MLP).
        pos_slice: Positions to keep (TransformerLens ``Slice`` semantics).

    Returns:
        ``([n_components, batch, pos, d_model], labels)``.

    Raises:
        NotImplementedError: On a model whose residual stream is no sum of its components.
    """
    from tl_attnonly.analysis.cache.decomposition import decompose_resid_heads

    model = model_of_cache(cache)
    require_additive_residual(model, "decompose_resid_experts")
    n_layers = model.cfg.n_layers
    layer = n_layers if layer is None or layer == -1 else layer
    if not 0 <= layer <= n_layers or (mlp_input and layer == n_layers):
        raise ValueError(f"layer must be in [0, {n_layers}] ({n_layers}: not with mlp_input).")
    # the dense decomposition reads an expert layer as its experts (cache.views)
    return decompose_resid_heads(
        cache, layer, mlp_input=mlp_input, return_labels=True, pos_slice=pos_slice
    )


def expert_logit_attrs(
    cache: Any,
    tokens: int | Int[torch.Tensor, "..."],
    incorrect_tokens: int | Int[torch.Tensor, "..."] | None = None,
    *,
    pos_slice: None | SliceInput | Slice = None,
) -> tuple[Float[torch.Tensor, "n_components *batch_and_pos"], list[str]]:  # noqa: F821
    """Direct logit attribution of every component of :func:`decompose_resid_experts` (at the
    unembed): each divided by the final norm's cached scale (centred first under LayerNorm), times
    its weight, dotted with ``W_U[:, tokens]`` (minus ``W_U[:, incorrect_tokens]``).

    The rows sum to the logit (difference) minus ``ln_final.b @ W_U[:, token] + b_U[token]``, as
    :func:`~tl_attnonly.analysis.head_logit_attrs` with ``incl_embeds_and_bias=True`` does on a
    dense model; an expert's row is its weighted contribution's.

    Args:
        cache: As in :func:`decompose_resid_experts`.
        tokens: Tokens to attribute to, shaped like the cache's ``[batch, pos]`` after
            ``pos_slice``.
        incorrect_tokens: Optional; attribute the difference ``tokens - incorrect_tokens``.
        pos_slice: Positions (``-1``: the last).

    Returns:
        ``([n_components, batch, pos], labels)`` (pos dropped for an int ``pos_slice``).
    """
    model = model_of_cache(cache)
    pos_slice = pos_slice if isinstance(pos_slice, Slice) else Slice(pos_slice)
    stack, labels = decompose_resid_experts(cache, pos_slice=pos_slice)
    directions = model.tokens_to_residual_directions(torch.as_tensor(tokens))
    if incorrect_tokens is not None:
        directions = directions - model.tokens_to_residual_directions(
            torch.as_tensor(incorrect_tokens)
        )
    w = None if model.ln_final is None else model.ln_final.w
    directions = directions if w is None else directions * w
    scaled = cache.apply_ln_to_stack(stack, layer=-1, pos_slice=pos_slice)
    return (scaled * directions.to(scaled.dtype)).sum(-1), labels


__all__ = [
    "ROUTING_WEIGHTS_HOOK",
    "decompose_resid_experts",
    "expert_components",
    "expert_logit_attrs",
    "routing_weights_hook_name",
]
