"""MLP-qualified cache keys mean the neuron-heads on both model kinds.

``cache["pattern", l, "mlp"]`` (and ``q, k, v, attn_scores, z, result``; ``"m"`` for ``"mlp"``;
the shorthand ``"pattern0mlp"``) is ``blocks.{l}.mlp.hook_pattern`` in an
``AttnOnlyTransformer``'s cache. A converted bridge's ``run_with_cache`` is TransformerLens's own,
whose plain ``ActivationCache`` sends those keys to the attention layer (checked here, as the
README says); ``tl_attnonly.neuron_head_cache(cache)`` gives the neuron-heads there too, with the
``AttnOnlyTransformer``'s shapes and values (``tests/kinds.py``: the same weights as both kinds).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from kinds import make_bridge, make_pair, make_tokens  # noqa: E402

import tl_attnonly  # noqa: E402
from tl_attnonly.bridge import set_use_neuron_result  # noqa: E402
from tl_attnonly.hooked.derived_cache import NeuronHeadActivationCache  # noqa: E402
from tl_attnonly.hooks import neuron_act_name  # noqa: E402

#: Neuron-head hooks a tuple key with layer type "mlp" reaches.
KINDS = ("q", "k", "v", "attn_scores", "pattern", "z", "result")
#: Agreement of the two kinds (relative to the largest value): float64 for GPT-2; the LLaMA
#: bridge computes its attention softmax in float32 (tests/analysis/test_both_kinds.py).
RTOL = {"gpt2": 1e-10, "llama_gqa": 1e-5}


def _keys(kind: str, layer: int) -> list:
    """Every way to write ``kind`` of the neuron-heads of ``layer`` (of 2) as a cache key."""
    keys = [(kind, layer, "mlp"), (kind, layer - 2, "mlp"), (kind, layer, "m")]
    if kind.isalpha():  # get_act_name's shorthand takes letters, then the layer
        keys += [f"{kind}{layer}mlp", f"{kind}{layer}m"]
    alias = {"pattern": "attn", "attn_scores": "attn_logits", "q": "query", "k": "key"}
    if kind in alias:
        keys.append((alias[kind], layer, "mlp"))
    return keys


@pytest.fixture(scope="module", params=sorted(RTOL))
def runs(request):
    """``(family, AttnOnlyTransformer cache or None on TL 4.x, converted bridge's cache)``."""
    hooked, bridge = make_pair(request.param)
    set_use_neuron_result(bridge, True)
    tokens = make_tokens(batch=2, pos=8)
    _, bridge_cache = bridge.run_with_cache(tokens)
    hooked_cache = None
    if hooked is not None:
        hooked.set_use_neuron_result(True)
        _, hooked_cache = hooked.run_with_cache(tokens)
    return request.param, hooked_cache, bridge_cache


def test_mlp_keys_reach_the_neuron_heads_of_a_wrapped_bridge_cache(runs):
    _, _, plain = runs
    cache = tl_attnonly.neuron_head_cache(plain)
    assert isinstance(cache, NeuronHeadActivationCache)
    n_neuron_heads = plain[neuron_act_name("pattern", 0)].shape[1]
    for layer in range(2):
        for kind in KINDS:
            stored = plain[neuron_act_name(kind, layer)]  # the bridge's hook, by full name
            for key in _keys(kind, layer):
                assert cache[key] is stored, (kind, layer, key)
        assert cache["pattern", layer, "mlp"].shape == (2, n_neuron_heads, 8, 2)
        # every other key as TransformerLens resolves it
        for key in (("pattern", layer), ("z", layer, "attn"), ("post", layer, "mlp")):
            assert cache[key] is plain[key]
    assert torch.equal(
        cache.stack_activation("pattern", sublayer_type="mlp"),
        torch.stack([plain[neuron_act_name("pattern", layer)] for layer in range(2)]),
    )


def test_a_plain_bridge_cache_sends_mlp_keys_to_the_attention_layer(runs):
    """TransformerLens's own resolution, which the README documents: the reason for the wrapper."""
    _, _, plain = runs
    assert type(plain).__name__ == "ActivationCache"
    assert plain["pattern", 0, "mlp"] is plain["blocks.0.attn.hook_pattern"]
    assert plain["pattern", 0, "mlp"].shape[-2:] == (8, 8)  # [batch, n_heads, pos, pos]
    assert plain["z", 0, "mlp"] is plain["blocks.0.attn.hook_z"]


def test_both_kinds_give_the_same_neuron_heads_for_mlp_keys(runs):
    family, hooked, plain = runs
    if hooked is None:
        pytest.skip("needs HookedTransformer (TransformerLens 3.x) for the second kind")
    cache = tl_attnonly.neuron_head_cache(plain)
    for layer in range(2):
        for kind in KINDS:
            expected = hooked[neuron_act_name(kind, layer)]
            for key in _keys(kind, layer):
                got_hooked, got_bridge = hooked[key], cache[key]
                assert got_hooked.shape == got_bridge.shape == expected.shape, (kind, key)
                assert torch.equal(got_hooked, expected), (kind, key)
                scale = max(1.0, float(expected.abs().max()))
                torch.testing.assert_close(
                    got_bridge, expected, rtol=0, atol=RTOL[family] * scale, msg=str(key)
                )


def test_wrapping_shares_the_tensors_and_keeps_the_cache_methods():
    bridge = make_bridge("gpt2")
    _, plain = bridge.run_with_cache(make_tokens(batch=1, pos=5))
    cache = tl_attnonly.neuron_head_cache(plain)
    assert tl_attnonly.neuron_head_cache(cache) is cache
    assert set(cache.keys()) == set(plain.keys())
    one = cache.remove_batch_dim(batch_size=1)  # TransformerLens 4.x's argument
    assert one["pattern", 1, "mlp"].shape == (24, 5, 2)  # [n_neuron_heads, pos, (self, bias)]


def test_a_cache_of_an_unconverted_model_is_refused():
    _, plain = make_bridge("gpt2", convert=False).run_with_cache(make_tokens(batch=1, pos=4))
    with pytest.raises(ValueError, match="no neuron-head hooks.*tl_attnonly.convert"):
        tl_attnonly.neuron_head_cache(plain)
