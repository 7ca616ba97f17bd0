"""Per-head ``hook_z`` on bridges whose heads' value width is not ``cfg.d_head`` (multi-head
latent attention).

A TransformerBridge shows ``blocks.{l}.attn.hook_z`` (an alias of ``o.hook_in``, the input of the
output projection, ``[batch, pos, n_heads * d_head_v]``) as ``[batch, pos, head, d_head]`` through a
reshape conversion. TransformerLens 3.9 and 4.3 build that reshape from ``cfg.d_head`` (or the
projection's width divided by it). Multi-head latent attention (DeepSeek-V2/V3's
``MLAAttentionBridge``) has queries and keys of one width and values of another
(``qk_nope_head_dim + qk_rope_head_dim`` against ``v_head_dim``), so there the reshape splits the
output projection's input into the wrong "heads": in the zoo's DeepSeek-V3, 8 of width 8 where
the 4 heads write 16 each (``W_O`` is ``[4, 16, 64]``). Every per-head reading or patch of
``hook_z`` (TransformerLens's own head patching, per-head results, direct logit attribution) would
then mix halves of two heads.

:func:`repair_z_layouts` (run by :func:`tl_attnonly.convert` on a bridge) gives each such
``hook_z`` the reshape of the heads ``W_O`` has (a new instance of the bridge's own reshape
class); :func:`check_z_layout` refuses, before any work, an analysis of a bridge whose ``hook_z``
still splits otherwise. The values are the same; only the split into heads changes.
"""

from __future__ import annotations

import weakref
from typing import Any

from tl_attnonly._compat import child_module

#: Hook point -> the reshape it had before :func:`repair_z_layouts` (for :func:`restore_z_layouts`).
_ORIGINAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _z_hook(attn: Any) -> Any:
    """The hook point behind ``attn.hook_z`` (``o.hook_in``), or None."""
    out_proj = child_module(attn, "o") if attn is not None else None
    return getattr(out_proj, "hook_in", None)


def head_layout(attn: Any) -> tuple[int, int] | None:
    """``(n_heads, d_head)`` of ``attn``'s ``W_O`` (``[n_heads, d_head, d_model]``), or None where
    the component has none. Before its first forward pass a latent-attention bridge cannot split
    ``W_O`` yet (TransformerLens reads the value width then); its Hugging Face module's
    ``v_head_dim`` and the output projection's width give the same split. A block without
    attention (a linear-attention or state-space layer of a hybrid model) has none."""
    if attn is None:
        return None
    try:
        W_O = attn.W_O
        return (int(W_O.shape[0]), int(W_O.shape[1])) if W_O.dim() == 3 else None
    except (AttributeError, NotImplementedError, RuntimeError, ValueError):
        pass
    d_head = getattr(getattr(attn, "original_component", None), "v_head_dim", None)
    out_proj = getattr(child_module(attn, "o"), "original_component", None)
    width = getattr(out_proj, "in_features", None)
    if isinstance(d_head, int) and isinstance(width, int) and d_head and width % d_head == 0:
        return width // d_head, d_head
    return None


def z_layout(attn: Any) -> tuple[int, int] | None:
    """``(n_heads, d_head)`` the bridge's ``hook_z`` reshape splits into, or None (no reshape)."""
    conversion = getattr(_z_hook(attn), "hook_conversion", None)
    if conversion is None or not hasattr(conversion, "n_heads"):
        return None
    return int(conversion.n_heads), int(conversion.d_head)


def _mismatched(attn: Any) -> tuple[tuple[int, int], tuple[int, int]] | None:
    heads, split = head_layout(attn), z_layout(attn)
    if heads is None or split is None or heads == split:
        return None
    return split, heads


def repair_z_layouts(bridge: Any) -> list[int]:
    """Give every block's ``hook_z`` the split into ``W_O``'s heads where it splits otherwise.

    Args:
        bridge: A TransformerBridge.

    Returns:
        The layers repaired.
    """
    repaired = []
    for index, block in enumerate(bridge.blocks):
        attn = child_module(block, "attn")
        found = _mismatched(attn)
        if found is None:
            continue
        hook = _z_hook(attn)
        _ORIGINAL.setdefault(hook, hook.hook_conversion)
        hook.hook_conversion = type(hook.hook_conversion)(*found[1])
        repaired.append(index)
    return repaired


def restore_z_layouts(bridge: Any) -> None:
    """Undo :func:`repair_z_layouts` (the bridge's own reshapes again)."""
    for block in bridge.blocks:
        hook = _z_hook(child_module(block, "attn"))
        if hook is not None and hook in _ORIGINAL:
            hook.hook_conversion = _ORIGINAL.pop(hook)


def check_z_layout(attn: Any, layer: int) -> None:
    """Refuse a bridge attention whose ``hook_z`` does not split into ``W_O``'s heads.

    Raises:
        NotImplementedError: Naming the two splits and the repair (``tl_attnonly.convert``).
    """
    found = _mismatched(attn)
    if found is None:
        return
    (n, d), (n_heads, d_head) = found
    raise NotImplementedError(
        f"blocks.{layer}.attn.hook_z is split into {n} heads of {d} by TransformerLens's bridge, "
        f"but the layer has {n_heads} heads writing {d_head} values each (W_O "
        f"[{n_heads}, {d_head}, d_model]; multi-head latent attention's values are narrower or "
        "wider than its queries): per-head readings and patches of hook_z would mix heads. "
        "tl_attnonly.convert(bridge) repairs the split (the values are unchanged); analyse the "
        "converted bridge."
    )


__all__ = ["check_z_layout", "head_layout", "repair_z_layouts", "restore_z_layouts", "z_layout"]
