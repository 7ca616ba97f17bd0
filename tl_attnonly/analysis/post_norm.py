"""Norms inside the residual stream's path, linear in one run: norms after each sublayer (Gemma
2/3's ``ln1_post`` / ``ln2_post``, OLMo 2/3's post-norm blocks) and norms of the residual stream
itself after each sublayer (a residual post-LN: GPT-1, BERT-style encoders, OPT's
``do_layer_norm_before=False``).

**Norms after each sublayer.** Such a block adds ``N(out)`` to the residual stream, not the
sublayer's output ``out`` (the sum of its heads' results and its output bias ``b_O``). With the
norm's scale ``sigma`` taken from the run (its ``hook_scale``: ``sqrt(mean(out_c ** 2) + eps)``,
``out_c`` the centred output for a LayerNorm, ``out`` for an RMSNorm),

    ``N(out) = w * out_c / sigma + b = sum_heads w * result_c / sigma + (w * b_O_c / sigma + b)``

is linear in the heads' results: head ``h`` writes ``w * result_c[h] / sigma`` to the residual
stream in that run, and the output bias and the norm's bias ``b`` are the layer's bias term. This
is how TransformerLens's ``logit_attrs`` treats the final norm (its cached scale); here it is
every sublayer's. The residual decomposition, direct logit attribution and the exact circuit runs
of :mod:`tl_attnonly.analysis.discovery` read the norms and scales through this module.

**A residual post-LN** (:func:`residual_post_norm`) normalises the sum itself:
``LN1(resid + attn_out)``, ``LN2(mid + mlp_out)``, and for an encoder ``LN(embeddings)`` first.
With each norm's scale from the run, each is the same affine map, so the stream after any norm is
an exact sum: every component pushed through the centred, scaled maps ``w * x_c / sigma`` of
every norm after its write (:class:`ResidualNorms`), plus one bias term: the sublayers' output
biases and the norms' biases ``b``, each pushed through the norms after it. The residual
decomposition reads this; the edge graph of :mod:`tl_attnonly.analysis.discovery` does not (its
runs change every scale).

Everything is read through :mod:`tl_attnonly.protocol`: ``Block.ln1_post`` / ``ln2_post`` (a
:class:`~tl_attnonly.protocol.Norm`), a residual post-LN's ``Block.ln1`` / ``ln2`` and
``embed_norm``, and the hook that sees each one's scale (``Norm.hook_scale``).
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


def residual_post_norm(model: AttnOnlyModel) -> bool:
    """Whether the model normalises the residual stream itself after each sublayer
    (``LN(resid + sublayer_out)``): a BERT-style encoder (``model.is_encoder``), or a decoder
    whose config says post-norm (``model.cfg.post_norm``) with no norm after a sublayer's output
    (GPT-1, OPT's ``do_layer_norm_before=False``). Its ``Block.ln1`` / ``ln2`` are then the
    norms after the attention's and the MLP's residual add."""
    return model.is_encoder or (model.cfg.post_norm and not has_post_norms(model))


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
            f"{name} is not in the cache: a model whose norms sit after its sublayers (or after "
            "their residual add) needs their scales to decompose the residual stream. Cache "
            "them, e.g. model.run_with_cache("
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
    """The bias term a post-normed sublayer adds in a run: ``w * b_O_c / scale + b``
    (``b_O`` may already vary by position: ``[*batch_and_pos, d_model]``)."""
    out = normed(b_O.to(scale.dtype).expand(scale.shape[:-1] + b_O.shape[-1:]), norm, scale)
    b = norm.b
    return out if b is None else out + b.to(out.dtype)


#: A write to the residual stream: ``(layer, "attn" | "mlp")``, or the embeddings' ``EMBED``.
Write = tuple[int, str]
EMBED: Write = (-1, "embed")


class ResidualNorms:
    """A residual post-LN's norms between each write and one point of the residual stream, with
    the scales of a cached run: the maps that carry a component to that point.

    The point is the stream after every norm that ran before it: block ``layer``'s input
    (``resid_pre``); with ``mlp_input``, the MLP's input ``LN1(resid_pre + attn_out)``; for
    ``layer = n_layers``, the last block's output (the final hidden states). A component written
    at ``write`` reaches it as ``reach(x, write)``: ``x`` through ``w * x_c / sigma`` of every
    norm after the write (its own sublayer's residual norm included), ``sigma`` the run's.

    Args:
        cache: The cached run (every norm's ``hook_scale``).
        model: A residual post-LN model (:func:`residual_post_norm`).
        layer: The block whose input (or MLP input) is the point; ``n_layers``: the output.
        mlp_input: The MLP's input of ``layer`` instead of the block's.
        pos_slice: The positions kept (applied to the scales).

    Raises:
        NotImplementedError: For parallel blocks, or a block without both residual norms.
        ValueError: For ``mlp_input`` at ``layer = n_layers``.
        KeyError: If a norm's scale is not cached (:func:`cached_scale`).
    """

    def __init__(
        self,
        cache: ActivationCache,
        model: AttnOnlyModel,
        layer: int,
        mlp_input: bool,
        pos_slice: Slice,
    ):
        if model.cfg.parallel_attn_mlp:
            raise NotImplementedError(
                "A residual post-LN with parallel attention and MLP is not decomposed: its "
                "norms' placement is not known here."
            )
        if mlp_input and layer >= model.cfg.n_layers:
            raise ValueError("mlp_input=True needs layer < n_layers (the unembed has no MLP).")
        self.model = model
        writes = [EMBED] + [(li, s) for li in range(layer) for s in ("attn", "mlp")]
        writes += [(layer, "attn")] if mlp_input else []
        #: Each write with the norm after it (``None``: none) and that norm's scale.
        self.steps: list[tuple[Write, Norm | None, torch.Tensor | None]] = []
        for write in writes:
            norm = self._norm_after(write)
            scale = None if norm is None else cached_scale(cache, norm, pos_slice)
            self.steps.append((write, norm, scale))
        self._index = {write: i for i, (write, _, _) in enumerate(self.steps)}

    def _norm_after(self, write: Write) -> Norm | None:
        layer, sublayer = write
        if sublayer == "embed":
            return self.model.embed_norm
        block = self.model.blocks[layer]
        norm = block.ln1 if sublayer == "attn" else block.ln2
        if norm is None:
            raise NotImplementedError(
                f"blocks.{layer} of this residual post-LN model has no norm after its "
                f"{sublayer} sublayer's residual add, so where its stream is normalised is not "
                "known here; its decomposition is refused."
            )
        return norm

    def reach(
        self, x: Float[torch.Tensor, "n *batch_and_pos d_model"], write: Write
    ) -> Float[torch.Tensor, "n *batch_and_pos d_model"]:
        """``x``, components written at ``write``, as they are at the point (norms' biases
        excluded: :meth:`bias`)."""
        for _, norm, scale in self.steps[self._index[write] :]:
            if norm is not None and scale is not None:
                x = normed(x, norm, scale)
        return x

    def bias(self) -> Float[torch.Tensor, "*batch_and_pos d_model"]:
        """The bias term at the point: every sublayer's output bias ``b_O`` (an expert layer's
        biases are in its components) and every norm's bias ``b``, each pushed through the norms
        after it."""
        model = self.model
        bias: torch.Tensor = model.blocks[0].attn.b_O.new_zeros(model.cfg.d_model)
        for (layer, sublayer), norm, scale in self.steps:
            if sublayer == "attn":
                bias = bias + model.blocks[layer].attn.b_O
            elif sublayer == "mlp" and not model.blocks[layer].mlp.is_mixture_of_experts:
                bias = bias + model.blocks[layer].mlp.b_O
            if norm is not None and scale is not None:
                bias = normed_bias(bias, norm, scale)
        return bias


__all__ = [
    "EMBED",
    "ResidualNorms",
    "Write",
    "cached_scale",
    "has_post_norms",
    "normed",
    "normed_bias",
    "post_norm",
    "residual_post_norm",
    "scale_hook",
]
