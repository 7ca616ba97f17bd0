"""Dataset summaries of a layer's expert neuron-heads, each over the tokens routed to its expert.

:func:`summarize_expert_neuron_heads` is the streaming pass of
:func:`~tl_attnonly.analysis.summarize_neuron_heads` over a mixture-of-experts layer (a shared
expert: every token): routed count, firing fraction, mean self weight and ``z``, largest ``z``,
top contexts by self weight and by ``|z|``; :class:`ExpertNeuronHeadSummaries` ranks, labels,
saves and loads them as :class:`~tl_attnonly.analysis.NeuronHeadSummaries` does. The experts and
their token space: :mod:`tl_attnonly.analysis.experts`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float

from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.experts.routing import (
    SHARED,
    Expert,
    expert_hook_name,
    expert_layer,
    expert_neuron_head_label,
    expert_tokens,
    hook_rows,
    moe_layer,
    resolve_experts,
    routing_hook_name,
    scatter_rows,
)
from tl_attnonly.analysis.summaries.collect import (
    SummaryOptions,
    add_heads,
    cached_batches,
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
from tl_attnonly.protocol import ModelLike

#: The files :meth:`ExpertNeuronHeadSummaries.save` writes (tensors, meta).
EXPERT_SUMMARY_FILES = ("expert_summaries.safetensors", "expert_summaries.json")


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
    the tokens routed to it (:func:`~tl_attnonly.analysis.experts.routed_tokens`) and every
    statistic is taken over those tokens. A shared expert's are taken over every (non-padding)
    token.

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
            "(token_stats=True); supported: token_stats=False (the default here), or "
            "summarize_neuron_heads, which records them for every expert head."
        )
    adapted = analysis_model(model, allow_experts=True)
    moe = moe_layer(adapted, layer)
    expert_ids = resolve_experts(moe, layer, experts)
    heads = [expert_layer(moe, expert).n_neuron_heads for expert in expert_ids]
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
    routing = routing_hook_name(layer, adapted)
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
            rows = expert_tokens(top_k_index, expert, batch * pos)
            pattern = hook_rows(cache[expert_hook_name(layer, expert, "pattern")], "pattern")
            z_rows = hook_rows(cache[expert_hook_name(layer, expert, "z")], "z")  # [rows, H]
            self_w = scatter_rows(pattern.float().cpu(), rows, batch, pos, nan)  # [batch, pos, H]
            z = scatter_rows(z_rows.float().cpu(), rows, batch, pos, nan)
            here = valid[..., None] & ~self_w.isnan()  # [batch, pos, H]: routed, not padding
            routed_count[i] += int(here[..., 0].sum())
            self_sum[i] += self_w.masked_fill(~here, 0.0).double().sum((0, 1))
            z_sum[i] += z.masked_fill(~here, 0.0).double().sum((0, 1))
            z_max[i] = torch.maximum(z_max[i], z.masked_fill(~here, -torch.inf).amax((0, 1)))
            add_heads(top, fire, i, self_w, z, here, tokens, lengths, n_rows, opts)
        n_positions += int(valid.sum())
        n_rows += tokens.shape[0]
    return ExpertNeuronHeadSummaries(
        layer, expert_ids, heads, moe.n_heads_per_neuron, opts.before, opts.after,
        n_positions, n_rows, routed_count, fire, self_sum, z_sum, z_max, top,
        meta={"k": k, "max_len": opts.max_len or adapted.cfg.n_ctx},
    )  # fmt: skip


__all__ = [
    "EXPERT_SUMMARY_FILES",
    "ExpertNeuronHeadSummaries",
    "summarize_expert_neuron_heads",
]
