"""Small random Hugging Face models behind a TransformerBridge, built offline from configs.

Works on TransformerLens 3.x and 4.x (no HookedTransformer here). The weights are redrawn at a
scale whose MLP pre-activations are O(1), so the GELU-family fits are probed, not their zeros.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import transformers
from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

warnings.filterwarnings("ignore", message=".*[Cc]ompatibility.*")

D_VOCAB = 64
SMALL = dict(vocab_size=D_VOCAB, num_hidden_layers=2)
_LLAMA_LIKE = dict(
    SMALL, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2
)

#: name -> (Hugging Face class, config class, config kwargs, expected act_fn)
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", _LLAMA_LIKE, "silu"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", _LLAMA_LIKE, "silu"),
    "gpt2": (
        "GPT2LMHeadModel",
        "GPT2Config",
        dict(vocab_size=D_VOCAB, n_layer=2, n_embd=32, n_head=4, n_positions=64),
        "gelu_new",
    ),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(_LLAMA_LIKE, head_dim=8), "gelu_new"),
}
SILU = ("llama", "qwen2")
GELU = ("gpt2", "gemma")


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Redraw every weight matrix ~ N(0, 1/fan_in) and every vector ~ N(0, 0.1^2) (norm scales
    around 1), so the residual stream and the MLP pre-activations are O(1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64)
            if param.ndim >= 2:
                param.copy_(noise / math.sqrt(min(param.shape)))
            elif "norm" in name or "ln" in name:
                param.copy_(noise * 0.1 + (0.0 if "gemma" in type(model).__name__.lower() else 1))
            else:
                param.copy_(noise * 0.1)
    return model


def make_hf(arch: str, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides: Any):
    """A random Hugging Face model of ``arch`` (see :data:`ARCHITECTURES`) and its config."""
    model_cls, config_cls, kwargs, _ = ARCHITECTURES[arch]
    config = getattr(transformers, config_cls)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    randomize_(model, seed)
    return model.to(dtype).eval(), config


def make_bridge(arch: str, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides: Any):
    """A TransformerBridge around a fresh random model of ``arch``."""
    model, config = make_hf(arch, dtype, seed, **overrides)
    return build_bridge_from_module(model, ARCHITECTURES[arch][0], hf_config=config)


def make_tokens(batch: int = 3, pos: int = 7, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, D_VOCAB, (batch, pos), generator=generator)

