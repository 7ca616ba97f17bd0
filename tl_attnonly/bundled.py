"""A tiny trained decoder model bundled with the repository, loadable fully offline.

The model lives in ``assets/tiny-stdlib-silu`` at the repository root and was produced by
``scripts/train_tiny_model.py``: a 2-layer, d_model 128, SiLU-MLP TransformerLens
``HookedTransformer`` trained on Python standard-library source code with its own 3072-token
byte-level BPE tokenizer. It is small enough for tests and examples and has real, learned MLP
neurons to rewrite as attention heads.

Example:
    >>> from tl_attnonly.bundled import load_bundled_model
    >>> model = load_bundled_model()
    >>> logits = model("def add(a, b):\\n    return a + b\\n")
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformers import PreTrainedTokenizerFast

BUNDLED_MODEL_NAME = "tiny-stdlib-silu"

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# Config fields that only control random initialisation. They are kept in config.json for a
# faithful record of training, but applying them on load would reseed the global RNGs (a
# ``HookedTransformerConfig`` with ``seed`` set calls ``torch.manual_seed``) and waste time on an
# initialisation that the loaded weights overwrite anyway.
_INIT_ONLY_FIELDS = ("seed", "init_weights")


def bundled_model_dir() -> Path:
    """Locate the directory of the bundled model.

    The assets are not part of the installed Python package: they sit in ``assets/`` at the
    repository root, which is the parent directory of the ``tl_attnonly`` package. They are
    therefore found when the package is used from a source checkout (``PYTHONPATH`` or
    ``pip install -e .``), but not from a regular wheel install.

    Returns:
        Path to ``assets/tiny-stdlib-silu``.

    Raises:
        FileNotFoundError: If the directory or one of its required files is missing.
    """
    repo_root = Path(__file__).resolve().parent.parent
    model_dir = repo_root / "assets" / BUNDLED_MODEL_NAME
    missing = [name for name in _REQUIRED_FILES if not (model_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"Bundled model {BUNDLED_MODEL_NAME!r} not found: expected {', '.join(missing)} in "
            f"{model_dir}. The model ships in the repository's assets/ directory, not in the "
            "wheel; use a source checkout (e.g. `pip install -e .`), or regenerate it with "
            "`python scripts/train_tiny_model.py`."
        )
    return model_dir


def load_bundled_model(
    device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32
) -> HookedTransformer:
    """Load the bundled model and its tokenizer, without any network access.

    Args:
        device: Device to put the model on.
        dtype: Parameter dtype (a ``torch.dtype`` or its name, e.g. ``"float32"``). The
            weights are stored in float32 and cast on load.

    Returns:
        The ``HookedTransformer`` in eval mode, with its tokenizer attached, so that it accepts
        strings. ``model.cfg`` equals the config the model was trained with (``config.json``),
        apart from ``device`` and ``dtype``.

    Raises:
        FileNotFoundError: If the bundled assets cannot be found.
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or its name, got {dtype!r}")
    model_dir = bundled_model_dir()

    cfg_dict = json.loads((model_dir / "config.json").read_text())
    for field in ("device", "dtype"):
        cfg_dict.pop(field, None)
    init_only = {field: cfg_dict.pop(field) for field in _INIT_ONLY_FIELDS if field in cfg_dict}
    cfg = HookedTransformerConfig(**cfg_dict, init_weights=False, device=str(device), dtype=dtype)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
    model = HookedTransformer(cfg, tokenizer=tokenizer)
    # Restore the recorded init-only fields only now: HookedTransformer.__init__ reads them.
    for field, value in init_only.items():
        setattr(model.cfg, field, value)
    state_dict = load_file(str(model_dir / "model.safetensors"))
    model.load_state_dict(state_dict, strict=True)
    model.eval()
    return model


__all__ = [
    "BUNDLED_MODEL_NAME",
    "bundled_model_dir",
    "load_bundled_model",
]
