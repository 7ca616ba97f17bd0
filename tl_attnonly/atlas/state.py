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
- ``act_min``, ``act_max``, ``act_sum`` (each batch's float64 sum, rounded to fixed point,
  :func:`fixed_point`, and added exactly: states of any split at batch boundaries add up to the
  same bits), ``fire`` (tokens with ``pre > 0``, i.e. ``s > 1/2`` for SiLU), a histogram over
  fixed bins uniform in ``asinh(a)``, and the token count.
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


def bin_index(x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Bin index (int32) of ``x`` for the bins between ``edges`` (compared in ``x``'s dtype:
    ``edges[i] <= x < edges[i + 1]``), values outside falling in the end bins."""
    inner = edges[1:-1].to(device=x.device, dtype=x.dtype).contiguous()
    return torch.bucketize(x, inner, right=True, out_int32=True)


#: The float32 bit patterns' cells of :func:`hist_bins`'s table: the top ``32 - _CELL_SHIFT`` bits.
_CELL_SHIFT = 12
_BIN_TABLES: dict[tuple[Any, ...], torch.Tensor] = {}


def _bin_table(edges: torch.Tensor, device: Any) -> torch.Tensor:
    """Per cell of float32 bit patterns (all values with the same top bits, a contiguous range
    of values): the bin of all its values, or ``-1`` where an edge (or NaN) falls inside."""
    key = (tuple(edges.tolist()), str(device))
    if key not in _BIN_TABLES:
        half = 1 << (31 - _CELL_SHIFT)
        cells = torch.arange(-half, half, dtype=torch.int32)
        low = (cells << _CELL_SHIFT).view(torch.float32)
        high = ((cells << _CELL_SHIFT) | ((1 << _CELL_SHIFT) - 1)).view(torch.float32)
        first, last = bin_index(low, edges), bin_index(high, edges)
        mixed = (first != last) | low.isnan() | high.isnan()
        _BIN_TABLES[key] = first.masked_fill(mixed, -1).to(device)
    return _BIN_TABLES[key]


def hist_bins(x: Float[torch.Tensor, "t n"], edges: torch.Tensor) -> Int[torch.Tensor, "t n"]:
    """:func:`bin_index` of float32 ``x``, the same bins, by a table of the bit patterns' top
    bits (one gather instead of a binary search per value); the values whose cell an edge
    splits (a few in a thousand) by :func:`bin_index`."""
    if x.dtype != torch.float32:
        return bin_index(x, edges)
    table = _bin_table(edges, x.device)
    cell = (x.view(torch.int32) >> _CELL_SHIFT) + (1 << (31 - _CELL_SHIFT))
    bins = table.index_select(0, cell.reshape(-1)).view_as(x)
    mixed = (bins < 0).nonzero(as_tuple=True)
    bins[mixed] = bin_index(x[mixed], edges)
    return bins


def _mix(x: torch.Tensor) -> torch.Tensor:
    for mult in (1103515245, 69069):
        x = (x ^ (x >> 13)) * mult % _P
    return x


def token_hash(gidx: torch.Tensor, seed: int) -> torch.Tensor:
    """A hash in ``[0, 2**31)`` of each global token index."""
    return _mix((gidx % _P * 1000003 + seed * 104729 + 12345) % _P)


def neuron_hash(neuron: torch.Tensor, seed: int) -> torch.Tensor:
    """A hash in ``[0, 2**31)`` of each global neuron id."""
    return _mix((neuron * 7919 + seed * 31 + 977) % _P)


def sample_key(gidx: torch.Tensor, neuron: torch.Tensor, seed: int) -> torch.Tensor:
    """A pseudo-random key in ``[0, 2**31)`` per (global token index, global neuron id): hashes
    of each, xor-ed (broadcast: ``gidx`` ``[..., 1]`` with ``neuron`` ``[n]``)."""
    return token_hash(gidx, seed) ^ neuron_hash(neuron, seed)


def fixed_point(x: torch.Tensor) -> Int[torch.Tensor, "... 2"]:
    """``x`` in fixed point, ``[..., (hi, lo)]`` (int64): ``hi = floor(x * 2**HI_BITS)`` and
    ``lo`` the rest in units of ``2**-(HI_BITS + LO_BITS)`` (about ``1e-12``), rounded. Exact for
    values up to ``2**40`` in magnitude but for that rounding, which is per value: integer sums
    of these are associative, so the values' sum is the same bits in any order."""
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
        "tokens": torch.full((groups, m, window), -1, dtype=torch.int32, device=device),
        "act": torch.zeros(groups, m, window, device=device),
        "self": torch.zeros(groups, m, window, device=device),
    }


def select(
    old: dict[str, torch.Tensor],
    rank: Float[torch.Tensor, " c"],
    gidx: Int[torch.Tensor, " c"],
    group: Int[torch.Tensor, " c"],
    fetch: Callable[[torch.Tensor], dict[str, torch.Tensor]],
    inplace: bool = False,
) -> dict[str, torch.Tensor]:
    """``old`` (``[groups, m, ...]``) with candidates merged in: per group the ``m`` entries of
    largest ``rank``, ties by smaller ``gidx``. Exact and independent of the candidates' order.
    Only the groups with candidates are re-ranked.

    Args:
        old: The selection.
        rank, gidx, group: The candidates' rank, global token index and group ``[c]``.
        fetch: The other fields (``tokens``, ``act``, ``self``) of the candidates at the given
            indices (called only for the candidates that enter).
        inplace: Write into ``old``'s tensors (else into copies).
    """
    out = old if inplace else {k: v.clone() for k, v in old.items()}
    if group.numel() == 0:
        return out
    groups, m = old["rank"].shape
    touched = torch.zeros(groups, dtype=torch.bool, device=group.device)
    touched[group] = True
    rows = touched.nonzero().squeeze(1)  # the groups re-ranked
    group = (torch.cumsum(touched, 0) - 1)[group]  # their places in ``rows``
    part = {k: v[rows] for k, v in old.items()}
    keep = part["gidx"] != EMPTY
    n_old = int(keep.sum())
    old_group = torch.arange(rows.shape[0], device=group.device)[:, None].expand_as(keep)[keep]
    allg = torch.cat([old_group, group])
    all_rank = torch.cat([part["rank"][keep], rank.double()])
    all_gidx = torch.cat([part["gidx"][keep], gidx.long()])
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
    new = empty_selection(rows.shape[0], m, old["tokens"].shape[-1], group.device)
    new["rank"][g_out, s_out] = all_rank[src]
    new["gidx"][g_out, s_out] = all_gidx[src]
    fetched = fetch(src[~from_old] - n_old)
    for name in ("tokens", "act", "self"):
        new[name][g_out[from_old], s_out[from_old]] = part[name][keep][src[from_old]]
        new[name][g_out[~from_old], s_out[~from_old]] = fetched[name].to(new[name].dtype)
    for name, value in new.items():
        out[name][rows] = value
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
    "bin_index",
    "bucket_edges",
    "carry",
    "fixed_point",
    "fixed_value",
    "empty_selection",
    "flatten_state",
    "hist_bins",
    "hist_edges",
    "merge_layer_states",
    "new_layer_state",
    "neuron_hash",
    "sample_key",
    "token_hash",
    "select",
    "unflatten_state",
]
