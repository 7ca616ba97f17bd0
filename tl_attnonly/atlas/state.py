"""The atlas's running state: per-neuron statistics that merge exactly, in memory bounded by the
number of neurons (never by the corpus).

Every token of the corpus has a global index ``row * max_len + pos`` (``row``: its row of at
most ``max_len`` tokens, counted from the corpus's start). Each selection keeps a fixed number of
entries per group, ranked by a value and, on ties, by the smaller global index, so the state of a
corpus does not depend on how it was cut: the merge of two states (:func:`merge_states`) equals
the state of one pass over both parts, bit for bit, and a resumed run equals an unstopped one.

Per neuron ``i`` of a layer (activation ``a = hook_post[..., i]``, self weight
``s = hook_pattern[:, i * K, :, 0]``, its first head's weight on itself):

- ``top``: the ``k`` largest activations, each with a window of tokens around it and every window
  token's activation and self weight;
- ``quant``: quantile samples: per activation bucket (fixed edges, :func:`bucket_edges`), the
  ``samples`` tokens of smallest pseudo-random key (a hash of the global index, the neuron and
  the seed: deterministic, and a uniform sample of the bucket's tokens);
- ``quad`` (gated layers): per sign quadrant of (gate ``g = hook_pre``, linear branch
  ``u = hook_pre_linear``) the ``quadrant_k`` tokens of largest ``|a - b_in|``, and the counts;
- ``act_min``, ``act_max``, ``act_sum`` (exact: in fixed point, :func:`fixed_point`, so that
  sums of any split of the corpus add up to the same bits), ``fire`` (tokens with ``pre > 0``,
  i.e. ``s > 1/2`` for SiLU), a histogram over fixed bins uniform in ``asinh(a)``, and the token
  count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from functools import partial
from typing import Any

import torch
from jaxtyping import Float, Int

#: Global index of an empty selection slot (sorts after every real token).
EMPTY = 2**62
#: Modulus of the sampling hash (a prime below 2**31).
_P = 2147483647
#: Selections kept per layer: name -> whether it ranks by the hash key (``quant``).
SELECTIONS = ("top", "quant", "quad")
#: The fixed point of the activation sum: ``hi * 2**-HI_BITS + lo * 2**-(HI_BITS + LO_BITS)``.
HI_BITS, LO_BITS = 8, 32


@dataclass(frozen=True)
class AtlasOptions:
    """What the atlas keeps (each also accepted by keyword in :func:`~.run.build_atlas`); states
    of equal options merge.

    Attributes:
        k: Top contexts per neuron.
        before, after: Tokens kept before and after each context's token.
        n_bins: Histogram bins (uniform in ``asinh(activation)`` over ``[-hist_max, hist_max]``;
            values outside fall in the end bins).
        hist_max: The histogram's range.
        n_buckets: Quantile-sample buckets over ``(0, hist_max]`` (uniform in ``asinh``).
        samples: Samples kept per bucket.
        quadrant_k: Top contexts per gate/value sign quadrant (gated layers).
        seed: Seed of the sampling hash.
        max_len: Longest token row (longer documents are split); default ``model.cfg.n_ctx``.
            It also numbers the tokens (``row * max_len + pos``): states of one value merge.
    """

    k: int = 20
    before: int = 8
    after: int = 4
    n_bins: int = 64
    hist_max: float = 32.0
    n_buckets: int = 10
    samples: int = 3
    quadrant_k: int = 5
    seed: int = 0
    max_len: int | None = None

    @property
    def window(self) -> int:
        """Tokens per context."""
        return self.before + self.after + 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AtlasOptions:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def hist_edges(opts: AtlasOptions) -> Float[torch.Tensor, " n_bins_plus_1"]:
    """The histogram's bin edges (float64): uniform in ``asinh`` over ``±hist_max``."""
    a = torch.asinh(torch.tensor(opts.hist_max, dtype=torch.float64))
    return torch.sinh(torch.linspace(-a, a, opts.n_bins + 1, dtype=torch.float64))


def bucket_edges(opts: AtlasOptions) -> Float[torch.Tensor, " n_buckets_plus_1"]:
    """The quantile-sample buckets' edges (float64): uniform in ``asinh`` over ``(0, hist_max]``
    (activations above ``hist_max`` go to the last bucket; ``<= 0``: no bucket)."""
    a = torch.asinh(torch.tensor(opts.hist_max, dtype=torch.float64))
    return torch.sinh(torch.linspace(0, a, opts.n_buckets + 1, dtype=torch.float64))


def _bin(x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Bin index of ``x`` for the bins between ``edges`` (as ``x``'s dtype; ``edges[i] <= x <
    edges[i + 1]``), values outside falling in the end bins."""
    n = edges.shape[0] - 1
    inner = edges[1:-1].to(device=x.device, dtype=x.dtype).contiguous()
    return torch.bucketize(x, inner, right=True).clamp(0, n - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    for mult in (1103515245, 69069):
        x = (x ^ (x >> 13)) * mult % _P
    return x


def sample_key(gidx: torch.Tensor, neuron: torch.Tensor, seed: int) -> torch.Tensor:
    """A pseudo-random key in ``[0, 2**31)`` per (global token index, global neuron id): hashes
    of each, xor-ed (broadcast: ``gidx`` ``[..., 1]`` with ``neuron`` ``[n]``)."""
    return _mix((gidx % _P * 1000003 + seed * 104729 + 12345) % _P) ^ _mix(
        (neuron * 7919 + seed * 31 + 977) % _P
    )


def fixed_point(x: torch.Tensor) -> Int[torch.Tensor, "... 2"]:
    """``x`` in fixed point, ``[..., (hi, lo)]`` (int64): ``hi = floor(x * 2**HI_BITS)`` and
    ``lo`` the rest in units of ``2**-(HI_BITS + LO_BITS)`` (about ``1e-12``), rounded. Exact for
    float32 activations up to ``2**40`` in magnitude but for that rounding, which is per token:
    integer sums of these are associative, so any split of a corpus sums to the same bits."""
    scaled = x.double() * 2.0**HI_BITS
    hi = torch.floor(scaled)
    lo = torch.round((scaled - hi) * 2.0**LO_BITS)
    return torch.stack([hi.long(), lo.long()], dim=-1)


def carry(total: Int[torch.Tensor, "... 2"]) -> Int[torch.Tensor, "... 2"]:
    """A fixed-point sum in its normal form (``0 <= lo < 2**LO_BITS``): one value, one bit
    pattern."""
    over = total[..., 1] >> LO_BITS  # floor division
    return torch.stack([total[..., 0] + over, total[..., 1] - (over << LO_BITS)], dim=-1)


def fixed_value(total: Int[torch.Tensor, "... 2"]) -> Float[torch.Tensor, "..."]:
    """The float64 value of a fixed-point sum."""
    return total[..., 0].double() * 2.0**-HI_BITS + total[..., 1].double() * 2.0 ** -(
        HI_BITS + LO_BITS
    )


def empty_selection(groups: int, m: int, window: int, device: Any) -> dict[str, torch.Tensor]:
    """A selection of ``m`` empty slots per group."""
    return {
        "rank": torch.full((groups, m), -torch.inf, dtype=torch.float64, device=device),
        "gidx": torch.full((groups, m), EMPTY, dtype=torch.long, device=device),
        "tokens": torch.full((groups, m, window), -1, dtype=torch.long, device=device),
        "act": torch.zeros(groups, m, window, device=device),
        "self": torch.zeros(groups, m, window, device=device),
    }


def select(
    old: dict[str, torch.Tensor],
    rank: Float[torch.Tensor, " c"],
    gidx: Int[torch.Tensor, " c"],
    group: Int[torch.Tensor, " c"],
    fetch: Callable[[torch.Tensor], dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """``old`` (``[groups, m, ...]``) with candidates merged in: per group the ``m`` entries of
    largest ``rank``, ties by smaller ``gidx``. Exact and independent of the candidates' order.

    Args:
        old: The selection.
        rank, gidx, group: The candidates' rank, global token index and group ``[c]``.
        fetch: The other fields (``tokens``, ``act``, ``self``) of the candidates at the given
            indices (called only for the candidates that enter).
    """
    groups, m = old["rank"].shape
    keep = old["gidx"] != EMPTY
    n_old = int(keep.sum())
    old_group = torch.arange(groups, device=group.device)[:, None].expand(groups, m)[keep]
    allg = torch.cat([old_group, group])
    all_rank = torch.cat([old["rank"][keep], rank.double()])
    all_gidx = torch.cat([old["gidx"][keep], gidx.long()])
    order = torch.argsort(all_gidx, stable=True)
    order = order[torch.argsort(all_rank[order], descending=True, stable=True)]
    order = order[torch.argsort(allg[order], stable=True)]
    g_sorted = allg[order]
    slot = torch.arange(g_sorted.shape[0], device=group.device) - torch.searchsorted(
        g_sorted, g_sorted
    )
    take = slot < m
    src, g_out, s_out = order[take], g_sorted[take], slot[take]
    from_old = src < n_old
    out = empty_selection(groups, m, old["tokens"].shape[-1], group.device)
    out["rank"][g_out, s_out] = all_rank[src]
    out["gidx"][g_out, s_out] = all_gidx[src]
    fetched = fetch(src[~from_old] - n_old)
    for name in ("tokens", "act", "self"):
        out[name][g_out[from_old], s_out[from_old]] = old[name][keep][src[from_old]]
        out[name][g_out[~from_old], s_out[~from_old]] = fetched[name].to(out[name].dtype)
    return out


def new_layer_state(n: int, opts: AtlasOptions, gated: bool, device: Any) -> dict[str, Any]:
    """An empty state of one layer of ``n`` neurons."""
    w = opts.window
    state: dict[str, Any] = {
        "top": empty_selection(n, opts.k, w, device),
        "quant": empty_selection(n * opts.n_buckets, opts.samples, w, device),
        "act_min": torch.full((n,), torch.inf, device=device),
        "act_max": torch.full((n,), -torch.inf, device=device),
        "act_sum": torch.zeros(n, 2, dtype=torch.long, device=device),
        "fire": torch.zeros(n, dtype=torch.long, device=device),
        "hist": torch.zeros(n, opts.n_bins, dtype=torch.long, device=device),
    }
    if gated:
        state["quad"] = empty_selection(n * 4, opts.quadrant_k, w, device)
        state["quad_count"] = torch.zeros(n, 4, dtype=torch.long, device=device)
    return state


@dataclass
class BatchActs:
    """One batch's activations of one layer, as the atlas reads them (``[batch, pos, n]``)."""

    tokens: Int[torch.Tensor, "batch pos"]
    valid: torch.Tensor
    gidx: Int[torch.Tensor, "batch pos"]
    act: Float[torch.Tensor, "batch pos n"]
    pre: Float[torch.Tensor, "batch pos n"]
    self_weight: Float[torch.Tensor, "batch pos n"]
    linear: Float[torch.Tensor, "batch pos n"] | None = None
    b_in: Float[torch.Tensor, " n"] | None = None


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


def update_layer(state: dict[str, Any], acts: BatchActs, layer_offset: int, opts: AtlasOptions):
    """Merge one batch of one layer into ``state`` (in place for the counters)."""
    valid = acts.valid[..., None]
    act, n_neurons = acts.act.float(), acts.act.shape[-1]
    neuron = torch.arange(n_neurons, device=act.device)
    state["act_min"] = torch.minimum(
        state["act_min"], act.masked_fill(~valid, torch.inf).amin((0, 1))
    )
    state["act_max"] = torch.maximum(
        state["act_max"], act.masked_fill(~valid, -torch.inf).amax((0, 1))
    )
    state["act_sum"] = carry(state["act_sum"] + fixed_point(act[acts.valid]).sum(0))
    state["fire"] += ((acts.pre > 0) & valid).sum((0, 1))
    bins = _bin(act[acts.valid], hist_edges(opts))  # [tokens, n]
    flat = (bins + neuron * opts.n_bins).reshape(-1)
    state["hist"] += torch.bincount(flat, minlength=n_neurons * opts.n_bins).view_as(state["hist"])
    # top contexts
    state["top"] = _select_batch(state["top"], act, valid.expand_as(act), acts, opts)
    # quantile samples: rank by minus the hash key within each positive-activation bucket
    key = sample_key(acts.gidx[..., None], neuron + layer_offset, opts.seed)
    bucket = _bin(act, bucket_edges(opts))
    state["quant"] = _select_batch(state["quant"], -key, valid & (act > 0), acts, opts, bucket)
    if "quad" in state and acts.linear is not None:
        quadrant = (acts.pre <= 0).long() * 2 + (acts.linear <= 0).long()
        counts = torch.bincount((neuron * 4 + quadrant)[acts.valid].reshape(-1),
                                minlength=n_neurons * 4)  # fmt: skip
        state["quad_count"] += counts.view_as(state["quad_count"])
        b_in = acts.b_in if acts.b_in is not None else torch.zeros_like(act[0, 0])
        mag = (act - b_in.float()).abs()
        state["quad"] = _select_batch(
            state["quad"], mag, valid.expand_as(act), acts, opts, quadrant
        )
    return state


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


def _select_batch(
    sel: dict[str, torch.Tensor],
    score: torch.Tensor,
    eligible: torch.Tensor,
    acts: BatchActs,
    opts: AtlasOptions,
    sub: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Merge the batch's ``eligible`` tokens into ``sel`` by ``score`` ``[batch, pos, n]``
    (float32 values, or int64), each into group ``n * n_sub + sub`` (``sub`` ``[batch, pos, n]``;
    ``None``: one group per neuron). Candidates are the tokens at or above their group's last
    entry (one group per neuron: and at or above the batch's own ``m``-th score; several: where
    many pass, at or above the batch's ``m``-th of the group). Ties are kept: exact."""
    groups, m = sel["rank"].shape
    n_neurons = score.shape[-1]
    last = sel["rank"][:, -1]  # float64: exact for float32 values and for keys below 2**31
    last = last.float() if score.is_floating_point() else last.clamp(min=-(2**62)).long()
    if sub is None:
        flat = score.masked_fill(~eligible, -torch.inf).reshape(-1, n_neurons)
        kth = flat.topk(min(m, flat.shape[0]), dim=0).values[-1]
        thresh = torch.maximum(last, kth)  # [n], broadcast
    else:
        n_sub = groups // n_neurons
        table = last.view(n_neurons, n_sub).expand(*score.shape, n_sub)
        thresh = table.gather(-1, sub[..., None]).squeeze(-1)
        if int(((score >= thresh) & eligible).sum()) > 4 * groups * m:  # one read per batch
            group = torch.arange(n_neurons, device=score.device) * n_sub + sub
            bound = _mth_best(score.double().masked_fill(~eligible, -torch.inf), group, groups, m)
            bound = bound if score.is_floating_point() else bound.clamp(min=-(2**62))
            thresh = torch.maximum(thresh, bound[group].to(score.dtype))
    b, p, n = (eligible & (score >= thresh)).nonzero(as_tuple=True)
    group_c = n if sub is None else n * (groups // n_neurons) + sub[b, p, n]
    return select(
        sel,
        score[b, p, n].double(),
        acts.gidx[b, p],
        group_c,
        lambda idx: _contexts(acts, b[idx], p[idx], n[idx], opts),
    )


def _rows_at(rows: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[idx] for k, v in rows.items()}


def merge_layer_states(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The state of two disjoint parts of a corpus, from theirs (exact)."""
    out: dict[str, Any] = {}
    for name, value in a.items():
        if name in SELECTIONS:
            groups = value["rank"].shape[0]
            other = b[name]
            keep = other["gidx"] != EMPTY
            group = torch.arange(groups, device=keep.device)[:, None].expand_as(keep)[keep]
            rows = {k: v[keep] for k, v in other.items()}
            out[name] = select(
                value,
                rows["rank"],
                rows["gidx"],
                group,
                partial(_rows_at, rows),
            )
        elif name == "act_min":
            out[name] = torch.minimum(value, b[name])
        elif name == "act_max":
            out[name] = torch.maximum(value, b[name])
        elif name == "act_sum":
            out[name] = carry(value + b[name])
        else:
            out[name] = value + b[name]
    return out


def flatten_state(layers: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """``{"L{l}.name[.field]": tensor}`` of every layer's state (for safetensors)."""
    flat = {}
    for li, state in enumerate(layers):
        for name, value in state.items():
            if isinstance(value, dict):
                flat.update({f"L{li}.{name}.{k}": v.contiguous() for k, v in value.items()})
            else:
                flat[f"L{li}.{name}"] = value.contiguous()
    return flat


def unflatten_state(flat: dict[str, torch.Tensor], n_layers: int) -> list[dict[str, Any]]:
    """The inverse of :func:`flatten_state`."""
    layers: list[dict[str, Any]] = [{} for _ in range(n_layers)]
    for key, value in flat.items():
        layer, _, rest = key.partition(".")
        name, _, field = rest.partition(".")
        target = layers[int(layer[1:])]
        if field:
            target.setdefault(name, {})[field] = value
        else:
            target[name] = value
    return layers


__all__ = [
    "EMPTY",
    "SELECTIONS",
    "AtlasOptions",
    "BatchActs",
    "bucket_edges",
    "carry",
    "fixed_point",
    "fixed_value",
    "empty_selection",
    "flatten_state",
    "hist_edges",
    "merge_layer_states",
    "new_layer_state",
    "sample_key",
    "select",
    "unflatten_state",
    "update_layer",
]
