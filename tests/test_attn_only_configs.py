"""Attention-only configs (``attn_only=True``) build exactly like HookedTransformer."""

from __future__ import annotations

import pytest
import torch
from conftest import make_config, make_tokens, randomize_
from transformer_lens import HookedTransformer

from tl_attnonly import AttnOnlyTransformer, convert


@pytest.mark.parametrize(
    "overrides",
    [
        dict(normalization_type="LN"),
        dict(normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=4),
        dict(normalization_type=None, act_fn=None, d_mlp=None),
    ],
)
def test_attn_only_config_builds_like_hooked_transformer(overrides):
    overrides = dict(dict(act_fn="silu"), **overrides)
    cfg = make_config(attn_only=True, **overrides)
    reference = HookedTransformer(cfg)
    model = AttnOnlyTransformer(cfg)
    assert model.n_neuron_heads == 0 and model.neuron_heads == [] and model.coefficients is None
    reference_state, state = reference.state_dict(), model.state_dict()
    assert list(state) == list(reference_state)
    assert all(torch.equal(state[k], reference_state[k]) for k in state)
    assert sorted(model.hook_dict) == sorted(reference.hook_dict)
    tokens = make_tokens()
    assert torch.equal(model(tokens), reference(tokens))


def test_convert_of_an_attn_only_model_warns_and_copies(tmp_path):
    model = randomize_(HookedTransformer(make_config("silu", attn_only=True))).eval()
    with pytest.warns(UserWarning, match="attention-only already"):
        converted = convert(model)
    assert isinstance(converted, AttnOnlyTransformer) and converted.n_neuron_heads == 0
    assert converted.embed.W_E is not model.embed.W_E
    tokens = make_tokens()
    assert torch.equal(converted(tokens), model(tokens))
    converted.save_pretrained(tmp_path / "m")
    loaded = AttnOnlyTransformer.load(tmp_path / "m")
    assert loaded.cfg.attn_only and torch.equal(loaded(tokens), model(tokens))
    assert torch.equal(loaded.to_hooked_transformer()(tokens), model(tokens))


def test_main_demo_pattern_filter_reaches_neuron_heads_and_the_readme_filter_does_not():
    """The documented drop-in difference: ``endswith("pattern")`` also names the compact
    neuron-head patterns; ``endswith("attn.hook_pattern")`` / ``attn_names_filter`` do not."""
    from tl_attnonly.hooks import attn_names_filter

    model = randomize_(HookedTransformer(make_config("silu"))).eval()
    converted = convert(model)
    tokens = make_tokens()

    def names(m, names_filter):
        _, cache = m.run_with_cache(tokens, names_filter=names_filter)
        return {name: tuple(t.shape) for name, t in cache.items()}

    main_demo = names(converted, lambda name: name.endswith("pattern"))
    assert len(main_demo) == 2 * model.cfg.n_layers
    assert main_demo["blocks.0.mlp.hook_pattern"] == (2, converted.n_neuron_heads, 10, 2)
    original = names(model, lambda name: name.endswith("pattern"))
    assert names(converted, lambda name: name.endswith("attn.hook_pattern")) == original
    assert names(converted, attn_names_filter("pattern")) == original
