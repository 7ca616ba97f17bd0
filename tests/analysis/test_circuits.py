"""OV / QK / full circuits of neuron-heads and composition scores between any heads."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tokens
from models import BRIDGES, facts, make_converted, make_original
from transformer_lens import FactoredMatrix
from transformer_lens.utilities import composition_scores as tl_composition_scores

from tl_attnonly.analysis import (
    bias_token_homogeneous,
    composition_scores,
    homogeneous,
    neuron_attn_scores_from_circuit,
    neuron_full_ov_circuit,
    neuron_full_qk_circuit,
    neuron_ov_circuit,
    neuron_qk_circuit,
    top_k,
)
from tl_attnonly.analysis.composition import _right_matrix
from tl_attnonly.hooks import HeadRef, neuron_act_name


@pytest.fixture(scope="module")
def silu():
    return make_converted("silu", torch.float64, normalization_type="LN")


@pytest.fixture(scope="module")
def gelu():
    model = make_converted("gelu", torch.float64, normalization_type="LN")
    assert facts(model).n_heads_per_neuron > 1
    return model


# ------------------------------------------------------------------------- OV / QK circuits
def test_ov_circuit_is_rank_one_w_in_times_w_out(gelu):
    K, n_neuron_heads = facts(gelu).n_heads_per_neuron, facts(gelu).n_neuron_heads
    ov = neuron_ov_circuit(gelu, 1)
    assert ov.shape == (n_neuron_heads, 16, 16) and ov.mdim == 1
    mlp = facts(gelu).blocks[1].mlp
    f = torch.tensor(mlp.coefficients.f, dtype=torch.float64)
    for h in [0, 1, 5 * K + K - 1]:
        neuron, k = divmod(h, K)
        expected = f[k] * torch.outer(mlp.W_in[:, neuron], mlp.W_out[neuron])
        torch.testing.assert_close(ov.AB[h], expected, rtol=0, atol=1e-12)
    assert neuron_ov_circuit(gelu).shape == (2, n_neuron_heads, 16, 16)
    assert torch.linalg.matrix_rank(ov.AB[3]) == 1


@pytest.mark.parametrize("which", ["silu", "gelu"])
def test_qk_circuit_in_homogeneous_coordinates_gives_the_scores(which, request):
    model = request.getfixturevalue(which)
    blocks = facts(model).blocks
    _, cache = model.run_with_cache(make_tokens())
    for layer in range(model.cfg.n_layers):
        x = blocks[layer].ln2(cache[f"blocks.{layer}.hook_resid_mid"])  # the MLP input
        from_circuit = neuron_attn_scores_from_circuit(model, layer, x)
        scores = cache[neuron_act_name("attn_scores", layer)]
        torch.testing.assert_close(from_circuit, scores, rtol=0, atol=1e-10)
    qk = neuron_qk_circuit(model, 0)
    assert qk.shape == (facts(model).n_neuron_heads, 17, 17) and qk.mdim == 1
    # Score of query x on a key y does not depend on y; the bias token scores 0.
    x, y = homogeneous(torch.randn(2, 16, dtype=torch.float64)).unbind(0)
    mlp = blocks[0].mlp
    expected = (x[:16] @ mlp.W_Q[:, :, 0].T) + mlp.b_Q[:, 0]
    torch.testing.assert_close(x @ qk.AB @ y, expected)
    torch.testing.assert_close(x @ qk.AB @ bias_token_homogeneous(model), 0 * expected)


def test_full_circuits(silu):
    layer = 1
    W_E, W_U = silu.W_E, silu.W_U
    ov = neuron_full_ov_circuit(silu, layer)
    n_neuron_heads = facts(silu).n_neuron_heads
    assert ov.shape == (n_neuron_heads, 61, 61)
    mlp = facts(silu).blocks[layer].mlp
    torch.testing.assert_close(ov.AB[4], W_E @ mlp.W_V[4] @ mlp.W_O[4] @ W_U)
    qk = neuron_full_qk_circuit(silu, layer)
    assert qk.shape == (n_neuron_heads, 61, 62)
    full = qk.AB[7]
    torch.testing.assert_close(full[:, 0], torch.zeros(61, dtype=torch.float64))  # bias token
    q = W_E @ mlp.W_Q[7, :, 0] + mlp.b_Q[7, 0]  # query of each token
    torch.testing.assert_close(full[:, 1:], q[:, None].expand(61, 61))


# ------------------------------------------------------------------------- composition scores
@pytest.mark.parametrize("mode", ["Q", "K", "V"])
def test_attention_pairs_equal_transformer_lens(silu, mode):
    scores = composition_scores(silu, mode)
    tl = silu.all_composition_scores(mode)  # [layer, head, layer, head]
    n_heads = silu.cfg.n_heads
    for l1 in range(2):
        for l2 in range(2):
            rows = [scores.senders.index(f"L{l1}H{h}") for h in range(n_heads)]
            cols = [scores.receivers.index(f"L{l2}H{h}") for h in range(n_heads)]
            torch.testing.assert_close(
                scores.scores[rows][:, cols], tl[l1, :, l2, :], rtol=1e-6, atol=1e-10
            )
    assert tl[0, :, 1, :].abs().min() > 0  # nothing trivially zero


@pytest.mark.parametrize("mode", ["Q", "V"])
@pytest.mark.parametrize("which", ["silu", "gelu"])
def test_neuron_pairs_equal_transformer_lens_on_the_same_matrices(which, mode, request):
    model = request.getfixturevalue(which)
    pairs = [
        (HeadRef("attn", 0, 1), HeadRef("neuron", 0, 3)),  # attention head -> neuron-head
        (HeadRef("neuron", 0, 2), HeadRef("attn", 1, 0)),  # neuron-head -> attention head
        (HeadRef("neuron", 0, 5), HeadRef("neuron", 1, 7)),  # neuron-head -> neuron-head
        (HeadRef("attn", 0, 0), HeadRef("attn", 1, 1)),
    ]
    senders = [s for s, _ in pairs]
    receivers = [r for _, r in pairs]
    ours = composition_scores(model, mode, senders, receivers)
    blocks = facts(model).blocks
    for i, (s, r) in enumerate(pairs):
        if s.kind == "attn":
            left = FactoredMatrix(blocks[s.layer].attn.W_V, blocks[s.layer].attn.W_O)
        else:
            left = neuron_ov_circuit(model, s.layer)
        right = _right_matrix(facts(model), r.kind, r.layer, mode)
        expected = tl_composition_scores(left[s.head], right[r.head])
        assert ours.scores[i, i].item() == pytest.approx(expected.item(), rel=1e-6)
        assert ours.scores[i, i] > 0


def test_neuron_composition_closed_forms(silu):
    """SiLU: W_Q = W_V = W_in column. Neuron -> neuron Q = V = |cos(W_out[i], W_in[:, j])|."""
    n = facts(silu).n_neuron_heads
    senders = [HeadRef("neuron", 0, i) for i in range(n)]
    receivers = [HeadRef("neuron", 1, j) for j in range(n)]
    w_out = facts(silu).blocks[0].mlp.W_out
    w_in = facts(silu).blocks[1].mlp.W_in
    cos = (w_out / w_out.norm(dim=-1, keepdim=True)) @ (w_in / w_in.norm(dim=0, keepdim=True))
    for mode in ("Q", "V"):
        torch.testing.assert_close(
            composition_scores(silu, mode, senders, receivers).scores, cos.abs(), rtol=1e-6, atol=0
        )
    # Keys are constant: nothing K-composes with a neuron-head.
    assert composition_scores(silu, "K", senders, receivers).scores.abs().max() == 0
    # Receivers that read before the sender writes score 0, as in TransformerLens.
    back = composition_scores(silu, "Q", receivers, senders + [HeadRef("attn", 1, 0)])
    assert back.scores.abs().max() == 0
    same_layer = composition_scores(silu, "V", ["L0H0", "L0N1"], ["L0N1", "L0H0"])
    assert same_layer.scores[0, 0] > 0  # attention L0 -> neuron-heads L0: MLP reads resid_mid
    assert same_layer.scores[1, 1] == 0 and same_layer.scores[0, 1] == 0


def test_parallel_blocks_do_not_compose_within_a_layer():
    model = make_converted("silu", torch.float64, parallel_attn_mlp=True)
    scores = composition_scores(model, "V", ["L0H0", "L0H1"], ["L0N0", "L1N0"]).scores
    assert (scores[:, 0] == 0).all() and (scores[:, 1] > 0).all()


def test_top_k_and_frames(silu):
    scores = composition_scores(silu, "Q")
    best = scores.top_k(5)
    assert list(best.columns) == ["sender", "receiver", "score"] and len(best) == 5
    flat = scores.scores.flatten()
    assert best["score"].tolist() == pytest.approx(flat.topk(5).values.tolist())
    i, j = divmod(int(flat.argmax()), scores.scores.shape[1])
    assert (best.loc[0, "sender"], best.loc[0, "receiver"]) == (
        scores.senders[i],
        scores.receivers[j],
    )
    frame = scores.to_frame()
    assert frame.shape == scores.scores.shape and frame.index[0] == "L0H0"
    vec = torch.tensor([0.5, -3.0, 2.0])
    t = top_k(vec, ["a", "b", "c"], k=2, absolute=True)
    assert t["label"].tolist() == ["b", "c"] and t["score"].tolist() == [-3.0, 2.0]
    assert top_k(vec, ["a", "b", "c"], k=1, largest=False)["label"].tolist() == ["b"]
    with pytest.raises(ValueError, match="Labels"):
        top_k(vec, ["a"])
    with pytest.raises(MemoryError, match="senders="):
        composition_scores(silu, "Q", max_bytes=100)
    with pytest.raises(ValueError, match="mode"):
        composition_scores(silu, "O")  # type: ignore[arg-type]


def test_literal_and_unconverted_models_are_refused_with_directions():
    model = make_original("silu")
    with pytest.raises(TypeError, match=r"tl_attnonly\.convert\(model\)"):
        neuron_ov_circuit(model, 0)
    if not BRIDGES:  # the literal form is a HookedTransformer's (TL 3)
        from tl_attnonly import to_literal

        with pytest.raises(TypeError, match="structured form.*hooks"):
            neuron_ov_circuit(to_literal(model), 0)
