"""tl_attnonly.vis: the views show the model's neuron-heads, page through them, and save offline."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch
from circuitsvis.utils.render import RenderedHTML
from models import facts, make_converted, make_pair

from tl_attnonly.hooks import dense_neuron_pattern, neuron_act_name
from tl_attnonly.vis import (
    BIAS_TOKEN,
    MAX_HEADS_PER_VIEW,
    NeuronHeadView,
    error_table_figure,
    gelu_fit_error_figure,
    neuron_activity_heatmap,
    neuron_head_activation,
    neuron_head_attention_view,
    neuron_head_scores,
    patching_heatmap,
    save_figure,
    select_neuron_heads,
    square_neuron_pattern,
)

N_POS = 9


@pytest.fixture(scope="module")
def silu():
    """(original, converted), float32 (TL 4: GPT-2 bridges)."""
    return make_pair("silu", dtype=torch.float32)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 61, (2, N_POS), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def cache(silu, tokens):
    _, converted = silu
    _, cache = converted.run_with_cache(tokens)
    return cache


def _str_tokens(tokens, b=0):
    return [f"t{int(t)}" for t in tokens[b]]


def _props(view: NeuronHeadView) -> dict:
    return json.loads(view.props)


# ------------------------------------------------------------------ square patterns
def test_square_pattern_is_the_dense_pattern_with_a_bias_query_row(cache):
    compact = cache[neuron_act_name("pattern", 0)][0]
    square = square_neuron_pattern(compact)
    n_heads = compact.shape[0]
    assert square.shape == (n_heads, N_POS + 1, N_POS + 1)
    torch.testing.assert_close(square[:, 1:], dense_neuron_pattern(compact[None])[0])
    assert torch.all(square[:, 0, 0] == 1) and torch.all(square[:, 0, 1:] == 0)
    torch.testing.assert_close(square.sum(-1), torch.ones(n_heads, N_POS + 1))
    assert torch.all(square.triu(1) == 0)  # causal-looking: circuitsvis can mask the upper part


def test_square_pattern_rejects_a_batch():
    with pytest.raises(ValueError, match="Index the batch"):
        square_neuron_pattern(torch.rand(2, 3, 4, 2))


# ------------------------------------------------------------------ ranking and selection
def test_scores_rank_by_neuron_activation_for_silu(silu):
    model, _ = silu
    # K = 1: z is the neuron's post-activation, read from the *original* model's cache.
    _, original_cache = model.run_with_cache(cache_tokens := torch.arange(N_POS)[None] % 61)
    converted_cache = silu[1].run_with_cache(cache_tokens)[1]
    scores = neuron_head_scores(converted_cache, 1, "z")
    expected = original_cache["blocks.1.mlp.hook_post"][0].abs().amax(0)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    self_w = neuron_head_scores(converted_cache, 1, "self")
    torch.testing.assert_close(
        self_w, torch.sigmoid(original_cache["blocks.1.mlp.hook_pre"][0]).amax(0)
    )
    contrast = neuron_head_scores(converted_cache, 1, "contrast")
    assert torch.all(contrast >= 0) and torch.all(contrast <= 1)
    output = neuron_head_scores(converted_cache, 1, "output")
    W_out = facts(silu[1]).blocks[1].mlp.W_out  # the original's (shared; a bridge's: its c_proj)
    torch.testing.assert_close(output, expected * W_out.norm(dim=-1))
    with pytest.raises(ValueError, match="rank_by"):
        neuron_head_scores(converted_cache, 1, "loudest")


def test_select_orders_by_score_and_keeps_explicit_order():
    scores = torch.tensor([0.1, 0.9, 0.5, 0.7])
    assert select_neuron_heads(scores, 4) == [1, 3, 2, 0]
    assert select_neuron_heads(scores, 4, top_k=2) == [1, 3]
    assert select_neuron_heads(scores, 4, heads=[2, 0]) == [2, 0]
    assert select_neuron_heads(None, 4) == [0, 1, 2, 3]
    with pytest.raises(IndexError, match="neurons="):
        select_neuron_heads(scores, 4, heads=[4])
    with pytest.raises(ValueError, match="top_k"):
        select_neuron_heads(scores, 4, top_k=0)


# ------------------------------------------------------------------ circuitsvis views
def test_view_draws_the_bias_token_first_and_the_models_patterns(silu, cache, tokens):
    _, converted = silu
    view = neuron_head_attention_view(cache, 0, _str_tokens(tokens), heads=[3, 7, 1])
    assert isinstance(view, RenderedHTML)
    props = _props(view)
    assert props["tokens"] == [BIAS_TOKEN, *_str_tokens(tokens)]
    assert props["attentionHeadNames"] == ["L0N3", "L0N7", "L0N1"]
    attention = torch.tensor(props["attention"])
    assert attention.shape == (3, N_POS + 1, N_POS + 1)
    compact = cache[neuron_act_name("pattern", 0)][0, [3, 7, 1]]
    # weight on self on the diagonal (rounded to 4 digits for the page), bias token in column 0
    torch.testing.assert_close(
        attention[:, 1:, 1:].diagonal(dim1=-2, dim2=-1), compact[..., 0], atol=6e-5, rtol=0
    )
    torch.testing.assert_close(attention[:, 1:, 0], compact[..., 1], atol=6e-5, rtol=0)
    assert props["maskUpperTri"] is True


def test_view_from_model_equals_view_from_cache(silu, cache, tokens):
    _, converted = silu
    from_model = neuron_head_attention_view(converted, 1, tokens[1], top_k=5)
    from_cache = neuron_head_attention_view(
        cache, 1, _str_tokens(tokens, 1), top_k=5, batch_index=1
    )
    assert from_model.heads == from_cache.heads
    assert _props(from_model)["attention"] == _props(from_cache)["attention"]


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=5, rank_by="contrast"),
        dict(neurons=[2, 0], level="neuron"),
        dict(heads=[4, 1, 6]),
        dict(top_k=7, rank_by="self", level="head"),
    ],
    ids=range(4),
)
def test_selection_and_keywords_give_identical_views(cache, tokens, kw):
    from tl_attnonly.vis import HeadSelection

    str_tokens = _str_tokens(tokens)
    by_keyword = neuron_head_attention_view(cache, 0, str_tokens, page_size=4, **kw)
    by_selection = neuron_head_attention_view(
        cache, 0, str_tokens, page_size=4, selection=HeadSelection(**kw)
    )
    # A keyword replaces the field of the same name.
    first = next(iter(kw))
    wrong = {"top_k": 1, "neurons": [5], "heads": [0]}[first]
    mixed = neuron_head_attention_view(
        cache,
        0,
        str_tokens,
        page_size=4,
        selection=HeadSelection(**{**kw, first: wrong}),
        **{first: kw[first]},
    )
    for view in (by_selection, mixed):
        assert view.heads == by_keyword.heads and view.caption == by_keyword.caption
        assert _props(view) == _props(by_keyword)
    # The selection matters (the test can fail): the default view shows other heads.
    default = neuron_head_attention_view(cache, 0, str_tokens, page_size=4)
    assert (default.heads, default.caption) != (by_keyword.heads, by_keyword.caption)
    with pytest.raises(TypeError, match="unexpected keyword argument.*'topk'"):
        neuron_head_attention_view(cache, 0, str_tokens, topk=3)


def test_pages_cover_every_head_once_in_rank_order(silu, cache, tokens):
    _, converted = silu
    n = facts(converted).n_neuron_heads
    first = neuron_head_attention_view(cache, 0, _str_tokens(tokens), page_size=10)
    assert first.n_pages == -(-n // 10) and first.n_selected == n
    seen = []
    for page in range(first.n_pages):
        view = neuron_head_attention_view(cache, 0, _str_tokens(tokens), page=page, page_size=10)
        assert len(view.heads) <= 10 and len(_props(view)["attention"]) == len(view.heads)
        seen += view.heads
    assert sorted(seen) == list(range(n))
    scores = neuron_head_scores(cache, 0, "z")
    assert torch.all(scores[seen][:-1] >= scores[seen][1:])  # most active first
    with pytest.raises(IndexError, match="page"):
        neuron_head_attention_view(cache, 0, _str_tokens(tokens), page=first.n_pages, page_size=10)


def test_a_page_never_holds_too_many_heads(cache, tokens):
    with pytest.raises(ValueError, match="page_size"):
        neuron_head_attention_view(cache, 0, _str_tokens(tokens), page_size=MAX_HEADS_PER_VIEW + 1)


def test_view_is_offline_and_script_safe(silu):
    _, converted = silu
    _, cache = converted.run_with_cache(torch.arange(4)[None])
    evil = ["</script><b>x", "a<!--", "&amp;", "\n"]
    view = neuron_head_attention_view(cache, 0, evil, top_k=2)
    page = view._repr_html_()
    assert page == view.local_src  # never the CDN version, no connectivity check
    assert "unpkg.com" not in page and "var CircuitsVis=" in page
    assert "</script><b>" not in page and page.count("</script>") == 1
    assert _props(view)["tokens"] == [BIAS_TOKEN, *evil]
    assert "unpkg.com" in str(view)  # circuitsvis's own str() (CDN) is kept


def test_view_needs_tokens_and_patterns(silu, tokens):
    model, converted = silu
    _, partial = converted.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_z"))
    with pytest.raises(KeyError, match="hook_pattern"):
        neuron_head_attention_view(partial, 0, _str_tokens(tokens))
    _, cache = converted.run_with_cache(tokens)
    with pytest.raises(ValueError, match="tokens"):
        neuron_head_attention_view(cache, 0)
    with pytest.raises(ValueError, match="positions"):
        neuron_head_attention_view(cache, 0, _str_tokens(tokens)[:-1])
    with pytest.raises(TypeError, match="convert"):
        neuron_head_attention_view(model, 0, tokens)


def test_neurons_select_all_their_heads_when_k_is_more_than_one():
    converted = make_converted("gelu", dtype=torch.float32, n_heads_per_neuron=2)
    assert facts(converted).n_heads_per_neuron == 2
    tokens = torch.arange(5)[None]
    view = neuron_head_attention_view(converted, 0, tokens, neurons=[4, 0])
    assert view.heads == [8, 9, 0, 1]
    assert view.labels == ["L0N4.0", "L0N4.1", "L0N0.0", "L0N0.1"]
    with pytest.raises(ValueError, match="not both"):
        neuron_head_attention_view(converted, 0, tokens, neurons=[1], heads=[1])


# ------------------------------------------------------------------ plotly figures
def test_activity_heatmap_shows_weight_on_self(silu, cache, tokens):
    _, converted = silu
    fig = neuron_activity_heatmap(cache, None, _str_tokens(tokens), top_k=6)
    assert isinstance(fig, go.Figure) and len(fig.data) == converted.cfg.n_layers
    for layer, trace in enumerate(fig.data):
        heads = [int(label.split("N")[1]) for label in trace.y]
        expected = cache[neuron_act_name("pattern", layer)][0, heads, :, 0]
        np.testing.assert_allclose(np.asarray(trace.z), expected.numpy(), rtol=1e-6)
        assert heads == neuron_head_scores(cache, layer).argsort(descending=True)[:6].tolist()
    # tokens with equal text stay separate columns
    assert list(fig.layout.xaxis.tickvals) == list(range(N_POS))
    with pytest.raises(ValueError, match="positions"):
        neuron_activity_heatmap(cache, 0, ["a"])


def test_patching_heatmap_accepts_tensors_and_long_frames():
    values = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])
    fig = patching_heatmap(values)
    np.testing.assert_array_equal(np.asarray(fig.data[0].z), values.numpy())
    long = pd.DataFrame(
        [{"layer": i, "head": j, "effect": values[i, j].item()} for i in range(2) for j in range(3)]
    ).sample(frac=1.0, random_state=0)
    fig = patching_heatmap(long)
    np.testing.assert_array_equal(np.asarray(fig.data[0].z), values.numpy())
    assert fig.data[0].zmid == 0
    with pytest.raises(ValueError, match="labels"):
        patching_heatmap(values, head_labels=["a"])


def test_error_table_figure_shows_every_cell():
    df = pd.DataFrame({"activation": ["gelu", "relu"], "K": [1, 2], "max_abs_err": [0.0123, 1e-7]})
    fig = error_table_figure(df, title="errors")
    cells = fig.data[0].cells.values
    assert list(cells[0]) == ["gelu", "relu"] and list(cells[2]) == ["0.0123", "1e-07"]
    with pytest.raises(TypeError, match="DataFrame"):
        error_table_figure(df.to_dict())


def test_neuron_head_activation_matches_the_layer(silu):
    _, converted = silu
    mlp = facts(converted).blocks[0].mlp
    x = torch.linspace(-6, 6, 101)
    approx = neuron_head_activation(mlp.coefficients, x)
    expected = mlp._fused_post(x.double()[None, :, None].expand(1, 101, 1))[0, :, 0]
    np.testing.assert_allclose(approx, expected.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(approx, torch.nn.functional.silu(x.double()).numpy(), atol=1e-12)


def test_gelu_fit_curves_show_the_conversions_error():
    from tl_attnonly import activation_error_table

    fig = gelu_fit_error_figure(ks=(1, 2, 3))
    assert fig.data[0].name == "gelu"
    exact = np.asarray(fig.data[0].y)
    table = activation_error_table("gelu")
    table = table[table["method"] == "fit"].set_index("n_heads")["max_abs_error"]
    curves = {t.name: np.asarray(t.y) for t in fig.data[1:]}
    for k in (1, 2, 3):
        err = np.abs(curves[f"K={k}"] - exact)
        # the curve is the conversion's own approximation: its error is the table's
        np.testing.assert_allclose(err.max(), table[k], rtol=0.05)
        (error_name,) = [n for n in curves if n.startswith(f"K={k} error")]
        np.testing.assert_allclose(curves[error_name], np.maximum(err, 1e-18))
    exact_silu = gelu_fit_error_figure(ks=(1,), activation="silu")
    assert max(np.asarray(exact_silu.data[-1].y)) <= 1e-15  # SiLU is one head, exactly


# ------------------------------------------------------------------ saving
def test_save_html_is_self_contained(tmp_path, cache, tokens):
    fig = patching_heatmap(torch.ones(2, 3))
    path = save_figure(fig, tmp_path / "fig.html")
    text = path.read_text()
    assert not re.search(r"<script[^>]*\ssrc=", text)  # nothing loaded from elsewhere
    assert len(text) > 1_000_000  # plotly.js inlined
    view = neuron_head_attention_view(cache, 0, _str_tokens(tokens), top_k=2)
    text = save_figure(view, tmp_path / "view.html").read_text()
    assert text.startswith("<!DOCTYPE html>") and "var CircuitsVis=" in text
    with pytest.raises(ValueError, match=".png"):
        save_figure(fig, tmp_path / "fig.gif")


def test_png_falls_back_to_html_with_a_clear_message(tmp_path, monkeypatch, cache, tokens):
    import tl_attnonly.vis.export as vis

    fig = patching_heatmap(torch.ones(2, 3))

    def no_chrome(*args, **kwargs):
        raise RuntimeError("Kaleido requires Google Chrome to be installed.")

    monkeypatch.setattr(go.Figure, "write_image", no_chrome)
    with pytest.warns(RuntimeWarning, match="plotly_get_chrome"):
        path = save_figure(fig, tmp_path / "fig.png")
    assert path == tmp_path / "fig.html" and path.exists() and not (tmp_path / "fig.png").exists()
    monkeypatch.setattr(vis, "find_chromium", lambda: None)
    view = neuron_head_attention_view(cache, 0, _str_tokens(tokens), top_k=2)
    with pytest.warns(RuntimeWarning, match="chromium"):
        path = save_figure(view, tmp_path / "view.png")
    assert path.suffix == ".html" and "var CircuitsVis=" in path.read_text()


@pytest.mark.slow
def test_png_export_when_chrome_is_available(tmp_path, cache, tokens):
    import tl_attnonly.vis.export as vis

    if vis.find_chromium() is None:
        pytest.skip("no chromium on PATH")
    view = neuron_head_attention_view(cache, 0, _str_tokens(tokens), top_k=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = save_figure(view, tmp_path / "view.png", width=600, height=400, scale=1)
    assert path.suffix == ".png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(rb"IHDR\x00\x00\x02X", path.read_bytes()[:32])  # 600 px wide
