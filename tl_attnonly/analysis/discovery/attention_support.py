"""Attention layers an exact circuit run reads whole (:func:`latent_attention_layers`).

An exact run rebuilds each head's ``q``, ``k`` and ``v`` from that head's mixed residual input
(``W ln1(x) + b``, :mod:`.exact_run`), using the linear maps ``W_Q``, ``W_K``, ``W_V``.
Multi-head latent attention (DeepSeek-V2/V3) has none: its queries and keys carry a rotary part
computed apart from the rest, and its keys and values are decompressed from one latent per
position that is normalised (``kv_a_layernorm``) and shared by every head. A head's ``k``/``v``
therefore depend on the input of all heads at once: no head reads an input of its own.

Such a layer is read through one input, ``L{l}ATTN`` (:data:`~.graph.LATENT_ATTN`): the layer's
normalised input ``blocks.{l}.attn.hook_in``, rebuilt in a run from the sources joined to it and
normalised by ``ln1`` like any reader's input, then fed to the layer's own computation (latents,
norms, rotary). Its heads stay nodes: each writes its own output (``hook_z`` split as ``W_O``'s
heads). The full graph is the clean run and the empty graph the corrupted run, exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tl_attnonly.protocol import AttnOnlyModel


def latent_attn_input_hook(layer: int) -> str:
    """``blocks.{layer}.attn.hook_in``: what a latent attention layer reads, its normalised
    input (a TransformerBridge's attention component's hook)."""
    return f"blocks.{layer}.attn.hook_in"


def latent_attention_layers(model: AttnOnlyModel) -> list[int]:
    """The layers of ``model`` whose attention has no linear per-head ``q``/``k``/``v`` maps.

    Args:
        model: The adapted model (:func:`~tl_attnonly.adapt.analysis_model`).
    """
    out = []
    for index, block in enumerate(model.blocks):
        try:
            block.attn.W_Q  # noqa: B018  (TransformerLens raises where there is none)
            block.attn.W_K  # noqa: B018
        except NotImplementedError:
            out.append(index)
    return out


def attention_problems(model: AttnOnlyModel) -> list[str]:
    """The attention layers of ``model`` an exact run cannot read (``[]``: none): latent
    attention without a hook of its normalised input (:func:`latent_attn_input_hook`).

    Args:
        model: The adapted model (:func:`~tl_attnonly.adapt.analysis_model`).
    """
    missing = [
        li
        for li in latent_attention_layers(model)
        if latent_attn_input_hook(li) not in model.hook_dict
    ]
    if not missing:
        return []
    return [
        f"attention without linear q/k/v maps and without a hook of its normalised input "
        f"(blocks.{{l}}.attn.hook_in) in layers {missing}"
    ]


__all__ = ["attention_problems", "latent_attention_layers", "latent_attn_input_hook"]
