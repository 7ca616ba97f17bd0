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

* :func:`summarize_expert_neuron_heads`: dataset summaries of a layer's expert neuron-heads
  (the streaming pass of :func:`~tl_attnonly.analysis.summarize_neuron_heads`), each over the
  tokens routed to its expert: routed count, firing fraction, mean self weight and ``z``,
  largest ``z``, top contexts by self weight and by ``|z|``.

Shared experts (Qwen2-MoE, DeepSeek) are dense neuron-head layers at ``blocks.{l}.mlp.{name}``,
not covered here. :func:`~tl_attnonly.analysis.summarize_neuron_heads` (all layers), circuit
discovery and the residual decomposition refuse mixtures of experts before any work, naming the
layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float, Int

from tl_attnonly._types import Metric
from tl_attnonly.adapt import analysis_model, model_of_cache
from tl_attnonly.analysis.summaries.collect import (
    SummaryOptions,
    cached_batches,
    merge_top,
    summary_options,
)
from tl_attnonly.analysis.summaries.results import RANKINGS, TopContexts
from tl_attnonly.components.expert_facts import routed_slots
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
    return routed_slots(top_k_index, expert)[1]


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
    return _scatter(act, routed_tokens(top_k_index, expert), batch, pos, fill)


def _scatter(
    act: Float[torch.Tensor, "routed ..."],
    routed: Int[torch.Tensor, " routed"],
    batch: int,
    pos: int,
    fill: float,
) -> Float[torch.Tensor, "batch pos ..."]:
    """Rows of ``act`` (the expert's routed tokens, in gather order) at their tokens."""
    out = act.new_full((batch * pos, *act.shape[1:]), fill)
    out[routed] = act
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


@dataclass
class ExpertNeuronHeadSummaries:
    """Dataset statistics of a layer's expert neuron-heads, each over the tokens routed to it.

    Row ``i`` of every tensor is expert ``experts[i]``. Statistics count only the (non-padding)
    positions routed to the expert; "fires" is as in :class:`~tl_attnonly.analysis.
    NeuronHeadSummaries`: the head's weight on itself (``hook_pattern[..., 0]``) exceeds 1/2.

    Attributes:
        layer: The mixture-of-experts layer.
        experts: The experts summarised.
        n_neuron_heads, n_heads_per_neuron: Neuron-heads per expert and per neuron.
        before, after: Context tokens kept before and after each top position.
        top: ``top[ranking][i]``: :class:`~tl_attnonly.analysis.TopContexts` of expert
            ``experts[i]`` (``ranking`` in ``("self", "abs_z")``), ranked over its routed tokens
            only; context tokens not routed to the expert have self weight and ``z`` NaN.
        routed_count: ``[n_experts]`` positions routed to each expert.
        fire_count: ``[n_experts, n_neuron_heads]`` routed positions where the head fires.
        self_sum: ``[n_experts, n_neuron_heads]`` sum of the self weight over routed positions.
        z_sum: ``[n_experts, n_neuron_heads]`` sum of ``z`` over routed positions.
        z_max: ``[n_experts, n_neuron_heads]`` largest ``z`` (``-inf``: never routed).
        n_positions: Positions seen (routed or not).
        n_rows: Token rows seen.
    """

    layer: int
    experts: list[int]
    n_neuron_heads: int
    n_heads_per_neuron: int
    before: int
    after: int
    n_positions: int
    n_rows: int
    routed_count: torch.Tensor
    fire_count: torch.Tensor
    self_sum: torch.Tensor
    z_sum: torch.Tensor
    z_max: torch.Tensor
    top: dict[str, list[TopContexts]]
    meta: dict = field(default_factory=dict)

    def _per_routed(self, sums: torch.Tensor) -> Float[torch.Tensor, "n_experts n_neuron_heads"]:
        """``sums / routed_count`` (NaN for an expert no token was routed to)."""
        routed = self.routed_count.double()[:, None]
        return (sums.double() / routed.clamp(min=1)).masked_fill(routed == 0, float("nan"))

    def firing_fraction(self) -> Float[torch.Tensor, "n_experts n_neuron_heads"]:
        """Share of the tokens routed to each expert where its neuron-head fires."""
        return self._per_routed(self.fire_count)

    def mean_self(self) -> Float[torch.Tensor, "n_experts n_neuron_heads"]:
        """Mean self weight over the routed tokens."""
        return self._per_routed(self.self_sum)

    def mean_z(self) -> Float[torch.Tensor, "n_experts n_neuron_heads"]:
        """Mean ``z`` over the routed tokens."""
        return self._per_routed(self.z_sum)

    def table(self) -> pd.DataFrame:
        """One row per ``(expert, head)``: ``layer, expert, head, label`` (``L{l}E{e}N{n}``),
        ``routed`` (tokens routed to the expert), ``firing_fraction``, ``mean_self``,
        ``mean_z``, ``max_z``, ``max_self`` and ``max_abs_z`` (the best top context's value)."""
        H, K = self.n_neuron_heads, self.n_heads_per_neuron
        stats = {
            "firing_fraction": self.firing_fraction(),
            "mean_self": self.mean_self(),
            "mean_z": self.mean_z(),
            "max_z": self.z_max.double(),
            "max_self": torch.stack([t.values[:, 0] for t in self.top["self"]]).double(),
            "max_abs_z": torch.stack([t.values[:, 0] for t in self.top["abs_z"]]).double(),
        }
        rows = [
            {
                "layer": self.layer,
                "expert": expert,
                "head": head,
                "label": expert_neuron_head_label(self.layer, expert, head, K),
                "routed": int(self.routed_count[i]),
                **{name: float(value[i, head]) for name, value in stats.items()},
            }
            for i, expert in enumerate(self.experts)
            for head in range(H)
        ]
        return pd.DataFrame(rows)


def summarize_expert_neuron_heads(
    model: ModelLike,
    corpus: Iterable[str | torch.Tensor] | None = None,
    *,
    layer: int,
    experts: Sequence[int] | None = None,
    options: SummaryOptions | None = None,
    **overrides: Any,
) -> ExpertNeuronHeadSummaries:
    """Stream ``corpus`` through ``model`` and summarise the expert neuron-heads of ``layer``.

    The streaming pass of :func:`~tl_attnonly.analysis.summarize_neuron_heads` (same corpus
    handling, batching and padding), caching each expert's ``hook_pattern`` and ``hook_z`` and the
    router's ``blocks.{layer}.mlp.hook_expert_indices``; each expert's values are mapped to the
    tokens routed to it (:func:`routed_tokens`) and every statistic is taken over those tokens.

    Args:
        model: A converted model with mixtures of experts (either kind).
        corpus: Strings and/or int token tensors, as for ``summarize_neuron_heads``.
        layer: The MoE layer.
        experts: The routed experts to summarise (default: all).
        options: A :class:`~tl_attnonly.analysis.SummaryOptions`; its ``k``, ``before``,
            ``after``, ``max_len``, ``batch_size``, ``max_rows``, ``max_bytes`` and ``progress``
            apply (each also by keyword). Per-token statistics are not recorded for experts.

    Returns:
        :class:`ExpertNeuronHeadSummaries` (:meth:`~ExpertNeuronHeadSummaries.table` for a
        table).

    Raises:
        ValueError: For a layer that is not a mixture of experts or an unknown expert.
        NotImplementedError: For ``token_stats=True`` (not recorded for experts).
        MemoryError: When the top contexts would need more than ``max_bytes``.
    """
    opts = summary_options("summarize_expert_neuron_heads", options, overrides)
    if overrides.get("token_stats"):
        raise NotImplementedError(
            "summarize_expert_neuron_heads does not record per-token statistics "
            "(token_stats=True); supported: token_stats=False (the default here)."
        )
    adapted = analysis_model(model, allow_experts=True)
    moe = moe_layer(adapted, layer)
    expert_ids = list(range(len(moe.expert_list()))) if experts is None else list(experts)
    for expert in expert_ids:
        _check_expert(moe, layer, expert)
    E, H, k = len(expert_ids), moe.n_neuron_heads, opts.k
    window = opts.before + opts.after + 1
    need = E * H * (k * (2 + 3 * window) * len(RANKINGS) + 4) * 8
    if need > opts.max_bytes:
        raise MemoryError(
            f"The expert summaries need {need / 2**30:.2f} GiB (budget "
            f"{opts.max_bytes / 2**30:.2f} GiB): {E} experts x {H} neuron-heads. Pass fewer "
            "experts, a smaller k, or max_bytes=... to raise the budget."
        )
    routing = routing_hook_name(layer)
    names = {routing} | {
        expert_hook_name(layer, e, kind) for e in expert_ids for kind in ("pattern", "z")
    }
    top = {r: [TopContexts.empty(H, k, window) for _ in expert_ids] for r in RANKINGS}
    routed_count = torch.zeros(E, dtype=torch.long)
    fire = torch.zeros(E, H, dtype=torch.long)
    self_sum = torch.zeros(E, H, dtype=torch.float64)
    z_sum = torch.zeros(E, H, dtype=torch.float64)
    z_max = torch.full((E, H), -torch.inf)
    n_positions = n_rows = 0
    for tokens, lengths, valid, cache in cached_batches(adapted, corpus, names, opts):
        batch, pos = tokens.shape
        top_k_index = cache[routing].cpu()  # [batch * pos, top_k]
        for i, expert in enumerate(expert_ids):
            routed = routed_tokens(top_k_index, expert)
            pattern = cache[expert_hook_name(layer, expert, "pattern")]  # [1, H, routed, 2]
            z_routed = cache[expert_hook_name(layer, expert, "z")]  # [1, routed, H, 1]
            nan = float("nan")
            self_w = _scatter(pattern[0, ..., 0].T.float().cpu(), routed, batch, pos, nan)
            z = _scatter(z_routed[0, ..., 0].float().cpu(), routed, batch, pos, nan)
            here = valid[..., None] & ~self_w.isnan()  # [batch, pos, H]: routed, not padding
            routed_count[i] += int(here[..., 0].sum())
            fire[i] += (here & (self_w > 0.5)).sum((0, 1))
            self_sum[i] += self_w.masked_fill(~here, 0.0).double().sum((0, 1))
            z_sum[i] += z.masked_fill(~here, 0.0).double().sum((0, 1))
            z_max[i] = torch.maximum(z_max[i], z.masked_fill(~here, -torch.inf).amax((0, 1)))
            for ranking, values in (("self", self_w), ("abs_z", z.abs())):
                top[ranking][i] = merge_top(
                    top[ranking][i],
                    values.masked_fill(~here, -torch.inf),
                    tokens,
                    self_w,
                    z,
                    lengths,
                    n_rows,
                    opts.before,
                    opts.after,
                )
        n_positions += int(valid.sum())
        n_rows += tokens.shape[0]
    return ExpertNeuronHeadSummaries(
        layer, expert_ids, H, moe.n_heads_per_neuron, opts.before, opts.after,
        n_positions, n_rows, routed_count, fire, self_sum, z_sum, z_max, top,
        meta={"k": k, "max_len": opts.max_len or adapted.cfg.n_ctx},
    )  # fmt: skip


__all__ = [
    "ROUTING_HOOK",
    "ExpertNeuronHeadSummaries",
    "expert_activation",
    "expert_hook_name",
    "expert_neuron_head_label",
    "get_act_patch_expert_neuron_heads",
    "moe_layer",
    "routed_tokens",
    "routing_hook_name",
    "summarize_expert_neuron_heads",
]
