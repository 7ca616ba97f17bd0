"""Expert neuron-heads in token space: caches, activation patching and summaries (both kinds).

A mixture-of-experts layer (:class:`~tl_attnonly.components.NeuronHeadMoE` on an
:class:`~tl_attnonly.AttnOnlyTransformer`, :class:`~tl_attnonly.bridge.experts.
BridgeNeuronHeadExperts` on a converted bridge) hooks each routed expert's neuron-heads at
``blocks.{l}.mlp.experts.{e}.hook_*`` over the tokens routed to that expert only: position ``i``
of ``hook_z`` (``[1, n_routed, n_neuron_heads, 1]``) is the ``i``-th routed token in the experts'
gather order (by top-k slot, then by token of the flattened ``[batch * pos]``). The router's
top-k indices (``blocks.{l}.mlp.hook_expert_indices``, ``[batch * pos, top_k]``: TransformerLens's
hook on both kinds, mounted by the conversion on a TL 3.9 bridge) give that order back:
:func:`routed_tokens`.

A bridge's MoE block may also have a *shared* expert (Qwen2-MoE's ``shared_expert``, whose output
the block scales by its sigmoid ``shared_expert_gate``; DeepSeek's ``shared_experts``): a dense
neuron-head layer that runs on every token, hooked at ``blocks.{l}.mlp.{name}.hook_*`` (Qwen2-MoE
flattens the tokens first: ``hook_z`` ``[1, batch * pos, n_neuron_heads, 1]``; DeepSeek does not:
``[batch, pos, n_neuron_heads, 1]``). Every tool here takes it as ``expert``: by its name, as the
converted block holds it (:func:`shared_experts`), or as :data:`SHARED` (``"shared"``: the block's
only shared expert). Its values are at every token; its ``z`` is before the block's shared gate.
An :class:`~tl_attnonly.AttnOnlyTransformer`'s MoE (TransformerLens's) has no shared expert.

* :func:`expert_activation`: an expert's neuron-head activation from a ``run_with_cache`` cache,
  in ``[batch, pos, n_neuron_heads]``; tokens not routed to a routed expert are NaN (``fill``),
  so that a mean over them is not silently diluted by zeros.
* :func:`get_act_patch_expert_neuron_heads`: clean into corrupted activation patching of expert
  neuron-heads' ``z``, at the tokens routed to the expert in both runs (a shared expert: every
  token); tokens routed in only one run are counted in the result and left unpatched.
* :func:`summarize_expert_neuron_heads`: dataset summaries of a layer's expert neuron-heads
  (the streaming pass of :func:`~tl_attnonly.analysis.summarize_neuron_heads`), each over the
  tokens routed to its expert (a shared expert: every token): routed count, firing fraction,
  mean self weight and ``z``, largest ``z``, top contexts by self weight and by ``|z|``;
  ranked, labelled, saved and loaded as :class:`~tl_attnonly.analysis.NeuronHeadSummaries` are.

:func:`~tl_attnonly.analysis.summarize_neuron_heads` (all layers), circuit discovery and the
residual decomposition refuse mixtures of experts before any work, naming the layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
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
from tl_attnonly.analysis.summaries.results import (
    RANKINGS,
    TopContexts,
    rank_heads,
    read_summaries,
    read_top,
    top_tensors,
    write_summaries,
)
from tl_attnonly.components.expert_facts import routed_slots
from tl_attnonly.protocol import AttnOnlyModel, ModelLike

#: The router's top-k expert indices under ``blocks.{l}.mlp``: ``[batch * pos, top_k]``.
ROUTING_HOOK = "hook_expert_indices"

#: What the ``expert`` arguments accept for a block's only shared expert.
SHARED = "shared"

#: An expert: a routed expert's index, or a shared expert's name (or :data:`SHARED`).
Expert = int | str

#: Hooks with the tokens first (``[tokens, d_mlp]``; a shared expert's may be ``[batch, pos,
#: d_mlp]``): a routed expert's (TransformerLens's MoE names: ``gate`` g, ``pre`` the linear
#: branch u) and a shared expert's (a dense layer's: ``pre`` the (gate) pre-activation,
#: ``pre_linear`` the linear branch of a gated one).
_TOKEN_FIRST = {"routed": ("gate", "pre", "post"), "shared": ("pre", "pre_linear", "post")}
#: Neuron-head hooks ``[1, routed, n_neuron_heads, d]`` (a shared expert's: every token).
_BATCHED = ("q", "k", "v", "z", "result")

#: The files :meth:`ExpertNeuronHeadSummaries.save` writes (tensors, meta).
EXPERT_SUMMARY_FILES = ("expert_summaries.safetensors", "expert_summaries.json")


def routing_hook_name(layer: int) -> str:
    """``blocks.{layer}.mlp.hook_expert_indices``."""
    return f"blocks.{layer}.mlp.{ROUTING_HOOK}"


def expert_hook_name(layer: int, expert: Expert, kind: str) -> str:
    """``blocks.{layer}.mlp.experts.{expert}.hook_{kind}`` (a routed expert) or
    ``blocks.{layer}.mlp.{expert}.hook_{kind}`` (a shared expert, by its name)."""
    where = f"experts.{expert}" if isinstance(expert, int) else expert
    return f"blocks.{layer}.mlp.{where}.hook_{kind}"


def expert_neuron_head_label(layer: int, expert: Expert, head: int, n_heads_per_neuron: int) -> str:
    """Label of an expert's neuron-head: ``L1E3N17`` (routed expert 3), ``L1SN17`` (the block's
    shared expert), ``L1E3N17.2`` with several heads per neuron."""
    neuron, k = divmod(head, n_heads_per_neuron)
    suffix = "" if n_heads_per_neuron == 1 else f".{k}"
    tag = f"E{expert}" if isinstance(expert, int) else "S"
    return f"L{layer}{tag}N{neuron}{suffix}"


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


def shared_experts(moe: Any) -> dict[str, Any]:
    """A mixture of experts' shared experts' neuron-head layers, by the name the converted block
    holds them under (``blocks.{l}.mlp.{name}``): a bridge's ``BridgeNeuronHeadExperts.shared``
    (Qwen2-MoE ``shared_expert``, DeepSeek ``shared_experts``); none for TransformerLens's MoE."""
    return dict(getattr(moe, "shared", None) or {})


def resolve_expert(moe: Any, layer: int, expert: Expert) -> Expert:
    """``expert`` as the tools key it: a routed expert's index, or a shared expert's name
    (:data:`SHARED` resolved to the block's only one).

    Raises:
        ValueError: For an index out of range or a name the block has no shared expert under,
            naming the routed and shared experts it has.
    """
    n_routed = len(moe.expert_list())
    shared = shared_experts(moe)
    if isinstance(expert, str):
        if expert in shared:
            return expert
        if expert == SHARED and len(shared) == 1:
            return next(iter(shared))
    elif 0 <= expert < n_routed:
        return int(expert)
    names = ", ".join(repr(name) for name in shared)
    has_shared = (
        "no shared expert"
        if not shared
        else f"the shared expert {names} (also {SHARED!r})"
        if len(shared) == 1
        else f"the shared experts {names} (name one)"
    )
    raise ValueError(
        f"blocks.{layer}.mlp has {n_routed} experts (0 to {n_routed - 1}) and {has_shared}; got "
        f"expert {expert!r}."
    )


def _resolve_all(moe: Any, layer: int, experts: Sequence[Expert] | None) -> list[Expert]:
    """``experts`` resolved; ``None``: the routed experts, then the shared ones."""
    if experts is None:
        return [*range(len(moe.expert_list())), *shared_experts(moe)]
    return [resolve_expert(moe, layer, expert) for expert in experts]


def _expert_layer(moe: Any, expert: Expert) -> Any:
    """The neuron-head layer of a resolved expert."""
    return moe.expert_list()[expert] if isinstance(expert, int) else shared_experts(moe)[expert]


def _routing(cache: Any, layer: int) -> Int[torch.Tensor, "tokens top_k"]:
    name = routing_hook_name(layer)
    if name not in cache.cache_dict:
        raise KeyError(
            f"The cache has no {name} (the router's top-k indices): cache it too "
            "(run_with_cache without a names_filter, or one that keeps it)."
        )
    return cache[name]


def _expert_tokens(
    top_k_index: Int[torch.Tensor, "tokens top_k"] | None, expert: Expert, n_tokens: int
) -> Int[torch.Tensor, " rows"]:
    """The flattened tokens an expert's hook rows are: the routed tokens in gather order, or
    every token (a shared expert; ``top_k_index`` is then not read)."""
    if isinstance(expert, int):
        assert top_k_index is not None
        return routed_tokens(top_k_index, expert)
    return torch.arange(n_tokens)


def _hook_rows(act: torch.Tensor, kind: str) -> torch.Tensor:
    """An expert hook's value with one row per token it saw, in the order it saw them:
    ``pattern`` gives the self weight ``[rows, n_neuron_heads]``; ``q, k, v, z``
    ``[rows, n_neuron_heads]``; ``result`` ``[rows, n_neuron_heads, d_model]``; the others
    ``[rows, d_mlp]``. A routed expert's leading 1 and a shared expert's ``[batch, pos]`` (or
    flattened tokens) are both flattened."""
    if kind == "pattern":  # [lead, n_neuron_heads, query_pos, 2]: self weight per query
        return act[..., 0].transpose(-1, -2).reshape(-1, act.shape[1])
    if kind in _BATCHED:  # [lead, pos, n_neuron_heads, d_head or d_model]
        rows = act.reshape(-1, *act.shape[-2:])
        return rows if kind == "result" else rows.squeeze(-1)
    return act.reshape(-1, act.shape[-1])  # [tokens, d_mlp]


def expert_activation(
    cache: Any,
    layer: int,
    expert: Expert,
    kind: str = "z",
    *,
    fill: float = float("nan"),
) -> Float[torch.Tensor, "batch pos ..."]:
    """An expert's activation from a ``run_with_cache`` cache, in token space.

    Args:
        cache: The ``ActivationCache`` of a converted model with mixtures of experts (both
            kinds); it must hold the expert's hook (and, for a routed expert,
            ``blocks.{l}.mlp.hook_expert_indices``).
        layer: The MoE layer.
        expert: A routed expert's index, or a shared expert's name (``"shared_expert"``,
            ``"shared_experts"``) or ``"shared"`` (the block's only shared expert).
        kind: ``z``, ``v``, ``q``, ``k`` (``[batch, pos, n_neuron_heads]``), ``result``
            (``[batch, pos, n_neuron_heads, d_model]``), or ``[batch, pos, d_mlp]``: for a routed
            expert ``gate``, ``pre`` (the linear branch), ``post`` (TransformerLens's MoE
            names); for a shared expert its own hooks' names ``pre`` (the gate's
            pre-activation), ``pre_linear`` (the linear branch, gated layers), ``post``.
        fill: The value at tokens not routed to a routed expert (NaN by default: the expert did
            not run there; use 0.0 for its contribution before the routing weight). A shared
            expert runs on every token.

    Returns:
        The activation at every ``(batch, pos)``; ``fill`` where the token is not routed to
        ``expert``.

    Raises:
        ValueError: For a layer that is not a mixture of experts, an unknown expert or kind.
        KeyError: If the cache lacks the expert's hook or the routing hook.
    """
    model = model_of_cache(cache, allow_experts=True)
    expert = resolve_expert(moe_layer(model, layer), layer, expert)
    group = "routed" if isinstance(expert, int) else "shared"
    kinds = (*_TOKEN_FIRST[group], *_BATCHED)
    if kind not in kinds:
        raise ValueError(
            f"kind={kind!r} is not supported for a {group} expert; supported: {sorted(kinds)} "
            "(a pattern has no token axis of its own: read hook_pattern's rows with "
            "routed_tokens)."
        )
    batch, pos = cache["hook_embed"].shape[:2]
    top_k_index = None
    if isinstance(expert, int):
        top_k_index = _routing(cache, layer)
        if batch * pos != top_k_index.shape[0]:
            raise ValueError(
                f"{routing_hook_name(layer)} has {top_k_index.shape[0]} tokens, hook_embed "
                f"{batch} x {pos}."
            )
    act = _hook_rows(cache[expert_hook_name(layer, expert, kind)], kind)
    rows = _expert_tokens(top_k_index, expert, batch * pos).to(act.device)
    if len(rows) != act.shape[0]:
        raise ValueError(
            f"{expert_hook_name(layer, expert, kind)} has {act.shape[0]} token rows; expected "
            f"{len(rows)} (hook_embed {batch} x {pos})."
        )
    return _scatter(act, rows, batch, pos, fill)


def _scatter(
    act: Float[torch.Tensor, "rows ..."],
    rows: Int[torch.Tensor, " rows"],
    batch: int,
    pos: int,
    fill: float,
) -> Float[torch.Tensor, "batch pos ..."]:
    """Rows of ``act`` (an expert's hook rows, in its order) at their tokens ``rows``."""
    out = act.new_full((batch * pos, *act.shape[1:]), fill)
    out[rows] = act
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
    clean_z: Float[torch.Tensor, "lead rows_clean n_neuron_heads 1"],
    i_clean: Int[torch.Tensor, " both"],
    i_corrupted: Int[torch.Tensor, " both"],
    head: int,
) -> Any:
    """A hook that writes ``clean_z``'s ``head`` at rows ``i_clean`` into rows ``i_corrupted``
    of an expert's ``hook_z`` (rows as :func:`_hook_rows` counts them)."""
    clean = _hook_rows(clean_z, "z")  # [rows (clean), n_neuron_heads]

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
    expert_ids = _resolve_all(moe, layer, experts)
    head_ids = {}
    for expert in expert_ids:
        n_heads = _expert_layer(moe, expert).n_neuron_heads
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
        clean_routing = _routing(clean_cache, layer)
        n_clean = clean_routing.shape[0]
    else:
        clean_z = clean_cache[expert_hook_name(layer, expert_ids[0], "z")]
        n_clean = _hook_rows(clean_z, "z").shape[0]
    if n_tokens != n_clean:
        raise ValueError(
            f"corrupted_tokens {tuple(corrupted_tokens.shape)} and the clean run "
            f"({n_clean} tokens) differ in shape."
        )
    if routed:
        routing_name = routing_hook_name(layer)
        with torch.no_grad():
            _, corrupted_cache = adapted.run_with_cache(
                corrupted_tokens, names_filter=lambda name: name == routing_name
            )
        corrupted_routing = corrupted_cache[routing_name]
    rows = []
    for expert in expert_ids:
        clean = _expert_tokens(clean_routing, expert, n_tokens)
        corrupted = _expert_tokens(corrupted_routing, expert, n_tokens)
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


#: What :meth:`ExpertNeuronHeadSummaries.save` writes to JSON, and its per-expert tensors.
_SAVED_FACTS = (
    "layer", "experts", "n_neuron_heads", "n_heads_per_neuron", "before", "after",
    "n_positions", "n_rows", "meta",
)  # fmt: skip
_PER_HEAD = ("fire_count", "self_sum", "z_sum", "z_max")


@dataclass
class ExpertNeuronHeadSummaries:
    """Dataset statistics of a layer's expert neuron-heads, each over the tokens routed to it.

    Row group ``i`` is expert ``experts[i]``: a routed expert (its index), or a shared expert
    (its name), whose statistics count every token. Statistics count only the (non-padding)
    positions routed to the expert; "fires" is as in :class:`~tl_attnonly.analysis.
    NeuronHeadSummaries`: the head's weight on itself (``hook_pattern[..., 0]``) exceeds 1/2.
    Methods take an expert as the tools do (index, shared name or ``"shared"``).

    Attributes:
        layer: The mixture-of-experts layer.
        experts: The experts summarised (routed indices, shared names).
        n_neuron_heads: Neuron-heads of each expert (a shared expert may have more).
        n_heads_per_neuron: Heads per neuron.
        before, after: Context tokens kept before and after each top position.
        top: ``top[ranking][i]``: :class:`~tl_attnonly.analysis.TopContexts` of expert
            ``experts[i]`` (``ranking`` in ``("self", "abs_z")``), ranked over its routed tokens
            only; context tokens not routed to the expert have self weight and ``z`` NaN.
        routed_count: ``[n_experts]`` positions routed to each expert (a shared expert: all).
        fire_count: ``fire_count[i]``: ``[n_neuron_heads[i]]`` routed positions where the head
            fires.
        self_sum: ``[n_neuron_heads[i]]`` each: sum of the self weight over routed positions.
        z_sum: ``[n_neuron_heads[i]]`` each: sum of ``z`` over routed positions.
        z_max: ``[n_neuron_heads[i]]`` each: largest ``z`` (``-inf``: never routed).
        n_positions: Positions seen (routed or not).
        n_rows: Token rows seen.
    """

    layer: int
    experts: list[Expert]
    n_neuron_heads: list[int]
    n_heads_per_neuron: int
    before: int
    after: int
    n_positions: int
    n_rows: int
    routed_count: torch.Tensor
    fire_count: list[torch.Tensor]
    self_sum: list[torch.Tensor]
    z_sum: list[torch.Tensor]
    z_max: list[torch.Tensor]
    top: dict[str, list[TopContexts]]
    meta: dict = field(default_factory=dict)

    def index(self, expert: Expert) -> int:
        """The row group of ``expert`` (an index, a shared expert's name or ``"shared"``)."""
        if expert in self.experts:
            return self.experts.index(expert)
        shared = [e for e in self.experts if isinstance(e, str)]
        if expert == SHARED and len(shared) == 1:
            return self.experts.index(shared[0])
        raise ValueError(f"Expert {expert!r} is not summarised here; summarised: {self.experts}.")

    def label(self, expert: Expert, head: int) -> str:
        """``L{l}E{e}N{n}`` (a shared expert: ``L{l}SN{n}``)."""
        key = self.experts[self.index(expert)]
        return expert_neuron_head_label(self.layer, key, head, self.n_heads_per_neuron)

    def _per_routed(self, sums: list[torch.Tensor], expert: Expert) -> torch.Tensor:
        """``sums / routed_count`` of ``expert`` (NaN where no token was routed to it)."""
        i = self.index(expert)
        routed = int(self.routed_count[i])
        return sums[i].double() / routed if routed else torch.full_like(sums[i].double(), torch.nan)

    def firing_fraction(self, expert: Expert) -> Float[torch.Tensor, " n_neuron_heads"]:
        """Share of the tokens routed to ``expert`` where its neuron-head fires."""
        return self._per_routed(self.fire_count, expert)

    def mean_self(self, expert: Expert) -> Float[torch.Tensor, " n_neuron_heads"]:
        """Mean self weight over the tokens routed to ``expert``."""
        return self._per_routed(self.self_sum, expert)

    def mean_z(self, expert: Expert) -> Float[torch.Tensor, " n_neuron_heads"]:
        """Mean ``z`` over the tokens routed to ``expert``."""
        return self._per_routed(self.z_sum, expert)

    def rank(
        self,
        expert: Expert,
        by: str = "firing_fraction",
        top: int | None = None,
        level: str = "neuron",
    ) -> list[int]:
        """Neuron-heads of ``expert`` ranked by a dataset statistic (largest first), as
        :meth:`~tl_attnonly.analysis.NeuronHeadSummaries.rank` ranks a layer's.

        Args:
            expert: A routed expert's index, a shared expert's name or ``"shared"``.
            by: ``"firing_fraction"``, ``"max_self"`` (best top context by weight on self) or
                ``"max_abs_z"`` (best top context by |z|); ``"selectivity"`` needs per-token
                statistics, which are not recorded for experts. An expert no token was routed
                to ranks its heads in index order.
            top: How many neurons (``level="head"``: heads); default all.
            level: ``"neuron"`` (default): neurons by the largest statistic of their heads,
                each with all its heads; ``"head"``: heads one by one.

        Returns:
            Head indices of the expert.
        """
        i = self.index(expert)

        def no_selectivity() -> torch.Tensor:
            raise ValueError(
                "by='selectivity' needs per-token statistics, which summarize_expert_neuron_heads "
                "does not record; use 'firing_fraction', 'max_self' or 'max_abs_z'."
            )

        scores = {
            "firing_fraction": lambda: self.firing_fraction(expert),
            "max_self": lambda: self.top["self"][i].values[:, 0],
            "max_abs_z": lambda: self.top["abs_z"][i].values[:, 0],
            "selectivity": no_selectivity,
        }
        return rank_heads(scores, by, self.n_heads_per_neuron, top, level)

    def table(self) -> pd.DataFrame:
        """One row per ``(expert, head)``: ``layer, expert, head, label`` (``L{l}E{e}N{n}``,
        ``L{l}SN{n}``), ``routed`` (tokens routed to the expert), ``firing_fraction``,
        ``mean_self``, ``mean_z``, ``max_z``, ``max_self`` and ``max_abs_z`` (the best top
        context's value)."""
        rows = []
        for i, expert in enumerate(self.experts):
            stats = {
                "firing_fraction": self.firing_fraction(expert),
                "mean_self": self.mean_self(expert),
                "mean_z": self.mean_z(expert),
                "max_z": self.z_max[i].double(),
                "max_self": self.top["self"][i].values[:, 0].double(),
                "max_abs_z": self.top["abs_z"][i].values[:, 0].double(),
            }
            rows += [
                {
                    "layer": self.layer,
                    "expert": expert,
                    "head": head,
                    "label": self.label(expert, head),
                    "routed": int(self.routed_count[i]),
                    **{name: float(value[head]) for name, value in stats.items()},
                }
                for head in range(self.n_neuron_heads[i])
            ]
        return pd.DataFrame(rows)

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | Path) -> Path:
        """Write the summaries to ``directory`` (safetensors + JSON, the files
        :data:`EXPERT_SUMMARY_FILES`); :meth:`load` reads them."""
        tensors = {"routed_count": self.routed_count, **top_tensors(self.top)}
        for name in _PER_HEAD:
            for i, values in enumerate(getattr(self, name)):
                tensors[f"{name}.{i}"] = values
        meta = {name: getattr(self, name) for name in _SAVED_FACTS}
        return write_summaries(directory, tensors, meta, EXPERT_SUMMARY_FILES)

    @classmethod
    def load(cls, directory: str | Path) -> ExpertNeuronHeadSummaries:
        """Read summaries written by :meth:`save`."""
        meta, tensors = read_summaries(
            directory, "ExpertNeuronHeadSummaries.save()", EXPERT_SUMMARY_FILES
        )
        n = len(meta["experts"])
        per_head: dict[str, Any] = {
            name: [tensors[f"{name}.{i}"] for i in range(n)] for name in _PER_HEAD
        }
        return cls(
            **{name: meta[name] for name in _SAVED_FACTS},
            routed_count=tensors["routed_count"],
            **per_head,
            top=read_top(tensors, n),
        )


def summarize_expert_neuron_heads(
    model: ModelLike,
    corpus: Iterable[str | torch.Tensor] | None = None,
    *,
    layer: int,
    experts: Sequence[Expert] | None = None,
    options: SummaryOptions | None = None,
    **overrides: Any,
) -> ExpertNeuronHeadSummaries:
    """Stream ``corpus`` through ``model`` and summarise the expert neuron-heads of ``layer``.

    The streaming pass of :func:`~tl_attnonly.analysis.summarize_neuron_heads` (same corpus
    handling, batching and padding), caching each expert's ``hook_pattern`` and ``hook_z`` and the
    router's ``blocks.{layer}.mlp.hook_expert_indices``; each routed expert's values are mapped to
    the tokens routed to it (:func:`routed_tokens`) and every statistic is taken over those
    tokens. A shared expert's are taken over every (non-padding) token.

    Args:
        model: A converted model with mixtures of experts (either kind).
        corpus: Strings and/or int token tensors, as for ``summarize_neuron_heads``.
        layer: The MoE layer.
        experts: The experts to summarise: routed experts' indices, shared experts' names or
            ``"shared"`` (default: every routed expert, then the shared ones).
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
    expert_ids = _resolve_all(moe, layer, experts)
    heads = [_expert_layer(moe, expert).n_neuron_heads for expert in expert_ids]
    E, k = len(expert_ids), opts.k
    window = opts.before + opts.after + 1
    need = sum(heads) * (k * (2 + 3 * window) * len(RANKINGS) + 4) * 8
    if need > opts.max_bytes:
        raise MemoryError(
            f"The expert summaries need {need / 2**30:.2f} GiB (budget "
            f"{opts.max_bytes / 2**30:.2f} GiB): {E} experts, {sum(heads)} neuron-heads. Pass "
            "fewer experts, a smaller k, or max_bytes=... to raise the budget."
        )
    routed = any(isinstance(expert, int) for expert in expert_ids)
    routing = routing_hook_name(layer)
    names = {routing} if routed else set()
    names |= {expert_hook_name(layer, e, kind) for e in expert_ids for kind in ("pattern", "z")}
    top = {r: [TopContexts.empty(H, k, window) for H in heads] for r in RANKINGS}
    routed_count = torch.zeros(E, dtype=torch.long)
    fire = [torch.zeros(H, dtype=torch.long) for H in heads]
    self_sum = [torch.zeros(H, dtype=torch.float64) for H in heads]
    z_sum = [torch.zeros(H, dtype=torch.float64) for H in heads]
    z_max = [torch.full((H,), -torch.inf) for H in heads]
    n_positions = n_rows = 0
    nan = float("nan")
    for tokens, lengths, valid, cache in cached_batches(adapted, corpus, names, opts):
        batch, pos = tokens.shape
        top_k_index = cache[routing].cpu() if routed else None  # [batch * pos, top_k]
        for i, expert in enumerate(expert_ids):
            rows = _expert_tokens(top_k_index, expert, batch * pos)
            pattern = _hook_rows(cache[expert_hook_name(layer, expert, "pattern")], "pattern")
            z_rows = _hook_rows(cache[expert_hook_name(layer, expert, "z")], "z")  # [rows, H]
            self_w = _scatter(pattern.float().cpu(), rows, batch, pos, nan)  # [batch, pos, H]
            z = _scatter(z_rows.float().cpu(), rows, batch, pos, nan)
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
        layer, expert_ids, heads, moe.n_heads_per_neuron, opts.before, opts.after,
        n_positions, n_rows, routed_count, fire, self_sum, z_sum, z_max, top,
        meta={"k": k, "max_len": opts.max_len or adapted.cfg.n_ctx},
    )  # fmt: skip


__all__ = [
    "EXPERT_SUMMARY_FILES",
    "ROUTING_HOOK",
    "SHARED",
    "Expert",
    "ExpertNeuronHeadSummaries",
    "expert_activation",
    "expert_hook_name",
    "expert_neuron_head_label",
    "get_act_patch_expert_neuron_heads",
    "moe_layer",
    "resolve_expert",
    "routed_tokens",
    "routing_hook_name",
    "shared_experts",
    "summarize_expert_neuron_heads",
]
