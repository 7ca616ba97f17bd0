"""Activation patching of expert neuron-heads: clean ``z`` into the corrupted run, per head.

:func:`get_act_patch_expert_neuron_heads` patches at the tokens routed to the expert in both runs
(a shared expert: every token); tokens routed in only one run are counted and left unpatched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float, Int

from tl_attnonly._types import Metric
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.experts.decomposition import expert_components
from tl_attnonly.analysis.experts.routing import (
    Expert,
    cached_routing,
    expert_hook_name,
    expert_layer,
    expert_neuron_head_label,
    expert_tokens,
    hook_rows,
    moe_layer,
    resolve_experts,
    routing_hook_name,
    shared_experts,
)
from tl_attnonly.protocol import ModelLike


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
    clean_z: Float[torch.Tensor, "lead rows_clean n_neuron_heads 1"],
    i_clean: Int[torch.Tensor, " both"],
    i_corrupted: Int[torch.Tensor, " both"],
    head: int,
) -> Any:
    """A hook that writes ``clean_z``'s ``head`` at rows ``i_clean`` into rows ``i_corrupted``
    of an expert's ``hook_z`` (rows as :func:`~.routing.hook_rows` counts them)."""
    clean = hook_rows(clean_z, "z")  # [rows (clean), n_neuron_heads]

    def patch(z: torch.Tensor, hook: Any) -> torch.Tensor:
        z = z.clone()  # [1, routed, n_neuron_heads, 1]; a shared expert's: every token
        rows = z.view(-1, *z.shape[-2:])  # [rows (corrupted), n_neuron_heads, 1], a view of z
        rows[i_corrupted, head, 0] = clean[i_clean, head].to(z.dtype)
        return z

    return patch


def get_act_patch_expert_neuron_heads(
    model: ModelLike,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: Any,
    patching_metric: Metric,
    *,
    layer: int,
    experts: Sequence[Expert] | None = None,
    heads: Sequence[int] | None = None,
) -> pd.DataFrame:
    """Patch each expert neuron-head's ``z`` from the clean run into the corrupted run.

    One forward pass per ``(expert, head)``: at ``blocks.{layer}.mlp.experts.{e}.hook_z`` the
    corrupted run's value of the head is replaced by the clean run's at every token routed to
    ``e`` in both runs (routing at ``layer`` is the corrupted run's in every patched pass: the
    patch acts after the router). Tokens routed to ``e`` in only one run have no clean value
    at that expert in the corrupted run (or no corrupted position) and are left unpatched; the
    result counts them. A shared expert (``blocks.{layer}.mlp.{name}.hook_z``) is patched at
    every token.

    Args:
        model: A converted model with mixtures of experts (either kind).
        corrupted_tokens: The corrupted prompts ``[batch, pos]``.
        clean_cache: The clean run's cache (same ``[batch, pos]``), with the experts' ``hook_z``
            and, for routed experts, ``blocks.{layer}.mlp.hook_expert_indices``.
        patching_metric: Logits -> scalar tensor.
        layer: The MoE layer.
        experts: The experts to patch: routed experts' indices, shared experts' names or
            ``"shared"`` (default: every routed expert, then the shared ones).
        heads: The neuron-heads of each expert (default: all of each).

    Returns:
        One row per ``(expert, head)``: ``layer, expert`` (index or shared name), ``head,
        label`` (``L{l}E{e}N{n}``; a shared expert's ``L{l}SN{n}``), ``metric``,
        ``patched_tokens`` (routed in both runs; a shared expert: every token), ``only_clean``
        and ``only_corrupted`` (routed in one run only: not patched).

    Raises:
        ValueError: For a layer that is not a mixture of experts, an unknown expert or head, or
            prompts of another shape than the clean run's.
    """
    adapted = analysis_model(model, allow_experts=True)
    moe = moe_layer(adapted, layer)
    expert_ids = resolve_experts(moe, layer, experts)
    head_ids = {}
    for expert in expert_ids:
        n_heads = expert_layer(moe, expert).n_neuron_heads
        head_ids[expert] = list(range(n_heads)) if heads is None else list(heads)
        if any(not 0 <= h < n_heads for h in head_ids[expert]):
            raise ValueError(
                f"Expert {expert!r} of blocks.{layer}.mlp has {n_heads} neuron-heads; got heads "
                f"{head_ids[expert]}."
            )
    n_tokens = corrupted_tokens.numel()
    routed = any(isinstance(expert, int) for expert in expert_ids)
    clean_routing = corrupted_routing = None
    if routed:
        clean_routing = cached_routing(clean_cache, layer)
        n_clean = clean_routing.shape[0]
    else:
        clean_z = clean_cache[expert_hook_name(layer, expert_ids[0], "z")]
        n_clean = hook_rows(clean_z, "z").shape[0]
    if n_tokens != n_clean:
        raise ValueError(
            f"corrupted_tokens {tuple(corrupted_tokens.shape)} and the clean run "
            f"({n_clean} tokens) differ in shape."
        )
    if routed:
        routing_name = routing_hook_name(layer, adapted)
        with torch.no_grad():
            _, corrupted_cache = adapted.run_with_cache(
                corrupted_tokens, names_filter=lambda name: name == routing_name
            )
        corrupted_routing = cached_routing(corrupted_cache, layer)
    rows = []
    for expert in expert_ids:
        clean = expert_tokens(clean_routing, expert, n_tokens)
        corrupted = expert_tokens(corrupted_routing, expert, n_tokens)
        i_corrupted, i_clean = _position_map(clean, corrupted, n_tokens)
        clean_z = clean_cache[expert_hook_name(layer, expert, "z")]  # [1, routed, heads, 1]
        counts = {
            "patched_tokens": len(i_corrupted),
            "only_clean": len(clean) - len(i_corrupted),
            "only_corrupted": len(corrupted) - len(i_corrupted),
        }
        for head in head_ids[expert]:
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
                    "label": expert_neuron_head_label(layer, expert, head, moe.n_heads_per_neuron),
                    "metric": float(patching_metric(logits)),
                    **counts,
                }
            )
    return pd.DataFrame(rows)


def get_act_patch_experts(
    model: ModelLike,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: Any,
    patching_metric: Metric,
    *,
    layer: int,
    experts: Sequence[Expert] | None = None,
    together: bool = False,
) -> pd.DataFrame:
    """Patch whole experts: each expert's weighted contribution from the clean run into the
    corrupted run.

    An expert's contribution is what :func:`~tl_attnonly.analysis.experts.expert_components`
    gives: its routing weight times its output at the tokens routed to it (a shared expert: its
    output as the block adds it). A patch adds ``clean - corrupted`` of that contribution to
    ``blocks.{layer}.hook_mlp_out`` in the corrupted run, so the layer writes the clean run's
    contribution of the expert (the clean run's tokens, routing weights and output) and the
    corrupted run's of every other. Later layers route from their own, patched, input.

    Args:
        model: A converted model with mixtures of experts (either kind).
        corrupted_tokens: The corrupted prompts ``[batch, pos]`` (the clean run's shape).
        clean_cache: The clean run's cache: every hook of ``blocks.{layer}``
            (``run_with_cache`` without a names_filter).
        patching_metric: Logits -> scalar tensor.
        layer: The MoE layer.
        experts: Routed experts' indices, shared experts' names or ``"shared"`` (default: every
            routed expert, then the shared ones).
        together: One patch of all ``experts`` at once (every expert of the layer: the clean
            ``hook_mlp_out``), instead of one per expert.

    Returns:
        One row per patch: ``layer, expert`` (index, shared name, or ``"together"``), ``label``
        (``L{l}E{e}``, ``L{l}S``), ``metric``, ``routed_clean`` and ``routed_corrupted`` (tokens
        routed to the expert in each run; a shared expert: every token).

    Raises:
        ValueError: For a layer that is not a mixture of experts, an unknown expert, or prompts
            of another shape than the clean run's.
    """
    adapted = analysis_model(model)
    moe = moe_layer(adapted, layer)
    expert_ids = resolve_experts(moe, layer, experts)
    clean, labels = expert_components(clean_cache, layer)  # [n_components, batch, pos, d_model]
    if tuple(clean.shape[1:3]) != tuple(corrupted_tokens.shape):
        raise ValueError(
            f"corrupted_tokens {tuple(corrupted_tokens.shape)} and the clean run "
            f"{tuple(clean.shape[1:3])} differ in shape."
        )
    prefix, resid = f"blocks.{layer}.mlp.", f"blocks.{layer}.hook_resid_pre"
    with torch.no_grad():  # what expert_components reads: the block's input and its MLP's hooks
        _, corrupted_cache = adapted.run_with_cache(
            corrupted_tokens, names_filter=lambda name: name.startswith(prefix) or name == resid
        )
    corrupted, _ = expert_components(corrupted_cache, layer)
    n_routed = len(moe.expert_list())
    shared = list(shared_experts(moe))

    def index(expert: Expert) -> int:
        return expert if isinstance(expert, int) else n_routed + shared.index(expert)

    def routed(cache: Any, expert: Expert) -> int:
        if not isinstance(expert, int):
            return corrupted_tokens.numel()
        return len(expert_tokens(cached_routing(cache, layer), expert, corrupted_tokens.numel()))

    groups = [list(expert_ids)] if together else [[e] for e in expert_ids]
    rows = []
    for group in groups:
        rows_of = [index(e) for e in group]
        delta = (clean[rows_of] - corrupted[rows_of]).sum(0)  # [batch, pos, d_model]

        def patch(act: torch.Tensor, hook: Any, delta: torch.Tensor = delta) -> torch.Tensor:
            return act + delta.to(act.dtype)

        with torch.no_grad():
            logits = adapted.run_with_hooks(
                corrupted_tokens, fwd_hooks=[(f"blocks.{layer}.hook_mlp_out", patch)]
            )
        one = group[0] if len(group) == 1 else None
        rows.append(
            {
                "layer": layer,
                "expert": "together" if one is None else one,
                "label": "+".join(labels[i] for i in rows_of),
                "metric": float(patching_metric(logits)),
                "routed_clean": None if one is None else routed(clean_cache, one),
                "routed_corrupted": None if one is None else routed(corrupted_cache, one),
            }
        )
    return pd.DataFrame(rows)


__all__ = ["get_act_patch_expert_neuron_heads", "get_act_patch_experts"]
