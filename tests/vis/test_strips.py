"""neuron_head_strips: two rows per head, the weights on self and on the bias token, per token."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from models import make_converted

from tl_attnonly.hooks import neuron_act_name
from tl_attnonly.vis import (
    neuron_activity_heatmap,
    neuron_head_attention_view,
    neuron_head_scores,
    neuron_head_strips,
    rank_neuron_heads,
)

N_POS = 7


@pytest.fixture(scope="module")
def cache():
    converted = make_converted("gelu_new", dtype=torch.float32)  # K = 4 heads per neuron
    tokens = torch.randint(0, 61, (1, N_POS), generator=torch.Generator().manual_seed(1))
    _, cache = converted.run_with_cache(tokens)
    return cache


STR_TOKENS = [f"t{i}" for i in range(N_POS)]


def test_strips_hold_the_self_and_bias_weights_of_the_most_active_heads(cache):
    fig = neuron_head_strips(cache, 1, STR_TOKENS, top_k=5, level="head")
    self_trace, bias_trace = fig.data
    pattern = cache[neuron_act_name("pattern", 1)][0].numpy()  # [head, pos, (self, bias)]
    shown = neuron_head_scores(cache, 1).argsort(descending=True)[:5].tolist()
    self_rows = np.asarray(self_trace.z, dtype=float)
    bias_rows = np.asarray(bias_trace.z, dtype=float)
    assert self_rows.shape == (15, N_POS)  # self, bias, gap per head
    np.testing.assert_allclose(self_rows[0::3], pattern[shown, :, 0], atol=1e-6)
    np.testing.assert_allclose(bias_rows[1::3], pattern[shown, :, 1], atol=1e-6)
    np.testing.assert_allclose(self_rows[0::3] + bias_rows[1::3], 1, atol=1e-6)
    assert np.isnan(self_rows[1::3]).all() and np.isnan(bias_rows[0::3]).all()
    assert np.isnan(self_rows[2::3]).all() and np.isnan(bias_rows[2::3]).all()  # gaps
    labels = list(fig.layout.yaxis.ticktext)
    assert labels == [f"L1N{h // 4}.{h % 4}" for h in shown]
    assert list(fig.layout.xaxis.ticktext) == STR_TOKENS


def test_strips_of_chosen_neurons_and_errors(cache):
    fig = neuron_head_strips(cache, 0, STR_TOKENS, neurons=[3])
    assert list(fig.layout.yaxis.ticktext) == [f"L0N3.{k}" for k in range(4)]
    with pytest.raises(IndexError, match="layer 2 is out of range"):
        neuron_head_strips(cache, 2, STR_TOKENS)
    with pytest.raises(ValueError, match="tokens given"):
        neuron_head_strips(cache, 0, STR_TOKENS[:-1])


def test_many_heads_stay_compact(cache):
    fig = neuron_head_strips(cache, 0, STR_TOKENS, top_k=64, level="head")
    assert fig.layout.height < 64 * 40  # a square view would need ~N x N cells per head


def test_views_rank_neurons_by_default_with_all_their_heads(cache):
    """K = 4: the default ranks neurons by max |sum_k z| (= |hook_post|) and shows their K heads."""
    post = cache[neuron_act_name("post", 1)][0]  # [pos, d_mlp]: the sum of each neuron's heads
    z = cache[neuron_act_name("z", 1)][0, :, :, 0]  # [pos, n_neuron_heads]
    torch.testing.assert_close(z.reshape(N_POS, -1, 4).sum(-1), post, rtol=0, atol=1e-6)
    top = post.abs().amax(0).argsort(descending=True)[:3].tolist()
    expected = [n * 4 + k for n in top for k in range(4)]
    assert rank_neuron_heads(cache, 1, top_k=3) == expected
    assert rank_neuron_heads(cache, 1, top_k=3, level="head") == (
        neuron_head_scores(cache, 1).argsort(descending=True)[:3].tolist()
    )
    fig = neuron_head_strips(cache, 1, STR_TOKENS, top_k=3)
    assert list(fig.layout.yaxis.ticktext) == [f"L1N{h // 4}.{h % 4}" for h in expected]
    view = neuron_head_attention_view(cache, 1, STR_TOKENS, top_k=3)
    assert view.heads == expected and "neurons ranked" in view.caption
    heat = neuron_activity_heatmap(cache, 1, STR_TOKENS, top_k=3)
    assert list(heat.data[0].y) == [f"L1N{h // 4}.{h % 4}" for h in expected]
    with pytest.raises(ValueError, match="level"):
        rank_neuron_heads(cache, 1, level="layer")  # type: ignore[arg-type]
