"""Neuron-level rankings and streamed composition top-k."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tokens
from models import BRIDGES, facts, make_converted

import tl_attnonly.analysis.composition as composition
from tl_attnonly.analysis import (
    composition_scores,
    composition_top_k,
    neuron_level,
    neuron_level_pairs,
    top_k,
)
from tl_attnonly.hooks import all_head_refs, head_labels, neuron_act_name


@pytest.fixture(scope="module")
def gelu_k4():
    return make_converted("gelu_new", torch.float64, normalization_type="LN")


@pytest.mark.parametrize("mode", ["Q", "V"])
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("level", ["neuron", "head"])
def test_streamed_top_k_equals_the_full_matrix(gelu_k4, mode, largest, level, monkeypatch):
    monkeypatch.setattr(composition, "_SENDERS_PER_BLOCK", 5)  # many blocks
    full = composition_scores(gelu_k4, mode)
    scores, senders, receivers = full.scores, full.senders, full.receivers
    if level == "neuron":
        scores, senders, receivers = neuron_level_pairs(scores, senders, receivers)
        n_attn = gelu_k4.cfg.n_layers * gelu_k4.cfg.n_heads
        assert len(senders) == (len(full.senders) - n_attn) // 4 + n_attn and "L0N7" in senders
    n_zero = int((scores == 0).sum())
    k = 25
    expected = full.top_k(k, largest=largest, level=level)
    streamed = composition_top_k(gelu_k4, mode, k, largest=largest, level=level)
    pairs = list(zip(streamed["sender"], streamed["receiver"], strict=True))
    assert len(set(pairs)) == k  # no pair twice (at neuron level: not K^2 times)
    # The K heads of a neuron tie (composition is scale-free): compare scores, then check that
    # every streamed pair has the score the full matrix gives it.
    rows = {label: i for i, label in enumerate(senders)}
    cols = {label: j for j, label in enumerate(receivers)}
    for sender, receiver, score in streamed.itertuples(index=False):
        assert scores[rows[sender], cols[receiver]].item() == pytest.approx(score, abs=1e-12)
    if largest:
        torch.testing.assert_close(
            torch.tensor(streamed["score"].to_numpy()), torch.tensor(expected["score"].to_numpy())
        )
    else:  # the full matrix also holds the zeros of pairs that cannot compose
        assert n_zero > 0 and (streamed["score"] > 0).all()
        nonzero = scores[scores > 0].sort().values[:k]
        torch.testing.assert_close(torch.tensor(streamed["score"].to_numpy()), nonzero)


def test_every_head_of_a_neuron_has_the_neurons_composition_score(gelu_k4):
    """Why neuron level may score one head per neuron: the K heads' scores are equal."""
    for mode in ("Q", "V"):
        full = composition_scores(gelu_k4, mode)
        n_attn = gelu_k4.cfg.n_layers * gelu_k4.cfg.n_heads
        neuron_rows = full.scores[n_attn:].reshape(-1, 4, full.scores.shape[1])
        torch.testing.assert_close(
            neuron_rows, neuron_rows[:, :1].expand_as(neuron_rows), rtol=1e-12, atol=1e-14
        )
        neuron_cols = full.scores[:, n_attn:].reshape(full.scores.shape[0], -1, 4)
        torch.testing.assert_close(
            neuron_cols, neuron_cols[..., :1].expand_as(neuron_cols), rtol=1e-12, atol=1e-14
        )
        assert neuron_rows.abs().sum() > 0 and neuron_cols.abs().sum() > 0


def test_streaming_needs_no_budget_where_the_matrix_is_refused(gelu_k4):
    with pytest.raises(MemoryError, match="composition_top_k"):
        composition_scores(gelu_k4, "V", max_bytes=1000)
    assert len(composition_top_k(gelu_k4, "V", 3)) == 3


def test_neuron_level_sums_each_neurons_heads_exactly():
    labels = head_labels(all_head_refs(facts(make_model_k4())), 4)
    values = torch.arange(len(labels), dtype=torch.float64)  # integers: sums are exact
    summed, units = neuron_level(values, labels)
    assert units[0] == "L0H0" and "L0N0" in units and "L0N0.0" not in units
    i = units.index("L1N7")
    heads = [labels.index(f"L1N7.{k}") for k in range(4)]
    assert summed[i] == values[heads].sum()
    assert torch.equal(summed.sum(), values.sum())


def make_model_k4():
    return make_converted("gelu_new", torch.float64, d_mlp=8)


def test_neuron_level_of_head_outputs_is_the_neurons_post(gelu_k4):
    """Summing a neuron's K heads' z gives its hook_post (the neuron's activation)."""
    stored = {} if BRIDGES else dict(derive=False)  # every entry stored (AttnOnlyTransformer)
    _, cache = gelu_k4.run_with_cache(make_tokens(), **stored)
    layer = 1
    z = cache[neuron_act_name("z", layer)][..., 0]  # [batch, pos, n_neuron_heads]
    labels = [f"L{layer}N{h // 4}.{h % 4}" for h in range(z.shape[-1])]
    per_neuron, units = neuron_level(z.permute(2, 0, 1), labels)
    assert units == [f"L{layer}N{i}" for i in range(gelu_k4.cfg.d_mlp)]
    post = cache[neuron_act_name("post", layer)].permute(2, 0, 1)
    torch.testing.assert_close(per_neuron, post, rtol=0, atol=1e-14)


def test_top_k_ranks_neurons_by_default(gelu_k4):
    labels = head_labels(all_head_refs(facts(gelu_k4)), 4)
    scores = torch.zeros(len(labels), dtype=torch.float64)
    for k, value in enumerate([0.4, 0.3, -0.2, 0.1]):  # neuron L0N2: 0.6 in all; heads <= 0.4
        scores[labels.index(f"L0N2.{k}")] = value
    scores[labels.index("L1N5.0")] = 0.5
    by_neuron = top_k(scores, labels, k=2)
    assert by_neuron["label"].tolist() == ["L0N2", "L1N5"]
    torch.testing.assert_close(float(by_neuron["score"][0]), 0.6)
    assert top_k(scores, labels, k=2, level="head")["label"].tolist() == ["L1N5.0", "L0N2.0"]
    with pytest.raises(ValueError, match="level"):
        top_k(scores, labels, level="layer")
