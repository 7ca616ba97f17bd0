"""Expert neuron-heads in token space: caches and activation patching (both model kinds).

A mixture-of-experts layer (:class:`~tl_attnonly.components.NeuronHeadMoE` on an
:class:`~tl_attnonly.AttnOnlyTransformer`, :class:`~tl_attnonly.bridge.experts.
BridgeNeuronHeadExperts` on a converted bridge) hooks each expert's neuron-heads at
``blocks.{l}.mlp.experts.{e}.hook_*`` over the tokens routed to that expert only: position ``i``
of ``hook_z`` (``[1, n_routed, n_neuron_heads, 1]``) is the ``i``-th routed token in the experts'
gather order (by top-k slot, then by token of the flattened ``[batch * pos]``). The router's
top-k indices (``blocks.{l}.mlp.hook_expert_indices``, ``[batch * pos, top_k]``: TransformerLens's
hook on both kinds, mounted by the conversion on a TL 3.9 bridge) give that order back:
:func:`routed_tokens`.

* :func:`expert_activation`: an expert's neuron-head activation from a ``run_with_cache`` cache,
  scattered back to ``[batch, pos, n_neuron_heads]``; tokens not routed to the expert are NaN
  (``fill``), so that a mean over them is not silently diluted by zeros.
* :func:`get_act_patch_expert_neuron_heads`: clean into corrupted activation patching of expert
  neuron-heads' ``z``, at the tokens routed to the expert in both runs; tokens routed in only one
  run are counted in the result and left unpatched.

Shared experts (Qwen2-MoE, DeepSeek) are dense neuron-head layers at ``blocks.{l}.mlp.{name}``,
not covered here. Dataset summaries, circuit discovery and the residual decomposition refuse
mixtures of experts before any work, naming the layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float, Int

from tl_attnonly._types import Metric
from tl_attnonly.adapt import analysis_model, model_of_cache
from tl_attnonly.protocol import AttnOnlyModel, ModelLike

#: The router's top-k expert indices under ``blocks.{l}.mlp``: ``[batch * pos, top_k]``.
ROUTING_HOOK = "hook_expert_indices"

#: Expert hooks :func:`expert_activation` scatters, and the axes after the routed tokens.
_TOKEN_FIRST = {"gate": 0, "pre": 0, "post": 0}  # [routed, d_mlp]
_BATCHED = {"q": 1, "k": 1, "v": 1, "z": 1, "result": 1}  # [1, routed, heads, ...]


def routing_hook_name(layer: int) -> str:
    """``blocks.{layer}.mlp.hook_expert_indices``."""
    return f"blocks.{layer}.mlp.{ROUTING_HOOK}"


def expert_hook_name(layer: int, expert: int, kind: str) -> str:
    """``blocks.{layer}.mlp.experts.{expert}.hook_{kind}``."""
    return f"blocks.{layer}.mlp.experts.{expert}.hook_{kind}"


def expert_neuron_head_label(layer: int, expert: int, head: int, n_heads_per_neuron: int) -> str:
    """Label of an expert's neuron-head: ``L1E3N17``, or ``L1E3N17.2`` with several heads."""
    neuron, k = divmod(head, n_heads_per_neuron)
    suffix = "" if n_heads_per_neuron == 1 else f".{k}"
    return f"L{layer}E{expert}N{neuron}{suffix}"


def routed_tokens(
    top_k_index: Int[torch.Tensor, "tokens top_k"], expert: int
) -> Int[torch.Tensor, " routed"]:
    """The flattened token indices routed to ``expert``, in the experts' gather order.

    Both kinds gather ``torch.where(one_hot(top_k_index).permute(2, 1, 0)[expert])``: by top-k
    slot, then by token; position ``i`` of the expert's hooks is token ``routed_tokens(...)[i]``
    (``batch = token // pos``, ``pos = token % pos``).
    """
    _, token = torch.where(top_k_index.T == expert)
    return token


def moe_layer(model: AttnOnlyModel, layer: int) -> Any:
    """The mixture-of-experts container of ``layer``, or ``ValueError`` naming what is there."""
    if not 0 <= layer < len(model.neuron_heads):
        raise ValueError(f"layer {layer} is out of range (the model has {model.cfg.n_layers}).")
    moe = model.neuron_heads[layer]
    if not getattr(moe, "is_mixture_of_experts", False):
        raise ValueError(
            f"blocks.{layer}.mlp is not a mixture of experts ({type(moe).__name__}): use "
            "the dense tools (get_act_patch_neuron_heads, the cache's blocks.{l}.mlp.hook_z)."
        )
    return moe


def _check_expert(moe: Any, layer: int, expert: int) -> None:
    n_experts = len(moe.expert_list())
    if not 0 <= expert < n_experts:
        raise ValueError(f"blocks.{layer}.mlp has {n_experts} experts; got expert {expert}.")


def _routing(cache: Any, layer: int) -> Int[torch.Tensor, "tokens top_k"]:
    name = routing_hook_name(layer)
    if name not in cache.cache_dict:
        raise KeyError(
            f"The cache has no {name} (the router's top-k indices): cache it too "
            "(run_with_cache without a names_filter, or one that keeps it)."
        )
    return cache[name]


def expert_activation(
    cache: Any,
    layer: int,
    expert: int,
    kind: str = "z",
    *,
    fill: float = float("nan"),
) -> Float[torch.Tensor, "batch pos ..."]:
    """An expert's activation from a ``run_with_cache`` cache, in token space.

    Args:
        cache: The ``ActivationCache`` of a converted model with mixtures of experts (both
            kinds); it must hold the expert's hook and ``blocks.{l}.mlp.hook_expert_indices``.
        layer: The MoE layer.
        expert: The routed expert.
        kind: ``z``, ``v``, ``q``, ``k`` (``[batch, pos, n_neuron_heads]``), ``result``
            (``[batch, pos, n_neuron_heads, d_model]``), or ``gate``, ``pre``, ``post``
            (``[batch, pos, d_mlp]``).
        fill: The value at tokens not routed to the expert (NaN by default: the expert did not
            run there; use 0.0 for its contribution before the routing weight).

    Returns:
        The activation at every ``(batch, pos)``; ``fill`` where the token is not routed to
        ``expert``.

    Raises:
        ValueError: For a layer that is not a mixture of experts, an unknown expert or kind.
        KeyError: If the cache lacks the expert's hook or the routing hook.
    """
    model = model_of_cache(cache, allow_experts=True)
    _check_expert(moe_layer(model, layer), layer, expert)
    if kind not in _TOKEN_FIRST and kind not in _BATCHED:
        raise ValueError(
            f"kind={kind!r} is not supported; supported: {sorted({*_TOKEN_FIRST, *_BATCHED})} "
            "(a pattern has no token axis of its own: read hook_pattern's rows with "
            "routed_tokens)."
        )
    top_k_index = _routing(cache, layer)
    batch, pos = cache["hook_embed"].shape[:2]
    if batch * pos != top_k_index.shape[0]:
        raise ValueError(
            f"{routing_hook_name(layer)} has {top_k_index.shape[0]} tokens, hook_embed "
            f"{batch} x {pos}."
        )
    act = cache[expert_hook_name(layer, expert, kind)]
    if kind in _BATCHED:
        act = act.squeeze(0)  # [routed, heads, d_head or d_model]
        if kind != "result":
            act = act.squeeze(-1)  # d_head = 1: [routed, heads]
    out = act.new_full((batch * pos, *act.shape[1:]), fill)
    out[routed_tokens(top_k_index, expert)] = act
    return out.reshape(batch, pos, *act.shape[1:])


def _position_map(
    clean: Int[torch.Tensor, " routed_clean"],
    corrupted: Int[torch.Tensor, " routed_corrupted"],
    n_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``(i_corrupted, i_clean)`` of the tokens routed in both runs."""
    where_clean = torch.full((n_tokens,), -1, dtype=torch.long, device=clean.device)
    where_clean[clean] = torch.arange(len(clean), device=clean.device)
    j = where_clean[corrupted]
    keep = j >= 0
    return torch.nonzero(keep).squeeze(-1), j[keep]


def _z_patch(
    clean_z: Float[torch.Tensor, "1 routed_clean n_neuron_heads 1"],
    i_clean: Int[torch.Tensor, " both"],
    i_corrupted: Int[torch.Tensor, " both"],
    head: int,
) -> Any:
    """A hook that writes ``clean_z``'s ``head`` at positions ``i_clean`` into positions
    ``i_corrupted`` of an expert's ``hook_z``."""

    def patch(z: torch.Tensor, hook: Any) -> torch.Tensor:
        z = z.clone()  # [1, routed (corrupted), n_neuron_heads, 1]
        z[0, i_corrupted, head] = clean_z[0, i_clean, head].to(z.dtype)
        return z

    return patch


def get_act_patch_expert_neuron_heads(
    model: ModelLike,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: Any,
    patching_metric: Metric,
    *,
    layer: int,
    experts: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
) -> pd.DataFrame:
    """Patch each expert neuron-head's ``z`` from the clean run into the corrupted run.

    One forward pass per ``(expert, head)``: at ``blocks.{layer}.mlp.experts.{e}.hook_z`` the
    corrupted run's value of the head is replaced by the clean run's at every token routed to
    ``e`` in both runs (routing at ``layer`` is the corrupted run's in every patched pass: the
    patch acts after the router). Tokens routed to ``e`` in only one run have no clean value
    at that expert in the corrupted run (or no corrupted position) and are left unpatched; the
    result counts them.

    Args:
        model: A converted model with mixtures of experts (either kind).
        corrupted_tokens: The corrupted prompts ``[batch, pos]``.
        clean_cache: The clean run's cache (same ``[batch, pos]``), with the experts' ``hook_z``
            and ``blocks.{layer}.mlp.hook_expert_indices``.
        patching_metric: Logits -> scalar tensor.
        layer: The MoE layer.
        experts: The experts to patch (default: all).
        heads: The neuron-heads of each expert (default: all).

    Returns:
        One row per ``(expert, head)``: ``layer, expert, head, label`` (``L{l}E{e}N{n}``),
        ``metric``, ``patched_tokens`` (routed in both runs), ``only_clean`` and
        ``only_corrupted`` (routed in one run only: not patched).

    Raises:
        ValueError: For a layer that is not a mixture of experts, an unknown expert or head, or
            prompts of another shape than the clean run's.
    """
    adapted = analysis_model(model, allow_experts=True)
    moe = moe_layer(adapted, layer)
    n_heads, k = moe.n_neuron_heads, moe.n_heads_per_neuron
    expert_ids = list(range(len(moe.expert_list()))) if experts is None else list(experts)
    for expert in expert_ids:
        _check_expert(moe, layer, expert)
    head_ids = list(range(n_heads)) if heads is None else list(heads)
    if any(not 0 <= h < n_heads for h in head_ids):
        raise ValueError(f"Each expert has {n_heads} neuron-heads; got heads {head_ids}.")
    clean_routing = _routing(clean_cache, layer)
    if corrupted_tokens.numel() != clean_routing.shape[0]:
        raise ValueError(
            f"corrupted_tokens {tuple(corrupted_tokens.shape)} and the clean run "
            f"({clean_routing.shape[0]} tokens) differ in shape."
        )
    routing_name = routing_hook_name(layer)
    with torch.no_grad():
        _, corrupted_cache = adapted.run_with_cache(
            corrupted_tokens, names_filter=lambda name: name == routing_name
        )
    corrupted_routing = corrupted_cache[routing_name]
    n_tokens = corrupted_tokens.numel()
    rows = []
    for expert in expert_ids:
        clean = routed_tokens(clean_routing, expert)
        corrupted = routed_tokens(corrupted_routing, expert)
        i_corrupted, i_clean = _position_map(clean, corrupted, n_tokens)
        clean_z = clean_cache[expert_hook_name(layer, expert, "z")]  # [1, routed, heads, 1]
        counts = {
            "patched_tokens": len(i_corrupted),
            "only_clean": len(clean) - len(i_corrupted),
            "only_corrupted": len(corrupted) - len(i_corrupted),
        }
        for head in head_ids:
            patch = _z_patch(clean_z, i_clean, i_corrupted, head)
            with torch.no_grad():
                logits = adapted.run_with_hooks(
                    corrupted_tokens, fwd_hooks=[(expert_hook_name(layer, expert, "z"), patch)]
                )
            rows.append(
                {
                    "layer": layer,
                    "expert": expert,
                    "head": head,
                    "label": expert_neuron_head_label(layer, expert, head, k),
                    "metric": float(patching_metric(logits)),
                    **counts,
                }
            )
    return pd.DataFrame(rows)


__all__ = [
    "ROUTING_HOOK",
    "expert_activation",
    "expert_hook_name",
    "expert_neuron_head_label",
    "get_act_patch_expert_neuron_heads",
    "moe_layer",
    "routed_tokens",
    "routing_hook_name",
]
