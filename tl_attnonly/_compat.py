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
:func:`tl_official_model_name`      TL's ``loading_from_pretrained.get_official_model_name``: the
                                    repository ``from_pretrained`` reads a name from
:func:`tl_lists_repo_files`         whether TL finds that model's weights by listing its hub
                                    repository (Neel Nanda's models): never from the cache alone
:func:`hf_offline_mode`             ``huggingface_hub.constants.HF_HUB_OFFLINE``, set for a block
==================================  ==============================================================
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

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


def tl_official_model_name(model_name: str) -> str | None:
    """The Hugging Face repository TL's ``from_pretrained`` loads ``model_name`` from, or ``None``
    for a name (or alias) TL does not know (no network: TL's own table)."""
    try:  # TransformerLens 3.x; 4.x moved it to ``supported_models``
        from transformer_lens.loading_from_pretrained import get_official_model_name
    except ImportError:
        from transformer_lens.supported_models import get_official_model_name
    try:
        return get_official_model_name(model_name)
    except ValueError:
        return None


#: Repository prefixes whose weights TL finds by listing the repository on the hub
#: (``loading_from_pretrained.get_pretrained_state_dict``), so they cannot load from the cache.
TL_LISTED_REPO_PREFIXES = ("NeelNanda", "ArthurConmy", "Baidicoot")


def tl_lists_repo_files(official_name: str) -> bool:
    """Whether TL needs the hub itself (a repository listing) to load ``official_name``."""
    return official_name.startswith(TL_LISTED_REPO_PREFIXES)


@contextlib.contextmanager
def hf_offline_mode() -> Iterator[None]:
    """Hugging Face offline mode for the block: files come from the cache, no request is made.

    ``huggingface_hub`` reads ``HF_HUB_OFFLINE`` once, at import, into
    ``huggingface_hub.constants.HF_HUB_OFFLINE``; its ``is_offline_mode()`` (which
    ``transformers`` asks) returns that constant, so setting it switches both to offline mode.
    """
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


__all__ = [
    "TL_LISTED_REPO_PREFIXES",
    "hf_offline_mode",
    "tl_lists_repo_files",
    "tl_official_model_name",
    "POST_NORM_ARCHITECTURES",
    "TL_ACTIVATIONS",
    "TypedModuleList",
    "apply_softcap",
    "CanBeUsedAsMLP",
    "batch_addmm",
    "convert_bert_weights",
    "convert_llama_weights",
    "has_hooks",
    "rotary_base",
    "softcap_enabled",
]
