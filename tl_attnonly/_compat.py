"""The one seam onto TransformerLens and torch internals.

Everything the package takes from a private attribute or a non-top-level module of
TransformerLens or torch is imported or wrapped here, so that a TransformerLens release that moves
one of them breaks (and is fixed in) this file only. ``tests/test_compat.py`` checks each item
against the installed versions.

==================================  ==============================================================
:func:`has_hooks`                   TL's public ``HookPoint.has_hooks()``, plus the hooks torch
                                    holds that TL does not know of (registered with torch directly)
:func:`rotary_base`                 TL's private ``AbstractAttention._rotary_base()``
``CanBeUsedAsMLP``                  the MLP extension point (``components/mlps/``)
``batch_addmm``                     TL's ``x @ W + b`` kernel (``utilities/addmm``)
``TL_ACTIVATIONS``                  TL's activation functions by ``act_fn`` name
``softcap_enabled``                 whether a config soft-caps scores
``TypedModuleList``                 the typed ``nn.ModuleList`` TL's models declare ``blocks`` as
``convert_bert_weights``            TL's BERT / LLaMA state-dict conversions (``pretrained.``
``convert_llama_weights``           ``weight_conversions``, imported when called)
:func:`make_model_alias_map`        TL 3.x's ``loading_from_pretrained.make_model_alias_map``
                                    (gone in TL 4), rebuilt from the public ``supported_models``
:func:`put_tensor`                  torch's private ``_parameters`` / ``_buffers`` dictionaries:
                                    put a given tensor itself at a dotted name
==================================  ==============================================================
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from transformer_lens.components.mlps.can_be_used_as_mlp import CanBeUsedAsMLP
from transformer_lens.hook_points import HookPoint
from transformer_lens.utilities.activation_functions import (
    SUPPORTED_ACTIVATIONS as TL_ACTIVATIONS,
)
from transformer_lens.utilities.activation_functions import apply_softcap, softcap_enabled
from transformer_lens.utilities.addmm import batch_addmm
from transformer_lens.utilities.architectures import POST_NORM_ARCHITECTURES
from transformer_lens.utilities.typed_module_list import TypedModuleList

#: torch's per-module hook dictionaries (private attributes of ``nn.Module``).
_TORCH_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def has_hooks(hook_point: HookPoint) -> bool:
    """Whether any hook would see the value passed through ``hook_point``.

    TransformerLens's public ``HookPoint.has_hooks()`` knows the hooks added through
    TransformerLens (``add_hook``, ``run_with_hooks``, ``hooks()``, ``run_with_cache``). A hook
    registered with torch directly (``hook_point.register_forward_hook``, as some tools do)
    bypasses that bookkeeping; skipping its value would silently change what the hook sees, so
    torch's own hook dictionaries are checked as well (the fallback).

    Args:
        hook_point: A TransformerLens ``HookPoint``.

    Returns:
        ``True`` if a forward or backward hook of either kind is attached.
    """
    tl_has_hooks = getattr(hook_point, "has_hooks", None)
    if callable(tl_has_hooks) and tl_has_hooks():
        return True
    return any(getattr(hook_point, name, None) for name in _TORCH_HOOK_DICTS)


def rotary_base(attn: nn.Module) -> float:
    """The rotary base a TransformerLens attention layer uses for its sin/cos tables.

    TransformerLens 3.x decides it in the private ``AbstractAttention._rotary_base()`` (local
    attention may use ``cfg.rotary_base_local``); without that method, ``cfg.rotary_base``.

    Args:
        attn: A TransformerLens attention module (``block.attn``).
    """
    private = getattr(attn, "_rotary_base", None)
    if callable(private):
        return private()
    cfg: Any = attn.cfg
    return cfg.rotary_base


def convert_bert_weights(*args: Any, **kwargs: Any) -> Any:
    """TransformerLens's ``convert_bert_weights`` (``pretrained.weight_conversions``), lazily."""
    from transformer_lens.pretrained.weight_conversions import convert_bert_weights as convert

    return convert(*args, **kwargs)


def convert_llama_weights(*args: Any, **kwargs: Any) -> Any:
    """TransformerLens's ``convert_llama_weights`` (``pretrained.weight_conversions``), lazily."""
    from transformer_lens.pretrained.weight_conversions import convert_llama_weights as convert

    return convert(*args, **kwargs)


def make_model_alias_map() -> dict[str, str]:
    """Every TransformerLens model name and alias, lowercased -> the official name.

    TransformerLens 3.x builds this in ``loading_from_pretrained.make_model_alias_map``, which 4.x
    removed; both keep ``OFFICIAL_MODEL_NAMES`` and ``MODEL_ALIASES`` in the public
    ``transformer_lens.supported_models``, from which this builds the same map.
    """
    from transformer_lens.supported_models import MODEL_ALIASES, OFFICIAL_MODEL_NAMES

    aliases: dict[str, str] = {}
    for official in OFFICIAL_MODEL_NAMES:
        for alias in MODEL_ALIASES.get(official, []):
            aliases[alias.lower()] = official
        aliases[official.lower()] = official
    return aliases


def put_tensor(root: nn.Module, name: str, tensor: torch.Tensor, *, buffer: bool = False) -> None:
    """Make ``tensor`` itself (no copy, no checks) the parameter or buffer at dotted ``name``.

    Writes torch's private ``_parameters`` / ``_buffers`` dictionaries of the owning submodule:
    ``setattr`` refuses a plain tensor where a parameter is registered, and ``register_buffer``
    would reset a non-persistent buffer to persistent.

    Args:
        root: The module ``name`` is relative to.
        name: E.g. ``"W_in"`` or ``"experts.0.W_gate.weight"``.
        tensor: The tensor to put there (an ``nn.Parameter`` for a parameter).
        buffer: Put it among the buffers instead of the parameters.
    """
    module_name, _, leaf = name.rpartition(".")
    module = root.get_submodule(module_name)
    store = module._buffers if buffer else module._parameters
    store[leaf] = tensor  # type: ignore[assignment]


__all__ = [
    "POST_NORM_ARCHITECTURES",
    "TL_ACTIVATIONS",
    "TypedModuleList",
    "apply_softcap",
    "CanBeUsedAsMLP",
    "batch_addmm",
    "convert_bert_weights",
    "convert_llama_weights",
    "has_hooks",
    "make_model_alias_map",
    "put_tensor",
    "rotary_base",
    "softcap_enabled",
]
