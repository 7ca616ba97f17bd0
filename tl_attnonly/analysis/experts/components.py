"""Each expert's weighted contribution to a mixture-of-experts layer's output
(:func:`expert_components`): the routed experts' outputs times the weights the block gave them,
and the shared experts' outputs, summing to ``blocks.{l}.hook_mlp_out``.

Kept apart from :mod:`.decomposition` (which builds residual decompositions from these and the
dense layers' neuron-heads) so that the dense residual views
(:mod:`tl_attnonly.analysis.cache.views`) can read an expert layer's components too.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int
from transformer_lens.utilities import Slice, SliceInput

from tl_attnonly.adapt import model_of_cache
from tl_attnonly.analysis.experts.routing import (
    Expert,
    cached_routing,
    expert_hook_name,
    hook_rows,
    moe_layer,
    routing_hook_name,
    shared_experts,
)
from tl_attnonly.components.expert_facts import routed_slots

#: The routing weights the block passes to its experts, under ``blocks.{l}.mlp``:
#: ``[batch * pos, top_k]`` (mounted by the conversion).
ROUTING_WEIGHTS_HOOK = "hook_routing_weights"


def routing_weights_hook_name(layer: int) -> str:
    """``blocks.{layer}.mlp.hook_routing_weights``."""
    return f"blocks.{layer}.mlp.{ROUTING_WEIGHTS_HOOK}"


def _cached(cache: Any, name: str) -> torch.Tensor:
    if name not in cache.cache_dict:
        raise KeyError(
            f"The cache has no {name}: run_with_cache without a names_filter (or one that keeps "
            "the experts' hook_post or hook_z, the routing hooks and the shared experts' "
            "hook_out)."
        )
    return cache[name]


def _routing_weights(
    cache: Any, layer: int, moe: Any, indices: Int[torch.Tensor, "tokens top_k"]
) -> Float[torch.Tensor, "tokens top_k"]:
    """The weights the experts of ``layer`` got: ``hook_routing_weights`` (a converted bridge);
    on TransformerLens's ``MoE`` (an :class:`~tl_attnonly.AttnOnlyTransformer`'s), its
    ``hook_expert_weights`` (the router's softmax over every expert) at the top-k indices,
    normalised where ``cfg.norm_topk_prob``, as its forward computes them."""
    name = routing_weights_hook_name(layer)
    probs = f"blocks.{layer}.mlp.hook_expert_weights"
    cfg = getattr(moe, "cfg", None)
    if name in cache.cache_dict or cfg is None or probs not in cache.cache_dict:
        return _cached(cache, name)
    weights = cache[probs].reshape(-1, moe.num_experts).gather(-1, indices)
    if getattr(cfg, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def _expert_output(cache: Any, layer: int, expert: Any, index: int) -> torch.Tensor:
    """Routed expert ``index``'s output (before its routing weight), ``[routed, d_model]``, in
    its gather order: ``(hook_post - b_post) @ W_out + b_O`` (or ``sum_h z_h W_O[h] + b_O``)."""
    post_name = expert_hook_name(layer, index, "post")
    if post_name in cache.cache_dict:  # hook_post fires unless per-head results are computed
        post = hook_rows(cache[post_name], "post")
        return (post - expert.b_post) @ expert.out_matrix + expert.b_O  # b_O counts b_post
    z = hook_rows(_cached(cache, expert_hook_name(layer, index, "z")), "z")
    return z @ expert.W_O[:, 0] + expert.b_O


def _residual_like(cache: Any, layer: int) -> torch.Tensor:
    """A cached ``[batch, pos, d_model]`` residual-stream tensor of the run (the block's input or
    output, or the embedding), for its shape and dtype."""
    names = (
        f"blocks.{layer}.hook_resid_pre",
        f"blocks.{layer}.hook_resid_post",
        f"blocks.{layer}.hook_mlp_out",
        "hook_embed",
    )
    for name in names:
        if name in cache.cache_dict:
            return cache[name]
    raise KeyError(
        f"The cache has none of {', '.join(names)}: cache one of them too "
        "(tl_attnonly.hooks.decomposition_names_filter() keeps what this needs)."
    )


def expert_components(
    cache: Any, layer: int, pos_slice: None | SliceInput | Slice = None
) -> tuple[Float[torch.Tensor, "n_components *batch_and_pos d_model"], list[str]]:
    """Each expert's weighted contribution to a mixture-of-experts layer's output, and each
    shared expert's output as the block adds it.

    Args:
        cache: A ``run_with_cache`` cache of a converted model (bridge) with mixtures of experts.
        layer: The MoE layer.
        pos_slice: Positions to keep (TransformerLens ``Slice`` semantics).

    Returns:
        ``([n_experts + n_shared, batch, pos, d_model], labels)``: routed expert ``e`` (label
        ``L{l}E{e}``) is ``routing weight x expert output`` at the tokens routed to it, zero
        elsewhere; a shared expert (``L{l}S``, ``L{l}S:{name}`` where there are several) its
        output times its gate where the block has one. Their sum is ``blocks.{l}.hook_mlp_out``.

    Raises:
        ValueError: For a layer that is not a mixture of experts.
        KeyError: If the cache lacks a hook read.
    """
    model = model_of_cache(cache)
    moe = moe_layer(model, layer)
    pos_slice = pos_slice if isinstance(pos_slice, Slice) else Slice(pos_slice)
    resid = _residual_like(cache, layer)  # [batch, pos, d_model]: for its shape and dtype
    batch, n_pos, d_model = resid.shape
    indices = cached_routing(cache, layer)  # [tokens, top_k]
    weights = _routing_weights(cache, layer, moe, indices)  # [tokens, top_k]
    parts, labels = [], []
    for index, expert in enumerate(moe.expert_list()):
        slot, token = routed_slots(indices, index)
        out = _expert_output(cache, layer, expert, index)  # [routed, d_model]
        part = resid.new_zeros(batch * n_pos, d_model)
        part[token] = (out * weights[token, slot, None]).to(part.dtype)
        parts.append(part)
        labels.append(f"L{layer}E{index}")
    shared = shared_experts(moe)
    gates = getattr(moe, "shared_gates", {})
    for name in shared:
        out = _cached(cache, f"blocks.{layer}.mlp.{name}.hook_out").reshape(-1, d_model)
        if name in gates:  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared_expert(x)
            out = torch.sigmoid(_cached(cache, f"blocks.{layer}.mlp.{gates[name]}.hook_out")) * out
        parts.append(out.to(resid.dtype))
        labels.append(f"L{layer}S" if len(shared) == 1 else f"L{layer}S:{name}")
    stack = torch.stack(parts).reshape(len(parts), batch, n_pos, d_model)
    return pos_slice.apply(stack, dim=-2), labels


def _neuron_rows(cache: Any, layer: int, key: Expert, module: Any) -> torch.Tensor:
    """``[rows, d_mlp]``: what each neuron of an expert (``key``: a routed expert's index or a
    shared expert's name; ``module`` its neuron-head layer) writes per unit of its row of
    ``out_matrix``, at each row its hooks saw (a routed expert: its tokens in gather order; a
    shared expert: every token): ``hook_post - b_post``, or the sum of its heads' ``hook_z``."""
    post_name = expert_hook_name(layer, key, "post")
    if post_name in cache.cache_dict:  # hook_post fires unless per-head results are computed
        return hook_rows(cache[post_name], "post") - module.b_post
    z = hook_rows(_cached(cache, expert_hook_name(layer, key, "z")), "z")  # [rows, heads]
    return z.unflatten(-1, (-1, module.n_heads_per_neuron)).sum(-1)


def component_layer(moe: Any, component: int) -> tuple[Expert, Any]:
    """``(key, neuron-head layer)`` of component ``component`` of a mixture of experts, in
    :func:`expert_components`' order: a routed expert's index, then the shared experts' names.

    Raises:
        ValueError: For a component the block does not have.
    """
    routed, shared = moe.expert_list(), shared_experts(moe)
    if not 0 <= component < len(routed) + len(shared):
        raise ValueError(
            f"component {component}: the block has {len(routed)} routed and {len(shared)} "
            "shared experts."
        )
    if component < len(routed):
        return component, routed[component]
    name = list(shared)[component - len(routed)]
    return name, shared[name]


def expert_neuron_activations(
    cache: Any, layer: int, component: int
) -> Float[torch.Tensor, "batch pos d_mlp"]:
    """Each neuron of one component of a mixture of experts, as the layer's output takes it:
    neuron ``j`` adds this times row ``j`` of the component's ``out_matrix``.

    A routed expert's neuron gives its routing weight times ``hook_post - b_post`` at the tokens
    routed to it (0 elsewhere); a shared expert's gives ``hook_post - b_post`` (times the
    sigmoid of the block's shared gate where it has one) at every token. Summed over the
    neurons with their rows, plus the expert's output bias ``b_O`` times its weight (or gate),
    they are the component of :func:`expert_components`.

    Args:
        cache: A ``run_with_cache`` cache of a converted model with mixtures of experts (the
            hooks of :func:`expert_component_hooks` with ``neurons=True``).
        layer: The MoE layer.
        component: The component's index in :func:`expert_components`' order (routed experts,
            then shared ones).

    Returns:
        ``[batch, pos, d_mlp]`` (``d_mlp``: the component's neurons).

    Raises:
        ValueError: For a layer that is not a mixture of experts, or a component it lacks.
        KeyError: If the cache lacks a hook read.
    """
    moe = moe_layer(model_of_cache(cache), layer)
    key, module = component_layer(moe, component)
    resid = _residual_like(cache, layer)  # [batch, pos, d_model]: for its shape and dtype
    batch, n_pos, _ = resid.shape
    rows = _neuron_rows(cache, layer, key, module)  # [rows, d_mlp]
    if isinstance(key, int):
        indices = cached_routing(cache, layer)  # [tokens, top_k]
        weights = _routing_weights(cache, layer, moe, indices)
        slot, token = routed_slots(indices, key)
        out = rows.new_zeros(batch * n_pos, rows.shape[-1])
        out[token] = rows * weights[token, slot, None].to(rows.dtype)
    else:
        out = rows
        gates = getattr(moe, "shared_gates", {})
        if key in gates:  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared_expert(x)
            gate = _cached(cache, f"blocks.{layer}.mlp.{gates[key]}.hook_out").reshape(-1, 1)
            out = torch.sigmoid(gate).to(rows.dtype) * out
    return out.reshape(batch, n_pos, -1).to(resid.dtype)


def component_suffixes(moe: Any) -> list[str]:
    """The node label suffixes of a mixture of experts' components, in
    :func:`expert_components`' order: ``E{e}`` per routed expert, then ``S`` (one shared expert)
    or ``S{j}`` (several)."""
    shared = shared_experts(moe)
    named = ["S"] if len(shared) == 1 else [f"S{j}" for j in range(len(shared))]
    return [f"E{e}" for e in range(len(moe.expert_list()))] + named


def expert_component_hooks(model: Any, layer: int, neurons: bool = False) -> list[str]:
    """The hooks :func:`expert_components` reads of ``layer`` in a run: the router's top-k
    indices and weights, each routed expert's ``hook_post`` and ``hook_z`` (whichever fires), each
    shared expert's ``hook_out`` and gate, and the layer's ``hook_mlp_out`` (for the shape).

    Args:
        model: The adapted model (:func:`~tl_attnonly.adapt.analysis_model`).
        layer: The MoE layer.
        neurons: Also what :func:`expert_neuron_activations` reads of the shared experts
            (their ``hook_post`` and ``hook_z``).
    """
    moe = moe_layer(model, layer)
    names = [
        routing_hook_name(layer, model),
        routing_weights_hook_name(layer),
        f"blocks.{layer}.hook_mlp_out",
    ]
    for index in range(len(moe.expert_list())):
        names += [expert_hook_name(layer, index, kind) for kind in ("post", "z")]
    gates = getattr(moe, "shared_gates", {})
    for name in shared_experts(moe):
        names.append(f"blocks.{layer}.mlp.{name}.hook_out")
        if neurons:
            names += [expert_hook_name(layer, name, kind) for kind in ("post", "z")]
        if name in gates:
            names.append(f"blocks.{layer}.mlp.{gates[name]}.hook_out")
    return [name for name in names if name in model.hook_dict]


def expert_routing(cache: Any, layer: int) -> Float[torch.Tensor, "batch pos n_experts"]:
    """The weight the block gave each routed expert of ``layer`` at each token of the cache's run,
    0 where the token was not routed to the expert (routing is recomputed in every run from its
    own input: see :func:`~tl_attnonly.analysis.experts.experts_used`).

    Args:
        cache: A ``run_with_cache`` cache of a converted model with mixtures of experts, holding
            the routing hooks (``hook_routing_indices`` or ``hook_expert_indices``, and
            ``hook_routing_weights``) and one residual-stream hook of the block (for the shape).
        layer: The MoE layer.

    Returns:
        ``[batch, pos, n_experts]``: expert ``e``'s weight in its contribution ``L{l}E{e}``
        (:func:`expert_components`).

    Raises:
        ValueError: For a layer that is not a mixture of experts.
        KeyError: If the cache lacks a hook read.
    """
    moe = moe_layer(model_of_cache(cache), layer)
    batch, n_pos, _ = _residual_like(cache, layer).shape
    indices = cached_routing(cache, layer).reshape(batch * n_pos, -1)  # [tokens, top_k]
    weights = _routing_weights(cache, layer, moe, indices).reshape(batch * n_pos, -1)
    routing = weights.new_zeros(batch * n_pos, len(moe.expert_list()))
    routing.scatter_(-1, indices.long(), weights)
    return routing.reshape(batch, n_pos, -1)


__all__ = [
    "ROUTING_WEIGHTS_HOOK",
    "component_layer",
    "component_suffixes",
    "expert_component_hooks",
    "expert_components",
    "expert_neuron_activations",
    "expert_routing",
    "routing_weights_hook_name",
]
