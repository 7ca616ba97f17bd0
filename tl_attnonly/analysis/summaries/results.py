""":class:`NeuronHeadSummaries`: what :func:`~tl_attnonly.analysis.summarize_neuron_heads` keeps.

Top contexts per ranking (:class:`TopContexts`), firing fractions and per-token statistics; saved
to and loaded from a directory (safetensors + JSON); heads ranked by dataset statistics.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from jaxtyping import Float

from tl_attnonly.hooks import neuron_head_label

if TYPE_CHECKING:
    pass


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


@dataclass
class NeuronHeadSummaries:
    """Dataset statistics of every neuron-head of a model (see the module docstring).

    Attributes:
        n_layers, d_mlp, n_heads_per_neuron, d_vocab: The model's shape.
        before, after: Context tokens kept before and after each top position.
        top: ``top[ranking][layer]``: :class:`TopContexts` (``ranking`` in :data:`RANKINGS`).
        fire_count: ``[n_layers, n_neuron_heads]`` positions where the head's self weight > 1/2.
        token_count: ``[d_vocab]`` positions seen per token.
        post_sum_by_token: ``[n_layers, d_mlp, d_vocab]`` sum of ``hook_post`` per token.
        fire_count_by_token: ``[n_layers, n_neuron_heads, d_vocab]``.
        n_positions: Positions seen.
        n_rows: Token rows (documents or chunks) seen.
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

    @property
    def n_neuron_heads(self) -> int:
        return self.d_mlp * self.n_heads_per_neuron

    def label(self, layer: int, head: int) -> str:
        return neuron_head_label(layer, head, self.n_heads_per_neuron)

    def firing_fraction(self) -> Float[torch.Tensor, "n_layers n_neuron_heads"]:
        """Share of positions where each neuron-head puts more than half its weight on itself."""
        return self.fire_count.double() / max(self.n_positions, 1)

    def _per_token(self, sums: torch.Tensor | None, min_count: int) -> torch.Tensor:
        """``sums / token_count``, NaN for tokens seen fewer than ``min_count`` times."""
        if sums is None:
            raise ValueError("Token statistics were not recorded (token_stats=False).")
        count = self.token_count.double()
        mean = sums.double() / count.clamp(min=1)
        return mean.masked_fill(count < max(min_count, 1), float("nan"))

    def mean_post_by_token(self, min_count: int = 1) -> torch.Tensor:
        """``[n_layers, d_mlp, d_vocab]`` mean ``hook_post`` per token (NaN below ``min_count``)."""
        return self._per_token(self.post_sum_by_token, min_count)

    def firing_fraction_by_token(self, min_count: int = 1) -> torch.Tensor:
        """``[n_layers, n_neuron_heads, d_vocab]`` (NaN below ``min_count``)."""
        return self._per_token(self.fire_count_by_token, min_count)

    def firing_auc_by_token(self, min_count: int = 5) -> torch.Tensor:
        """``[n_layers, n_neuron_heads, d_vocab]``: AUC of "fires" (self weight > 1/2) for a token.

        The area under the ROC curve of the binary firing indicator as a detector of the token,
        ``0.5 + (P(fires | token) - P(fires | other token)) / 2``: 1 when the head fires exactly
        on that token, 0.5 when firing says nothing about it (NaN below ``min_count``).
        """
        tpr = self.firing_fraction_by_token(min_count)  # raises without token statistics
        fire_tok = self.fire_count_by_token
        if fire_tok is None:
            raise ValueError("Token statistics were not recorded (token_stats=False).")
        count = self.token_count.double()
        fire_other = self.fire_count.double()[..., None] - fire_tok.double()
        fpr = fire_other / (self.n_positions - count).clamp(min=1)
        return 0.5 + (tpr - fpr) / 2

    def selectivity(self, layer: int, neuron: int, top: int = 10, min_count: int = 5):
        """Tokens on which neuron ``neuron`` writes most on average: ``[(token, mean, count)]``."""
        mean = self.mean_post_by_token(min_count)[layer, neuron]
        values, idx = mean.nan_to_num(-torch.inf).topk(top)
        return [
            (int(t), float(v), int(self.token_count[t]))
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
            Head indices, usable as ``heads=`` in the views of :mod:`tl_attnonly.vis`.
        """
        if level not in ("neuron", "head"):
            raise ValueError(f"level must be 'neuron' or 'head', got {level!r}.")
        if by == "firing_fraction":
            score = self.firing_fraction()[layer]
        elif by == "max_self":
            score = self.top["self"][layer].values[:, 0]
        elif by == "max_abs_z":
            score = self.top["abs_z"][layer].values[:, 0]
        elif by == "selectivity":
            score = self.firing_auc_by_token(min_count=5)[layer].nan_to_num(0.0).max(-1).values
        else:
            raise ValueError(
                "by must be 'firing_fraction', 'max_self', 'max_abs_z' or 'selectivity', got "
                f"{by!r}."
            )
        K = self.n_heads_per_neuron
        if level == "neuron" and K > 1:
            neurons = score.double().reshape(-1, K).amax(-1).argsort(descending=True, stable=True)
            chosen = neurons[: top or len(neurons)].tolist()
            return [n * K + k for n in chosen for k in range(K)]
        order = score.double().argsort(descending=True)
        return order[: top or len(order)].tolist()

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | Path) -> Path:
        """Write the summaries to ``directory`` (safetensors + JSON); :meth:`load` reads them."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {
            "fire_count": self.fire_count,
            "token_count": self.token_count,
        }
        if self.post_sum_by_token is not None:
            tensors["post_sum_by_token"] = self.post_sum_by_token
        if self.fire_count_by_token is not None:
            tensors["fire_count_by_token"] = self.fire_count_by_token
        for ranking, layers in self.top.items():
            for li, tc in enumerate(layers):
                for name in ("values", "tokens", "self_weight", "z", "document", "position"):
                    tensors[f"top.{ranking}.{li}.{name}"] = getattr(tc, name)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / SUMMARY_FILE))
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
        (directory / META_FILE).write_text(json.dumps(meta, indent=2))
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> NeuronHeadSummaries:
        """Read summaries written by :meth:`save`."""
        from safetensors.torch import load_file

        directory = Path(directory)
        if not (directory / META_FILE).is_file():
            raise FileNotFoundError(
                f"No {META_FILE} in {directory}: expected a directory written by "
                "NeuronHeadSummaries.save()."
            )
        meta = json.loads((directory / META_FILE).read_text())
        tensors = load_file(str(directory / SUMMARY_FILE))
        top = {
            ranking: [
                TopContexts(
                    *(
                        tensors[f"top.{ranking}.{li}.{name}"]
                        for name in ("values", "tokens", "self_weight", "z", "document", "position")
                    )
                )
                for li in range(meta["n_layers"])
            ]
            for ranking in RANKINGS
        }
        return cls(
            n_layers=meta["n_layers"],
            d_mlp=meta["d_mlp"],
            n_heads_per_neuron=meta["n_heads_per_neuron"],
            d_vocab=meta["d_vocab"],
            before=meta["before"],
            after=meta["after"],
            top=top,
            fire_count=tensors["fire_count"],
            token_count=tensors["token_count"],
            post_sum_by_token=tensors.get("post_sum_by_token"),
            fire_count_by_token=tensors.get("fire_count_by_token"),
            n_positions=meta["n_positions"],
            n_rows=meta["n_rows"],
            meta=meta.get("meta", {}),
        )


__all__ = [
    "META_FILE",
    "RANKINGS",
    "SUMMARY_FILE",
    "NeuronHeadSummaries",
    "TopContexts",
]
