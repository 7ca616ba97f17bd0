"""Random models of SmolLM2-135M's size in two families, for ``bench_discovery.py --families``.

``llama``: SmolLM2's own architecture (``LlamaForCausalLM``: pre-norm RMSNorm, SwiGLU, one exact
neuron-head per neuron). ``gemma2``: ``Gemma2ForCausalLM`` of the same sizes (norms after each
sublayer as well as before, attention and final logit soft caps, GeGLU with the tanh GELU:
``K = 4`` neuron-heads per neuron by default). Both: 30 layers, d_model 576, 9 heads of 64 (3
key/value heads), d_mlp 1536, ``--vocab`` tokens (SmolLM2's 49152 by default), random weights
(Hugging Face's initialisation, seed 0), fp32, built offline and bridged
(``build_bridge_from_module``), then converted.

The task is random: ``--prompts`` prompts of ``--pos`` random tokens (seed 1), corrupted at two
positions, and the mean logit difference of two random tokens per prompt at the last position
(``logit_diff_metric``). The circuits mean nothing; the times compare what discovery costs on the
two families for the same sizes and the same pipeline.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

import tl_attnonly
from tl_attnonly.analysis import logit_diff_metric

#: SmolLM2-135M's sizes (``HuggingFaceTB/SmolLM2-135M``'s config).
SIZES: dict[str, Any] = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=2048,
)
#: Family -> (architecture, config class, its own settings).
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(hidden_act="silu", tie_word_embeddings=True)),
    "gemma2": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=64,
            sliding_window=4096,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
    ),  # fmt: skip
}


#: Random Llama-like models of three public models' sizes, for ``bench_discovery_scaling.py``:
#: name -> (config sizes, vocabulary). Tied embeddings, as those models have.
SCALES: dict[str, tuple[dict[str, Any], int]] = {
    "135M": (SIZES, 49152),  # SmolLM2-135M
    "0.5B": (
        dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
             num_attention_heads=14, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=2048),
        151936,
    ),  # Qwen2.5-0.5B's sizes
    "1B": (
        dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64,
             max_position_embeddings=2048),
        128256,
    ),  # Llama-3.2-1B's sizes
    "tiny": (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256),
        512,
    ),  # for the benchmark's test
}  # fmt: skip


def build(family: str, vocab: int, sizes: dict[str, Any] | None = None) -> Any:
    """The converted bridge of a random model of ``family`` (:data:`FAMILIES`), of ``sizes``
    (default SmolLM2-135M's, :data:`SIZES`)."""
    import transformers
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    architecture, config_name, own = FAMILIES[family]
    config = getattr(transformers, config_name)(vocab_size=vocab, **(sizes or SIZES), **own)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = getattr(transformers, architecture)(config).eval()
        bridge = build_bridge_from_module(hf_model, architecture, hf_config=config)
    return tl_attnonly.convert(bridge)


def task(vocab: int, prompts: int, pos: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(clean, corrupted, metric)`` of the random task (module docstring)."""
    gen = torch.Generator().manual_seed(1)
    clean = torch.randint(2, vocab, (prompts, pos), generator=gen)
    corrupted = clean.clone()
    corrupted[:, 1] = torch.randint(2, vocab, (prompts,), generator=gen)
    corrupted[:, -2] = torch.randint(2, vocab, (prompts,), generator=gen)
    correct, wrong = torch.randint(2, vocab, (2, prompts), generator=gen)
    return clean, corrupted, logit_diff_metric(correct, wrong)
