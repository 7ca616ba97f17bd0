"""Small trained models that ship inside the package, loadable fully offline.

Each bundled model is a directory under ``tl_attnonly/data/models/`` (package data, so it is in
the wheel too) holding ``config.json`` (the ``HookedTransformerConfig`` fields),
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` and ``training.json`` (how it
was made). Files are read through :mod:`importlib.resources`, so they load from any install: a
source checkout, an editable install or a wheel. A new bundled model is a new directory there;
:func:`bundled_model_names` lists them.

The default, ``tiny-stdlib-silu``, was produced by ``scripts/train_tiny_model.py``: a 2-layer,
d_model 128, SiLU-MLP TransformerLens ``HookedTransformer`` trained on Python standard-library
source code with its own 3072-token byte-level BPE tokenizer. It is small enough for tests and
examples and has real, learned MLP neurons to rewrite as attention heads.

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
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load as load_safetensors
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformers import PreTrainedTokenizerFast

if TYPE_CHECKING:
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
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or its name, got {dtype!r}")
    model_dir = bundled_model_dir(name)

    cfg_dict = json.loads(model_dir.joinpath("config.json").read_text(encoding="utf-8"))
    for field in ("device", "dtype"):
        cfg_dict.pop(field, None)
    init_only = {field: cfg_dict.pop(field) for field in _INIT_ONLY_FIELDS if field in cfg_dict}
    cfg = HookedTransformerConfig(**cfg_dict, init_weights=False, device=str(device), dtype=dtype)
    model = HookedTransformer(cfg, tokenizer=load_bundled_tokenizer(name))
    # Restore the recorded init-only fields only now: HookedTransformer.__init__ reads them.
    for field, value in init_only.items():
        setattr(model.cfg, field, value)
    state_dict = load_safetensors(model_dir.joinpath("model.safetensors").read_bytes())
    model.load_state_dict(state_dict, strict=True)
    model.eval()
    return model


__all__ = [
    "BUNDLED_MODEL_NAME",
    "bundled_model_dir",
    "bundled_model_files",
    "bundled_model_names",
    "load_bundled_model",
    "load_bundled_tokenizer",
]
