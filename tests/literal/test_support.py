"""Every HookedTransformerConfig field is built by the literal form or refused before any work."""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace

import pytest
import torch
from conftest import make_config, make_model, make_tokens
from transformer_lens import HookedTransformerConfig

from tl_attnonly.literal import CONFIG_AUDIT, check_literal_supported, to_literal

warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")

#: One unsupported setting of every refused field (a config TransformerLens accepts).
REFUSED_EXAMPLES: dict[str, dict] = {
    "normalization_type": {},  # TL accepts no other value (it warns and builds no norm)
    "post_embedding_ln": dict(post_embedding_ln=True),
    "use_normalization_before_and_after": dict(use_normalization_before_and_after=True),
    "original_architecture": dict(original_architecture="Olmo2ForCausalLM"),
    "act_fn": dict(act_fn="solu_ln"),
    "gated_mlp": dict(gated_mlp=True),
    "num_experts": dict(num_experts=2, experts_per_token=1),
    "load_in_4bit": dict(load_in_4bit=True),
    "attn_only": dict(attn_only=True),
    "parallel_attn_mlp": dict(parallel_attn_mlp=True),
    "use_qk_norm": dict(use_qk_norm=True),
    "clip_qkv": dict(clip_qkv=1.0),
    "use_logn_attn": dict(
        use_logn_attn=True, positional_embedding_type="rotary", rotary_dim=4, train_seq_length=4
    ),
    "use_local_attn": dict(use_local_attn=True, window_size=3, attn_types=["local", "global"]),
    "use_attention_sinks": dict(use_attention_sinks=True),
    "attn_scores_soft_cap": dict(attn_scores_soft_cap=30.0),
    "positional_embedding_type": dict(positional_embedding_type="alibi"),
    "use_dynamic_ntk_rope": dict(
        use_dynamic_ntk_rope=True,
        positional_embedding_type="rotary",
        rotary_dim=4,
        train_seq_length=4,
    ),
    "n_devices": dict(n_devices=2),
}


def test_the_audit_lists_every_config_field():
    fields = {f.name for f in dataclasses.fields(HookedTransformerConfig)}
    assert set(CONFIG_AUDIT) == fields, (
        f"unaudited: {sorted(fields - set(CONFIG_AUDIT))}, "
        f"stale: {sorted(set(CONFIG_AUDIT) - fields)}"
    )
    assert {treatment for treatment, _ in CONFIG_AUDIT.values()} <= {"built", "refused", "inert"}
    refused = {name for name, (treatment, _) in CONFIG_AUDIT.items() if treatment == "refused"}
    assert refused == set(REFUSED_EXAMPLES)


@pytest.mark.parametrize("field", sorted(k for k, v in REFUSED_EXAMPLES.items() if v))
def test_every_refused_field_is_refused_before_any_work(field):
    overrides = dict(REFUSED_EXAMPLES[field])
    n_devices = overrides.pop("n_devices", 1)  # the constructor wants that many CUDA devices
    cfg = make_config(**overrides)
    cfg.n_devices = n_devices
    assert getattr(cfg, field) != getattr(make_config(), field)
    shell = SimpleNamespace(cfg=cfg)  # no weights: a refusal must come before reading any
    with pytest.raises((NotImplementedError, ValueError)) as info:
        to_literal(shell)
    message = str(info.value)
    assert field in message or "upported" in message or "attention-only" in message


@pytest.mark.parametrize(
    "overrides",
    [
        dict(normalization_type="RMS", output_logits_soft_cap=2.0),
        dict(normalization_type="LN", output_logits_soft_cap=0.5, act_fn="gelu_new"),
    ],
)
def test_output_logit_soft_cap_is_built(overrides):
    model = make_model(**overrides)
    tokens = make_tokens()
    expected = model(tokens)
    assert expected.abs().max() < overrides["output_logits_soft_cap"]  # the cap is active
    literal = to_literal(model, conversion=None)
    if model.cfg.act_fn == "silu":
        torch.testing.assert_close(literal(tokens), expected, rtol=0, atol=1e-9)
    else:  # GELU: the K = 4 fit's error, squashed by the cap
        torch.testing.assert_close(literal(tokens), expected, rtol=0, atol=1e-3)


def test_post_norm_olmo2_is_refused():
    model = make_model(normalization_type="RMS", original_architecture="Olmo2ForCausalLM")
    with pytest.raises(NotImplementedError, match="Olmo2ForCausalLM.*post-norm"):
        check_literal_supported(model)
    with pytest.raises(NotImplementedError, match="post-norm"):
        to_literal(model)
