"""A converted GPT-2 bridge and the AttnOnlyTransformer of the same weights agree, hook by hook.

TransformerLens 3.x only (it builds the HookedTransformer from the Hugging Face weights with TL's
``convert_gpt2_weights``, no weight processing, like the raw bridge).
"""

from __future__ import annotations

import pytest
import torch
from bridge_models import make_hf, make_tokens

import tl_attnonly
from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER

pytestmark = pytest.mark.skipif(not HAS_HOOKED_TRANSFORMER, reason="needs HookedTransformer")

HOOKS = ("q", "v", "attn_scores", "pattern", "z", "result")


def test_gpt2_bridge_neuron_heads_equal_attn_only_transformer():
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    hf, config = make_hf("gpt2")
    cfg = HookedTransformerConfig(
        n_layers=2, d_model=32, d_head=8, n_heads=4, d_mlp=128, d_vocab=64, n_ctx=64,
        act_fn="gelu_new", normalization_type="LN", dtype=torch.float64,
    )
    hooked = HookedTransformer(cfg)
    hooked.load_state_dict(convert_gpt2_weights(hf, cfg), strict=False)
    bridge = build_bridge_from_module(hf, "GPT2LMHeadModel", hf_config=config)
    tokens = make_tokens()
    torch.testing.assert_close(hooked(tokens), bridge(tokens), rtol=0, atol=1e-12)

    converted = tl_attnonly.convert(hooked)
    converted.set_use_neuron_result(True)
    tl_attnonly.convert(bridge)
    tl_attnonly.bridge.set_use_neuron_result(bridge, True)
    logits, cache = converted.run_with_cache(tokens)
    bridge_logits, bridge_cache = bridge.run_with_cache(tokens)
    torch.testing.assert_close(bridge_logits, logits, rtol=0, atol=1e-12)
    for layer in range(2):
        for hook in HOOKS:
            name = f"blocks.{layer}.mlp.hook_{hook}"
            torch.testing.assert_close(bridge_cache[name], cache[name], rtol=0, atol=1e-12)
    # the head weights too
    ours = tl_attnonly.bridge.neuron_head_layers(bridge)[1]
    theirs = converted.blocks[1].mlp
    for weight in ("W_Q", "b_Q", "W_V", "b_V", "W_O", "b_O"):
        torch.testing.assert_close(getattr(ours, weight), getattr(theirs, weight), msg=weight)
