"""Per-head views of a TransformerLens ``ActivationCache``: attention heads and neuron-heads.

TransformerLens stacks attention-head results (``cache.stack_head_results``) and MLP-neuron
results (``cache.stack_neuron_results``). In an :class:`~tl_attnonly.AttnOnlyTransformer` every
neuron is ``K`` neuron-heads, so the residual stream decomposes into heads only (attention heads and
neuron-heads), the embeddings, and the output biases:

    ``resid = embed + pos_embed + sum_{attention heads} result + sum_{neuron-heads} result + bias``

A neuron-head's result is ``z[..., h, 0] * W_O[h]`` (``W_O[h] = W_out[h // K]``). It is computed
on demand from the cached ``z`` (``[batch, pos, n_neuron_heads, 1]`` per layer), in chunks, never
cached as ``[batch, pos, n_neuron_heads, d_model]``. Cache what these functions need, and nothing
more, with :func:`tl_attnonly.hooks.decomposition_names_filter`. For ``K = 1`` models the neuron's
``hook_post`` is its head's ``z`` (minus TL's ``b_in`` for gated MLPs) and is accepted instead.

Gated MLPs (:class:`~tl_attnonly.components.GatedNeuronHeadMLP`): a head's result is still
``z * W_O`` (``z`` includes the input-dependent linear branch ``u``); TL's ``b_in``, added after
the product, is no head's: it is part of the layer's output bias ``b_O = b_in @ W_out + b_out``
and so of ``bias``.

Norms after each sublayer (Gemma 2/3, OLMo 2/3): the stacks hold what each head writes to the
residual stream in the cached run, ``w * result_c / sigma`` with the sublayer's norm scale
``sigma`` from the cache (:mod:`tl_attnonly.analysis.post_norm`), and ``bias`` holds each
sublayer's ``w * b_O_c / sigma + b`` (so it varies by position). The per-layer
:func:`get_attn_head_results` and :func:`get_neuron_head_results` stay the sublayer's own results
(TransformerLens's ``hook_result``), before that norm.

A residual post-LN (GPT-1, BERT: the residual stream itself normalised after each sublayer's
add): :func:`~tl_attnonly.analysis.decompose_resid_heads` carries every component through the
later norms with the run's scales (:class:`tl_attnonly.analysis.post_norm.ResidualNorms`); the
stacks without embeddings and bias stay the heads' own results, as written.

Order of components everywhere: attention heads (layer by layer), then neuron-heads (layer by
layer), then ``embed``, ``pos_embed`` (an encoder's ``token_type_embed``), ``bias``:
TransformerLens's ``get_full_resid_decomposition`` order, with neurons replaced by neuron-heads
(for ``K = 1`` the two are identical, labels included).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch
from jaxtyping import Float, Int
from tqdm.auto import tqdm
from transformer_lens import ActivationCache
from transformer_lens.utilities import Slice, SliceInput

import tl_attnonly.analysis.post_norm as post_norm
from tl_attnonly._types import Kinds, check_kinds
from tl_attnonly.adapt import model_of_cache, require_additive_residual
from tl_attnonly.analysis.cache.options import DEFAULT_CHUNK, STACK_BUDGET
from tl_attnonly.hooks import head_act_name, neuron_act_name, neuron_head_label
from tl_attnonly.protocol import BLOCK_INPUT_HOOK

if TYPE_CHECKING:
    from tl_attnonly.analysis.cache.options import StackOptions
    from tl_attnonly.mlp_protocol import ExpertsLayerView
    from tl_attnonly.protocol import AttnOnlyModel


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def cache_model(cache: ActivationCache) -> AttnOnlyModel:
    """The converted model whose run made ``cache``, as analysis reads it."""
    return model_of_cache(cache)


def _resolve_layer(model: AttnOnlyModel, layer: int | None) -> int:
    n_layers = model.cfg.n_layers
    if layer is None or layer == -1:
        return n_layers
    if not 0 <= layer <= n_layers:
        raise ValueError(f"layer must be in [0, {n_layers}] (or -1 / None for all), got {layer}.")
    return layer


def _head_index(
    heads: None | slice | SliceInput | Slice, n_heads: int, device: torch.device
) -> Int[torch.Tensor, "n_selected"]:  # noqa: F821
    if heads is None:
        return torch.arange(n_heads, device=device)
    # TL's Slice takes a builtin slice too; its SliceInput alias does not list it.
    selection = Slice.unwrap(cast(SliceInput, heads))
    try:
        idx = torch.as_tensor(selection.indices(n_heads), device=device)
    except IndexError as err:
        raise IndexError(f"Neuron-head indices must be in [0, {n_heads}), got {heads}.") from err
    return idx


def neuron_head_z(
    cache: ActivationCache, layer: int
) -> Float[torch.Tensor, "*batch_and_pos n_neuron_heads"]:
    """The neuron-heads' ``z`` of one layer (their output before ``W_O``), last axis squeezed.

    Reads ``blocks.{layer}.mlp.hook_z``; for ``K = 1`` models ``blocks.{layer}.mlp.hook_post``
    (identical) is accepted too.

    Raises:
        KeyError: If neither is cached; the message says which names_filter to use.
    """
    model = cache_model(cache)
    z_name = neuron_act_name("z", layer)
    if z_name in cache.cache_dict:
        return cache.cache_dict[z_name][..., 0]
    post_name = neuron_act_name("post", layer)
    if model.n_heads_per_neuron == 1 and post_name in cache.cache_dict:
        # z = post - b_post: b_post is 0, or TL's b_in for gated neuron-heads
        return cache.cache_dict[post_name] - model.blocks[layer].mlp.b_post
    raise KeyError(
        f"{z_name} is not in the cache"
        + (
            f" (nor {post_name}, which equals it when K = 1)"
            if model.n_heads_per_neuron == 1
            else ""
        )
        + ". Cache it, e.g. model.run_with_cache(tokens, names_filter="
        "tl_attnonly.hooks.decomposition_names_filter())."
    )


def _normalize_projection(
    project_output_onto: torch.Tensor | None,
) -> tuple[torch.Tensor | None, bool]:
    if project_output_onto is None:
        return None, False
    if project_output_onto.ndim == 1:
        return project_output_onto[:, None], True
    if project_output_onto.ndim != 2:
        raise ValueError(
            "project_output_onto must be [d_model] or [d_model, n_outputs], got shape "
            f"{tuple(project_output_onto.shape)}."
        )
    return project_output_onto, False


def _accumulated_bias(
    cache: ActivationCache, model: AttnOnlyModel, layer: int, mlp_input: bool, pos_slice: Slice
) -> torch.Tensor:
    """``HookedTransformer.accumulated_bias`` in the model's dtype (TL's sums in float32):
    ``[d_model]``; with norms after each sublayer, their bias terms in the cached run
    (:func:`tl_attnonly.analysis.post_norm.normed_bias`), ``[*batch_and_pos, d_model]``."""
    if mlp_input and layer >= model.cfg.n_layers:
        raise ValueError("mlp_input=True needs layer < n_layers (the unembed has no MLP).")
    bias: torch.Tensor = model.blocks[0].attn.b_O.new_zeros(model.cfg.d_model)
    sublayers = [(li, "attn") for li in range(layer + (1 if mlp_input else 0))]
    sublayers += [(li, "mlp") for li in range(layer)]
    for li, sublayer in sublayers:
        block = model.blocks[li]
        if sublayer == "mlp" and block.mlp.is_mixture_of_experts:
            continue  # the experts' biases are in their components (expert_components)
        # the MLP's output bias: b_out, plus b_in @ W_out for gated neuron-heads (b_O)
        b_O = block.attn.b_O if sublayer == "attn" else block.mlp.b_O
        norm = post_norm.post_norm(model, li, sublayer)
        if norm is None:
            bias = bias + b_O
        else:
            scale = post_norm.cached_scale(cache, norm, pos_slice)
            bias = bias + post_norm.normed_bias(b_O, norm, scale)
    return bias


def _post_normed(
    cache: ActivationCache,
    model: AttnOnlyModel,
    layer: int,
    sublayer: str,
    results: Float[torch.Tensor, "*batch_and_pos n d_model"],
    pos_slice: Slice,
) -> Float[torch.Tensor, "*batch_and_pos n d_model"]:
    """``results`` of one sublayer as they reach the residual stream in the cached run (as they
    are where the sublayer has no norm after it)."""
    norm = post_norm.post_norm(model, layer, sublayer)
    if norm is None:
        return results
    scale = post_norm.cached_scale(cache, norm, pos_slice)
    return post_norm.normed(results, norm, scale[..., None, :])


# ------------------------------------------------------------------------------------------------
# neuron-head results
# ------------------------------------------------------------------------------------------------
def get_neuron_head_results(
    cache: ActivationCache,
    layer: int,
    heads: None | slice | SliceInput | Slice = None,
    pos_slice: None | SliceInput | Slice = None,
    project_output_onto: torch.Tensor | None = None,
) -> torch.Tensor:
    """What each neuron-head of one layer writes to the residual stream (not cached).

    The neuron-head analogue of ``ActivationCache.get_neuron_results``: ``z[..., h] * W_O[h]``.

    Args:
        cache: Cache of an :class:`~tl_attnonly.AttnOnlyTransformer` run holding
            ``blocks.{layer}.mlp.hook_z`` (or ``hook_post`` when ``K = 1``).
        layer: Layer index.
        heads: Which neuron-heads (indices, a ``slice``, a ``(start, stop)`` tuple, a tensor);
            default all ``n_neuron_heads``.
        pos_slice: Positions to keep (TransformerLens ``Slice`` semantics; an int drops the axis).
        project_output_onto: ``[d_model]`` or ``[d_model, n_outputs]``: project each result onto
            these directions without materialising the ``d_model`` axis.

    Returns:
        ``[batch, pos, n_selected, d_model]`` (pos dropped for an int ``pos_slice``; last axis
        ``n_outputs`` or squeezed when projecting).
    """
    model = cache_model(cache)
    pos_slice = Slice.unwrap(pos_slice) if isinstance(pos_slice, Slice) else Slice(pos_slice)
    z = pos_slice.apply(neuron_head_z(cache, layer), dim=-2)
    mlp = model.blocks[layer].mlp
    idx = _head_index(heads, mlp.n_neuron_heads, z.device)
    z = z.index_select(-1, idx)
    W_O = mlp.W_O[idx, 0]  # [n_selected, d_model]
    if project_output_onto is None:
        return z[..., None] * W_O
    projected = W_O @ project_output_onto.to(W_O.dtype)
    if projected.ndim == 1:
        return z * projected
    return z[..., None] * projected


def get_attn_head_results(
    cache: ActivationCache, layer: int, pos_slice: None | SliceInput | Slice = None
) -> Float[torch.Tensor, "*batch_and_pos n_heads d_model"]:
    """What each attention head of one layer writes, without storing it in the cache.

    ``z @ W_O`` per head, as TransformerLens's ``ActivationCache.compute_head_results``, which
    however stores ``[batch, pos, n_heads, d_model]`` for every layer in the cache. Uses
    ``blocks.{layer}.attn.hook_result`` instead if it was cached (``use_attn_result``).
    """
    model = model_of_cache(cache, neuron_heads=False)  # attention heads: any model
    pos_slice = pos_slice if isinstance(pos_slice, Slice) else Slice(pos_slice)
    name = head_act_name("result", layer, "attn")
    cached = cache.cache_dict.get(name)
    if cached is not None and cached.ndim >= 3 and cached.shape[-2] == model.cfg.n_heads:
        return pos_slice.apply(cached, dim=-3)
    z = pos_slice.apply(cache[head_act_name("z", layer, "attn")], dim=-3)  # [..., head, d_head]
    W_O = model.blocks[layer].attn.W_O  # [head, d_head, d_model]
    return torch.einsum("...hd,hdm->...hm", z, W_O)


def component_chunks(
    cache: ActivationCache,
    layer: int,
    mlp_input: bool,
    kinds: Kinds,
    pos_slice: Slice,
    incl_embeds_and_bias: bool,
    chunk_size: int,
    progress: bool,
    norms: post_norm.ResidualNorms | None = None,
) -> Iterator[tuple[Float[torch.Tensor, "chunk *batch_and_pos d_model"], list[str]]]:
    """Residual-stream components in the module's order, in chunks of at most ``chunk_size``.

    ``norms``: a residual post-LN's norms up to the decomposed point; each component is carried
    through them (:meth:`~tl_attnonly.analysis.post_norm.ResidualNorms.reach`) and ``bias`` is
    theirs. ``None``: as the components are written.
    """
    model = cache_model(cache)

    def reach(chunk: torch.Tensor, write: post_norm.Write) -> torch.Tensor:
        return chunk if norms is None else norms.reach(chunk, write)

    n_attn_layers = layer + (1 if mlp_input else 0)
    if "attn" in kinds:
        for li in range(n_attn_layers):
            results = get_attn_head_results(cache, li, pos_slice)
            results = _post_normed(cache, model, li, "attn", results, pos_slice)
            yield (
                reach(results.movedim(-2, 0), (li, "attn")),
                [f"L{li}H{h}" for h in range(model.cfg.n_heads)],
            )
    if "neuron" in kinds:
        K = model.n_heads_per_neuron
        steps: list[tuple[int, int | None]] = []  # (layer, first neuron-head); None: experts
        for li in range(layer):
            if model.blocks[li].mlp.is_mixture_of_experts:  # each expert's weighted output
                steps.append((li, None))
            else:
                n = model.blocks[li].mlp.n_neuron_heads
                steps += [(li, start) for start in range(0, n, chunk_size)]
        for li, start in tqdm(steps, desc="neuron-heads", disable=not progress):
            if start is None:
                from tl_attnonly.analysis.experts.components import expert_components

                experts, expert_labels = expert_components(cache, li, pos_slice)
                experts = _post_normed(cache, model, li, "mlp", experts.movedim(0, -2), pos_slice)
                yield reach(experts.movedim(-2, 0), (li, "mlp")), expert_labels
                continue
            stop = min(start + chunk_size, model.blocks[li].mlp.n_neuron_heads)
            results = get_neuron_head_results(cache, li, slice(start, stop), pos_slice)
            results = _post_normed(cache, model, li, "mlp", results, pos_slice)
            yield (
                reach(results.movedim(-2, 0), (li, "mlp")),
                [neuron_head_label(li, h, K) for h in range(start, stop)],
            )
    if incl_embeds_and_bias:
        embeddings = embedding_components(cache, model, before_norm=norms is not None)
        for embedding, label in embeddings:
            yield reach(pos_slice.apply(embedding, dim=-2)[None], post_norm.EMBED), [label]
        embed = embeddings[0][0] if embeddings else cache["hook_embed"]
        template = pos_slice.apply(embed, dim=-2)
        if norms is None:
            bias = _accumulated_bias(cache, model, layer, mlp_input, pos_slice)
        else:
            bias = norms.bias()
        yield bias.to(template.dtype).expand((1,) + template.shape), ["bias"]


def embedding_components(
    cache: ActivationCache, model: AttnOnlyModel, before_norm: bool = False
) -> list[tuple[Float[torch.Tensor, "batch pos d_model"], str]]:
    """The embeddings' components of a decoder's residual stream, as cached: ``embed``
    (``hook_embed``) and ``pos_embed`` (``hook_pos_embed``). Where learned or sinusoidal
    positions have no hook of their own (:attr:`~tl_attnonly.protocol.AttnOnlyModel.embed_hooks`:
    XGLM on a bridge), ``pos_embed`` is block 0's input less ``embed``: what the positions add.

    ``before_norm``: the embeddings before the model's
    :attr:`~tl_attnonly.protocol.AttnOnlyModel.embed_norm`
    (:attr:`~tl_attnonly.protocol.AttnOnlyModel.embedding_hooks`: an encoder's
    ``token_type_embed`` too), as a residual post-LN's decomposition carries them through it.

    Raises:
        KeyError: If positions are unhooked and the cache lacks ``blocks.0.hook_resid_pre``;
            with ``before_norm``, if ``embed`` is not cached.
    """
    if before_norm:
        found = [
            (cache.cache_dict[name], label)
            for label, name in model.embedding_hooks
            if name in cache.cache_dict
        ]
        if not found or found[0][1] != "embed":
            raise KeyError(
                f"{model.embedding_hooks[0][1]} is not in the cache. Cache it, e.g. "
                "model.run_with_cache(tokens, names_filter="
                "tl_attnonly.hooks.decomposition_names_filter())."
            )
        return found
    out = []
    if "hook_embed" in cache.cache_dict:
        out.append((cache["hook_embed"], "embed"))
    if "hook_pos_embed" in cache.cache_dict:
        out.append((cache["hook_pos_embed"], "pos_embed"))
    elif out and model.embed_hooks == (BLOCK_INPUT_HOOK,):
        if BLOCK_INPUT_HOOK not in cache.cache_dict:
            raise KeyError(
                f"This model's position embeddings have no hook of their own, so they are read as "
                f"{BLOCK_INPUT_HOOK} less hook_embed, which the cache lacks: cache it too "
                "(tl_attnonly.hooks.decomposition_names_filter() keeps it)."
            )
        out.append((cache[BLOCK_INPUT_HOOK] - cache["hook_embed"], "pos_embed"))
    return out


def _template(cache: ActivationCache, pos_slice: Slice) -> torch.Tensor:
    """An empty-ish ``[*batch_and_pos, 0]`` tensor with the cache's batch/pos shape and dtype."""
    if "hook_embed" in cache.cache_dict:
        source = cache.cache_dict["hook_embed"]
    else:  # any head's z: [..., pos, head, d_head]
        names = [n for n in cache.cache_dict if n.endswith(("attn.hook_z", "mlp.hook_z"))]
        names += [n for n in cache.cache_dict if n.endswith("mlp.hook_post")]
        if not names:
            raise KeyError(
                "The cache holds neither hook_embed nor any head's z. Cache them with "
                "names_filter=tl_attnonly.hooks.decomposition_names_filter()."
            )
        source = cache.cache_dict[names[0]]
        source = source[..., 0, :] if names[0].endswith("hook_z") else source
    return pos_slice.apply(source[..., :0], dim=-2)


def _target_resid(cache: ActivationCache, layer: int, mlp_input: bool) -> torch.Tensor:
    n_layers = model_of_cache(cache, neuron_heads=False).cfg.n_layers
    if layer == n_layers:
        return cache[("resid_post", n_layers - 1)]
    return cache[("resid_mid" if mlp_input else "resid_pre", layer)]


def _n_mlp_components(model: AttnOnlyModel, layer: int) -> int:
    """Components of one MLP layer in a stack: its neuron-heads, or its experts (and shared
    experts, at most a few: counted as 2)."""
    mlp = model.blocks[layer].mlp
    if mlp.is_mixture_of_experts:
        return len(cast("ExpertsLayerView", mlp).expert_list()) + 2
    return int(mlp.n_neuron_heads)


def stack_components(
    cache: ActivationCache,
    layer: int | None,
    options: StackOptions,
    *,
    mlp_input: bool = False,
    kinds: Kinds = ("attn", "neuron"),
    incl_embeds_and_bias: bool = False,
) -> tuple[torch.Tensor, list[str]]:
    """The stack behind :func:`stack_all_head_results` and :func:`decompose_resid_heads`."""
    pos_slice, apply_ln = options.pos_slice, options.apply_ln
    incl_remainder, project_output_onto = options.incl_remainder, options.project_output_onto
    max_bytes, chunk_size, progress = options.max_bytes, options.chunk_size, options.progress
    model = cache_model(cache)
    residual_post_norm = post_norm.residual_post_norm(model)
    if incl_remainder or (incl_embeds_and_bias and not residual_post_norm):
        require_additive_residual(
            model, "decompose_resid_heads" if incl_embeds_and_bias else "incl_remainder=True"
        )
    if apply_ln and residual_post_norm:
        raise ValueError(
            "apply_ln=True has no norm to apply here: this model normalises the residual stream "
            "itself after each sublayer, so the stream a sublayer reads is already a norm's "
            "output (decompose_resid_heads decomposes it, each norm's scale from the run)."
        )
    check_kinds(kinds)
    layer = _resolve_layer(model, layer)
    pos_slice = pos_slice if isinstance(pos_slice, Slice) else Slice(pos_slice)
    norms = None
    if incl_embeds_and_bias and residual_post_norm:
        norms = post_norm.ResidualNorms(cache, model, layer, mlp_input, pos_slice)
    project, squeeze = _normalize_projection(project_output_onto)

    template = _template(cache, pos_slice)
    n_components = 0
    if "attn" in kinds:
        n_components += (layer + (1 if mlp_input else 0)) * model.cfg.n_heads
    if "neuron" in kinds:
        n_components += sum(_n_mlp_components(model, li) for li in range(layer))
    n_components += len(model.embedding_hooks) + 1 if incl_embeds_and_bias else 0
    d_out = model.cfg.d_model if project is None else project.shape[-1]
    size = n_components * math.prod(template.shape[:-1]) * d_out * template.element_size()
    if size > max_bytes:
        raise MemoryError(
            f"Stacking {n_components} components needs {size / 2**30:.2f} GiB (budget "
            f"{max_bytes / 2**30:.2f} GiB). Narrow it: pos_slice=-1, "
            "project_output_onto=<direction>, "
            "kinds=('attn',), an earlier layer; or use head_logit_attrs() for DLA, which works in "
            "chunks; or raise max_bytes."
        )

    # The norm the stack reaches: ln1 / ln2 of ``layer``, ln_final at the unembed (a block
    # whose sublayers read the residual stream itself, OLMo 2's, has none to apply).
    if layer == model.cfg.n_layers:
        target_norm = model.ln_final
    else:
        target_norm = model.blocks[layer].ln2 if mlp_input else model.blocks[layer].ln1

    def finish(stack: torch.Tensor) -> torch.Tensor:
        if apply_ln and target_norm is not None:
            stack = cache.apply_ln_to_stack(stack, layer, mlp_input=mlp_input, pos_slice=pos_slice)
        if project is not None:
            stack = stack @ project.to(stack.dtype)
        return stack

    parts, labels = [], []
    for chunk, chunk_labels in component_chunks(
        cache, layer, mlp_input, kinds, pos_slice, incl_embeds_and_bias, chunk_size, progress, norms
    ):
        parts.append(finish(chunk))
        labels += chunk_labels
    if incl_remainder:
        resid = pos_slice.apply(_target_resid(cache, layer, mlp_input), dim=-2)
        # LN with a cached scale and a projection are linear: remainder of the processed stack.
        total = sum(p.sum(0) for p in parts) if parts else 0
        parts.append(finish(resid[None]) - total)
        labels.append("remainder")
    if parts:
        stack = torch.cat(parts, dim=0)
    else:
        stack = template.new_zeros((0,) + template.shape[:-1] + (d_out,))
    if squeeze:
        stack = stack.squeeze(-1)
    return stack, labels


__all__ = [
    "DEFAULT_CHUNK",
    "STACK_BUDGET",
    "embedding_components",
    "get_attn_head_results",
    "get_neuron_head_results",
    "neuron_head_z",
]
