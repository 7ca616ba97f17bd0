"""Property test: any small random SiLU config converts with fp64-exact logits."""

from __future__ import annotations

import torch
from conftest import make_model, make_tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tl_attnonly import convert


@st.composite
def configs(draw):
    n_heads = draw(st.sampled_from([1, 2, 4]))
    d_head = draw(st.sampled_from([2, 4, 8]))
    overrides = dict(
        n_layers=draw(st.integers(1, 3)),
        n_heads=n_heads,
        d_head=d_head,
        d_model=n_heads * d_head,
        d_mlp=draw(st.integers(1, 40)),
        normalization_type=draw(st.sampled_from(["LN", "LNPre", "RMS", "RMSPre", None])),
        attention_dir=draw(st.sampled_from(["causal", "bidirectional"])),
        parallel_attn_mlp=draw(st.booleans()),
        use_hook_mlp_in=draw(st.booleans()),
        seed=draw(st.integers(0, 10_000)),
    )
    if draw(st.booleans()):
        overrides.update(positional_embedding_type="rotary", rotary_dim=d_head)
    if n_heads > 1 and draw(st.booleans()):
        overrides["n_key_value_heads"] = n_heads // 2
    return overrides


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), st.integers(1, 3), st.integers(1, 12))
def test_random_silu_configs_convert_exactly(overrides, batch, pos):
    seed = overrides.pop("seed")
    model = make_model("silu", torch.float64, seed=seed, **overrides)
    tokens = make_tokens(batch, pos, seed=seed)
    converted = convert(model)
    logits, cache = model.run_with_cache(tokens)
    conv_logits, conv_cache = converted.run_with_cache(tokens)
    assert (logits - conv_logits).abs().max().item() <= 1e-10
    for name in ("blocks.0.mlp.hook_post", f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"):
        assert (cache[name] - conv_cache[name]).abs().max().item() <= 1e-10
