""":class:`NeuronHeadSummaries`: what :func:`~tl_attnonly.analysis.summarize_neuron_heads` keeps.

Top contexts per ranking (:class:`TopContexts`), firing fractions and per-token statistics; saved
to and loaded from a directory (safetensors + JSON); heads ranked by dataset statistics.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float

from tl_attnonly.hooks import neuron_head_label

#: Rankings kept per neuron-head: by weight on self, and by |z|.
RANKINGS = ("self", "abs_z")


SUMMARY_FILE = "summaries.safetensors"


META_FILE = "summaries.json"


@dataclass
class TopContexts:
    """The top-``k`` contexts of every head for one ranking of one layer.

    Attributes:
        values: ``[n, k]`` the ranked value at the context's centre, descending (``-inf``: empty).
        tokens: ``[n, k, window]`` token ids around the centre (``-1`` outside the document).
        self_weight: ``[n, k, window]`` the head's weight on itself at every context token.
        z: ``[n, k, window]`` the head's ``z`` at every context token.
        document: ``[n, k]`` index of the token row (in streaming order); ``position``: ``[n, k]``.
    """

    values: torch.Tensor
    tokens: torch.Tensor
    self_weight: torch.Tensor
    z: torch.Tensor
    document: torch.Tensor
    position: torch.Tensor

    @classmethod
    def empty(cls, n: int, k: int, window: int) -> TopContexts:
        return cls(
            torch.full((n, k), -torch.inf),
            torch.full((n, k, window), -1, dtype=torch.long),
            torch.zeros(n, k, window),
            torch.zeros(n, k, window),
            torch.full((n, k), -1, dtype=torch.long),
            torch.full((n, k), -1, dtype=torch.long),
        )


#: The tensors of a :class:`TopContexts`, in its field order (the saved names).
_TOP_FIELDS = ("values", "tokens", "self_weight", "z", "document", "position")


def rank_heads(
    scores: Mapping[str, Callable[[], torch.Tensor]],
    by: str,
    n_heads_per_neuron: int,
    top: int | None,
    level: str,
) -> list[int]:
    """Neuron-heads of one group (a layer, an expert) ranked by a statistic, largest first.

    The ranking of :meth:`NeuronHeadSummaries.rank` and :meth:`~tl_attnonly.analysis.
    ExpertNeuronHeadSummaries.rank`. A NaN score (no position counted) ranks last.

    Args:
        scores: The statistics ``by`` may name, each a function giving ``[n_neuron_heads]``.
        by: The statistic.
        n_heads_per_neuron: ``K``: a neuron's heads are ``n * K`` to ``n * K + K - 1``.
        top: How many neurons (``level="head"``: heads); ``None``: all.
        level: ``"neuron"``: neurons by the largest score of their heads, each listed with all
            its heads (consecutively); ``"head"``: heads one by one. The same for ``K = 1``.

    Raises:
        ValueError: For an unknown ``level`` or ``by``.
    """
    if level not in ("neuron", "head"):
        raise ValueError(f"level must be 'neuron' or 'head', got {level!r}.")
    if by not in scores:
        names = [repr(name) for name in scores]
        raise ValueError(f"by must be {', '.join(names[:-1])} or {names[-1]}, got {by!r}.")
    score = scores[by]().double().nan_to_num(nan=-torch.inf)
    K = n_heads_per_neuron
    if level == "neuron" and K > 1:
        neurons = score.reshape(-1, K).amax(-1).argsort(descending=True, stable=True)
        chosen = neurons[: top or len(neurons)].tolist()
        return [n * K + k for n in chosen for k in range(K)]
    order = score.argsort(descending=True)
    return order[: top or len(order)].tolist()


def top_tensors(top: Mapping[str, list[TopContexts]]) -> dict[str, torch.Tensor]:
    """The tensors of ``top[ranking][group]`` under ``top.{ranking}.{group}.{field}``."""
    return {
        f"top.{ranking}.{group}.{name}": getattr(contexts, name)
        for ranking, groups in top.items()
        for group, contexts in enumerate(groups)
        for name in _TOP_FIELDS
    }


def read_top(tensors: Mapping[str, torch.Tensor], n_groups: int) -> dict[str, list[TopContexts]]:
    """``top[ranking][group]`` back from :func:`top_tensors`' tensors (every ranking)."""
    return {
        ranking: [
            TopContexts(*(tensors[f"top.{ranking}.{group}.{name}"] for name in _TOP_FIELDS))
            for group in range(n_groups)
        ]
        for ranking in RANKINGS
    }


def write_summaries(
    directory: str | Path,
    tensors: Mapping[str, torch.Tensor],
    meta: dict[str, Any],
    files: tuple[str, str] = (SUMMARY_FILE, META_FILE),
) -> Path:
    """Write ``tensors`` (safetensors) and ``meta`` (JSON) to ``directory`` under ``files``
    (tensors, meta); :func:`read_summaries` reads them."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensor_file, meta_file = files
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / tensor_file))
    (directory / meta_file).write_text(json.dumps(meta, indent=2))
    return directory


def read_summaries(
    directory: str | Path, writer: str, files: tuple[str, str] = (SUMMARY_FILE, META_FILE)
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(meta, tensors)`` written by :func:`write_summaries`.

    Raises:
        FileNotFoundError: If ``directory`` has no meta file (naming ``writer``, the ``save``
            that writes one).
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    tensor_file, meta_file = files
    if not (directory / meta_file).is_file():
        raise FileNotFoundError(
            f"No {meta_file} in {directory}: expected a directory written by {writer}."
        )
    meta = json.loads((directory / meta_file).read_text())
    return meta, load_file(str(directory / tensor_file))


#: A layer's head groups: ``(None, n)`` a dense layer's ``n`` neuron-heads; ``(expert, n)`` an
#: expert's (a routed expert's index, a shared expert's name), in the layer's order.
HeadGroups = list[tuple[int | str | None, int]]


@dataclass
class NeuronHeadSummaries:
    """Dataset statistics of every neuron-head of a model (see the module docstring).

    A mixture-of-experts layer's neuron-heads are its experts' end to end (routed experts in index
    order, then the shared ones), numbered and labelled as :func:`~tl_attnonly.analysis.
    get_act_patch_neuron_heads` numbers them (``L1E3N17``, ``L1SN17``); an expert head is counted
    over the tokens routed to its expert only (:attr:`groups`). Per-head tensors are as wide as
    the widest layer; past a layer's width they hold 0 (ratios: NaN), and ``top[r][layer]`` has
    the layer's own width.

    Attributes:
        n_layers, d_mlp, n_heads_per_neuron, d_vocab: The model's shape (``d_mlp``: the widest
            layer's neurons, experts end to end on a mixture of experts).
        before, after: Context tokens kept before and after each top position.
        top: ``top[ranking][layer]``: :class:`TopContexts` (``ranking`` in :data:`RANKINGS`).
        fire_count: ``[n_layers, n_neuron_heads]`` positions where the head's self weight > 1/2.
        token_count: ``[d_vocab]`` positions seen per token.
        post_sum_by_token: ``[n_layers, d_mlp, d_vocab]`` sum of ``hook_post`` per token.
        fire_count_by_token: ``[n_layers, n_neuron_heads, d_vocab]``.
        n_positions: Positions seen.
        n_rows: Token rows (documents or chunks) seen.
        groups: Per layer, its :data:`HeadGroups`; empty for a model without mixtures of experts
            (every layer dense, ``n_neuron_heads`` heads, each counted at every position).
        group_positions: ``[n_layers, n_groups]`` positions each group counted (an expert's: the
            tokens routed to it); ``None`` without :attr:`groups`.
        group_token_count: ``[n_layers, n_groups, d_vocab]`` those positions per token (with
            token statistics).
    """

    n_layers: int
    d_mlp: int
    n_heads_per_neuron: int
    d_vocab: int
    before: int
    after: int
    top: dict[str, list[TopContexts]]
    fire_count: torch.Tensor
    token_count: torch.Tensor
    post_sum_by_token: torch.Tensor | None
    fire_count_by_token: torch.Tensor | None
    n_positions: int = 0
    n_rows: int = 0
    meta: dict = field(default_factory=dict)
    groups: list[HeadGroups] = field(default_factory=list)
    group_positions: torch.Tensor | None = None
    group_token_count: torch.Tensor | None = None

    @property
    def n_neuron_heads(self) -> int:
        return self.d_mlp * self.n_heads_per_neuron

    def layer_width(self, layer: int) -> int:
        """Neuron-heads of ``layer`` (a mixture of experts: its experts' together)."""
        return sum(n for _, n in self.groups[layer]) if self.groups else self.n_neuron_heads

    def head_expert(self, layer: int, head: int) -> tuple[int | str | None, int]:
        """``(expert, h)``: head ``head`` of ``layer`` is head ``h`` of ``expert`` (``None``: a
        dense layer's head ``head``).

        Raises:
            IndexError: For a head past the layer's width.
        """
        if not 0 <= head < self.layer_width(layer):
            raise IndexError(
                f"Layer {layer} has {self.layer_width(layer)} neuron-heads; got head {head}."
            )
        if not self.groups:
            return None, head
        for expert, n in self.groups[layer]:
            if head < n:
                return expert, head
            head -= n
        raise AssertionError("unreachable: head < layer width")

    def label(self, layer: int, head: int) -> str:
        """``L{l}N{n}`` (a dense layer's), ``L{l}E{e}N{n}`` (routed expert ``e``'s), ``L{l}SN{n}``
        (the shared expert's)."""
        expert, h = self.head_expert(layer, head)
        if expert is None:
            return neuron_head_label(layer, h, self.n_heads_per_neuron)
        from tl_attnonly.analysis.experts.routing import expert_neuron_head_label

        return expert_neuron_head_label(layer, expert, h, self.n_heads_per_neuron)

    def _at_heads(self, per_group: torch.Tensor) -> torch.Tensor:
        """``[n_layers, n_groups, ...]`` spread to ``[n_layers, n_neuron_heads, ...]`` (each head
        its group's value; 0 past a layer's width)."""
        out = per_group.new_zeros((self.n_layers, self.n_neuron_heads, *per_group.shape[2:]))
        for layer, groups in enumerate(self.groups):
            start = 0
            for g, (_, n) in enumerate(groups):
                out[layer, start : start + n] = per_group[layer, g]
                start += n
        return out

    def head_positions(self) -> torch.Tensor:
        """``[n_layers, n_neuron_heads]`` positions each head was counted over: every position
        (``n_positions``) for a dense layer's, the tokens routed to its expert for an expert's;
        0 past a layer's width."""
        if self.group_positions is None:
            return torch.full((self.n_layers, self.n_neuron_heads), self.n_positions)
        return self._at_heads(self.group_positions)

    def head_token_count(self) -> torch.Tensor:
        """``[n_layers, n_neuron_heads, d_vocab]`` (a broadcast view of :attr:`token_count` on a
        dense model): positions of each token each head was counted over."""
        if self.group_token_count is not None:
            return self._at_heads(self.group_token_count)
        if self.groups:
            raise ValueError("Token statistics were not recorded (token_stats=False).")
        return self.token_count.expand(self.n_layers, self.n_neuron_heads, self.d_vocab)

    def firing_fraction(self) -> Float[torch.Tensor, "n_layers n_neuron_heads"]:
        """Share of the positions each neuron-head counted (:meth:`head_positions`) where it puts
        more than half its weight on itself (NaN where a head of a model with mixtures of experts
        counted none: past a layer's width, an expert no token was routed to)."""
        if self.group_positions is None:
            return self.fire_count.double() / max(self.n_positions, 1)
        positions = self.head_positions()
        fraction = self.fire_count.double() / positions.clamp(min=1)
        return fraction.masked_fill(positions == 0, float("nan"))

    def _token_counts(self, per: str) -> torch.Tensor:
        """Positions per token a per-token sum is over: ``token_count`` ``[d_vocab]`` on a dense
        model; per head (``per="head"``) or neuron (``"neuron"``) ``[n_layers, n, d_vocab]``."""
        if not self.groups:
            return self.token_count
        counts = self.head_token_count()
        return counts[:, :: self.n_heads_per_neuron] if per == "neuron" else counts

    def _per_token(self, sums: torch.Tensor | None, min_count: int, per: str) -> torch.Tensor:
        """``sums`` over their positions per token, NaN for tokens seen fewer than ``min_count``
        times (by the head or neuron)."""
        if sums is None:
            raise ValueError("Token statistics were not recorded (token_stats=False).")
        count = self._token_counts(per).double()
        mean = sums.double() / count.clamp(min=1)
        return mean.masked_fill(count < max(min_count, 1), float("nan"))

    def mean_post_by_token(self, min_count: int = 1) -> torch.Tensor:
        """``[n_layers, d_mlp, d_vocab]`` mean ``hook_post`` per token (NaN below ``min_count``;
        an expert's neuron: over the tokens routed to it)."""
        return self._per_token(self.post_sum_by_token, min_count, "neuron")

    def firing_fraction_by_token(self, min_count: int = 1) -> torch.Tensor:
        """``[n_layers, n_neuron_heads, d_vocab]`` (NaN below ``min_count``; an expert's head:
        over the tokens routed to it)."""
        return self._per_token(self.fire_count_by_token, min_count, "head")

    def firing_auc_by_token(self, min_count: int = 5) -> torch.Tensor:
        """``[n_layers, n_neuron_heads, d_vocab]``: AUC of "fires" (self weight > 1/2) for a token.

        The area under the ROC curve of the binary firing indicator as a detector of the token,
        ``0.5 + (P(fires | token) - P(fires | other token)) / 2``: 1 when the head fires exactly
        on that token, 0.5 when firing says nothing about it (NaN below ``min_count``; an
        expert's head: among the tokens routed to it).
        """
        tpr = self.firing_fraction_by_token(min_count)  # raises without token statistics
        fire_tok = self.fire_count_by_token
        if fire_tok is None:
            raise ValueError("Token statistics were not recorded (token_stats=False).")
        count = self._token_counts("head").double()
        positions = self.n_positions if not self.groups else self.head_positions()[..., None]
        fire_other = self.fire_count.double()[..., None] - fire_tok.double()
        fpr = fire_other / (positions - count).clamp(min=1)
        return 0.5 + (tpr - fpr) / 2

    def selectivity(self, layer: int, neuron: int, top: int = 10, min_count: int = 5):
        """Tokens on which neuron ``neuron`` writes most on average: ``[(token, mean, count)]``
        (``count``: the token's positions the neuron was counted over)."""
        mean = self.mean_post_by_token(min_count)[layer, neuron]
        counts = self._token_counts("neuron")
        counts = counts if counts.ndim == 1 else counts[layer, neuron]
        values, idx = mean.nan_to_num(-torch.inf).topk(top)
        return [
            (int(t), float(v), int(counts[t]))
            for t, v in zip(idx, values, strict=True)
            if v > -torch.inf
        ]

    def rank(
        self,
        layer: int,
        by: str = "firing_fraction",
        top: int | None = None,
        level: str = "neuron",
    ) -> list[int]:
        """Neuron-heads of ``layer`` ranked by a dataset statistic (largest first).

        Args:
            by: ``"firing_fraction"``, ``"max_self"`` (best top context by weight on self),
                ``"max_abs_z"`` (best top context by |z|), or ``"selectivity"`` (the best token's
                :meth:`firing_auc_by_token`, tokens seen at least 5 times).
            top: How many neurons (``level="head"``: heads); default all.
            level: ``"neuron"`` (default): neurons ranked by the largest statistic of their ``K``
                heads, each listed with all its heads (consecutively); ``"head"``: heads ranked
                one by one. The same for ``K = 1``.

        Returns:
            Head indices of the layer (:meth:`label` names them), usable as ``heads=`` in the
            views of :mod:`tl_attnonly.vis`.
        """
        width = self.layer_width(layer)
        scores = {
            "firing_fraction": lambda: self.firing_fraction()[layer, :width],
            "max_self": lambda: self.top["self"][layer].values[:width, 0],
            "max_abs_z": lambda: self.top["abs_z"][layer].values[:width, 0],
            "selectivity": lambda: (
                self.firing_auc_by_token(min_count=5)[layer, :width].nan_to_num(0.0).max(-1).values
            ),
        }
        return rank_heads(scores, by, self.n_heads_per_neuron, top, level)

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | Path) -> Path:
        """Write the summaries to ``directory`` (safetensors + JSON); :meth:`load` reads them."""
        tensors = {
            "fire_count": self.fire_count,
            "token_count": self.token_count,
        }
        for name in ("post_sum_by_token", "fire_count_by_token", *_GROUP_TENSORS):
            if getattr(self, name) is not None:
                tensors[name] = getattr(self, name)
        tensors.update(top_tensors(self.top))
        meta = dict(
            n_layers=self.n_layers,
            d_mlp=self.d_mlp,
            n_heads_per_neuron=self.n_heads_per_neuron,
            d_vocab=self.d_vocab,
            before=self.before,
            after=self.after,
            n_positions=self.n_positions,
            n_rows=self.n_rows,
            meta=self.meta,
        )
        if self.groups:  # a dense model's files are as before
            meta["groups"] = self.groups
        return write_summaries(directory, tensors, meta)

    @classmethod
    def load(cls, directory: str | Path) -> NeuronHeadSummaries:
        """Read summaries written by :meth:`save` (a dense model's, from any version)."""
        meta, tensors = read_summaries(directory, "NeuronHeadSummaries.save()")
        return cls(
            n_layers=meta["n_layers"],
            d_mlp=meta["d_mlp"],
            n_heads_per_neuron=meta["n_heads_per_neuron"],
            d_vocab=meta["d_vocab"],
            before=meta["before"],
            after=meta["after"],
            top=read_top(tensors, meta["n_layers"]),
            fire_count=tensors["fire_count"],
            token_count=tensors["token_count"],
            post_sum_by_token=tensors.get("post_sum_by_token"),
            fire_count_by_token=tensors.get("fire_count_by_token"),
            n_positions=meta["n_positions"],
            n_rows=meta["n_rows"],
            meta=meta.get("meta", {}),
            groups=[[(e, n) for e, n in layer] for layer in meta.get("groups", [])],
            **{name: tensors.get(name) for name in _GROUP_TENSORS},
        )


#: The tensors of :attr:`NeuronHeadSummaries.groups`'s counts (saved only with groups).
_GROUP_TENSORS = ("group_positions", "group_token_count")


__all__ = [
    "META_FILE",
    "HeadGroups",
    "RANKINGS",
    "SUMMARY_FILE",
    "NeuronHeadSummaries",
    "TopContexts",
    "rank_heads",
    "read_summaries",
    "read_top",
    "top_tensors",
    "write_summaries",
]
