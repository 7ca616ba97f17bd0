"""``summarize_neuron_heads`` on models with mixtures of experts: an expert layer's neuron-heads
are its experts' end to end (routed experts, then the shared ones), each counted over the tokens
routed to its expert.

Zoo bridges in float32 (TransformerLens 3.9 and 4.x): each expert head's figures (firing counts
and fraction, positions counted, top contexts, labels) equal ``summarize_expert_neuron_heads``'s
for that layer on the same corpus (Mixtral; Qwen2-MoE and DeepSeek-V3, with a shared expert); its
per-token statistics equal sums gathered by hand over its routed tokens
(``tests/analysis/test_experts_analysis.py``'s plain-hook reference); DeepSeek-V3's dense layer 0
equals statistics read by hand from ``run_with_cache``, NaN or empty past its width. On TL 3.x
also an ``AttnOnlyTransformer`` with TransformerLens's ``NeuronHeadMoE``. Then ranking, save and
load, and the HTML page on the result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bridge"))

from models import hooked_only  # noqa: E402
from test_experts_analysis import LAYER, N_EXPERTS, SHARED_MODELS, _corpus, _reference  # noqa: E402
from zoo import build_bridge, convert_zoo_bridge  # noqa: E402

from tl_attnonly.analysis import NeuronHeadSummaries, summarize_neuron_heads  # noqa: E402
from tl_attnonly.analysis.experts import summarize_expert_neuron_heads  # noqa: E402
from tl_attnonly.analysis.summaries import RANKINGS  # noqa: E402
from tl_attnonly.vis.summaries import summary_html  # noqa: E402

#: The summaries' options, for both tools.
OPTIONS: dict[str, Any] = dict(k=3, before=2, after=1, batch_size=2, progress=False)
TOL = 1e-5  # float32
FIELDS = ("values", "tokens", "self_weight", "z", "document", "position")


@pytest.fixture(scope="module", params=["mixtral", *sorted(SHARED_MODELS)])
def moe(request) -> tuple[str, Any, NeuronHeadSummaries]:
    """``(zoo name, converted float32 bridge, its whole-model summaries of _corpus())``."""
    bridge = convert_zoo_bridge(build_bridge(request.param, torch.float32))
    return request.param, bridge, summarize_neuron_heads(bridge, _corpus(), **OPTIONS)


def _expert_layers(model: Any) -> list[int]:
    from tl_attnonly.adapt import analysis_model

    blocks = analysis_model(model).blocks
    return [li for li, block in enumerate(blocks) if block.mlp.is_mixture_of_experts]


def _check_against_expert_tool(model: Any, corpus: list[torch.Tensor], whole: Any) -> None:
    """Every expert layer's heads in ``whole`` are ``summarize_expert_neuron_heads``'s, expert by
    expert, laid end to end; past the layer's width, nothing is counted.

    Counts, positions and tokens are equal; values to float32 rounding past the first layer: a
    bridge whose earlier expert layers' hooks are cached (the whole-model run caches them all)
    computes them on another path, equal to rounding (the per-layer run caches one layer's)."""
    for layer in _expert_layers(model):
        per = summarize_expert_neuron_heads(model, corpus, layer=layer, **OPTIONS)
        assert whole.groups[layer] == list(zip(per.experts, per.n_neuron_heads, strict=True))
        assert (whole.n_positions, whole.n_rows) == (per.n_positions, per.n_rows)
        start = 0
        for i, expert in enumerate(per.experts):
            heads = slice(start, start + per.n_neuron_heads[i])
            assert torch.equal(whole.fire_count[layer, heads], per.fire_count[i])
            assert bool((whole.head_positions()[layer, heads] == per.routed_count[i]).all())
            torch.testing.assert_close(
                whole.firing_fraction()[layer, heads], per.firing_fraction(expert),
                rtol=0, atol=0, equal_nan=True,
            )  # fmt: skip
            for ranking in RANKINGS:
                for name in FIELDS:  # indices exactly; values to float32 rounding
                    tol = TOL if name in ("values", "self_weight", "z") else 0
                    torch.testing.assert_close(
                        getattr(whole.top[ranking][layer], name)[heads],
                        getattr(per.top[ranking][i], name), rtol=tol, atol=tol, equal_nan=True,
                    )  # fmt: skip
            n = per.n_neuron_heads[i]
            labels = [whole.label(layer, start + h) for h in range(n)]
            assert labels == [per.label(expert, h) for h in range(n)]
            start += n
        width = whole.layer_width(layer)
        assert start == width == whole.top["self"][layer].values.shape[0]
        assert not whole.fire_count[layer, width:].any()
        assert whole.firing_fraction()[layer, width:].isnan().all()


def test_expert_heads_equal_the_expert_summaries(moe):
    """Each expert head's firing count, fraction, positions counted (the tokens routed to its
    expert), top contexts and label are ``summarize_expert_neuron_heads``'s."""
    _, bridge, whole = moe
    _check_against_expert_tool(bridge, _corpus(), whole)


def test_expert_heads_token_statistics_over_their_routed_tokens(moe):
    """Layer 1's per-token statistics of each expert head equal sums by hand over the tokens
    routed to its expert (plain hooks per row, routing read in the same pass): positions per
    token, firings per token, and hook_post per token (K = 1: the neuron's only head's z)."""
    name, bridge, whole = moe
    corpus = _corpus()
    experts = [e for e, _ in whole.groups[LAYER]]
    assert experts == [*range(N_EXPERTS), *([SHARED_MODELS[name]] if name in SHARED_MODELS else [])]
    assert whole.n_heads_per_neuron == 1
    ref = _reference(bridge, corpus, experts)
    V = whole.d_vocab
    start = 0
    for i, (expert, n) in enumerate(whole.groups[LAYER]):
        routed = ref[expert]
        toks = torch.tensor([int(corpus[r][t]) for r, t, _, _ in routed])
        self_w = torch.stack([s for _, _, s, _ in routed])  # [routed, n]
        z = torch.stack([z for _, _, _, z in routed])
        count = torch.bincount(toks, minlength=V)
        assert torch.equal(whole.group_token_count[LAYER, i], count)
        assert int(whole.group_positions[LAYER, i]) == len(routed)
        heads = slice(start, start + n)
        assert torch.equal(whole.head_token_count()[LAYER, heads], count.expand(n, V))
        fires = torch.zeros(n, V, dtype=torch.long).index_add_(1, toks, (self_w > 0.5).T.long())
        assert torch.equal(whole.fire_count_by_token[LAYER, heads], fires)
        post = torch.zeros(n, V, dtype=torch.float64).index_add_(1, toks, z.T)
        torch.testing.assert_close(whole.post_sum_by_token[LAYER, heads], post, rtol=TOL, atol=TOL)
        seen = count > 0
        by_token = whole.firing_fraction_by_token()[LAYER, heads]
        torch.testing.assert_close(by_token[:, seen], fires[:, seen] / count[seen].double())
        assert by_token[:, ~seen].isnan().all()
        start += n


def test_a_dense_layer_beside_expert_layers_is_read_by_hand():
    """DeepSeek-V3: layer 0 (dense, 96 heads) beside layer 1 (4 experts and the shared one, 240
    heads): layer 0's figures are those read by hand from ``run_with_cache`` row by row, every
    position counted; past its width nothing is counted (0, NaN ratios, no top context)."""
    bridge = convert_zoo_bridge(build_bridge("deepseek_v3", torch.float32))
    corpus = _corpus()
    whole = summarize_neuron_heads(bridge, corpus, **OPTIONS)
    width = 96
    assert whole.groups[0] == [(None, width)] and whole.layer_width(1) == whole.n_neuron_heads
    assert whole.layer_width(0) == width < whole.n_neuron_heads
    rows = []
    for row in corpus:
        with torch.no_grad():
            _, cache = bridge.run_with_cache(row[None])
        rows.append(
            (
                cache["blocks.0.mlp.hook_pattern"][0, :, :, 0].T,  # [pos, heads]
                cache["blocks.0.mlp.hook_z"][0, :, :, 0],
                cache["blocks.0.mlp.hook_post"][0],
            )
        )
    self_w, z, post = (torch.cat([r[i] for r in rows]) for i in range(3))
    toks = torch.cat(corpus)
    n = len(toks)
    assert self_w.shape == (n, width) and whole.n_positions == n
    assert torch.equal(whole.fire_count[0, :width], (self_w > 0.5).sum(0))
    assert bool((whole.head_positions()[0, :width] == n).all())
    fraction = whole.firing_fraction()[0]
    torch.testing.assert_close(fraction[:width], (self_w > 0.5).sum(0).double() / n)
    assert fraction[width:].isnan().all() and not whole.fire_count[0, width:].any()
    for ranking, values in (("self", self_w), ("abs_z", z.abs())):
        top = whole.top[ranking][0]
        assert top.values.shape[0] == width
        best = values.topk(OPTIONS["k"], dim=0).values.T
        torch.testing.assert_close(top.values, best, rtol=TOL, atol=TOL)
    count = torch.bincount(toks, minlength=whole.d_vocab)
    assert torch.equal(whole.token_count, count)
    post_sum = torch.zeros(width, whole.d_vocab, dtype=torch.float64)
    post_sum.index_add_(1, toks, post.T.double())
    torch.testing.assert_close(whole.post_sum_by_token[0, :width], post_sum, rtol=TOL, atol=TOL)
    fires = torch.zeros(width, whole.d_vocab, dtype=torch.long)
    assert torch.equal(
        whole.fire_count_by_token[0, :width], fires.index_add_(1, toks, (self_w > 0.5).T.long())
    )
    assert whole.mean_post_by_token()[0, width:].isnan().all()
    assert whole.firing_auc_by_token(min_count=1)[0, width:].isnan().all()
    assert [whole.label(0, h) for h in (0, width - 1)] == ["L0N0", f"L0N{width - 1}"]
    with pytest.raises(IndexError, match="96 neuron-heads"):
        whole.label(0, width)


@hooked_only("NeuronHeadMoE")
def test_attn_only_transformer_moe_expert_heads_equal_the_expert_summaries():
    """TL 3.x: an ``AttnOnlyTransformer`` of TransformerLens's ``NeuronHeadMoE`` layers (no
    shared expert), every layer an expert layer."""
    from conftest import make_model, make_tokens

    import tl_attnonly

    original = make_model(
        "silu", torch.float32, 0, normalization_type="RMS", num_experts=4, experts_per_token=2
    )
    converted = tl_attnonly.convert(original)
    corpus = [make_tokens(batch=1, pos=n, seed=i)[0] for i, n in enumerate((10, 4, 7, 10, 3))]
    whole = summarize_neuron_heads(converted, corpus, **OPTIONS)
    assert _expert_layers(converted) == list(range(converted.cfg.n_layers))
    assert all([e for e, _ in groups] == [0, 1, 2, 3] for groups in whole.groups)
    _check_against_expert_tool(converted, corpus, whole)


def test_rank_save_load_and_page_of_expert_heads(moe, tmp_path):
    """``rank`` orders a layer's heads (its own width only) as a hand sort of the statistic does;
    ``save`` then ``load`` gives back equal summaries (groups, counts, labels); the HTML page
    names expert heads by their labels and gives each its routed positions."""
    name, bridge, whole = moe
    width = whole.layer_width(LAYER)
    for by, score in (
        ("firing_fraction", whole.firing_fraction()[LAYER, :width]),
        ("max_abs_z", whole.top["abs_z"][LAYER].values[:, 0]),
        ("selectivity", whole.firing_auc_by_token(5)[LAYER, :width].nan_to_num(0.0).amax(-1)),
    ):
        by_hand = score.double().nan_to_num(nan=-torch.inf).argsort(descending=True)
        assert whole.rank(LAYER, by, level="head") == by_hand.tolist()
        assert whole.rank(LAYER, by, top=4) == by_hand[:4].tolist()  # K = 1
    loaded = NeuronHeadSummaries.load(whole.save(tmp_path / "moe"))
    assert loaded.groups == whole.groups
    for attr in ("n_layers", "d_mlp", "n_heads_per_neuron", "n_positions", "n_rows", "meta"):
        assert getattr(loaded, attr) == getattr(whole, attr)
    for attr in ("fire_count", "token_count", "post_sum_by_token", "fire_count_by_token",
                 "group_positions", "group_token_count"):  # fmt: skip
        assert torch.equal(getattr(loaded, attr), getattr(whole, attr))
    for ranking in RANKINGS:
        for layer in range(whole.n_layers):
            for field in FIELDS:
                torch.testing.assert_close(
                    getattr(loaded.top[ranking][layer], field),
                    getattr(whole.top[ranking][layer], field), rtol=0, atol=0, equal_nan=True,
                )  # fmt: skip
    torch.testing.assert_close(
        loaded.firing_fraction(), whole.firing_fraction(), rtol=0, atol=0, equal_nan=True
    )
    last = width - 1  # the shared expert's last head, or routed expert 3's
    assert loaded.label(LAYER, last) == whole.label(LAYER, last)
    assert loaded.rank(LAYER, "max_self") == whole.rank(LAYER, "max_self")
    saved = json.loads((tmp_path / "moe" / "summaries.json").read_text())
    assert saved["groups"][LAYER][0] == [0, whole.groups[LAYER][0][1]]
    page = summary_html(loaded, LAYER, heads=[0, last]).html
    n_routed = int(whole.group_positions[LAYER, -1])
    assert (
        f">{whole.label(LAYER, 0)} &mdash;" in page
        and f">{whole.label(LAYER, last)} &mdash;" in page
    )
    assert f"of positions of the {n_routed} routed to its expert" in page
    assert "&lt;bias&gt;" in page
    if name in SHARED_MODELS:
        assert f"L{LAYER}SN" in whole.label(LAYER, last)
    else:
        assert whole.label(LAYER, last) == f"L{LAYER}E3N{whole.groups[LAYER][3][1] - 1}"
    # routed expert 0's contexts: each context token not routed to it is unshaded, so titled
    heads = list(range(whole.groups[LAYER][0][1]))
    top = whole.top["self"][LAYER]
    shown = ~top.values[heads].isneginf()[..., None] & (top.tokens[heads] >= 0)
    not_routed = int((shown & top.self_weight[heads].isnan()).sum())
    page = summary_html(loaded, LAYER, heads=heads).html
    assert page.count("title='not routed to its expert'") == not_routed > 0


def test_a_dense_models_saved_files_are_as_before(tmp_path):
    """A model without mixtures of experts saves no groups: its files are those of earlier
    versions, and files without groups load as a dense model's."""
    bridge = convert_zoo_bridge(build_bridge("llama", torch.float32))
    summ = summarize_neuron_heads(bridge, _corpus(), **OPTIONS)
    assert summ.groups == [] and summ.group_positions is None
    summ.save(tmp_path / "dense")
    saved = json.loads((tmp_path / "dense" / "summaries.json").read_text())
    assert set(saved) == {"n_layers", "d_mlp", "n_heads_per_neuron", "d_vocab", "before", "after",
                          "n_positions", "n_rows", "meta"}  # fmt: skip
    loaded = NeuronHeadSummaries.load(tmp_path / "dense")
    assert loaded.groups == [] and loaded.group_positions is None
    assert torch.equal(loaded.firing_fraction(), summ.firing_fraction())
    assert loaded.label(1, 5) == "L1N5"
