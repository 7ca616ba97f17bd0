"""One batch of one layer into the atlas's state, in a few passes over its activations.

Per batch and layer, :func:`update_layer` makes a fixed number of elementwise passes over the
``[tokens, d_mlp]`` activations: min and max, the sum, the firing count, the histogram, and per
selection one comparison against thresholds the state already holds (its entries' last ranks),
so that only the tokens that can enter a selection (``top``, ``quant``, ``quad``) are looked at
one by one. Those thresholds are conservative: a token is dropped only if it cannot enter, so the
selections are exactly those of ranking every token (:func:`~tl_attnonly.atlas.state.select`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float, Int

from tl_attnonly.atlas.state import (
    AtlasOptions,
    bin_index,
    bucket_edges,
    carry,
    fixed_point,
    hist_bins,
    hist_edges,
    neuron_hash,
    select,
    token_hash,
)

#: A ``quant`` bucket whose last key is at most this is "common": its tokens are found by key
#: (about 1 in 256 passes); the others are found by activation (their lower edge).
_COMMON_KEY = 2**31 // 256
#: A batch with more candidates than this many per selection slot first bounds them per group.
_CROWD = 4


@dataclass
class BatchActs:
    """One batch's activations of one layer, as the atlas reads them (``[batch, pos, n]``)."""

    tokens: Int[torch.Tensor, "batch pos"]
    valid: Bool[torch.Tensor, "batch pos"]
    gidx: Int[torch.Tensor, "batch pos"]
    act: Float[torch.Tensor, "batch pos n"]
    pre: Float[torch.Tensor, "batch pos n"]
    self_weight: Float[torch.Tensor, "batch pos n"]
    linear: Float[torch.Tensor, "batch pos n"] | None = None
    b_in: Float[torch.Tensor, " n"] | None = None


@dataclass
class _Tokens:
    """The batch's valid tokens, flattened: activations ``[t, n]`` and where each token is."""

    act: Float[torch.Tensor, "t n"]
    pre: Float[torch.Tensor, "t n"]
    linear: Float[torch.Tensor, "t n"] | None
    row: Int[torch.Tensor, " t"]
    pos: Int[torch.Tensor, " t"]
    gidx: Int[torch.Tensor, " t"]


def _flatten(acts: BatchActs) -> _Tokens:
    """The valid tokens of ``acts`` (views when there is no padding, else copies)."""
    n = acts.act.shape[-1]
    if bool(acts.valid.all()):
        batch, pos = acts.valid.shape
        device = acts.act.device
        row = torch.arange(batch, device=device).repeat_interleave(pos)
        place = torch.arange(pos, device=device).repeat(batch)

        def pick(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(-1, n)
    else:
        row, place = acts.valid.nonzero(as_tuple=True)

        def pick(x: torch.Tensor) -> torch.Tensor:
            return x[acts.valid]

    linear = None if acts.linear is None else pick(acts.linear)
    return _Tokens(pick(acts.act).float(), pick(acts.pre), linear, row, place,
                   acts.gidx[row, place])  # fmt: skip


def _count(mask: Bool[torch.Tensor, "t n"]) -> Int[torch.Tensor, " n"]:
    """The true entries per column (int64; counted in int32 without an int64 copy of ``mask``)."""
    return mask.view(torch.uint8).sum(0, dtype=torch.int32).long()


def _contexts(
    acts: BatchActs, b: torch.Tensor, p: torch.Tensor, n: torch.Tensor, opts: AtlasOptions
) -> dict[str, torch.Tensor]:
    """The windows around candidates ``(row b, position p, neuron n)``, each ``[c, window]``."""
    offsets = torch.arange(-opts.before, opts.after + 1, device=p.device)
    pos = p[:, None] + offsets
    inside = (pos >= 0) & (pos < acts.tokens.shape[1])
    pos_c = pos.clamp(0, acts.tokens.shape[1] - 1)
    inside = inside & acts.valid[b[:, None], pos_c]
    b_e, n_e = b[:, None].expand_as(pos), n[:, None].expand_as(pos)
    return {
        "tokens": acts.tokens[b[:, None], pos_c].masked_fill(~inside, -1),
        "act": acts.act[b_e, pos_c, n_e].float().masked_fill(~inside, 0.0),
        "self": acts.self_weight[b_e, pos_c, n_e].float().masked_fill(~inside, 0.0),
    }


def update_layer(
    state: dict[str, Any], acts: BatchActs, layer_offset: int, opts: AtlasOptions
) -> dict[str, Any]:
    """Merge one batch of one layer into ``state`` (in place; returned).

    Args:
        state: The layer's state (:func:`~tl_attnonly.atlas.state.new_layer_state`).
        acts: The batch's activations.
        layer_offset: The layer's first global neuron id (``layer * d_mlp``: the sampling hash).
        opts: The atlas's options.
    """
    tok = _flatten(acts)
    a = tok.act
    state["act_min"] = torch.minimum(state["act_min"], a.amin(0))
    state["act_max"] = torch.maximum(state["act_max"], a.amax(0))
    batch_sum = a.sum(0, dtype=torch.float64)  # the same bits for the same batch
    state["act_sum"] = carry(state["act_sum"] + fixed_point(batch_sum))
    fires = tok.pre > 0
    n_fire = _count(fires)
    state["fire"] += n_fire
    n_bins, n = opts.n_bins, a.shape[1]
    bins = hist_bins(a, hist_edges(opts))
    bins += torch.arange(0, n * n_bins, n_bins, dtype=torch.int32, device=a.device)
    state["hist"] += torch.bincount(bins.view(-1), minlength=n * n_bins).view(n, n_bins)
    del bins
    _update_top(state["top"], tok, acts, opts)
    _update_quantiles(state["quant"], tok, acts, layer_offset, opts)
    if "quad" in state and tok.linear is not None:
        _update_quadrants(state, tok, (fires, n_fire), acts, opts)
    return state


def _enter(
    sel: dict[str, torch.Tensor],
    score: Float[torch.Tensor, " c"],
    group: Int[torch.Tensor, " c"],
    idx: tuple[torch.Tensor, torch.Tensor],
    tok: _Tokens,
    acts: BatchActs,
    opts: AtlasOptions,
) -> None:
    """Merge candidates ``(token idx[0], neuron idx[1])`` of ``score`` into groups ``group`` of
    ``sel`` (in place): those below their group's last entry are dropped first, and in a crowded
    batch (the state still filling) those below the group's ``m``-th best candidate."""
    groups, m = sel["rank"].shape
    score = score.double()
    keep = score >= sel["rank"][group, -1]
    if int(keep.sum()) > _CROWD * groups * m:
        keep &= score >= _mth_best(score.masked_fill(~keep, -torch.inf), group, groups, m)[group]
    r, nn, score, group = idx[0][keep], idx[1][keep], score[keep], group[keep]
    select(sel, score, tok.gidx[r], group,
           lambda i: _contexts(acts, tok.row[r[i]], tok.pos[r[i]], nn[i], opts),
           inplace=True)  # fmt: skip


def _update_top(
    sel: dict[str, torch.Tensor], tok: _Tokens, acts: BatchActs, opts: AtlasOptions
) -> None:
    """The ``k`` largest activations per neuron."""
    a = tok.act
    last = sel["rank"][:, -1].float()  # exact: the ranks are float32 values
    mask = a >= last
    if int(_count(mask).sum()) > _CROWD * sel["rank"].numel():  # still filling: bound by the batch
        kth = a.topk(min(sel["rank"].shape[1], a.shape[0]), dim=0).values[-1]
        mask = a >= torch.maximum(last, kth)
    r, nn = mask.nonzero(as_tuple=True)
    _enter(sel, a[r, nn], nn, (r, nn), tok, acts, opts)


def _update_quantiles(
    sel: dict[str, torch.Tensor],
    tok: _Tokens,
    acts: BatchActs,
    layer_offset: int,
    opts: AtlasOptions,
) -> None:
    """Per (neuron, activation bucket), the ``samples`` tokens of smallest hash key (rank: minus
    the key). A token can enter a common bucket (last key at most :data:`_COMMON_KEY`) only with
    a key at most the neuron's largest such key, and any other bucket only with an activation at
    least the neuron's lowest such bucket's lower edge."""
    a, n, nb = tok.act, tok.act.shape[1], opts.n_buckets
    neuron = torch.arange(n, device=a.device) + layer_offset
    key = token_hash(tok.gidx, opts.seed).int()[:, None] ^ neuron_hash(neuron, opts.seed).int()
    last_key = -sel["rank"][:, -1].view(n, nb)  # +inf where not full
    common = last_key <= _COMMON_KEY
    key_bound = torch.where(common, last_key, -1.0).amax(1).int()  # [n]
    edges = bucket_edges(opts)
    inner = edges[1:-1].to(device=a.device, dtype=a.dtype)  # as bin_index compares them
    lower = torch.cat([inner.new_full((1,), -torch.inf), inner])  # bucket b: x >= this
    act_bound = torch.where(common, torch.inf, lower).amin(1)  # [n]
    mask = ((key <= key_bound) | (a >= act_bound)) & (a > 0)
    r, nn = mask.nonzero(as_tuple=True)
    bucket = bin_index(a[r, nn], edges).long()
    _enter(sel, -key[r, nn].double(), nn * nb + bucket, (r, nn), tok, acts, opts)


def _update_quadrants(
    state: dict[str, Any],
    tok: _Tokens,
    gate: tuple[Bool[torch.Tensor, "t n"], Int[torch.Tensor, " n"]],
    acts: BatchActs,
    opts: AtlasOptions,
) -> None:
    """Per gate/value sign quadrant: the token counts, and the ``quadrant_k`` tokens of largest
    ``|act - b_in|`` (quadrant ``2 * (g <= 0) + (u <= 0)``; ``gate``: ``g > 0`` and its count)."""
    assert tok.linear is not None
    sel, a, n = state["quad"], tok.act, tok.act.shape[1]
    fires, n_g = gate
    u_pos = tok.linear > 0
    both, n_u = _count(fires & u_pos), _count(u_pos)
    t = a.shape[0]
    state["quad_count"] += torch.stack([both, n_g - both, n_u - both, t - n_g - n_u + both], 1)
    no_bias = acts.b_in is None or not bool(acts.b_in.any())
    mag = a.abs() if no_bias else (a - acts.b_in.float()).abs()  # type: ignore[union-attr]
    bound = sel["rank"][:, -1].view(n, 4).float().amin(1)  # -inf while a quadrant is not full
    r, nn = (mag >= bound).nonzero(as_tuple=True)
    quadrant = (~fires[r, nn]).long() * 2 + (~u_pos[r, nn]).long()
    _enter(sel, mag[r, nn], nn * 4 + quadrant, (r, nn), tok, acts, opts)


def _mth_best(score: torch.Tensor, group: torch.Tensor, groups: int, m: int) -> torch.Tensor:
    """Per group, a lower bound of its ``m``-th largest finite score (``-inf``: fewer): the
    largest, removed ``m - 1`` times (removing ties too can only lower it)."""
    flat_score, flat_group = score.reshape(-1), group.reshape(-1)
    best = torch.full((groups,), -torch.inf, dtype=score.dtype, device=score.device)
    for i in range(m):
        best = best.fill_(-torch.inf).scatter_reduce(0, flat_group, flat_score, "amax")
        if i < m - 1:
            flat_score = flat_score.masked_fill(flat_score >= best[flat_group], -torch.inf)
    return best


__all__ = ["BatchActs", "update_layer"]
