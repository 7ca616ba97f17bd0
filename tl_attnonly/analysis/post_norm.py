"""Norms after each sublayer (Gemma 2/3's ``ln1_post`` / ``ln2_post``, OLMo 2/3's post-norm
blocks), linear in one run.

Such a block adds ``N(out)`` to the residual stream, not the sublayer's output ``out`` (the sum
of its heads' results and its output bias ``b_O``). With the norm's scale ``sigma`` taken from
the run (its ``hook_scale``: ``sqrt(mean(out_c ** 2) + eps)``, ``out_c`` the centred output for
a LayerNorm, ``out`` for an RMSNorm),

    ``N(out) = w * out_c / sigma + b = sum_heads w * result_c / sigma + (w * b_O_c / sigma + b)``

is linear in the heads' results: head ``h`` writes ``w * result_c[h] / sigma`` to the residual
stream in that run, and the output bias and the norm's bias ``b`` are the layer's bias term. This
is how TransformerLens's ``logit_attrs`` treats the final norm (its cached scale); here it is
every sublayer's. The residual decomposition, direct logit attribution and the exact circuit runs
of :mod:`tl_attnonly.analysis.discovery` read the norms and scales through this module.

Everything is read through :mod:`tl_attnonly.protocol`: ``Block.ln1_post`` / ``ln2_post`` (a
:class:`~tl_attnonly.protocol.Norm`) and the hook that sees each one's scale
(``Norm.hook_scale``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from jaxtyping import Float
from transformer_lens.utilities import Slice

if TYPE_CHECKING:
    from transformer_lens import ActivationCache

    from tl_attnonly.protocol import AttnOnlyModel, Norm


def has_post_norms(model: AttnOnlyModel) -> bool:
    """Whether any block normalises a sublayer's output before adding it."""
    return any(b.ln1_post is not None or b.ln2_post is not None for b in model.blocks)


def post_norm(model: AttnOnlyModel, layer: int, sublayer: str) -> Norm | None:
    """The norm after ``sublayer`` (``"attn"`` or ``"mlp"``) of block ``layer``, or ``None``."""
    block = model.blocks[layer]
    return block.ln1_post if sublayer == "attn" else block.ln2_post


def scale_hook(norm: Norm) -> str:
    """The name of the hook that sees ``norm``'s scale in a run.

    Raises:
        NotImplementedError: If the model names none.
    """
    name = norm.hook_scale
    if name is None:
        raise NotImplementedError(
            "This model's norm after a sublayer has no hook_scale, so its scale in a run cannot "
            "be read; the decomposition needs it."
        )
    return name


def cached_scale(
    cache: ActivationCache, norm: Norm, pos_slice: Slice | None = None
) -> Float[torch.Tensor, "*batch_and_pos 1"]:
    """``norm``'s scale in the cached run (``pos_slice`` applied).

    Raises:
        KeyError: If the scale is not cached; the message names the filter that caches it.
    """
    name = scale_hook(norm)
    if name not in cache.cache_dict:
        raise KeyError(
            f"{name} is not in the cache: a model with norms after each sublayer needs their "
            "scales to decompose the residual stream. Cache them, e.g. model.run_with_cache("
            "tokens, names_filter=tl_attnonly.hooks.decomposition_names_filter())."
        )
    scale = cache.cache_dict[name]
    return scale if pos_slice is None else pos_slice.apply(scale, dim=-2)


def normed(
    x: Float[torch.Tensor, "... d_model"],
    norm: Norm,
    scale: Float[torch.Tensor, "... 1"],
) -> Float[torch.Tensor, "... d_model"]:
    """``w * x_c / scale``: what ``x``, one summand of the norm's input, contributes to its
    output in a run with that ``scale`` (``x_c``: centred for a LayerNorm). The norm's bias is
    not included (:func:`normed_bias`)."""
    if norm.centred:
        x = x - x.mean(-1, keepdim=True)
    x = x / scale
    w = norm.w
    return x if w is None else x * w.to(x.dtype)


def normed_bias(
    b_O: Float[torch.Tensor, " d_model"],
    norm: Norm,
    scale: Float[torch.Tensor, "... 1"],
) -> Float[torch.Tensor, "... d_model"]:
    """The bias term a post-normed sublayer adds in a run: ``w * b_O_c / scale + b``."""
    out = normed(b_O.to(scale.dtype).expand(scale.shape[:-1] + b_O.shape), norm, scale)
    b = norm.b
    return out if b is None else out + b.to(out.dtype)


__all__ = [
    "cached_scale",
    "has_post_norms",
    "normed",
    "normed_bias",
    "post_norm",
    "scale_hook",
]
