"""The batch update's thresholds drop only tokens that cannot enter: after many batches (the
selections full, most buckets "common") every selection equals ranking all tokens at once, ties
(coarse activations) broken by the earlier token."""

from __future__ import annotations

import torch

from tl_attnonly.atlas.state import (
    AtlasOptions,
    bin_index,
    bucket_edges,
    new_layer_state,
    sample_key,
)
from tl_attnonly.atlas.update import BatchActs, update_layer

N, B, P, BATCHES, OFFSET = 12, 4, 32, 120, 24
OPTS = AtlasOptions(k=6, before=2, after=1, samples=3, quadrant_k=4, max_len=P)


def _batches():
    gen = torch.Generator().manual_seed(0)
    for i in range(BATCHES):
        pre = torch.randn(B, P, N, generator=gen) * 2
        lin = torch.randn(B, P, N, generator=gen)
        act = torch.round(torch.nn.functional.silu(pre) * lin * 4) / 4  # coarse: many ties
        valid = torch.ones(B, P, dtype=torch.bool)
        valid[-1, P - 5 :] = i % 3 != 0  # some batches padded
        gidx = torch.arange(i * B, (i + 1) * B)[:, None] * P + torch.arange(P)
        yield BatchActs(tokens=torch.randint(0, 50, (B, P), generator=gen), valid=valid,
                        gidx=gidx, act=act, pre=pre, self_weight=torch.sigmoid(pre),
                        linear=lin, b_in=torch.full((N,), 0.25))  # fmt: skip


def _ranked(value, gidx, group, groups, m, descending=True):
    """Per group the ``m`` global indices of best ``value``, ties by smaller index."""
    out = torch.full((groups, m), -1, dtype=torch.long)
    for g in range(groups):
        idx = (group == g).nonzero().squeeze(1)
        order = sorted(idx.tolist(), key=lambda j: (-value[j] if descending else value[j], gidx[j]))
        chosen = [int(gidx[j]) for j in order[:m]]
        out[g, : len(chosen)] = torch.tensor(chosen, dtype=torch.long)
    return out


def _kept(sel):
    gidx = sel["gidx"].clone()
    gidx[gidx == 2**62] = -1
    return gidx


def test_update_equals_ranking_every_token():
    state = new_layer_state(N, OPTS, True, "cpu")
    seen = {"act": [], "pre": [], "lin": [], "gidx": []}
    for acts in _batches():
        update_layer(state, acts, OFFSET, OPTS)
        v = acts.valid
        seen["act"].append(acts.act[v]), seen["pre"].append(acts.pre[v])
        seen["lin"].append(acts.linear[v]), seen["gidx"].append(acts.gidx[v])
    act, pre, lin = (torch.cat(seen[k]) for k in ("act", "pre", "lin"))
    gidx = torch.cat(seen["gidx"])
    neuron = torch.arange(N).expand_as(act)
    tok = gidx[:, None].expand_as(act)
    # top contexts
    top = _ranked(act.double().reshape(-1).tolist(), tok.reshape(-1).tolist(),
                  neuron.reshape(-1), N, OPTS.k)  # fmt: skip
    assert torch.equal(_kept(state["top"]), top)
    # quantile samples: smallest key per (neuron, bucket) of the positive activations
    key = sample_key(gidx[:, None], torch.arange(N) + OFFSET, OPTS.seed)
    bucket = bin_index(act, bucket_edges(OPTS)).long()
    pos = act > 0
    group = (neuron * OPTS.n_buckets + bucket)[pos]
    quant = _ranked(key[pos].tolist(), tok[pos].tolist(), group, N * OPTS.n_buckets,
                    OPTS.samples, descending=False)  # fmt: skip
    assert torch.equal(_kept(state["quant"]), quant)
    last_key = -state["quant"]["rank"][:, -1]
    assert (last_key <= 2**31 // 256).sum() >= N  # buckets found by key alone: the filter ran
    # quadrants
    quadrant = (pre <= 0).long() * 2 + (lin <= 0).long()
    group = (neuron * 4 + quadrant).reshape(-1)
    quad = _ranked((act - 0.25).abs().reshape(-1).tolist(), tok.reshape(-1).tolist(), group,
                   N * 4, OPTS.quadrant_k)  # fmt: skip
    assert torch.equal(_kept(state["quad"]), quad)
    counts = torch.stack([(quadrant == q).sum(0) for q in range(4)], 1)
    assert torch.equal(state["quad_count"], counts)
    assert torch.equal(state["fire"], (pre > 0).sum(0))
