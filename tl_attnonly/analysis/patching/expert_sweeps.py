"""Neuron-head patching sweeps that reach mixture-of-experts layers.

:func:`~tl_attnonly.analysis.get_act_patch_neuron_heads` sweeps every layer, dense or not. A
mixture-of-experts layer has no dense ``blocks.{l}.mlp.hook_z``; its neuron-heads are its experts'
neuron-heads laid end to end: the routed experts in index order, then the shared experts (by
their names in the block), each expert's heads in order. Head ``h`` of such a layer is row ``h``
of :func:`~tl_attnonly.analysis.experts.get_act_patch_expert_neuron_heads` on that layer, with its
semantics: the clean ``z`` is written at the tokens routed to the expert in both runs (a shared
expert: every token); tokens routed to it in one run only have no value to patch and keep the
corrupted run's. One forward pass per expert neuron-head.

A sweep of several layers gives ``[n_layers, n_heads]`` with ``n_heads`` the widest layer's count
(``heads`` given: those heads of every layer); cells past a narrower layer's last head are NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from tl_attnonly._types import Metric
from tl_attnonly.analysis.experts.patching import get_act_patch_expert_neuron_heads
from tl_attnonly.analysis.experts.routing import (
    Expert,
    expert_hook_name,
    layer_head_labels,
    layer_heads,
    routing_hook_name,
)
from tl_attnonly.analysis.patching.dense_layers import expert_layers
from tl_attnonly.analysis.patching.options import PatchingOptions, patch_level
from tl_attnonly.hooks import neuron_hook_kind
from tl_attnonly.protocol import AttnOnlyModel

#: ``(layers, heads) -> [len(layers), len(heads)]``: the dense layers' sweep.
DenseSweep = Callable[[list[int], list[int]], torch.Tensor]


def _experts(heads: list[tuple[Expert | None, int]]) -> list[Expert]:
    """The experts of a layer's :func:`layer_heads`, in order (none for a dense layer)."""
    return [expert for expert in dict.fromkeys(e for e, _ in heads) if expert is not None]


def _refuse_options(model: AttnOnlyModel, expert_layers: list[int], kind: str, opts: Any) -> None:
    """Refuse, before any work, what an expert layer's sweep cannot do, naming the option."""
    where = ", ".join(f"blocks.{layer}.mlp" for layer in expert_layers)
    dense = [li for li in range(model.cfg.n_layers) if li not in set(expert_layers)]
    also = f"; the dense layers ({dense}) take it with layers={dense}" if dense else ""
    if kind != "z":
        raise ValueError(
            f"activation_name={kind!r}: {where} (mixtures of experts) are patched through their "
            f"experts' z only; pass activation_name='z'{also}."
        )
    if opts.per_position:
        raise ValueError(
            f"per_position=True: {where} (mixtures of experts) are patched at every routed token "
            f"at once; pass per_position=False{also}."
        )
    if patch_level(opts.level, model.n_heads_per_neuron) == "neuron" and (
        model.n_heads_per_neuron > 1
    ):
        raise ValueError(
            f"level='neuron' (the default where K = {model.n_heads_per_neuron} > 1): {where} "
            f"(mixtures of experts) are patched one expert neuron-head at a time; pass "
            f"level='head'{also}."
        )


def _check_cache(
    model: AttnOnlyModel, clean_cache: Any, per_layer: dict[int, list[tuple[Expert | None, int]]]
) -> None:
    """Refuse a clean cache without the experts' ``hook_z`` or the routers' top-k indices (of the
    expert layers among ``per_layer``: layer -> its :func:`layer_heads`)."""
    names = []
    for layer, heads in sorted(per_layer.items()):
        if any(isinstance(expert, int) for expert, _ in heads):
            names.append(routing_hook_name(layer, model))
        names += [expert_hook_name(layer, e, "z") for e in _experts(heads)]
    cached = getattr(clean_cache, "cache_dict", clean_cache)  # an ActivationCache, or a dict
    missing = [name for name in names if name not in cached]
    if missing:
        raise KeyError(
            f"The clean cache lacks {missing[:4]}{' ...' if len(missing) > 4 else ''} (the "
            "experts' z and the routers' top-k indices). Cache them with names_filter="
            "tl_attnonly.hooks.neuron_names_filter('z')."
        )


def patch_neuron_heads_with_experts(
    model: AttnOnlyModel,
    corrupted_tokens: torch.Tensor,
    clean_cache: Any,
    patching_metric: Metric,
    activation_name: str,
    layers: Sequence[int],
    heads: Sequence[int] | None,
    opts: PatchingOptions,
    dense_sweep: DenseSweep,
) -> tuple[torch.Tensor, pd.DataFrame]:
    """:func:`~tl_attnonly.analysis.get_act_patch_neuron_heads` over ``layers``, some of them
    mixtures of experts (see the module docstring).

    Args:
        model: The analysed model.
        corrupted_tokens, clean_cache, patching_metric, activation_name: As the sweep's.
        layers: The layers swept, in the result's order.
        heads: Neuron-heads of every layer (each must exist in every layer); ``None``: all.
        opts: The sweep's options (``per_position``, ``level`` and ``activation_name`` other
            than ``z`` are refused for expert layers before any work).
        dense_sweep: Runs the dense layers' sweep.

    Returns:
        The metric after each patch, ``[len(layers), n_heads]`` (float64; NaN past a narrower
        layer's heads), and the index frame: one row per cell, ``layer, head, expert, label``
        (``expert``: ``None`` on a dense layer; ``label``: ``None`` for a NaN cell).

    Raises:
        ValueError: For an option an expert layer cannot take.
        IndexError: For a head that a layer does not have.
        KeyError: For a clean cache without the experts' hooks.
    """
    kind = neuron_hook_kind(activation_name)
    expert_set = expert_layers(model) & set(layers)
    _refuse_options(model, sorted(expert_set), kind, opts)
    per_layer = {layer: layer_heads(model, layer) for layer in layers}
    width = max(len(h) for h in per_layer.values())
    columns = list(range(width)) if heads is None else [int(h) for h in heads]
    for layer in layers:
        bad = [h for h in columns if heads is not None and not 0 <= h < len(per_layer[layer])]
        if bad:
            raise IndexError(
                f"blocks.{layer}.mlp has {len(per_layer[layer])} neuron-heads (experts' heads end "
                f"to end on a mixture of experts); got heads {bad[:5]}."
            )
    _check_cache(model, clean_cache, {li: per_layer[li] for li in expert_set})
    out = torch.full((len(layers), len(columns)), float("nan"), dtype=torch.float64)
    dense = [li for li in layers if li not in expert_set]
    if dense:
        dense_width = min(len(per_layer[li]) for li in dense)
        cols = [c for c in columns if c < dense_width]
        values = dense_sweep(dense, cols).to(torch.float64).reshape(len(dense), len(cols))
        for i, layer in enumerate(dense):
            out[layers.index(layer), : len(cols)] = values[i]
    cell = {c: j for j, c in enumerate(columns)}  # layer-wide head -> column of the result
    jobs = []  # (layer, expert, [(the expert's head, its column)] swept)
    for layer in sorted(expert_set):
        heads_of = per_layer[layer]
        for expert in _experts(heads_of):
            local = [(h, cell[c]) for c, (e, h) in enumerate(heads_of) if e == expert and c in cell]
            jobs.append((layer, expert, local))
    bar = tqdm(total=sum(len(h) for *_, h in jobs), disable=not opts.progress, desc="expert heads")
    for layer, expert, local in jobs:
        if not local:
            continue
        rows = get_act_patch_expert_neuron_heads(
            model, corrupted_tokens, clean_cache, patching_metric, layer=layer, experts=[expert],
            heads=[h for h, _ in local],
        )  # fmt: skip
        assert rows["head"].tolist() == [h for h, _ in local]  # one row per head, in order
        for (_, j), metric in zip(local, rows["metric"], strict=True):
            out[layers.index(layer), j] = metric
        bar.update(len(local))
    bar.close()
    return out, _index_frame(model, per_layer, layers, columns)


def _index_frame(
    model: AttnOnlyModel,
    per_layer: dict[int, list[tuple[Expert | None, int]]],
    layers: Sequence[int],
    columns: list[int],
) -> pd.DataFrame:
    """One row per cell of the sweep: ``layer, head, expert, label`` (``None`` past a layer's
    heads; ``expert``: ``None`` on a dense layer; labels from :func:`layer_head_labels`)."""
    rows = []
    for layer in layers:
        inside = [c for c in columns if c < len(per_layer[layer])]
        labels = dict(zip(inside, layer_head_labels(model, layer, inside), strict=True))
        for c in columns:
            expert = per_layer[layer][c][0] if c in labels else None
            rows.append({"layer": layer, "head": c, "expert": expert, "label": labels.get(c)})
    return pd.DataFrame(rows)


__all__ = ["patch_neuron_heads_with_experts"]
