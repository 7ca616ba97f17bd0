"""Dataset-level neuron-head summaries against brute force over a small corpus."""

from __future__ import annotations

import pytest
import torch
from conftest import D_VOCAB
from models import facts, make_converted

from tl_attnonly.analysis.summaries import NeuronHeadSummaries, summarize_neuron_heads
from tl_attnonly.vis.summaries import summary_html

BEFORE, AFTER, K_TOP = 3, 1, 4


def _corpus(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 10, 3, 12, 9, 5, 11]
    return [torch.randint(0, D_VOCAB, (n,), generator=g) for n in lengths]


def _brute_force(model, rows):
    """Every position's self weight, z and post, one row at a time."""
    out = []
    for r, row in enumerate(rows):
        _, cache = model.run_with_cache(row[None])
        for li in range(model.cfg.n_layers):
            out.append(
                dict(
                    row=r,
                    layer=li,
                    tokens=row,
                    self=cache[f"blocks.{li}.mlp.hook_pattern"][0, :, :, 0].T,  # [pos, H]
                    z=cache[f"blocks.{li}.mlp.hook_z"][0, :, :, 0],
                    post=cache[f"blocks.{li}.mlp.hook_post"][0],
                )
            )
    return out


@pytest.mark.parametrize("act_fn", ["silu", "gelu"])
def test_summaries_equal_brute_force(act_fn):
    model = make_converted(act_fn, normalization_type="LN", n_ctx=12)
    rows = _corpus()
    summary = summarize_neuron_heads(
        model, rows, k=K_TOP, before=BEFORE, after=AFTER, batch_size=3, progress=False
    )
    brute = _brute_force(model, rows)
    L, H, N = model.cfg.n_layers, facts(model).n_neuron_heads, model.cfg.d_mlp
    n_pos = sum(len(r) for r in rows)
    assert summary.n_positions == n_pos and summary.n_rows == len(rows)
    counts = torch.bincount(torch.cat(rows), minlength=D_VOCAB)
    assert torch.equal(summary.token_count, counts)
    for li in range(L):
        entries = [e for e in brute if e["layer"] == li]
        self_all = torch.cat([e["self"] for e in entries])  # [n_pos, H]
        z_all = torch.cat([e["z"] for e in entries])
        post_all = torch.cat([e["post"] for e in entries])
        toks = torch.cat([e["tokens"] for e in entries])
        # firing fraction
        assert torch.equal(summary.fire_count[li], (self_all > 0.5).sum(0))
        # per-token mean post and firing
        expected_sum = torch.zeros(N, D_VOCAB, dtype=torch.float64).index_add_(
            1, toks, post_all.T.double()
        )
        torch.testing.assert_close(summary.post_sum_by_token[li], expected_sum)
        expected_fire = torch.zeros(H, D_VOCAB, dtype=torch.long).index_add_(
            1, toks, (self_all > 0.5).T.long()
        )
        assert torch.equal(summary.fire_count_by_token[li], expected_fire)
        # top-k values for both rankings, and the context of the best one
        for ranking, values in (("self", self_all), ("abs_z", z_all.abs())):
            best = values.float().topk(K_TOP, dim=0).values.T  # [H, k]
            torch.testing.assert_close(summary.top[ranking][li].values, best)
            for head in range(0, H, 5):
                flat = int(values[:, head].argmax())
                r, p = _row_pos(rows, flat)
                top = summary.top[ranking][li]
                assert (int(top.document[head, 0]), int(top.position[head, 0])) == (r, p)
                expected_tokens = [
                    int(rows[r][q]) if 0 <= q < len(rows[r]) else -1
                    for q in range(p - BEFORE, p + AFTER + 1)
                ]
                assert top.tokens[head, 0].tolist() == expected_tokens
                entry = entries[r]
                for t, q in enumerate(range(p - BEFORE, p + AFTER + 1)):
                    if 0 <= q < len(rows[r]):
                        assert float(top.self_weight[head, 0, t]) == pytest.approx(
                            float(entry["self"][q, head]), rel=1e-6
                        )
                        assert float(top.z[head, 0, t]) == pytest.approx(
                            float(entry["z"][q, head]), rel=1e-6, abs=1e-9
                        )


def _row_pos(rows, flat):
    for r, row in enumerate(rows):
        if flat < len(row):
            return r, flat
        flat -= len(row)
    raise IndexError(flat)


def test_summaries_round_trip_rank_and_render(tmp_path):
    model = make_converted("silu", normalization_type="LN", n_ctx=12)
    summary = summarize_neuron_heads(model, _corpus(1), k=3, batch_size=4, progress=False)
    summary.save(tmp_path / "s")
    loaded = NeuronHeadSummaries.load(tmp_path / "s")
    assert loaded.n_positions == summary.n_positions
    assert torch.equal(loaded.fire_count_by_token, summary.fire_count_by_token)
    for ranking in summary.top:
        for li in range(model.cfg.n_layers):
            for name in ("values", "tokens", "self_weight", "z", "document", "position"):
                assert torch.equal(
                    getattr(loaded.top[ranking][li], name), getattr(summary.top[ranking][li], name)
                )
    ranked = summary.rank(0, by="firing_fraction")
    fire = summary.firing_fraction()[0]
    assert fire[ranked[0]] == fire.max() and fire[ranked[-1]] == fire.min()
    assert summary.rank(1, by="max_abs_z", top=3)[0] == int(
        summary.top["abs_z"][1].values[:, 0].argmax()
    )
    page = summary_html(summary, 0, heads=ranked[:2]).html
    assert "&lt;bias&gt;" in page and "L0N" in page
    with pytest.raises(ValueError, match="by must be"):
        summary.rank(0, by="nope")


def test_rank_lists_neurons_with_all_their_heads_by_default():
    model = make_converted("gelu", normalization_type="LN", n_ctx=12)
    K = facts(model).n_heads_per_neuron
    assert K == 4
    summary = summarize_neuron_heads(model, _corpus(1), k=2, batch_size=4, progress=False)
    fire = summary.firing_fraction()[1]
    by_neuron = summary.rank(1, top=3)
    best = fire.double().reshape(-1, K).amax(-1).argsort(descending=True, stable=True)[:3]
    assert by_neuron == [n * K + k for n in best.tolist() for k in range(K)]
    by_head = summary.rank(1, top=3, level="head")
    assert by_head == fire.double().argsort(descending=True)[:3].tolist()
    with pytest.raises(ValueError, match="level"):
        summary.rank(1, level="layer")


def test_top_slots_beyond_the_counted_positions_stay_empty():
    """With fewer counted positions than k (rows of 3 and 1 tokens, one batch padded to 3: 4
    counted, 2 padding), the slots left over keep value -inf, document and position -1 and tokens
    -1 (before, they held the document and position of a padding token)."""
    model = make_converted("silu", n_ctx=12)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, D_VOCAB, (n,), generator=g) for n in (3, 1)]
    summary = summarize_neuron_heads(model, rows, k=6, batch_size=2, progress=False)
    for ranking in summary.top.values():
        for top in ranking:
            empty = torch.isneginf(top.values)
            assert empty[:, 4:].all() and not empty[:, :4].any()
            assert (top.document[empty] == -1).all() and (top.position[empty] == -1).all()
            assert (top.tokens[empty] == -1).all()
            assert set(top.document[~empty].tolist()) == {0, 1}


def test_summaries_refuse_over_budget_and_bad_items():
    model = make_converted("silu", n_ctx=12)
    with pytest.raises(MemoryError, match="token_stats=False"):
        summarize_neuron_heads(model, _corpus(), max_bytes=1000, progress=False)
    with pytest.raises(TypeError, match="strings or int tensors"):
        summarize_neuron_heads(model, [3.5], progress=False)


def test_summary_options_equal_keywords():
    from tl_attnonly.analysis import SummaryOptions

    model = make_converted("gelu", normalization_type="LN", n_ctx=12)
    kw = dict(k=K_TOP, before=BEFORE, after=AFTER, batch_size=3, progress=False)
    by_keyword = summarize_neuron_heads(model, _corpus(), **kw)
    by_options = summarize_neuron_heads(model, _corpus(), options=SummaryOptions(**kw))
    assert by_options.fire_count.equal(by_keyword.fire_count)
    assert by_options.post_sum_by_token.equal(by_keyword.post_sum_by_token)
    for r in by_keyword.top:
        for a, b in zip(by_keyword.top[r], by_options.top[r]):
            assert a.values.equal(b.values) and a.tokens.equal(b.tokens)
    with pytest.raises(TypeError, match="SummaryOptions"):
        summarize_neuron_heads(model, _corpus(), kk=3)
    with pytest.raises(TypeError, match="takes a tl_attnonly.analysis.SummaryOptions"):
        summarize_neuron_heads(model, _corpus(), options=kw)
