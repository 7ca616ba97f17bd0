"""What the literal form builds: every ``HookedTransformerConfig`` field, built or refused.

:data:`CONFIG_AUDIT` lists every field of TransformerLens's ``HookedTransformerConfig`` with how
the literal form treats it (tests check that the list is complete, so a field added by a new
TransformerLens version fails the suite until it is audited):

* ``"built"``: the literal form reproduces its effect (tested against the original);
* ``"refused"``: some values cannot be built; :func:`check_literal_supported` raises for them,
  before any work (the note says which values are built);
* ``"inert"``: it does not change what the model computes from token ids (tokenisation, hooks,
  initialisation, metadata), or only matters together with a refused option.
"""

from __future__ import annotations

from typing import Literal

from transformer_lens import HookedTransformer

from tl_attnonly._compat import POST_NORM_ARCHITECTURES, softcap_enabled

Treatment = Literal["built", "refused", "inert"]

#: Architectures whose attention normalises the full projected queries and keys (TL applies
#: ``q_norm``/``k_norm`` for these whatever ``use_qk_norm`` says).
QK_NORM_ARCHITECTURES = ("OlmoeForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM")

_ROTARY = "rotary tables copied from the model's attention (every rotary variant built alike)"

#: field -> (treatment, note). Complete for TransformerLens 3.9's HookedTransformerConfig.
CONFIG_AUDIT: dict[str, tuple[Treatment, str]] = {
    # shapes
    "d_model": ("built", "the original coordinates of the residual stream"),
    "d_head": ("built", "head dimension of the tweaked attention heads"),
    "n_layers": ("built", "one literal block per layer"),
    "n_ctx": ("built", "default max_len (one-hot position coordinates)"),
    "n_heads": ("built", "the model's heads, tweaked (Theorem 6)"),
    "d_mlp": ("built", "d_mlp * K neuron-heads per layer"),
    "d_vocab": ("built", "embedding copied"),
    "d_vocab_out": ("built", "unembedding copied"),
    "n_key_value_heads": ("built", "grouped-query attention expanded to full heads"),
    "ungroup_grouped_query_attention": ("inert", "hook layout of grouped-query attention"),
    # norms
    "normalization_type": ("refused", "LN, LNPre, RMS, RMSPre and None are built"),
    "final_rms": ("built", "the final norm is read from the model's ln_final"),
    "eps": ("built", "epsilon of the literal form's norms"),
    "uses_rms_norm": ("inert", "not read by HookedTransformer (normalization_type decides)"),
    "layer_norm_folding": ("inert", "not read by HookedTransformer"),
    "post_embedding_ln": ("refused", "False is built; a norm after the embedding is not"),
    "use_normalization_before_and_after": ("refused", "False is built; norms after sublayers"),
    "original_architecture": (
        "refused",
        "post-norm (OLMo 2/3) and OLMo-family full-vector q/k norms are refused; TL reads it for "
        "nothing else that changes the computation",
    ),
    # MLP
    "act_fn": ("refused", "activations with neuron-head coefficients (check_convertible)"),
    "gated_mlp": ("refused", "built in layout='split' (product heads); refused in 'neuron'"),
    "num_experts": ("refused", "None is built (no mixture-of-experts)"),
    "experts_per_token": ("inert", "only with num_experts (refused)"),
    "norm_topk_prob": ("inert", "only with num_experts (refused)"),
    "load_in_4bit": ("refused", "False is built"),
    "quantization_method": ("inert", "not read by HookedTransformer"),
    "attn_only": ("refused", "False is built (an attention-only model has nothing to convert)"),
    "parallel_attn_mlp": ("refused", "False is built; MLP sublayers read after attention"),
    # attention
    "attention_dir": ("built", "causal or bidirectional mask (Theorem 9)"),
    "use_attn_scale": ("built", "folded into the queries"),
    "attn_scale": ("built", "folded into the queries"),
    "scale_attn_by_inverse_layer_idx": ("built", "folded into the queries (attn.attn_scale)"),
    "use_qk_norm": ("refused", "False is built; q/k normalisation is not plain attention"),
    "clip_qkv": ("refused", "None is built; clamped q/k/v are not linear"),
    "use_logn_attn": ("refused", "False is built; log-n query scaling"),
    "train_seq_length": ("inert", "only with use_logn_attn / use_dynamic_ntk_rope (refused)"),
    "use_local_attn": ("refused", "False is built; windowed attention"),
    "window_size": ("inert", "only with use_local_attn (refused)"),
    "attn_types": ("inert", "only with use_local_attn (refused)"),
    "rotary_base_local": ("inert", "only for local attention (refused)"),
    "use_attention_sinks": ("refused", "False is built; learned sink logits"),
    "attn_scores_soft_cap": ("refused", "disabled is built; capped scores are not softmax(QK)"),
    "output_logits_soft_cap": ("built", "the cap is applied to the logits, as TL's unembed does"),
    "relative_attention_max_distance": ("inert", "only with relative_positional_bias (refused)"),
    "relative_attention_num_buckets": ("inert", "only with relative_positional_bias (refused)"),
    # positions
    "positional_embedding_type": ("refused", "'standard' and 'rotary' are built"),
    "rotary_dim": ("built", _ROTARY),
    "rotary_base": ("built", _ROTARY),
    "rotary_scaling_factor": ("built", _ROTARY),
    "rotary_adjacent_pairs": ("built", "GPT-J-style rotation of adjacent pairs"),
    "use_dynamic_ntk_rope": ("refused", "False is built; the base depends on the input length"),
    "use_NTK_by_parts_rope": ("built", _ROTARY),
    "NTK_by_parts_low_freq_factor": ("built", _ROTARY),
    "NTK_by_parts_high_freq_factor": ("built", _ROTARY),
    "NTK_by_parts_factor": ("built", _ROTARY),
    "NTK_original_ctx_len": ("built", _ROTARY),
    "use_yarn_rope": ("built", _ROTARY + ", YaRN's attention factor included"),
    "yarn_factor": ("built", _ROTARY),
    "yarn_attention_factor": ("built", _ROTARY),
    "yarn_beta_fast": ("built", _ROTARY),
    "yarn_beta_slow": ("built", _ROTARY),
    "yarn_original_max_position_embeddings": ("built", _ROTARY),
    "yarn_truncate": ("built", _ROTARY),
    "yarn_global_attn_only": ("built", _ROTARY),
    # hooks, tokenisation, devices, initialisation, metadata
    "use_attn_result": ("inert", "hooks only (to_literal has its own use_attn_result)"),
    "use_split_qkv_input": ("inert", "hooks only"),
    "use_attn_in": ("inert", "hooks only"),
    "use_hook_mlp_in": ("inert", "hooks only"),
    "use_hook_tokens": ("inert", "hooks only"),
    "default_prepend_bos": ("inert", "tokenisation (the literal form takes token ids)"),
    "tokenizer_prepends_bos": ("inert", "tokenisation"),
    "tokenizer_name": ("inert", "tokenisation"),
    "trust_remote_code": ("inert", "loading"),
    "decoder_start_token_id": ("inert", "encoder-decoder models only"),
    "tie_word_embeddings": ("inert", "embedding and unembedding are copied either way"),
    "device": ("built", "built on the model's device"),
    "n_devices": ("refused", "1 is built (the literal form lives on one device)"),
    "dtype": ("built", "built in float64, then cast to the model's dtype (or dtype=)"),
    "init_mode": ("inert", "initialisation"),
    "initializer_range": ("inert", "initialisation"),
    "init_weights": ("inert", "initialisation"),
    "seed": ("inert", "initialisation"),
    "model_name": ("inert", "metadata"),
    "n_params": ("inert", "metadata"),
    "from_checkpoint": ("inert", "metadata"),
    "checkpoint_index": ("inert", "metadata"),
    "checkpoint_label_type": ("inert", "metadata"),
    "checkpoint_value": ("inert", "metadata"),
}

_REFUSED_FLAGS = {
    "parallel_attn_mlp": (
        "parallel attention + MLP (GPT-J/NeoX): the literal form's MLP sublayers read the "
        "residual stream after the attention sublayer has written to it"
    ),
    "use_qk_norm": "query/key normalisation is not part of plain attention",
    "use_local_attn": "local (windowed) attention",
    "use_attention_sinks": "learned attention sinks",
    "use_logn_attn": "log-n query scaling",
    "use_dynamic_ntk_rope": "dynamic NTK rotary scaling (the base depends on the input length)",
    "use_normalization_before_and_after": "norms after the sublayers",
    "post_embedding_ln": "a norm after the embedding",
}


def check_literal_supported(model: HookedTransformer, layout: str = "split") -> None:
    """Refuse, before building, a model the literal form cannot represent exactly.

    Every ``HookedTransformerConfig`` field is either built or refused, here or (activation,
    gated MLPs, 4-bit weights) by :func:`tl_attnonly.options.check_convertible`, which
    :func:`to_literal` runs next (see :data:`CONFIG_AUDIT`). Built: LN, LNPre, RMS, RMSPre or no
    norm (``final_rms`` too); learned ("standard") or rotary positions, with any rotary scaling
    TransformerLens bakes into its tables (linear, NTK-by-parts, YaRN); causal or bidirectional
    attention; grouped-query attention (expanded to full heads); ``output_logits_soft_cap``; any
    activation with neuron-head coefficients; gated MLPs in the ``"split"`` layout (product heads,
    :mod:`tl_attnonly.literal.gated`).

    Args:
        model: The model.
        layout: The layout asked for (``"neuron"`` refuses gated MLPs).

    Raises:
        NotImplementedError: Naming the unsupported option and what is supported.
        ValueError: For an attention-only model (nothing to convert).
    """
    cfg = model.cfg
    if cfg.attn_only:
        raise ValueError(
            "The model is attention-only already (cfg.attn_only=True): the literal form converts "
            "MLPs; tl_attnonly.convert(model) returns a copy."
        )
    if cfg.positional_embedding_type not in ("standard", "rotary"):
        raise NotImplementedError(
            f"positional_embedding_type={cfg.positional_embedding_type!r} is not supported by the "
            "literal form (supported: 'standard' learned positions and 'rotary')."
        )
    for flag, why in _REFUSED_FLAGS.items():
        if getattr(cfg, flag, False):
            raise NotImplementedError(
                f"cfg.{flag}=True is not supported by the literal form: {why}. Supported: "
                f"{flag}=False."
            )
    arch = cfg.original_architecture
    if arch in POST_NORM_ARCHITECTURES:
        raise NotImplementedError(
            f"original_architecture={arch!r} is post-norm (each sublayer's output is normalised "
            "before it is added to the residual stream), which the literal form does not build. "
            "Supported: pre-norm architectures."
        )
    if arch in QK_NORM_ARCHITECTURES:
        raise NotImplementedError(
            f"original_architecture={arch!r} normalises the projected queries and keys "
            "(TransformerLens's OLMo q_norm/k_norm), which is not plain attention. Supported: "
            "architectures without q/k normalisation."
        )
    if softcap_enabled(cfg.attn_scores_soft_cap):
        raise NotImplementedError(
            f"attn_scores_soft_cap={cfg.attn_scores_soft_cap} is not supported by the literal "
            "form: capped scores are not plain softmax attention. Supported: no score cap."
        )
    if cfg.clip_qkv is not None:
        raise NotImplementedError(
            f"clip_qkv={cfg.clip_qkv} is not supported by the literal form: clamped q/k/v are not "
            "plain attention. Supported: clip_qkv=None."
        )
    if cfg.num_experts:
        raise NotImplementedError(
            f"num_experts={cfg.num_experts}: mixture-of-experts MLPs are not supported by the "
            "literal form. Supported: dense MLPs."
        )
    if cfg.load_in_4bit:
        raise NotImplementedError(
            "load_in_4bit=True: 4-bit quantised weights are not supported by the literal form. "
            "Load the model in float32 or float64 first."
        )
    if cfg.gated_mlp and layout != "split":
        raise NotImplementedError(
            f"Gated MLPs (act(x W_gate) * (x W_in)) need layout='split' in the literal form "
            f"(got layout={layout!r}): the product g * u gets its own sublayer of product heads "
            "before the activation heads. Supported: gated_mlp=True with layout='split'."
        )
    if cfg.n_devices != 1:
        raise NotImplementedError(
            f"n_devices={cfg.n_devices}: the literal form is built on one device. Move the model "
            "to one device first (n_devices=1)."
        )
    if cfg.normalization_type not in ("LN", "LNPre", "RMS", "RMSPre", None):
        raise NotImplementedError(
            f"normalization_type={cfg.normalization_type!r} is not supported by the literal form "
            "(supported: LN, LNPre, RMS, RMSPre, None)."
        )
    if cfg.act_fn is not None and cfg.act_fn.endswith("_ln"):
        raise NotImplementedError(
            f"act_fn={cfg.act_fn!r} (a norm inside the MLP) is not supported by the literal form."
        )


__all__ = [
    "CONFIG_AUDIT",
    "QK_NORM_ARCHITECTURES",
    "Treatment",
    "check_literal_supported",
]
