"""Where a view's data comes from: the converted model of a cache, the cache and string tokens of
a prompt, the patterns and ``z`` of chosen neuron-heads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
from transformer_lens import ActivationCache

from tl_attnonly._types import HeadsLike
from tl_attnonly.adapt import analysis_model, model_of_cache
from tl_attnonly.analysis.experts.routing import expert_heads_as_dense
from tl_attnonly.hooks import neuron_act_name, neuron_names_filter
from tl_attnonly.mlp_protocol import refuse_expert_layers
from tl_attnonly.protocol import AttnOnlyModel

#: A prompt for a view: text, token ids ``[pos]``/``[batch, pos]``, or its string tokens.
TokensLike = str | torch.Tensor | Sequence[str]


def converted_model_of(cache_or_model: Any) -> AttnOnlyModel:
    """The converted model itself, or the one whose run made a cache."""
    if isinstance(cache_or_model, ActivationCache):
        return model_of_cache(cache_or_model)
    return analysis_model(cache_or_model)


def cached(cache: ActivationCache, kind: str, layer: int) -> torch.Tensor:
    tensor = _optional(cache, kind, layer)
    if tensor is None:
        mlps = [block.mlp for block in model_of_cache(cache).blocks]
        refuse_expert_layers(mlps, [layer], "A view of dense neuron-heads")  # experts: no hook
        name = neuron_act_name(kind, layer)
        raise KeyError(
            f"{name} is not in the cache. Run the converted model with it cached, e.g. "
            f"converted.run_with_cache(tokens, names_filter=lambda n: n.endswith(('mlp.hook_"
            "pattern', 'mlp.hook_z')))."
        )
    return tensor


def _optional(cache: ActivationCache, kind: str, layer: int) -> torch.Tensor | None:
    name = neuron_act_name(kind, layer)
    return cache[name] if name in cache.cache_dict else None


def weights_and_z(
    cache: ActivationCache, layer: int, shown: list[int], n_tokens: int, batch_index: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(pattern [head, pos, (self, bias)], z [head, pos])`` of the shown heads, as float arrays.

    ``z`` is NaN when the cache lacks ``hook_z``. Raises if the cache is not ``n_tokens`` long.
    """
    pattern = cached(cache, "pattern", layer)[batch_index, shown].detach().float().cpu().numpy()
    if pattern.shape[1] != n_tokens:
        raise ValueError(
            f"{n_tokens} tokens given for a cache of {pattern.shape[1]} positions: pass the "
            "string tokens of the prompt the cache was computed on."
        )
    z = _optional(cache, "z", layer)
    if z is None:
        return pattern, np.full(pattern.shape[:2], np.nan)
    return pattern, z[batch_index, :, shown, 0].detach().float().T.cpu().numpy()


def heads_from_neurons(
    heads: HeadsLike, neurons: HeadsLike, k_per_neuron: int, d_mlp: int
) -> list[int] | None:
    if neurons is None:
        return None if heads is None else heads  # type: ignore[return-value]
    if heads is not None:
        raise ValueError("Pass heads=... or neurons=..., not both.")
    if isinstance(neurons, int):
        neurons = [neurons]
    out: list[int] = []
    for n in torch.as_tensor(neurons).flatten().tolist():
        if not 0 <= n < d_mlp:
            raise IndexError(f"Neuron indices must be in [0, {d_mlp}), got {n}.")
        out.extend(range(n * k_per_neuron, (n + 1) * k_per_neuron))
    return out


def cache_and_tokens(
    source: Any, tokens: TokensLike | None, layer: int, batch_index: int
) -> tuple[ActivationCache, list[str]]:
    """The cache a view of ``layer`` reads (``source`` itself, or a run of the model ``source``
    on ``tokens``) and the prompt's string tokens.

    For a mixture-of-experts layer the cache returned holds the layer's experts' neuron-heads in
    a dense layer's hooks (``blocks.{layer}.mlp.hook_pattern`` and ``hook_z``; numbered and
    laid out as :func:`~tl_attnonly.analysis.experts.expert_heads_as_dense` does, NaN at the
    tokens not routed to a head's expert), so the views read every layer alike.
    """
    if isinstance(source, ActivationCache):
        model = converted_model_of(source)
        _check_layer(model, layer)
        if tokens is None:
            raise ValueError(
                "Pass tokens=...: the prompt (text or ids) or its string tokens, to label the view."
            )
        if isinstance(tokens, (list, tuple)):
            str_tokens = [str(t) for t in tokens]
        else:
            str_tokens = _str_tokens(model, cast("str | torch.Tensor", tokens), batch_index)
        return _layer_view(source, layer, len(str_tokens)), str_tokens
    model = converted_model_of(source)
    if tokens is None:
        raise ValueError("Pass tokens=...: the prompt to run the model on (text or token ids).")
    if isinstance(tokens, (list, tuple)):
        raise TypeError("With a model, pass the prompt as text or token ids, not string tokens.")
    run_kwargs: dict[str, Any] = {}
    if isinstance(tokens, str):  # an encoder's forward also takes its token types and mask
        ids, run_kwargs = model.tokenize(tokens)
    else:
        ids = torch.as_tensor(tokens)
    if ids.ndim == 1:
        ids = ids.unsqueeze(0)
    _check_layer(model, layer)
    names = neuron_names_filter("pattern", "z", layers=layer)  # an expert layer's too
    with torch.inference_mode():
        _, cache = model.run_with_cache(ids, names_filter=names, **run_kwargs)
    return _layer_view(cache, layer, ids.shape[-1]), _str_tokens(model, ids, batch_index)


def _layer_view(cache: ActivationCache, layer: int, n_pos: int) -> ActivationCache:
    """``cache``, or for a mixture-of-experts layer a cache of its experts' neuron-heads in the
    dense hooks of ``layer`` (see :func:`cache_and_tokens`)."""
    model = converted_model_of(cache)
    if not getattr(model.neuron_heads[layer], "is_mixture_of_experts", False):
        return cache
    try:
        dense = {
            neuron_act_name(kind, layer): expert_heads_as_dense(cache, layer, kind, n_pos)
            for kind in ("pattern", "z")
        }
    except KeyError as missing:
        raise KeyError(
            f"A view of blocks.{layer}.mlp (a mixture of experts) reads its experts' hook_pattern "
            f"and hook_z and the router's indices; the cache lacks {missing}. Cache them with "
            f"names_filter=tl_attnonly.hooks.neuron_names_filter('pattern', 'z')."
        ) from None
    return ActivationCache(dense, cache.model)


def _check_layer(model: AttnOnlyModel, layer: int) -> None:
    n_layers = model.cfg.n_layers
    if not 0 <= layer < n_layers:
        raise IndexError(
            f"layer {layer!r} is out of range: the model has {n_layers} layers "
            f"(0 to {n_layers - 1})."
        )


def _str_tokens(model: AttnOnlyModel, tokens: str | torch.Tensor, batch_index: int) -> list[str]:
    if isinstance(tokens, str):
        if not model.is_encoder:
            return list(model.to_str_tokens(tokens))
        tokens = model.tokenize(tokens)[0]  # an encoder: no to_str_tokens of a text
    ids = torch.as_tensor(tokens)
    if ids.ndim == 2:
        ids = ids[batch_index]
    return model.str_tokens(ids)


__all__ = [
    "TokensLike",
    "cache_and_tokens",
    "cached",
    "converted_model_of",
    "heads_from_neurons",
    "weights_and_z",
]
