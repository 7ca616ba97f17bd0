"""Residual decomposition and direct logit attribution on models with norms after each sublayer
(Gemma 2/3's ``ln1_post`` / ``ln2_post``, OLMo 2/3, GLM-4), with each norm's scale from the run.

In a run, ``N(out) = w * out_c / sigma + b`` is linear in the heads' results once ``sigma`` is
the run's, so the components (attention heads, neuron-heads, embeddings, bias) sum to the
residual stream to rounding, and their direct logit attributions to the (pre-soft-cap) logit.
Bridges: the zoo's tiny random models (both TransformerLens lines), with float64-exact norms;
``HookedTransformer`` (TransformerLens 3.x): Gemma-2-like (soft caps, local windows) and
OLMo-2-like configs.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parents[1] / "bridge"))

from kinds import _exact_norms_  # noqa: E402
from models import BRIDGES  # noqa: E402
from zoo import ZOO, build_hf_model, convert_zoo_bridge  # noqa: E402

from tl_attnonly.adapt import analysis_model, require_additive_residual  # noqa: E402
from tl_attnonly.analysis import decompose_resid_heads, head_logit_attrs  # noqa: E402
from tl_attnonly.hooks import decomposition_names_filter  # noqa: E402

ATOL = 1e-10


def _zoo_bridge(name: str, convert: bool = True):
    """Zoo model ``name`` in float64 with norms computed in float64 (Hugging Face's compute in
    float32 inside), bridged and converted."""
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    hf, config = build_hf_model(name, torch.float64)
    _exact_norms_(hf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = build_bridge_from_module(
            hf, ZOO[name].architecture, hf_config=config, dtype=torch.float64
        )
    return convert_zoo_bridge(bridge) if convert else bridge, config


def _hooked(name: str):
    from conftest import GATED_ZOO, make_model

    import tl_attnonly

    overrides = dict(GATED_ZOO[name])
    act_fn = overrides.pop("act_fn", "silu")
    original = make_model(act_fn, torch.float64, **overrides)
    return original, tl_attnonly.convert(original)


def _check_decomposition(model, tokens):
    """Every residual stream (each block's input, MLP input and the final one) is the sum of its
    components; returns the full cache."""
    _, full = model.run_with_cache(tokens)
    _, cache = model.run_with_cache(tokens, names_filter=decomposition_names_filter())
    n_layers = analysis_model(model).cfg.n_layers
    for layer in range(n_layers + 1):
        for mlp_input in (False, True) if layer < n_layers else (False,):
            stack, labels = decompose_resid_heads(
                cache, layer, mlp_input=mlp_input, return_labels=True
            )
            if layer == n_layers:
                resid = full[f"blocks.{n_layers - 1}.hook_resid_post"]
            else:
                resid = full[f"blocks.{layer}.hook_{'resid_mid' if mlp_input else 'resid_pre'}"]
            torch.testing.assert_close(stack.sum(0), resid, rtol=0, atol=ATOL)
            assert labels[-1] == "bias" and "embed" in labels
    return cache


def _check_dla(model, tokens, logits, soft_cap: float | None):
    """Every component's direct logit attribution (``incl_embeds_and_bias``) sums to the logit
    before the final soft cap, less the constant ``ln_final.b @ W_U + b_U``."""
    adapter = analysis_model(model)
    _, cache = model.run_with_cache(tokens, names_filter=decomposition_names_filter())
    target = tokens[:, -1]
    attrs, labels = head_logit_attrs(
        cache, target, pos_slice=-1, incl_embeds_and_bias=True, return_labels=True
    )
    assert attrs.shape[0] == len(labels)
    rows = torch.arange(tokens.shape[0])
    logit = logits[rows, -1, target]
    if soft_cap:
        logit = soft_cap * torch.atanh(logit / soft_cap)  # the logit before the cap
    constant = adapter.b_U[target]
    if adapter.ln_final is not None and adapter.ln_final.b is not None:
        constant = constant + adapter.ln_final.b @ adapter.W_U[:, target]
    torch.testing.assert_close(attrs.sum(0) + constant, logit, rtol=0, atol=ATOL)
    heads = [i for i, label in enumerate(labels) if label not in ("embed", "pos_embed", "bias")]
    assert attrs[heads].abs().max() > 1e-3  # the heads do contribute


@pytest.mark.parametrize("name", ["gemma2", "olmo2", "gemma3", "olmo3", "glm4"])
def test_bridge_components_sum_to_the_residual_stream_and_the_logit(name):
    bridge, config = _zoo_bridge(name)
    assert analysis_model(bridge).cfg.post_norm
    require_additive_residual(bridge, "the decomposition")  # no refusal
    tokens = torch.randint(2, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    _check_decomposition(bridge, tokens)
    soft_cap = getattr(config, "final_logit_softcapping", None)
    logits = bridge(tokens)
    _check_dla(bridge, tokens, logits, soft_cap)
    if ZOO[name].act == "silu":  # exact conversion: the unconverted bridge's logit too
        original, _ = _zoo_bridge(name, convert=False)
        torch.testing.assert_close(original(tokens), logits, rtol=0, atol=1e-10)


@pytest.mark.skipif(BRIDGES, reason="HookedTransformer (TL 3 only)")
@pytest.mark.parametrize("name", ["gemma2", "olmo2"])
def test_hooked_components_sum_to_the_residual_stream_and_the_logit(name):
    original, converted = _hooked(name)
    tokens = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(0))
    _check_decomposition(converted, tokens)
    soft_cap = original.cfg.output_logits_soft_cap
    assert (name == "gemma2") == (soft_cap > 0)  # Gemma 2: soft caps on
    logits = converted(tokens)
    _check_dla(converted, tokens, logits, soft_cap if soft_cap > 0 else None)
    if name == "olmo2":  # SiLU: exact conversion
        torch.testing.assert_close(original(tokens), logits, rtol=0, atol=1e-10)


@pytest.mark.skipif(BRIDGES, reason="HookedTransformer (TL 3 only)")
def test_hooked_olmo2_norms_are_read_as_norms_after_each_sublayer():
    """TransformerLens's OLMo 2 calls its post-norms ``ln1`` / ``ln2``: the blocks read the
    residual stream itself, so the analysis sees no input norm and two output norms."""
    _, converted = _hooked("olmo2")
    block = analysis_model(converted).blocks[0]
    assert block.ln1 is None and block.ln2 is None
    assert block.ln1_post is not None and block.ln1_post.hook_scale == "blocks.0.ln1.hook_scale"
