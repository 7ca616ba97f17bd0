"""IOI head roles (Wang et al. 2022) from attention patterns and direct logit attribution.

See :mod:`tl_attnonly.analysis.ioi` for the table of roles; :func:`ioi_head_scores` reads every
attention head's scores from one cached run per batch, :meth:`IOIHeadScores.roles` assigns them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import pandas as pd
import torch
from jaxtyping import Float
from tqdm.auto import tqdm

import tl_attnonly.analysis.post_norm as post_norm
from tl_attnonly.adapt import analysis_model, require_additive_residual
from tl_attnonly.analysis.ioi.prompts import IOIDataset
from tl_attnonly.hooks import attn_names_filter, exact_names_filter

if TYPE_CHECKING:
    from tl_attnonly.protocol import AttnOnlyModel, ModelLike


#: Attention scores: column -> (query position, key position).
ATTENTION_SCORES: dict[str, tuple[str, str]] = {
    "end_to_io": ("end", "io"),
    "end_to_s1": ("end", "s1"),
    "end_to_s2": ("end", "s2"),
    "s2_to_s1": ("s2", "s1"),
    "s2_to_s1_plus1": ("s2", "s1_plus1"),
    "s1_plus1_to_s1": ("s1_plus1", "s1"),
    "end_to_end": ("end", "end"),
    "end_to_first": ("end", "first"),
}


#: Roles :meth:`IOIHeadScores.roles` assigns, in this order.
ROLES = (
    "name mover",
    "negative name mover",
    "S suppression",
    "S mover",
    "S-inhibition",
    "duplicate token",
    "induction",
    "previous token",
)


@dataclass
class IOIHeadScores:
    """Every attention head's IOI scores, per prompt; :attr:`table` averages them.

    Attributes:
        attention: Column of :data:`ATTENTION_SCORES` -> ``[batch, n_layers, n_heads]``: the
            pattern's weight from the query position on the key position.
        dla_io, dla_s: ``[batch, n_layers, n_heads]`` direct logit attribution of each head at
            END on ``logit(IO)`` and on ``logit(S)``: the head's output through the final norm
            (its cached scale, its weight; centred for a LayerNorm) onto ``W_U[:, IO]`` and
            ``W_U[:, S]``, before any output soft cap.
        logit_diff: ``[batch]`` the model's ``logit(IO) - logit(S)`` at END.
    """

    attention: dict[str, Float[torch.Tensor, "batch n_layers n_heads"]]
    dla_io: Float[torch.Tensor, "batch n_layers n_heads"]
    dla_s: Float[torch.Tensor, "batch n_layers n_heads"]
    logit_diff: Float[torch.Tensor, " batch"]

    @property
    def dla(self) -> Float[torch.Tensor, "batch n_layers n_heads"]:
        """``[batch, n_layers, n_heads]`` direct logit attribution on ``logit(IO) - logit(S)``."""
        return self.dla_io - self.dla_s

    @property
    def table(self) -> pd.DataFrame:
        """One row per head (index ``L{l}H{h}``): ``layer, head``, the mean of every attention
        score, ``end_to_s`` (``end_to_s1 + end_to_s2``), ``dla``, ``dla_io`` and ``dla_s``."""
        n_layers, n_heads = self.dla_io.shape[1:]
        index = [f"L{li}H{h}" for li in range(n_layers) for h in range(n_heads)]
        data: dict[str, list] = {
            "layer": [li for li in range(n_layers) for _ in range(n_heads)],
            "head": [h for _ in range(n_layers) for h in range(n_heads)],
        }
        for name, values in self.attention.items():
            data[name] = values.mean(0).flatten().tolist()
        end_to_s = (self.attention["end_to_s1"] + self.attention["end_to_s2"]).mean(0)
        data["end_to_s"] = end_to_s.flatten().tolist()
        for name in ("dla", "dla_io", "dla_s"):
            data[name] = getattr(self, name).mean(0).flatten().tolist()
        return pd.DataFrame(data, index=index)

    def roles(
        self, attention_threshold: float = 0.3, dla_threshold: float | None = None
    ) -> pd.DataFrame:
        """Heads with each role of :data:`ROLES`, by thresholds on the mean scores.

        With ``a = attention_threshold`` and ``d = dla_threshold``:

        * name mover: ``end_to_io >= a``, ``end_to_io > end_to_s`` and ``dla >= d`` (attends to
          IO and writes it, Wang et al.); negative name mover: the same with ``dla <= -d``;
        * S suppression: ``end_to_s >= a``, ``end_to_s > end_to_io`` and ``dla >= d`` (attends
          to S and writes against it: copy suppression of S, McDougall et al. 2023); S mover:
          the same with ``dla <= -d`` (writes S);
        * S-inhibition: ``end_to_s2 >= a``, ``end_to_s2 > end_to_io`` and ``|dla| < d`` (attends
          to S2 from END and writes little to the answer directly; Wang et al. confirm such heads
          by their effect on the name movers' queries, which patterns alone cannot show);
        * duplicate token: ``s2_to_s1 >= a``; induction: ``s2_to_s1_plus1 >= a``; previous
          token: ``s1_plus1_to_s1 >= a``.

        Args:
            attention_threshold: Minimum mean attention weight.
            dla_threshold: The ``|dla|`` that counts as writing the answer; default 10% of the
                largest ``|dla|`` of any head.

        Returns:
            One row per (head, role): ``label, role, score`` (the score the role is defined by:
            ``dla`` for movers and suppressors, else the attention weight) and every column of
            :attr:`table`; sorted by role (in :data:`ROLES` order), then by ``|score|``.
        """
        table = self.table
        if dla_threshold is None:
            dla_threshold = 0.1 * float(table["dla"].abs().max())
        a, d, dla = attention_threshold, dla_threshold, table["dla"]
        to_io = (table["end_to_io"] >= a) & (table["end_to_io"] > table["end_to_s"])
        to_s = (table["end_to_s"] >= a) & (table["end_to_s"] > table["end_to_io"])
        to_s2 = (table["end_to_s2"] >= a) & (table["end_to_s2"] > table["end_to_io"])
        rules = {
            "name mover": (to_io & (dla >= d), "dla"),
            "negative name mover": (to_io & (dla <= -d), "dla"),
            "S suppression": (to_s & (dla >= d), "dla"),
            "S mover": (to_s & (dla <= -d), "dla"),
            "S-inhibition": (to_s2 & (dla.abs() < d), "end_to_s2"),
            "duplicate token": (table["s2_to_s1"] >= a, "s2_to_s1"),
            "induction": (table["s2_to_s1_plus1"] >= a, "s2_to_s1_plus1"),
            "previous token": (table["s1_plus1_to_s1"] >= a, "s1_plus1_to_s1"),
        }
        parts = []
        for role in ROLES:
            mask, column = rules[role]
            part = table[mask].copy()
            part.insert(0, "score", part[column])
            part.insert(0, "role", role)
            part.insert(0, "label", part.index)
            parts.append(part.sort_values("score", key=abs, ascending=False, kind="stable"))
        return pd.concat(parts, ignore_index=True)

    def roles_of(
        self,
        heads: Sequence[str],
        attention_threshold: float = 0.3,
        dla_threshold: float | None = None,
    ) -> dict[str, list[str]]:
        """``head -> [roles]`` for the labels ``heads`` (``[]`` for a head with none).

        Args:
            heads: Attention-head labels ``L{l}H{h}``.
            attention_threshold, dla_threshold: As in :meth:`roles`.
        """
        roles = self.roles(attention_threshold, dla_threshold)
        out: dict[str, list[str]] = {head: [] for head in heads}
        for head, role in zip(roles["label"], roles["role"], strict=True):
            if head in out:
                out[head].append(role)
        return out


def ioi_head_scores(
    model: ModelLike,
    dataset: IOIDataset,
    *,
    corrupted: bool = False,
    batch_size: int = 32,
    progress: bool = False,
) -> IOIHeadScores:
    """Every attention head's IOI attention scores and direct logit attribution.

    One ``run_with_cache`` per batch, caching only the attention patterns, ``z`` and the final
    norm's scale. ``attention[name][b, l, h]`` is ``pattern[l][b, h, q, k]`` at the query and key
    positions of :data:`ATTENTION_SCORES`; ``dla_io[b, l, h]`` is the head's output at END
    (``z[l][b, END, h] @ W_O[l, h]``, centred if the final norm is a LayerNorm, divided by its
    cached scale, times its weight) dotted with ``W_U[:, IO]``, and ``dla_s`` the same with
    ``W_U[:, S]``.

    Args:
        model: A ``HookedTransformer`` (original or converted) with causal attention.
        dataset: The prompts (:func:`make_ioi_dataset` or :meth:`IOIDataset.from_tokens`).
        corrupted: Score the corrupted prompts instead (positions as in the clean ones).
        batch_size: Prompts per forward pass.
        progress: Show a progress bar over batches.

    Returns:
        The :class:`IOIHeadScores`.

    Raises:
        ValueError: For bidirectional attention (the padding after END would be attended to).
        NotImplementedError: For a model whose residual stream is not a sum of head outputs
            (a post-LN encoder): direct logit attribution is undefined there. Norms after each
            sublayer (Gemma 2/3, OLMo 2/3) are applied with their scales from the run.
    """
    model = analysis_model(model, neuron_heads=False)
    if model.cfg.attention_dir != "causal":
        raise ValueError(
            "IOI head scores need causal attention (a next-token task; right padding would be "
            f"attended to); this model has attention_dir={model.cfg.attention_dir!r}."
        )
    require_additive_residual(model, "ioi_head_scores (direct logit attribution)")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
    post_scales = [
        post_norm.scale_hook(norm)
        for norm in (post_norm.post_norm(model, li, "attn") for li in range(model.cfg.n_layers))
        if norm is not None
    ]
    names_filter = attn_names_filter("pattern", "z") | exact_names_filter(
        "ln_final.hook_scale", *post_scales
    )
    device = model.W_U.device
    parts: list[tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]] = []
    starts = range(0, len(dataset), batch_size)
    for start in tqdm(starts, desc="IOI head scores", disable=not progress):
        part = dataset.select(slice(start, start + batch_size))
        tokens = (part.corrupted_tokens if corrupted else part.tokens).to(device)
        with torch.inference_mode():
            parts.append(_batch_scores(model, part, tokens, names_filter))
    return IOIHeadScores(
        attention={name: torch.cat([p[1][name] for p in parts]) for name in ATTENTION_SCORES},
        dla_io=torch.cat([p[2] for p in parts]),
        dla_s=torch.cat([p[3] for p in parts]),
        logit_diff=torch.cat([p[0] for p in parts]),
    )


def _batch_scores(
    model: AttnOnlyModel, part: IOIDataset, tokens: torch.Tensor, names_filter
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """One batch: ``logit_diff [batch]``, ``{score: [batch, n_layers, n_heads]}``, ``dla_io``
    and ``dla_s`` (``[batch, n_layers, n_heads]``), on the CPU."""
    device = tokens.device
    output, cache = model.run_with_cache(tokens, names_filter=names_filter)
    logits = cast(torch.Tensor, output)  # return_type "logits" (the default)
    rows = torch.arange(len(part), device=device)
    end = part.end_pos.to(device)
    attention = {}
    for name, (query, key) in ATTENTION_SCORES.items():
        q, k = part.positions(query).to(device), part.positions(key).to(device)
        per_layer = [
            cache[f"blocks.{li}.attn.hook_pattern"][rows, :, q, k]
            for li in range(model.cfg.n_layers)
        ]
        attention[name] = torch.stack(per_layer, 1).cpu()  # [batch, n_layers, n_heads]
    ln_final = model.ln_final
    if "ln_final.hook_scale" in cache.cache_dict:
        scale = cache["ln_final.hook_scale"][rows, end]  # [batch, 1]
    else:  # no final norm
        scale = torch.ones(len(part), 1, dtype=model.W_U.dtype, device=device)
    centre = ln_final is not None and ln_final.centred
    weight = None if ln_final is None else ln_final.w
    directions = []
    for token in (part.io_token, part.s_token):
        direction = model.W_U[:, token.to(device)].T  # [batch, d_model]
        directions.append(direction if weight is None else direction * weight)
    dla_io, dla_s = [], []
    for li in range(model.cfg.n_layers):
        z = cache[f"blocks.{li}.attn.hook_z"][rows, end]  # [batch, n_heads, d_head]
        out = torch.einsum("bhd,hdm->bhm", z, model.blocks[li].attn.W_O)
        norm = post_norm.post_norm(model, li, "attn")
        if norm is not None:  # what the head adds to the residual stream in this run
            out = post_norm.normed(out, norm, post_norm.cached_scale(cache, norm)[rows, end, None])
        if centre:
            out = out - out.mean(-1, keepdim=True)
        out = out / scale[:, None]
        dla_io.append(torch.einsum("bhm,bm->bh", out, directions[0]))
        dla_s.append(torch.einsum("bhm,bm->bh", out, directions[1]))
    return (
        part.logit_diff(logits).cpu(),
        attention,
        torch.stack(dla_io, 1).cpu(),
        torch.stack(dla_s, 1).cpu(),
    )


__all__ = ["ATTENTION_SCORES", "ROLES", "IOIHeadScores", "ioi_head_scores"]
