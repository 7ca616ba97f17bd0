"""Every number of the atlas against an independent computation from the model's own hooks
(``run_with_cache`` of each row alone), on the bundled model as both kinds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from helpers import BATCH, KINDS, MAX_LEN, bundled, corpus_rows, hooked_acts  # noqa: E402

from tl_attnonly.atlas import AtlasOptions, collect_atlas, logit_effect  # noqa: E402
from tl_attnonly.atlas.state import (  # noqa: E402
    EMPTY,
    bucket_edges,
    fixed_value,
    hist_edges,
    sample_key,
)

OPTS = AtlasOptions(k=6, before=3, after=2, samples=2, max_len=MAX_LEN)
ATOL = 1e-5


@pytest.fixture(scope="module", params=KINDS)
def run(request):
    model = bundled(request.param)
    rows = corpus_rows(model)
    state = collect_atlas(model, rows, options=OPTS, batch_size=BATCH)
    return model, rows, state, hooked_acts(model, rows)


def test_counts_min_max_and_firing(run):
    model, rows, state, acts = run
    n_tokens = sum(r.shape[0] for r in rows)
    assert int(state.n_tokens) == n_tokens and state.n_rows == len(rows)
    for layer, ref in zip(state.layers, acts):
        torch.testing.assert_close(layer["act_max"], ref["post"].amax(0), atol=ATOL, rtol=0)
        torch.testing.assert_close(layer["act_min"], ref["post"].amin(0), atol=ATOL, rtol=0)
        torch.testing.assert_close(
            fixed_value(layer["act_sum"]), ref["post"].double().sum(0), atol=1e-3, rtol=0
        )
        # firing frequency = P(pre > 0); a token within rounding of 0 may go either way
        near = (ref["pre"].abs() < 1e-5).sum(0)
        assert ((layer["fire"] - (ref["pre"] > 0).sum(0)).abs() <= near).all()
        # self weight > 1/2 exactly where pre > 0 (SiLU: sigmoid(pre))
        assert ((ref["self"] > 0.5) == (ref["pre"] > 0)).float().mean() > 0.999


def test_histogram(run):
    _, rows, state, acts = run
    edges = hist_edges(OPTS).float()
    for layer, ref in zip(state.layers, acts):
        assert (layer["hist"].sum(1) == int(state.n_tokens)).all()
        x = ref["post"]  # [tokens, d_mlp]
        inner = (x[..., None] >= edges[None, None, 1:-1]).sum(-1)  # bin index
        expect = torch.stack([(inner == b).sum(0) for b in range(OPTS.n_bins)], 1)
        assert (layer["hist"] - expect).abs().sum() <= 4  # rounding at bin edges only


def test_top_contexts(run):
    _, rows, state, acts = run
    for layer, ref in zip(state.layers, acts):
        top = layer["top"]
        values, order = ref["post"].topk(OPTS.k, dim=0)  # [k, d_mlp]
        torch.testing.assert_close(top["rank"].float(), values.T, atol=ATOL, rtol=0)
        # each kept position's own activation, read from the hooks, is the kept value
        where = {int(g): i for i, g in enumerate(ref["gidx"])}
        index = torch.tensor([[where[int(g)] for g in row] for row in top["gidx"]])
        own = ref["post"].gather(0, index.T).T
        torch.testing.assert_close(own, top["rank"].float(), atol=ATOL, rtol=0)
        # the windows: tokens, activations and self weights around each position
        for n in (0, 7, 100):
            for slot in range(OPTS.k):
                g = int(top["gidx"][n, slot])
                r, p = divmod(g, MAX_LEN)
                for j, off in enumerate(range(-OPTS.before, OPTS.after + 1)):
                    q = p + off
                    token = int(top["tokens"][n, slot, j])
                    if not 0 <= q < rows[r].shape[0]:
                        assert token == -1
                        continue
                    i = where[r * MAX_LEN + q]
                    assert token == int(rows[r][q])
                    assert abs(float(top["act"][n, slot, j]) - float(ref["post"][i, n])) < ATOL
                    assert abs(float(top["self"][n, slot, j]) - float(ref["self"][i, n])) < ATOL


def test_quantile_samples(run):
    model, _, state, acts = run
    edges = bucket_edges(OPTS).float()
    n_mlp = model.cfg.d_mlp
    for li, (layer, ref) in enumerate(zip(state.layers, acts)):
        quant = layer["quant"]
        for n in (0, 5, 300):
            x = ref["post"][:, n]
            bucket = (x[:, None] >= edges[None, 1:-1]).sum(1)
            keys = sample_key(ref["gidx"], torch.tensor(li * n_mlp + n), OPTS.seed)
            for b in range(OPTS.n_buckets):
                chosen = quant["gidx"][n * OPTS.n_buckets + b]
                members = (x > 0) & (bucket == b)
                order = sorted(zip(keys[members].tolist(), ref["gidx"][members].tolist()))
                expect = [g for _, g in order[: OPTS.samples]]
                got = [int(g) for g in chosen if int(g) != EMPTY]
                assert got == expect


def test_logit_effect(run):
    model, _, _, _ = run
    effects = logit_effect(model, n=10)
    for li, (top_v, top_i, bot_v, bot_i) in enumerate(effects):
        direct = model.blocks[li].mlp.W_out.detach().float() @ model.W_U.detach().float()
        torch.testing.assert_close(top_v, direct.topk(10, dim=1).values)
        torch.testing.assert_close(bot_v, direct.topk(10, dim=1, largest=False).values)
        torch.testing.assert_close(direct.gather(1, top_i), top_v)
        torch.testing.assert_close(direct.gather(1, bot_i), bot_v)
