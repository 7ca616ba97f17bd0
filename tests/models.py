"""Models for the analysis and vis tests on either TransformerLens line.

The tests ask for a model by the ``HookedTransformerConfig`` overrides of ``conftest.make_model``
(``act_fn``, ``normalization_type``, ``gated_mlp``, ...): :func:`make_original`,
:func:`make_converted`, :func:`make_pair`. What they get:

* TransformerLens 3.x: exactly ``conftest.make_model``'s ``HookedTransformer`` (the *original*) and
  its :func:`tl_attnonly.convert` (an ``AttnOnlyTransformer``, the *converted* model), as before.
* TransformerLens 4.x (no ``HookedTransformer``): two ``TransformerBridge`` models of the same tiny
  random Hugging Face weights (``bridge_models.randomize_``), the *original* unconverted and the
  *converted* one converted in place. The family is the one whose architecture the overrides
  describe (:func:`bridge_family`): LayerNorm and learned positions: GPT-2; LayerNorm and a gated
  MLP: StableLM; LayerNorm without weights (LNPre): OLMo; parallel blocks: GPT-NeoX; RMSNorm
  (rotary, grouped-query attention, gated MLP): LLaMA; GeGLU: Gemma; local windows: Mistral;
  ``rotary_base=1e6``: Qwen2; norms after each sublayer: Gemma 2 / Gemma 3 (qk-norm) / OLMo 2;
  qk-norm in pre-norm blocks: Qwen3.
  A test may name the family (``family="gpt2"``; ignored on 3.x). The sizes are the config's
  (``d_model`` 16, 2 layers, 61 tokens, ...), so the tests' numbers hold on both lines; the
  analysis reads of either kind go through :func:`facts` (``tl_attnonly.adapt.analysis_model``).

A config no Hugging Face family has (RMSPre, no normalisation, attention-only, bidirectional
decoders, shortformer positions, mixtures of experts) has no bridge: its test or parameter is
marked :func:`tl3_only` (skipped on 4.x with that reason); :func:`hooked_only` marks tests whose
subject is a HookedTransformer class (``AttnOnlyEncoder``), :func:`tl3_extra` parameters whose
bridge would repeat another's (the same family) and are left out on 4.x to keep the suite fast.

Precision: the bridges of the LLaMA-like families (every family here but GPT-2 and GPT-NeoX)
compute the attention softmax in float32 (TransformerLens 4's ``PositionEmbeddingsAttentionBridge``,
as Hugging Face). The tests keep their float64 tolerances on them: each comparison feeds that
softmax inputs that agree to float64 rounding, far below float32's resolution. Norms that compute
in float32 inside (LLaMA's, Gemma's, OLMo's) are replaced by float64-exact ones before the bridge
is built (their inputs do differ between a tool and its reference).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "bridge"))  # bridge_models

from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER  # noqa: E402
from tl_attnonly.adapt import analysis_model  # noqa: E402

#: Whether the tests' models are HookedTransformers (TL 3.x) or bridges (TL 4.x).
BRIDGES = not HAS_HOOKED_TRANSFORMER

_D_VOCAB = 61

#: Overrides no Hugging Face family has, and what to call them (TransformerLens 3.x only).
_NO_BRIDGE = {
    "normalization_type": {
        "RMSPre": "RMSPre (RMSNorm without weights)",
        None: "no normalisation",
    },
    "attn_only": {True: "attention-only models"},
    "use_attn_result": {True: "use_attn_result"},
    "attention_dir": {"bidirectional": "bidirectional decoders"},
    "positional_embedding_type": {"shortformer": "shortformer positions"},
}

#: act_fn -> the Hugging Face activation name (``ACT2FN``) computing it.
_HF_ACT = {
    "silu": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_new",
    "gelu_pytorch_tanh": "gelu_pytorch_tanh",
    "relu": "relu",
}


def no_bridge_reason(overrides: dict[str, Any]) -> str | None:
    """Why no Hugging Face family has the config of ``overrides`` (``None``: one has)."""
    for key, values in _NO_BRIDGE.items():
        if key in overrides and overrides[key] in values:
            return values[overrides[key]]
    if overrides.get("num_experts"):
        return "mixtures of experts (the bridge's MoE layers are refused by convert)"
    return None


def tl3_only(reason: str) -> pytest.MarkDecorator:
    """Skip on TransformerLens 4.x: ``reason`` names the config no Hugging Face family has."""
    return pytest.mark.skipif(BRIDGES, reason=f"no bridge has {reason} (TL 3 only)")


def hooked_only(what: str) -> pytest.MarkDecorator:
    """Skip on TransformerLens 4.x a test whose subject is a ``HookedTransformer`` class of this
    package (``what``: ``AttnOnlyEncoder``, the literal form, ...)."""
    return pytest.mark.skipif(
        BRIDGES, reason=f"tests {what}, a HookedTransformer class (TL 3 only)"
    )


def tl3_extra(covered_by: str) -> pytest.MarkDecorator:
    """Skip on TransformerLens 4.x a parameter whose bridge adds no coverage there (its Hugging
    Face family is ``covered_by``'s, or ``covered_by`` holds what it checks), to keep the suite
    fast."""
    return pytest.mark.skipif(BRIDGES, reason=f"on TL 4 covered by {covered_by} (same bridge)")


def bridge_family(act_fn: str, overrides: dict[str, Any]) -> str:
    """The Hugging Face family of a config (see the module docstring)."""
    arch = overrides.get("original_architecture")
    if arch == "Olmo2ForCausalLM":
        return "olmo2"
    if overrides.get("use_normalization_before_and_after"):
        return "gemma3" if overrides.get("use_qk_norm") else "gemma2"
    if overrides.get("use_qk_norm"):
        return "qwen3"  # per-head q/k RMSNorm, pre-norm blocks
    if overrides.get("parallel_attn_mlp"):
        return "neox"
    norm = overrides.get("normalization_type", "LN")
    if norm == "LNPre":
        return "olmo"  # OLMo 1: LayerNorm without weights or bias, SwiGLU, rotary
    if norm == "LN":
        return "stablelm" if overrides.get("gated_mlp") else "gpt2"
    if act_fn == "gelu_pytorch_tanh" and overrides.get("gated_mlp"):
        return "gemma"
    if overrides.get("use_local_attn"):
        return "mistral"
    if overrides.get("rotary_base") == 1_000_000:
        return "qwen2"
    return "llama"


def _hf_config(family: str, act_fn: str, cfg: dict[str, Any]):
    import transformers

    n_layers, d_model, n_heads = cfg["n_layers"], cfg["d_model"], cfg["n_heads"]
    d_head, d_mlp, n_ctx = cfg["d_head"], cfg["d_mlp"], cfg["n_ctx"]
    act, n_vocab = _HF_ACT[act_fn], cfg["d_vocab"]
    if family == "gpt2":
        assert d_model == n_heads * d_head, cfg
        return transformers.GPT2Config(
            vocab_size=n_vocab, n_layer=n_layers, n_embd=d_model, n_head=n_heads,
            n_positions=n_ctx, n_inner=d_mlp, activation_function=act, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
        )  # fmt: skip
    if family == "neox":
        rotary_dim = cfg.get("rotary_dim") or d_head // 2
        return transformers.GPTNeoXConfig(
            vocab_size=n_vocab, num_hidden_layers=n_layers, hidden_size=d_model,
            num_attention_heads=n_heads, intermediate_size=d_mlp, hidden_act=act,
            max_position_embeddings=n_ctx, rotary_pct=rotary_dim / d_head,
            use_parallel_residual=True, tie_word_embeddings=False,
        )  # fmt: skip
    common = dict(
        vocab_size=n_vocab, num_hidden_layers=n_layers, hidden_size=d_model,
        num_attention_heads=n_heads, num_key_value_heads=cfg.get("n_key_value_heads") or n_heads,
        head_dim=d_head, intermediate_size=d_mlp, max_position_embeddings=n_ctx,
        tie_word_embeddings=False,
    )  # fmt: skip
    if family == "stablelm":
        assert d_model == n_heads * d_head, cfg
        common.pop("head_dim")
        return transformers.StableLmConfig(
            **common, hidden_act=act, partial_rotary_factor=0.5, use_qkv_bias=True
        )
    if family == "olmo":
        assert d_model == n_heads * d_head, cfg
        common.pop("head_dim")
        return transformers.OlmoConfig(**common, hidden_act=act)
    if family == "gemma":
        return transformers.GemmaConfig(**common, hidden_activation=act)
    if family == "gemma2":
        return transformers.Gemma2Config(**common, hidden_activation=act)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(**common, hidden_activation=act)
    config_class = {
        "llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig",
        "olmo2": "Olmo2Config", "phi3": "Phi3Config", "qwen3": "Qwen3Config",
    }[family]  # fmt: skip
    extra: dict[str, Any] = dict(hidden_act=act)
    if family == "mistral":
        extra["sliding_window"] = cfg.get("window_size", 3)
    return getattr(transformers, config_class)(**common, **extra)


_HF_CLASS = {
    "gpt2": "GPT2LMHeadModel", "neox": "GPTNeoXForCausalLM", "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM", "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM", "stablelm": "StableLmForCausalLM", "olmo": "OlmoForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}  # fmt: skip


def _config(overrides: dict[str, Any]) -> dict[str, Any]:
    cfg = dict(n_layers=2, d_model=16, n_heads=2, d_head=8, d_mlp=24, n_ctx=12, d_vocab=_D_VOCAB)
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    return cfg


def make_bridge(
    act_fn: str = "silu",
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    *,
    convert: bool = True,
    family: str | None = None,
    n_heads_per_neuron: int | None = None,
    **overrides: Any,
) -> Any:
    """A (converted) ``TransformerBridge`` of the config ``overrides`` describe, on a tiny random
    Hugging Face model of its family (the same weights for the same arguments)."""
    import transformers
    from bridge_models import randomize_
    from kinds import _exact_norms_
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

    import tl_attnonly

    reason = no_bridge_reason(overrides)
    if reason is not None:
        pytest.skip(f"no bridge has {reason} (TL 3 only)")
    family = family or bridge_family(act_fn, overrides)
    config = _hf_config(family, act_fn, _config(overrides))
    torch.manual_seed(seed)
    hf = getattr(transformers, _HF_CLASS[family])(config)
    randomize_(hf, seed)
    _exact_norms_(hf)
    _exact_weightless_layer_norms_(hf)
    bridge = build_bridge_from_module(hf.to(dtype).eval(), _HF_CLASS[family], hf_config=config)
    if not convert:
        return bridge
    options = {} if n_heads_per_neuron is None else dict(n_heads_per_neuron=n_heads_per_neuron)
    return tl_attnonly.convert(bridge, **options)


class ExactLayerNorm(torch.nn.Module):
    """A LayerNorm without weight or bias computed in its input's dtype (OLMo's ``OlmoLayerNorm``
    computes in float32 inside, which would limit float64 comparisons to about 1e-6)."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.normalized_shape = norm.normalized_shape
        self.eps = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, self.normalized_shape, None, None, self.eps)


def _exact_weightless_layer_norms_(model: torch.nn.Module) -> None:
    for name, module in list(model.named_modules()):
        if type(module).__name__ == "OlmoLayerNorm":
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, ExactLayerNorm(module))


def make_original(
    act_fn: str = "silu", dtype: torch.dtype = torch.float64, seed: int = 0, **overrides: Any
) -> Any:
    """The unconverted model: ``conftest.make_model`` (TL 3) or an unconverted bridge (TL 4)."""
    if BRIDGES:
        return make_bridge(act_fn, dtype, seed, convert=False, **overrides)
    from conftest import make_model

    overrides.pop("family", None)
    return make_model(act_fn, dtype, seed, **overrides)


def make_converted(
    act_fn: str = "silu",
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    *,
    n_heads_per_neuron: int | None = None,
    share_weights: bool | None = None,
    **overrides: Any,
) -> Any:
    """The converted model: an ``AttnOnlyTransformer`` (TL 3; ``share_weights`` as
    :func:`tl_attnonly.convert` takes it) or a converted bridge (TL 4; its weights are shared)."""
    if BRIDGES:
        return make_bridge(act_fn, dtype, seed, n_heads_per_neuron=n_heads_per_neuron, **overrides)
    import tl_attnonly

    options = dict(n_heads_per_neuron=n_heads_per_neuron, share_weights=share_weights)
    return tl_attnonly.convert(
        make_original(act_fn, dtype, seed, **overrides),
        **{key: value for key, value in options.items() if value is not None},
    )


def make_pair(
    act_fn: str = "silu", dtype: torch.dtype = torch.float64, seed: int = 0, **overrides: Any
) -> tuple[Any, Any]:
    """``(original, converted)`` of the same weights (TL 3: the converted model shares them)."""
    if BRIDGES:
        return (
            make_bridge(act_fn, dtype, seed, convert=False, **overrides),
            make_bridge(act_fn, dtype, seed, **overrides),
        )
    import tl_attnonly

    original = make_original(act_fn, dtype, seed, **overrides)
    return original, tl_attnonly.convert(original)


def facts(model: Any) -> Any:
    """What analysis reads of ``model`` (``tl_attnonly.adapt.analysis_model``), converted or not."""
    return analysis_model(model, neuron_heads=False)
