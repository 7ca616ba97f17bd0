"""circuitsvis draws neuron-heads with every self weight visible, on both model kinds.

Read from the rendered HTML (the properties passed to circuitsvis's ``render``): tokens start
with the bias token ``"<bias>"``; row ``1 + q`` holds token ``q``'s weight on the bias token in
column 0 and its weight on itself on the diagonal (``1 + q``), so circuitsvis's causal mask
(everything above the diagonal) hides nothing; every other entry is 0.
``dense_neuron_pattern`` (TransformerLens's layout plus a bias key) puts every self weight above
the diagonal, which is why it is not a circuitsvis input (its docstring says so).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import circuitsvis as cv
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from kinds import make_pair, make_tokens  # noqa: E402

from tl_attnonly import dense_neuron_pattern  # noqa: E402
from tl_attnonly.hooks import neuron_act_name  # noqa: E402
from tl_attnonly.vis import (  # noqa: E402
    BIAS_TOKEN,
    circuitsvis_pattern_args,
    neuron_head_attention_view,
)

POS = 6
STR_TOKENS = [f"t{i}" for i in range(POS)]
HEADS = [0, 5, 17, 23]
#: The views round weights to 4 decimals.
ROUNDING = 5e-5


def rendered_props(html: str) -> tuple[str, dict]:
    """The component and the properties of the ``render(id, component, props)`` call in ``html``."""
    match = re.search(
        r'render\(\s*"circuits-vis-[^"]+",\s*(?:CircuitsVis\.)?(\w+),\s*(\{.*\})\s*\)', html, re.S
    )
    assert match is not None, "no circuitsvis render call in the HTML"
    return match.group(1), json.loads(match.group(2))


def check_square(props: dict, pattern: torch.Tensor, atol: float) -> None:
    """``props`` draws ``pattern`` (``[head, pos, (self, bias)]``) as bias-first squares."""
    assert props["tokens"] == [BIAS_TOKEN, *STR_TOKENS]
    attention = np.asarray(props["attention"], dtype=np.float64)
    expected = pattern.double().numpy()
    assert attention.shape == (len(expected), 1 + POS, 1 + POS)
    for h, square in enumerate(attention):
        assert square[0, 0] == 1 and not square[0, 1:].any()  # the bias token's own row
        for q in range(POS):
            row = square[1 + q]
            np.testing.assert_allclose(row[1 + q], expected[h, q, 0], atol=atol)  # self: diagonal
            np.testing.assert_allclose(row[0], expected[h, q, 1], atol=atol)  # bias: column 0
            assert not np.delete(row, [0, 1 + q]).any()
            assert row[1 + q] > 0 and row[1 + q] + row[0] == pytest.approx(1, abs=2 * atol)
        assert not np.triu(square, k=1).any()  # nothing where the causal mask would hide it


@pytest.fixture(scope="module")
def patterns():
    """Layer 1's neuron-head patterns of one prompt: ``{kind: (cache, [head, pos, 2])}``."""
    hooked, bridge = make_pair("gpt2")
    tokens = make_tokens(batch=1, pos=POS)
    out = {}
    for kind, model in (("AttnOnlyTransformer", hooked), ("bridge", bridge)):
        if model is not None:
            _, cache = model.run_with_cache(tokens)
            out[kind] = cache, cache[neuron_act_name("pattern", 1)][0, HEADS].detach()
    return out


def test_the_neuron_head_view_draws_every_self_weight(patterns):
    drawn = {}
    for kind, (cache, pattern) in patterns.items():
        view = neuron_head_attention_view(cache, 1, STR_TOKENS, heads=HEADS)
        component, props = rendered_props(view.local_src)
        assert component == "AttentionHeads" and props["maskUpperTri"] is True
        assert props == json.loads(view.props)
        assert props["attentionHeadNames"] == [f"L1N{h}" for h in HEADS]
        check_square(props, pattern, ROUNDING)
        drawn[kind] = np.asarray(props["attention"])
    if len(drawn) == 2:  # the two kinds draw the same weights (to the views' rounding)
        np.testing.assert_allclose(drawn["bridge"], drawn["AttnOnlyTransformer"], atol=2e-4)


@pytest.mark.parametrize("view", ["attention_patterns", "attention_heads"])
def test_circuitsvis_own_views_draw_every_self_weight_from_the_args(patterns, view):
    for _, pattern in patterns.values():
        html = getattr(cv.attention, view)(**circuitsvis_pattern_args(pattern, STR_TOKENS))
        component, props = rendered_props(html.cdn_src)
        assert component == {"attention_patterns": "AttentionPatterns"}.get(view, "AttentionHeads")
        check_square(props, pattern, 1e-6)


def test_the_args_refuse_tokens_that_do_not_match_the_pattern(patterns):
    _, pattern = next(iter(patterns.values()))
    with pytest.raises(ValueError, match="5 tokens given for a cache of 6 positions"):
        circuitsvis_pattern_args(pattern, STR_TOKENS[:5])
    with pytest.raises(ValueError, match="Index the batch first"):
        circuitsvis_pattern_args(pattern[None], STR_TOKENS)


def test_dense_patterns_put_the_self_weights_where_circuitsvis_masks_them(patterns):
    _, pattern = next(iter(patterns.values()))
    dense = dense_neuron_pattern(pattern[None])[0]  # [head, pos, 1 + pos]
    assert dense.shape == (len(HEADS), POS, 1 + POS)
    for q in range(POS):  # the self weight of query q is key 1 + q: above the diagonal
        assert torch.equal(dense[:, q, 1 + q], pattern[:, q, 0])
    assert torch.equal(torch.tril(dense[..., :POS]).sum(-1), pattern[..., 1])  # only the bias
    doc = dense_neuron_pattern.__doc__ or ""
    assert "Not for circuitsvis" in doc and "circuitsvis_pattern_args" in doc
