"""Small trained models that ship inside the package, loadable fully offline.

Each bundled model is a directory under ``tl_attnonly/data/models/`` (package data, so it is in
the wheel too) holding ``config.json`` (the ``HookedTransformerConfig`` fields),
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` and ``training.json`` (how it
was made). Files are read through :mod:`importlib.resources`, so they load from any install: a
source checkout, an editable install or a wheel. A new bundled model is a new directory there;
:func:`bundled_model_names` lists them.

Two more, ``tiny-stdlib-gemma2`` (Gemma-2-like: GeGLU, norms before and after each sublayer,
soft caps, a local layer) and ``tiny-stdlib-qwen3moe`` (Qwen3-MoE-like: q/k norms, 4 experts, 2
routed per token), are Hugging Face models (``config.json`` is their ``transformers`` config:
:func:`is_hf_native`), trained by ``scripts/train_tiny_hf_models.py`` on the same corpus with half
of each batch repeated random sequences, so that both learn induction; load them with
:func:`load_bundled_bridge`.

The default, ``tiny-stdlib-silu``, was produced by ``scripts/train_tiny_model.py``: a 2-layer,
d_model 128, SiLU-MLP TransformerLens ``HookedTransformer`` trained on Python standard-library
source code with its own 3072-token byte-level BPE tokenizer. It is small enough for tests and
examples and has real, learned MLP neurons to rewrite as attention heads.

:func:`load_bundled_model` returns a ``HookedTransformer`` (TransformerLens 3.x).
:func:`load_bundled_hf_model` builds the same model as a Hugging Face ``GPT2LMHeadModel`` and
:func:`load_bundled_bridge` boots that into a ``TransformerBridge``; both work on TransformerLens
3.x and 4.x (``tl-attnonly demo`` uses the bridge on 4.x).

Example:
    >>> from tl_attnonly.bundled import load_bundled_model
    >>> model = load_bundled_model()
    >>> logits = model("def add(a, b):\\n    return a + b\\n")
"""

from __future__ import annotations

import json
import sys
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load as load_safetensors
from transformers import PreTrainedTokenizerFast

if TYPE_CHECKING:
    from transformer_lens import HookedTransformer
    from transformers import GPT2LMHeadModel

    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:
        from importlib.abc import Traversable

#: The model :func:`load_bundled_model` loads by default.
BUNDLED_MODEL_NAME = "tiny-stdlib-silu"

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# Config fields that only control random initialisation. They are kept in config.json for a
# faithful record of training, but applying them on load would reseed the global RNGs (a
# ``HookedTransformerConfig`` with ``seed`` set calls ``torch.manual_seed``) and waste time on an
# initialisation that the loaded weights overwrite anyway.
_INIT_ONLY_FIELDS = ("seed", "init_weights")


def _models_root() -> Traversable:
    return files("tl_attnonly") / "data" / "models"


def bundled_model_names() -> list[str]:
    """The names of the bundled models (directories under ``tl_attnonly/data/models``).

    Returns:
        Sorted names, e.g. ``["tiny-stdlib-silu"]``.
    """
    root = _models_root()
    if not root.is_dir():
        return []
    return sorted(
        d.name for d in root.iterdir() if d.is_dir() and d.joinpath("config.json").is_file()
    )


def bundled_model_files(name: str = BUNDLED_MODEL_NAME) -> Traversable:
    """The package-data directory of one bundled model, checked for completeness.

    Args:
        name: A name from :func:`bundled_model_names`.

    Returns:
        An :mod:`importlib.resources` ``Traversable`` (a ``pathlib.Path`` for an install on a
        file system).

    Raises:
        FileNotFoundError: If there is no such model, or one of its files is missing.
    """
    model_dir = _models_root().joinpath(name)
    missing = [f for f in _REQUIRED_FILES if not model_dir.joinpath(f).is_file()]
    if missing:
        available = ", ".join(repr(n) for n in bundled_model_names()) or "none"
        raise FileNotFoundError(
            f"Bundled model {name!r} not found: {', '.join(missing)} missing from the package "
            f"data directory tl_attnonly/data/models/{name}. Bundled models: {available}. "
            "Reinstall tl-attnonly, or regenerate the default model with "
            "`python scripts/train_tiny_model.py`."
        )
    return model_dir


def bundled_model_dir(name: str = BUNDLED_MODEL_NAME) -> Path:
    """The directory of a bundled model on the file system (e.g. for ``from_pretrained(dir)``).

    Args:
        name: A name from :func:`bundled_model_names`.

    Returns:
        Path to ``tl_attnonly/data/models/{name}``.

    Raises:
        FileNotFoundError: If the model is missing (see :func:`bundled_model_files`), or the
            package is imported from an archive rather than a directory (TransformerLens and
            transformers load a tokenizer from a directory; pip installs unzipped).
    """
    model_dir = bundled_model_files(name)
    if not isinstance(model_dir, Path):
        raise FileNotFoundError(
            f"Bundled model {name!r} is inside an archive ({model_dir}), not a directory; "
            "install tl-attnonly with pip (which unpacks it), or put it on sys.path unzipped."
        )
    return model_dir


def load_bundled_tokenizer(name: str = BUNDLED_MODEL_NAME) -> PreTrainedTokenizerFast:
    """The tokenizer of a bundled model, read from package data (no network).

    Args:
        name: A name from :func:`bundled_model_names`.

    Returns:
        The ``PreTrainedTokenizerFast`` saved with the model. It is loaded from the model's
        directory (TransformerLens reloads a tokenizer from its ``name_or_path``).
    """
    return PreTrainedTokenizerFast.from_pretrained(
        str(bundled_model_dir(name)), local_files_only=True
    )


def load_bundled_model(
    name: str = BUNDLED_MODEL_NAME,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
) -> HookedTransformer:
    """Load a bundled model and its tokenizer, without any network access.

    Args:
        name: A name from :func:`bundled_model_names` (default: ``tiny-stdlib-silu``).
        device: Device to put the model on.
        dtype: Parameter dtype (a ``torch.dtype`` or its name, e.g. ``"float32"``). The
            weights are stored in float32 and cast on load.

    Returns:
        The ``HookedTransformer`` in eval mode, with its tokenizer attached, so that it accepts
        strings. ``model.cfg`` equals the config the model was trained with (``config.json``),
        apart from ``device`` and ``dtype``.

    Raises:
        FileNotFoundError: If the bundled files cannot be found.
    """
    from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER

    if not HAS_HOOKED_TRANSFORMER:
        raise ImportError(
            "load_bundled_model returns a HookedTransformer, which TransformerLens 4.x removed. "
            "On 4.x load the bundled model as a TransformerBridge: "
            "tl_attnonly.bundled.load_bundled_bridge() (then tl_attnonly.convert(bridge)), or "
            "install transformer-lens>=3,<4."
        )
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    dtype = _as_dtype(dtype)
    bundled_model_dir(name)  # fails early, naming what is missing
    if is_hf_native(name):
        raise NotImplementedError(
            f"Bundled model {name!r} is a Hugging Face "
            f"{_read_config(name)['architectures'][0]}, not a HookedTransformer: load it with "
            f"tl_attnonly.bundled.load_bundled_bridge({name!r}) (TransformerLens 3.x and 4.x)."
        )

    cfg_dict = _read_config(name)
    for field in ("device", "dtype"):
        cfg_dict.pop(field, None)
    init_only = {field: cfg_dict.pop(field) for field in _INIT_ONLY_FIELDS if field in cfg_dict}
    cfg = HookedTransformerConfig(**cfg_dict, init_weights=False, device=str(device), dtype=dtype)
    model = HookedTransformer(cfg, tokenizer=load_bundled_tokenizer(name))
    # Restore the recorded init-only fields only now: HookedTransformer.__init__ reads them.
    for field, value in init_only.items():
        setattr(model.cfg, field, value)
    model.load_state_dict(_read_state_dict(name), strict=True)
    model.eval()
    return model


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, dtype)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or its name, got {dtype!r}")
    return dtype


def is_hf_native(name: str = BUNDLED_MODEL_NAME) -> bool:
    """Whether bundled model ``name`` is stored as a Hugging Face model (its ``config.json`` is a
    ``transformers`` config naming its ``architectures``: ``tiny-stdlib-gemma2``,
    ``tiny-stdlib-qwen3moe``) rather than as a ``HookedTransformer`` (``tiny-stdlib-silu``)."""
    return "architectures" in _read_config(name)


def _read_config(name: str) -> dict[str, Any]:
    """The bundled model's ``config.json`` (``HookedTransformerConfig`` fields)."""
    model_dir = bundled_model_files(name)
    return json.loads(model_dir.joinpath("config.json").read_text(encoding="utf-8"))


def _read_state_dict(name: str) -> dict[str, torch.Tensor]:
    """The bundled model's TransformerLens state dict (float32, as stored)."""
    model_dir = bundled_model_files(name)
    return load_safetensors(model_dir.joinpath("model.safetensors").read_bytes())


# ------------------------------------------------------------------------------------------------
# The bundled model as a Hugging Face GPT-2 (and a TransformerBridge around it): TL 3.x and 4.x
# ------------------------------------------------------------------------------------------------
#: TransformerLens config values a GPT-2 (``GPT2LMHeadModel``) layout can hold: field -> the
#: values allowed (a missing field takes TransformerLens's default, listed first).
_GPT2_LAYOUT = {
    "normalization_type": ("LN",),
    "positional_embedding_type": ("standard",),
    "attention_dir": ("causal",),
    "attn_only": (False,),
    "gated_mlp": (False,),
    "parallel_attn_mlp": (False,),
    "final_rms": (False,),
    "use_attn_scale": (True,),
    "attn_scale": (None,),
    "eps": (1e-5,),
    "n_key_value_heads": (None,),
    "original_architecture": (None, "GPT2LMHeadModel"),
}
#: TransformerLens ``act_fn`` -> Hugging Face ``activation_function`` (the same function).
_HF_ACTIVATIONS = {
    "silu": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_new",
    "gelu_fast": "gelu_fast",
    "relu": "relu",
}


def bundled_hf_config(name: str = BUNDLED_MODEL_NAME) -> Any:
    """The ``transformers.GPT2Config`` of a bundled model: the same architecture in Hugging
    Face's GPT-2 layout (``activation_function`` the model's own, ``n_positions = n_ctx``,
    ``n_inner = d_mlp``, no dropout, untied embeddings).

    Raises:
        NotImplementedError: If the bundled model's config has a field GPT-2 cannot represent
            (named, with the value GPT-2 needs).
    """
    from transformers import GPT2Config

    if is_hf_native(name):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(bundled_model_dir(name)), local_files_only=True)
    cfg = _read_config(name)
    problems = [
        f"{field}={cfg[field]!r} (GPT-2 needs {' or '.join(repr(v) for v in allowed)})"
        for field, allowed in _GPT2_LAYOUT.items()
        if field in cfg and cfg[field] not in allowed
    ]
    if cfg["act_fn"] not in _HF_ACTIVATIONS:
        problems.append(f"act_fn={cfg['act_fn']!r} (supported: {', '.join(_HF_ACTIVATIONS)})")
    if cfg["d_head"] * cfg["n_heads"] != cfg["d_model"]:
        problems.append(
            f"d_head * n_heads = {cfg['d_head'] * cfg['n_heads']} != d_model = {cfg['d_model']}"
        )
    if problems:
        raise NotImplementedError(
            f"Bundled model {name!r} has no Hugging Face GPT-2 form: {'; '.join(problems)}. "
            "Load it with load_bundled_model() (TransformerLens 3.x) instead."
        )
    tokenizer_cfg = json.loads(
        bundled_model_files(name).joinpath("tokenizer_config.json").read_text(encoding="utf-8")
    )
    tokenizer = load_bundled_tokenizer(name)
    token_id: dict[str, int] = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        if key in tokenizer_cfg:
            token_id[key] = int(tokenizer.convert_tokens_to_ids(tokenizer_cfg[key]))  # type: ignore[arg-type]
    return GPT2Config(
        vocab_size=cfg["d_vocab"],
        n_positions=cfg["n_ctx"],
        n_embd=cfg["d_model"],
        n_layer=cfg["n_layers"],
        n_head=cfg["n_heads"],
        n_inner=cfg["d_mlp"],
        activation_function=_HF_ACTIVATIONS[cfg["act_fn"]],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=cfg.get("eps", 1e-5),
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        tie_word_embeddings=False,
        bos_token_id=token_id.get("bos_token"),
        eos_token_id=token_id.get("eos_token"),
        pad_token_id=token_id.get("pad_token"),
    )


def tl_to_hf_gpt2_state_dict(
    state_dict: dict[str, torch.Tensor], n_layers: int, n_heads: int
) -> dict[str, torch.Tensor]:
    """A TransformerLens GPT-2-style state dict in Hugging Face ``GPT2LMHeadModel`` layout.

    The exact inverse of TransformerLens's ``convert_gpt2_weights``
    (``transformer_lens/pretrained/weight_conversions/gpt2.py``): ``W_Q, W_K, W_V``
    ``[n_heads, d_model, d_head]`` -> ``c_attn.weight`` ``[d_model, 3 * d_model]`` (``Conv1D``
    stores ``[in, out]``: columns ``(head, d_head)`` for Q, then K, then V), ``b_Q, b_K, b_V``
    ``[n_heads, d_head]`` -> ``c_attn.bias`` ``[3 * d_model]``, ``W_O`` ``[n_heads, d_head,
    d_model]`` -> ``attn.c_proj.weight`` ``[d_model, d_model]``, ``W_in`` / ``W_out`` as they are
    (``Conv1D``), ``W_U`` ``[d_model, d_vocab]`` -> ``lm_head.weight`` ``[d_vocab, d_model]``
    (``nn.Linear``) and ``b_U`` -> ``lm_head.bias``. Only reshapes: no value changes.

    Args:
        state_dict: ``HookedTransformer.state_dict()`` of a model with GPT-2's layout (LN,
            learned positions, a plain MLP, biases everywhere, ``d_head * n_heads = d_model``).
        n_layers: Its ``cfg.n_layers``.
        n_heads: Its ``cfg.n_heads``.

    Returns:
        The Hugging Face state dict (``transformer.*`` and ``lm_head.weight`` / ``lm_head.bias``).

    Raises:
        KeyError: If a TransformerLens weight is missing, or one is left over (a weight GPT-2
            has no place for), both named.
    """
    import einops

    sd = {k: v for k, v in state_dict.items() if not k.endswith((".IGNORE", ".mask"))}
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise KeyError(f"{key} is missing from the TransformerLens state dict")
        used.add(key)
        return sd[key]

    hf = {
        "transformer.wte.weight": take("embed.W_E"),
        "transformer.wpe.weight": take("pos_embed.W_pos"),
    }
    for layer in range(n_layers):
        tl, h = f"blocks.{layer}.", f"transformer.h.{layer}."
        hf[h + "ln_1.weight"] = take(tl + "ln1.w")
        hf[h + "ln_1.bias"] = take(tl + "ln1.b")
        qkv = [take(f"{tl}attn.W_{x}") for x in "QKV"]  # [n_heads, d_model, d_head] each
        hf[h + "attn.c_attn.weight"] = torch.cat(
            [einops.rearrange(w, "i m h -> m (i h)", i=n_heads) for w in qkv], dim=1
        )
        hf[h + "attn.c_attn.bias"] = torch.cat([take(f"{tl}attn.b_{x}").flatten() for x in "QKV"])
        hf[h + "attn.c_proj.weight"] = einops.rearrange(
            take(tl + "attn.W_O"), "i h m -> (i h) m", i=n_heads
        )
        hf[h + "attn.c_proj.bias"] = take(tl + "attn.b_O")
        hf[h + "ln_2.weight"] = take(tl + "ln2.w")
        hf[h + "ln_2.bias"] = take(tl + "ln2.b")
        hf[h + "mlp.c_fc.weight"] = take(tl + "mlp.W_in")
        hf[h + "mlp.c_fc.bias"] = take(tl + "mlp.b_in")
        hf[h + "mlp.c_proj.weight"] = take(tl + "mlp.W_out")
        hf[h + "mlp.c_proj.bias"] = take(tl + "mlp.b_out")
    hf["transformer.ln_f.weight"] = take("ln_final.w")
    hf["transformer.ln_f.bias"] = take("ln_final.b")
    hf["lm_head.weight"] = take("unembed.W_U").T
    hf["lm_head.bias"] = take("unembed.b_U")
    left = sorted(set(sd) - used)
    if left:
        raise KeyError(f"TransformerLens weights with no place in GPT-2's layout: {left}")
    return {key: value.contiguous() for key, value in hf.items()}


def load_bundled_hf_model(
    name: str = BUNDLED_MODEL_NAME,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
) -> GPT2LMHeadModel:
    """A bundled model as a Hugging Face ``GPT2LMHeadModel``, offline (TransformerLens 3.x and
    4.x).

    Same weights and same function as :func:`load_bundled_model`: the TransformerLens state dict
    is laid out as GPT-2's (:func:`tl_to_hf_gpt2_state_dict`) in the config of
    :func:`bundled_hf_config`. One difference from a stock GPT-2: the bundled model's unembedding
    has a bias (``b_U``), so ``lm_head`` is an ``nn.Linear`` with a bias (GPT-2's has none).

    Args:
        name: A name from :func:`bundled_model_names`.
        device: Device to put the model on.
        dtype: Parameter dtype (weights are stored in float32 and cast on load).

    Returns:
        The model in eval mode, eager attention.
    """
    import torch.nn as nn
    from transformers import GPT2LMHeadModel

    dtype = _as_dtype(dtype)
    if is_hf_native(name):
        from transformers import AutoModelForCausalLM

        native = AutoModelForCausalLM.from_pretrained(
            str(bundled_model_dir(name)), local_files_only=True, attn_implementation="eager",
            dtype=dtype,
        )  # fmt: skip
        nn.Module.to(native, device=device)
        return native.eval()
    config = bundled_hf_config(name)
    config._attn_implementation = "eager"
    cfg = _read_config(name)
    hf_state = tl_to_hf_gpt2_state_dict(_read_state_dict(name), cfg["n_layers"], cfg["n_heads"])
    model = GPT2LMHeadModel(config)
    model.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=True)
    model.load_state_dict(hf_state, strict=True)
    model.name_or_path = str(bundled_model_files(name))
    nn.Module.to(model, device=device, dtype=dtype)
    return model.eval()


def load_bundled_bridge(
    name: str = BUNDLED_MODEL_NAME,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
) -> Any:
    """A bundled model as a TransformerLens ``TransformerBridge``, offline (TransformerLens 3.x
    and 4.x): :func:`load_bundled_hf_model` booted into a bridge (GPT-2 adapter), with the
    bundled tokenizer, so it takes strings. Convert it with ``tl_attnonly.convert(bridge)``.

    Args:
        name: A name from :func:`bundled_model_names`.
        device: Device to put the model on.
        dtype: Parameter dtype.

    Returns:
        The ``TransformerBridge`` (not in compatibility mode: it runs the Hugging Face modules).
    """
    from tl_attnonly._compat import build_bridge_from_module

    model = load_bundled_hf_model(name, device=device, dtype=dtype)
    architectures = getattr(model.config, "architectures", None) or ["GPT2LMHeadModel"]
    return build_bridge_from_module(
        model,
        architectures[0],
        hf_config=model.config,
        tokenizer=load_bundled_tokenizer(name),
        model_name=name,
    )


__all__ = [
    "BUNDLED_MODEL_NAME",
    "bundled_hf_config",
    "bundled_model_dir",
    "bundled_model_files",
    "bundled_model_names",
    "is_hf_native",
    "load_bundled_bridge",
    "load_bundled_hf_model",
    "load_bundled_model",
    "load_bundled_tokenizer",
    "tl_to_hf_gpt2_state_dict",
]
