"""The same small random model as both model kinds: a converted ``HookedTransformer``
(``AttnOnlyTransformer``, TransformerLens 3.x) and a converted ``TransformerBridge`` (3.x and 4.x).

Each family is a tiny random Hugging Face model (:mod:`bridge_models`' scale: O(1) residual stream
and MLP pre-activations). The bridge wraps it as it is; the ``HookedTransformer`` loads it with
TransformerLens's own weight conversion and no weight processing (like the raw bridge), and takes
the Hugging Face rotary tables (TransformerLens computes its own, which differ at float32 rounding),
so the two kinds compute the same function to float64 rounding.

On TransformerLens 4.x there is no ``HookedTransformer``: :func:`make_pair` gives ``None`` for it
and the tests compare the bridge against independent references instead.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent / "bridge"))

import transformers  # noqa: E402
from bridge_models import randomize_  # noqa: E402
from transformer_lens.model_bridge.sources._bridge_builder import (  # noqa: E402
    build_bridge_from_module,
)

import tl_attnonly  # noqa: E402
from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER  # noqa: E402

D_VOCAB = 64
_LLAMA = dict(
    vocab_size=D_VOCAB, num_hidden_layers=2, hidden_size=32, intermediate_size=24,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip

#: family -> (Hugging Face class, config class, config kwargs)
# fmt: off
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama_gqa": ("LlamaForCausalLM", "LlamaConfig", _LLAMA),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", _LLAMA),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(
        vocab_size=D_VOCAB, n_layer=2, n_embd=32, n_head=4, n_positions=64, n_inner=24,
        activation_function="silu")),
    "neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(
        vocab_size=D_VOCAB, num_hidden_layers=2, hidden_size=32, intermediate_size=24,
        num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5, hidden_act="silu")),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(
        _LLAMA, head_dim=8, hidden_activation="gelu_pytorch_tanh")),
}
# fmt: on
#: Families whose MLPs are exact as neuron-heads (SiLU / SwiGLU).
EXACT = ("llama_gqa", "qwen2", "gpt2", "neox")


class ExactRMSNorm(torch.nn.Module):
    """An RMSNorm computed in its input's dtype (Hugging Face's ``LlamaRMSNorm`` and
    ``GemmaRMSNorm`` compute in float32 inside, which would limit the float64 comparison of the two
    model kinds to about 1e-7). ``offset``: Gemma's ``1 + weight``."""

    def __init__(self, norm: torch.nn.Module, offset: bool):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = getattr(norm, "variance_epsilon", None) or norm.eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return x * ((1.0 + self.weight) if self.offset else self.weight)


def _exact_norms_(model: torch.nn.Module) -> None:
    for name, module in list(model.named_modules()):
        kind = type(module).__name__
        if kind.endswith("RMSNorm") and kind != "ExactRMSNorm":
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, ExactRMSNorm(module, "Gemma" in kind))


def make_hf(family: str, dtype: torch.dtype = torch.float64, seed: int = 0):
    model_cls, config_cls, kwargs = FAMILIES[family]
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    randomize_(model, seed)
    _exact_norms_(model)
    return model.to(dtype).eval(), config


def make_bridge(family: str, dtype: torch.dtype = torch.float64, seed: int = 0, convert=True):
    """A (converted) bridge of a fresh random model of ``family``."""
    hf, config = make_hf(family, dtype, seed)
    bridge = build_bridge_from_module(hf, FAMILIES[family][0], hf_config=config)
    return tl_attnonly.convert(bridge) if convert else bridge


def _hooked_config(family: str, config: Any, dtype: torch.dtype):
    from transformer_lens import HookedTransformerConfig

    common = dict(n_layers=2, d_vocab=D_VOCAB, dtype=dtype, device="cpu", n_ctx=64)
    if family in ("llama_gqa", "qwen2", "gemma"):
        extra: dict[str, Any] = dict(
            d_model=32, n_heads=4, d_head=8, n_key_value_heads=2, d_mlp=24,
            act_fn="silu", normalization_type="RMS", positional_embedding_type="rotary",
            rotary_dim=8, rotary_adjacent_pairs=False, final_rms=True, gated_mlp=True,
            eps=config.rms_norm_eps, rotary_base=10000,
        )  # fmt: skip
        if family == "gemma":
            extra.update(act_fn="gelu_pytorch_tanh", original_architecture="GemmaForCausalLM")
        return HookedTransformerConfig(**common, **extra)
    if family == "gpt2":
        return HookedTransformerConfig(
            **common, d_model=32, n_heads=4, d_head=8, d_mlp=24, act_fn="silu",
            normalization_type="LN", eps=config.layer_norm_epsilon,
        )  # fmt: skip
    if family == "neox":
        return HookedTransformerConfig(
            **common, d_model=32, n_heads=4, d_head=8, d_mlp=24, act_fn="silu",
            normalization_type="LN", eps=config.layer_norm_eps, parallel_attn_mlp=True,
            positional_embedding_type="rotary", rotary_dim=4, rotary_adjacent_pairs=False,
            default_prepend_bos=False,
        )  # fmt: skip
    raise KeyError(family)


def _hf_rotary(hf: Any, n_ctx: int, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Hugging Face model's rotary ``(sin, cos)`` tables ``[n_ctx, rotary_dim]``."""
    rotary = hf.model.rotary_emb if hasattr(hf, "model") else hf.gpt_neox.rotary_emb
    x = torch.zeros(1, n_ctx, rotary_dim, dtype=torch.float64)
    cos, sin = rotary(x, torch.arange(n_ctx)[None])
    return sin[0], cos[0]


def make_hooked(family: str, hf: Any, config: Any, dtype: torch.dtype = torch.float64):
    """The ``HookedTransformer`` of ``hf``'s weights (TransformerLens 3.x), unconverted."""
    from transformer_lens import HookedTransformer
    from transformer_lens.pretrained.weight_conversions import (
        convert_gemma_weights,
        convert_gpt2_weights,
        convert_llama_weights,
        convert_neox_weights,
        convert_qwen2_weights,
    )

    cfg = _hooked_config(family, config, dtype)
    convert = {
        "llama_gqa": convert_llama_weights, "qwen2": convert_qwen2_weights,
        "gpt2": convert_gpt2_weights, "neox": convert_neox_weights,
        "gemma": convert_gemma_weights,
    }[family]  # fmt: skip
    model = HookedTransformer(cfg)
    state = convert(hf, cfg)
    model.load_state_dict(state, strict=False)
    if cfg.positional_embedding_type == "rotary":
        sin, cos = _hf_rotary(hf, cfg.n_ctx, cfg.rotary_dim)
        for block in model.blocks:
            block.attn.rotary_sin.copy_(sin.to(dtype))
            block.attn.rotary_cos.copy_(cos.to(dtype))
    return model.eval()


def make_pair(family: str, dtype: torch.dtype = torch.float64, seed: int = 0):
    """``(AttnOnlyTransformer or None on TL 4.x, converted bridge)`` over the same weights."""
    hf, config = make_hf(family, dtype, seed)
    hooked = None
    if HAS_HOOKED_TRANSFORMER:
        hooked = tl_attnonly.convert(make_hooked(family, hf, config, dtype))
    bridge = build_bridge_from_module(hf, FAMILIES[family][0], hf_config=config)
    return hooked, tl_attnonly.convert(bridge)


def make_tokens(batch: int = 2, pos: int = 8, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, D_VOCAB, (batch, pos), generator=generator)


def kind_with_task(kind: str, family: str = "llama_gqa", batch: int = 3, pos: int = 6):
    """``(model, clean, corrupted, metric)``: the ``kind`` (``"hooked"`` or ``"bridge"``) of
    :func:`make_pair`'s models (the test is skipped where TransformerLens has no
    ``HookedTransformer``), ``batch`` clean and corrupted prompts and a logit-difference metric."""
    import pytest

    from tl_attnonly.analysis import logit_diff_metric

    hooked, bridge = make_pair(family)
    model = hooked if kind == "hooked" else bridge
    if model is None:
        pytest.skip("no HookedTransformer on TransformerLens 4.x")
    clean, corrupted = make_tokens(batch, pos, seed=0), make_tokens(batch, pos, seed=1)
    metric = logit_diff_metric(torch.arange(1, batch + 1), torch.arange(5, batch + 5))
    return model, clean, corrupted, metric
