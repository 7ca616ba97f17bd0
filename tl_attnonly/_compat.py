"""The one seam onto TransformerLens and torch internals.

Everything the package takes from a private attribute or a non-top-level module of
TransformerLens or torch is imported or wrapped here, so that a TransformerLens release that moves
one of them breaks (and is fixed in) this file only. ``tests/test_compat.py`` checks each item
against the installed versions.

==================================  ==============================================================
:func:`has_hooks`                   TL's public ``HookPoint.has_hooks()``, plus the hooks torch
                                    holds that TL does not know of (registered with torch directly)
:func:`global_module_hooks`         whether torch holds a global module hook (its private
                                    ``nn.modules.module._global_*_hooks``)
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
``HAS_HOOKED_TRANSFORMER``          whether this TransformerLens has ``HookedTransformer`` (3.x;
                                    4.x removed it and its component tree: only
                                    ``TransformerBridge``)
``BRIDGE_STARTS_AT_LAYER``          whether a bridge's forward takes ``start_at_layer`` (4.x)
:func:`is_transformer_bridge`       whether an object is a ``TransformerBridge`` (3.x and 4.x)
:func:`bridge_bypasses_original`    whether a bridge MLP computes itself from processed weights
:func:`route_through_original`      (TL's private ``_use_processed_weights``) and making it call
                                    its wrapped module instead
:func:`make_model_alias_map`        TL 3.x's ``loading_from_pretrained.make_model_alias_map``
                                    (gone in TL 4), rebuilt from the public ``supported_models``
:func:`put_tensor`                  torch's private ``_parameters`` / ``_buffers`` dictionaries:
                                    put a given tensor itself at a dotted name
:func:`build_bridge_from_module`    TL's bridge over a Hugging Face model in memory (offline)
:func:`boot_bridge`                 TL's ``TransformerBridge.boot_transformers`` (the hub)
:func:`hook_alias_generation`       TL's count of bridge hook-alias rebinds (``model_bridge.
                                    generalized_components.base.alias_generation``)
==================================  ==============================================================
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
from typing import TYPE_CHECKING, Any, Dict, Iterator

import torch
import torch.nn as nn
from jaxtyping import Float
from transformer_lens.hook_points import HookPoint
from transformer_lens.utilities.activation_functions import (
    SUPPORTED_ACTIVATIONS as TL_ACTIVATIONS,
)
from transformer_lens.utilities.activation_functions import apply_softcap, softcap_enabled
from transformer_lens.utilities.addmm import batch_addmm
from transformer_lens.utilities.architectures import POST_NORM_ARCHITECTURES
from transformer_lens.utilities.typed_module_list import TypedModuleList

#: Whether this TransformerLens has ``HookedTransformer`` and its component tree (3.x). 4.x has
#: only ``TransformerBridge``: there, :func:`tl_attnonly.convert` takes a bridge and the
#: HookedTransformer-only entry points raise an ``ImportError`` that says what to use.
HAS_HOOKED_TRANSFORMER = importlib.util.find_spec("transformer_lens.HookedTransformer") is not None

#: Whether a ``TransformerBridge`` starts a forward pass at a block
#: (``run_with_hooks(resid, start_at_layer=l)``): TransformerLens 4.x; 3.x's bridge raises
#: ``NotImplementedError``. Read from the installed version, not by trying.
BRIDGE_STARTS_AT_LAYER = int(importlib.metadata.version("transformer-lens").split(".")[0]) >= 4

#: The message of the HookedTransformer-only entry points on TransformerLens 4.x.
NO_HOOKED_TRANSFORMER = (
    "needs TransformerLens's HookedTransformer, which TransformerLens 4.x removed. On 4.x, "
    "convert a TransformerBridge instead: bridge = TransformerBridge.boot_transformers(name); "
    "tl_attnonly.convert(bridge) (see docs/bridge.md), or install transformer-lens>=3,<4."
)


class _MLPBase(nn.Module):
    """What the neuron-head layers take from TL 3.x's ``CanBeUsedAsMLP`` (absent from 4.x).

    Args:
        cfg: Any object with ``d_model``, ``d_mlp``, ``act_fn`` and ``dtype`` attributes.
    """

    def __init__(self, cfg: Any):
        super().__init__()
        self.cfg = cfg
        if cfg.d_mlp is None:
            raise ValueError("d_mlp must be set to use an MLP")
        self.d_mlp = cfg.d_mlp

    def forward(
        self, x: Float[torch.Tensor, "batch pos d_model"]
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        return x

    def select_activation_function(self) -> None:
        """``self.act_fn``: TransformerLens's function of ``cfg.act_fn``."""
        self.act_fn = TL_ACTIVATIONS[self.cfg.act_fn]


if TYPE_CHECKING:
    from transformer_lens.model_bridge import TransformerBridge as TransformerBridge

if TYPE_CHECKING or HAS_HOOKED_TRANSFORMER:
    from transformer_lens.components.mlps.can_be_used_as_mlp import CanBeUsedAsMLP
else:  # TransformerLens 4.x
    CanBeUsedAsMLP = _MLPBase


class MLPConfig:
    """The few config fields a neuron-head layer reads, for layers built outside a
    ``HookedTransformer`` (a ``TransformerBridge``'s MLPs).

    Args:
        d_model: Residual width.
        d_mlp: Neurons.
        act_fn: TransformerLens ``act_fn`` name.
        dtype: Parameter dtype.
    """

    def __init__(self, d_model: int, d_mlp: int, act_fn: str, dtype: torch.dtype):
        self.d_model = d_model
        self.d_mlp = d_mlp
        self.act_fn = act_fn
        self.dtype = dtype
        self.gated_mlp = False

    def is_layer_norm_activation(self) -> bool:
        """Never (SoLU-LN is not convertible)."""
        return False

    def to_dict(self) -> Dict[str, Any]:
        return dict(vars(self))


def mlp_config(d_model: int, d_mlp: int, act_fn: str, dtype: torch.dtype) -> Any:
    """A config for one neuron-head layer built outside a HookedTransformer (a bridge's MLP):
    TL 3.x's ``CanBeUsedAsMLP`` wants a ``HookedTransformerConfig``; on 4.x, an
    :class:`MLPConfig`."""
    if not HAS_HOOKED_TRANSFORMER:
        return MLPConfig(d_model, d_mlp, act_fn, dtype)
    from transformer_lens import HookedTransformerConfig

    return HookedTransformerConfig(
        d_model=d_model,
        d_head=d_model,
        n_layers=1,
        n_ctx=1,
        d_mlp=d_mlp,
        act_fn=act_fn,
        dtype=dtype,
        device="cpu",
    )


def is_transformer_bridge(model: object) -> bool:
    """Whether ``model`` is a TransformerLens ``TransformerBridge`` (3.x or 4.x), or an instance
    of a subclass of one, without importing the bridge package for other objects: a class named
    ``TransformerBridge`` of ``transformer_lens.model_bridge`` in its MRO. The package's one test
    of whether a model is a bridge."""
    for cls in type(model).__mro__:
        if cls.__name__ == "TransformerBridge" and cls.__module__.startswith(
            "transformer_lens.model_bridge"
        ):
            return True
    return False


def bridge_bypasses_original(mlp_bridge: nn.Module) -> bool:
    """Whether a bridge MLP component computes its output itself from processed weights
    (TransformerLens's private ``_use_processed_weights``, set by ``enable_compatibility_mode``
    on gated MLPs) instead of calling its wrapped module."""
    return bool(mlp_bridge.__dict__.get("_use_processed_weights", False))


def register_bridge_hooks(bridge: nn.Module, names: list[str]) -> None:
    """Add hook points mounted after the bridge was built to its hook registry (TL's private
    ``_hook_registry``, which ``hook_dict``, ``run_with_cache`` and ``run_with_hooks`` read), under
    their full names (``blocks.0.mlp.hook_pattern``)."""
    registry = bridge.__dict__["_hook_registry"]
    for name in names:
        hook_point: Any = bridge.get_submodule(name)
        hook_point.name = name
        registry[name] = hook_point


def unregister_bridge_hooks(bridge: nn.Module, names: list[str]) -> None:
    """Remove hook points from a bridge's hook registry (see :func:`register_bridge_hooks`)."""
    registry = bridge.__dict__["_hook_registry"]
    for name in names:
        registry.pop(name, None)


def route_through_original(mlp_bridge: nn.Module) -> None:
    """Make a bridge MLP component call its wrapped module again (clears the private
    ``_use_processed_weights``). Only for components whose processed weights also live in their
    projection submodules, which the wrapped module then calls (TL 3.9 and 4.x gated MLPs)."""
    mlp_bridge.__dict__["_use_processed_weights"] = False


def child_module(module: nn.Module, name: str) -> nn.Module | None:
    """``module``'s direct submodule ``name``, or ``None`` (torch's private ``_modules``: unlike
    ``getattr``, it finds no parameter, buffer or plain attribute of that name)."""
    return module._modules.get(name)


def unmount_component_hook(component: nn.Module, hook_name: str) -> None:
    """Remove a hook point mounted on a bridge component: from the component's hook registry
    (TL's private ``_hook_registry``) and its submodules (torch's private ``_modules``)."""
    component.__dict__.get("_hook_registry", {}).pop(hook_name, None)
    component._modules.pop(hook_name, None)


def boot_bridge(name: str, **kwargs: Any) -> Any:
    """TransformerLens's ``TransformerBridge.boot_transformers(name, **kwargs)``
    (``transformer_lens.model_bridge``, 3.9 and 4.x): a bridge of a hub model."""
    from transformer_lens.model_bridge import TransformerBridge as Bridge

    return Bridge.boot_transformers(name, **kwargs)


def hook_alias_generation() -> int:
    """TransformerLens's count of the times a bridge component rebound its hook aliases
    (``model_bridge.generalized_components.base.alias_generation``, 3.9 and 4.x; 0 where there
    is none): a bridge's alias resolution read while it had one value holds while it has it."""
    try:
        from transformer_lens.model_bridge.generalized_components.base import alias_generation
    except ImportError:
        return 0
    return int(alias_generation())


def build_bridge_from_module(*args: Any, **kwargs: Any) -> Any:
    """TransformerLens's ``build_bridge_from_module`` (``model_bridge.sources``, 3.9 and 4.x): a
    ``TransformerBridge`` over a Hugging Face model already in memory, offline."""
    from transformer_lens.model_bridge.sources import build_bridge_from_module as build

    return build(*args, **kwargs)


#: torch's per-module hook dictionaries (private attributes of ``nn.Module``).
_TORCH_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)


#: torch's global module hooks (private dictionaries of ``torch.nn.modules.module``, filled by
#: ``register_module_forward_hook`` and its kin): they see every module's value, hook points'.
_TORCH_GLOBAL_HOOK_DICTS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def global_module_hooks() -> bool:
    """Whether a global module hook (``torch.nn.modules.module.register_module_forward_hook``
    and its kin) is registered: it sees the value passed through every hook point, and may keep
    it, so a neuron-head layer then gives each hooked quantity memory of its own."""
    return any(getattr(nn.modules.module, name, None) for name in _TORCH_GLOBAL_HOOK_DICTS)


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
        module = importlib.import_module("transformer_lens.loading_from_pretrained")
    except ImportError:
        module = importlib.import_module("transformer_lens.supported_models")
    try:
        return module.get_official_model_name(model_name)
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
    "boot_bridge",
    "build_bridge_from_module",
    "child_module",
    "unmount_component_hook",
    "TL_LISTED_REPO_PREFIXES",
    "hf_offline_mode",
    "tl_lists_repo_files",
    "tl_official_model_name",
    "HAS_HOOKED_TRANSFORMER",
    "MLPConfig",
    "mlp_config",
    "NO_HOOKED_TRANSFORMER",
    "POST_NORM_ARCHITECTURES",
    "bridge_bypasses_original",
    "register_bridge_hooks",
    "unregister_bridge_hooks",
    "is_transformer_bridge",
    "route_through_original",
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
