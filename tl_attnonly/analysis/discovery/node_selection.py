"""The nodes a circuit search works with: picked by attribution, the coarse graph's, baselines.

:func:`top_nodes` keeps the attention heads and neurons with the largest node attribution
``|score|`` (``discover_circuit(..., n_nodes=N)``, and the ``"attribution"`` neuron ranking);
:func:`coarse_nodes` are the coarse graph's (every attention head, every MLP layer as one node
``L{l}MLP``); :func:`expand_mask` puts a coarse circuit on a finer graph (each ``L{l}MLP`` edge
on each of the layer's named neurons and its remainder: the same circuit, computed exactly);
:func:`node_patching_metric` is the plain node-patching baseline a circuit is compared with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd
import torch
from jaxtyping import Int
from tqdm.auto import tqdm

from tl_attnonly._types import tokens_on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.expert_nodes import (
    component_index,
    expert_neuron_layer,
    expert_patch_hooks,
    expert_source_hooks,
)
from tl_attnonly.analysis.discovery.graph import (
    EMBED,
    EXPERT,
    EXPERT_NEURON,
    MLP_REST,
    HeadGraph,
    mlp_rest_label,
)
from tl_attnonly.analysis.discovery.sites import (
    DiscoveryMetric,
    Mask,
    batch_indices,
    call_metric,
    check_additive,
    check_discoverable,
)
from tl_attnonly.analysis.patching.dense_layers import expert_layers
from tl_attnonly.hooks import attn_head_label, block_act_name, head_act_name, neuron_act_name

if TYPE_CHECKING:
    from tl_attnonly.protocol import ModelLike


def top_nodes(
    model: ModelLike,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    metric: DiscoveryMetric,
    n_nodes: int,
    *,
    neuron_level: bool = True,
    batch_size: int | None = None,
    progress: bool = True,
) -> tuple[list[str], pd.Series]:
    """The ``n_nodes`` attention heads and neurons with the largest node attribution ``|score|``.

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` or a ``TransformerBridge``
            converted with :func:`tl_attnonly.convert` (in place).
        clean_tokens, corrupted_tokens: ``[n_examples, pos]``, same shape.
        metric: As in :func:`~tl_attnonly.analysis.edge_attribution_scores` (additive over
            batches).
        n_nodes: How many nodes to keep (attention heads and neurons together).
        neuron_level: Return neurons ``L{l}N{i}`` (default), or all their neuron-heads
            ``L{l}N{i}.{k}`` (for a head-level graph).
        batch_size: Examples per forward/backward pass; default all at once.
        progress: Progress bar over batches.

    Returns:
        ``(labels, scores)``: the kept nodes' labels, best first, and every node's score
        (``pd.Series`` indexed by label; ``"embed"`` included, never kept: the graph always has
        it).
    """
    model = analysis_model(model)
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    from tl_attnonly.analysis.discovery.node_circuits import ModelInputs, node_attribution_scores

    check_discoverable(model, neuron_level)
    if n_nodes < 1:
        raise ValueError(f"n_nodes must be >= 1, got {n_nodes}.")
    batches = batch_indices(clean_tokens.shape[0], batch_size)
    check_additive(model, clean_tokens, metric, batches)
    total: pd.Series | None = None
    for idx in tqdm(batches, desc="node attribution", disable=not progress):

        def node_metric(out, inputs, idx=idx):
            return call_metric(metric, out, idx)

        scores = node_attribution_scores(
            model, ModelInputs(clean_tokens[idx]), ModelInputs(corrupted_tokens[idx]), node_metric
        ).scores
        total = scores if total is None else total + scores
    if total is None:
        raise ValueError("No examples: clean_tokens has 0 rows.")
    ranked = total.drop(EMBED).abs().sort_values(ascending=False, kind="stable")
    labels = list(ranked.index[:n_nodes])
    K = model.n_heads_per_neuron
    if not neuron_level and K > 1:
        labels = [f"{lab}.{k}" if "N" in lab else lab for lab in labels for k in range(K)]
        labels = list(dict.fromkeys(labels))
    return labels, total


def coarse_nodes(model: ModelLike, experts: bool = False) -> list[str]:
    """The coarse graph's nodes: every attention head and every MLP layer as one node; with
    ``experts``, a mixture-of-experts layer as its experts (``L{l}E{e}``, ``L{l}S``:
    :mod:`.expert_nodes`) instead."""
    model = analysis_model(model)
    cfg = model.cfg
    heads = [attn_head_label(li, h) for li in range(cfg.n_layers) for h in range(cfg.n_heads)]
    mlps = [mlp_rest_label(li) for li in range(cfg.n_layers)]
    if experts:
        from tl_attnonly.analysis.discovery.expert_nodes import expert_parts

        layers = sorted(expert_layers(model))
        parts = dict(zip(layers, expert_parts(model, layers), strict=True))
        mlps = [
            label
            for li in range(cfg.n_layers)
            for label in ([f"L{li}{p}" for p in parts[li]] if li in parts else [mlps[li]])
        ]
    return heads + mlps


def node_patching_metric(
    model: ModelLike,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    metric: DiscoveryMetric,
    nodes: list[str],
    *,
    batch_size: int | None = None,
) -> float:
    """The metric of the corrupted run with the clean outputs of ``nodes`` patched in.

    Plain node patching, the baseline a circuit is compared with: every other node is recomputed
    (not frozen to the corrupted run as in a circuit run).

    Args:
        nodes: Attention heads ``L{l}H{h}``, neurons ``L{l}N{i}``, MLP layers ``L{l}MLP`` (every
            neuron of the layer), a mixture of experts' experts ``L{l}E{e}``, ``L{l}S`` (their
            weighted outputs: :mod:`.expert_nodes`) and expert neurons ``L{l}E{e}N{j}``,
            ``L{l}SN{j}`` (their contributions; with their expert, the whole expert);
            ``"embed"`` patches the token and position embeddings.
            :func:`discover_circuit` gives the circuit's sources (a neuron-head's whole neuron at
            neuron-head level).
        Others: As in :func:`~tl_attnonly.analysis.circuit_metric`.

    Returns:
        The metric summed over batches.
    """
    model = analysis_model(model)
    heads: dict[int, list[int]] = {}
    neurons: dict[int, list[int] | None] = {}
    parts: dict[int, list[int]] = {}  # a mixture of experts' experts
    expert_neurons: dict[int, list[str]] = {}  # and their neurons
    embed = False
    for label in nodes:
        part = component_index(model, label) if label != EMBED else None
        if part is not None:
            parts.setdefault(part[0], []).append(part[1])
        elif (layer := expert_neuron_layer(label)) is not None:
            expert_neurons.setdefault(layer, []).append(label)
        elif label == EMBED:
            embed = True
        elif label.endswith("MLP"):
            neurons[int(label[1:-3])] = None
        elif "H" in label:
            li, h = map(int, label[1:].split("H"))
            heads.setdefault(li, []).append(h)
        elif "N" in label and "." not in label:
            li, i = map(int, label[1:].split("N"))
            if neurons.get(li, []) is not None:
                neurons.setdefault(li, []).append(i)  # type: ignore[union-attr]
        else:
            raise ValueError(
                f"node_patching_metric patches heads 'L0H1', neurons 'L0N5', MLP layers 'L0MLP', "
                f"a mixture of experts' experts 'L1E0', 'L1S', their neurons 'L1E0N5', 'L1SN5' "
                f"and 'embed'; got {label!r}."
            )
    names: dict[str, list[int] | None] = {}
    if embed:
        names.update(dict.fromkeys(model.embed_hooks))
    for li, hs in heads.items():
        names[head_act_name("z", li, "attn")] = hs
    experts = expert_layers(model)
    for li, idx in neurons.items():  # a mixture of experts: its whole output
        if li in experts and idx is not None:
            raise ValueError(
                f"blocks.{li}.mlp is a mixture of experts: patch the whole layer 'L{li}MLP' "
                "(its experts' neurons see only the tokens routed to them: "
                "tl_attnonly.analysis.experts.get_act_patch_expert_neuron_heads)."
            )
        names[block_act_name("mlp_out", li) if li in experts else neuron_act_name("post", li)] = idx
    part_names = {
        n
        for li in {*parts, *expert_neurons}
        for n in expert_source_hooks(model, li, neurons=li in expert_neurons)
    }
    total = 0.0
    for rows in batch_indices(clean_tokens.shape[0], batch_size):
        with torch.no_grad():
            _, cache = model.run_with_cache(
                clean_tokens[rows], names_filter=lambda n: n in names or n in part_names
            )

            def patch(act, hook, cache=cache):
                which = names[hook.name]
                act = act.clone()
                if which is None:
                    return cache[hook.name].to(act.dtype)
                act[:, :, which] = cache[hook.name][:, :, which].to(act.dtype)
                return act

            clean = dict(cache.cache_dict)
            hooks = [(n, patch) for n in names]
            for li in sorted({*parts, *expert_neurons}):
                which, named = parts.get(li, []), expert_neurons.get(li, [])
                hooks += expert_patch_hooks(model, li, which, clean, named)
            logits = model.run_with_hooks(corrupted_tokens[rows], fwd_hooks=hooks)
            total += call_metric(metric, logits, rows).item()
    return total


def _coarse_key(key: str) -> str:
    """The coarse group key of a fine group key (a layer's neurons belong to its MLP node, an
    expert's named neurons to its expert's node)."""
    if key.startswith(f"{EXPERT_NEURON}."):
        return f"{EXPERT}." + key.split(".", 1)[1]
    return "mlp." + key.split(".", 1)[1] if key.startswith("neuron.") else key


def expand_mask(coarse: HeadGraph, mask: Mask, fine: HeadGraph) -> Mask:
    """A coarse circuit on a finer graph: each edge into or out of ``L{l}MLP`` goes into or out of
    each of the layer's named neurons and its remainder, each edge out of an expert ``L{l}E{e}``
    out of its named neurons too (the same circuit, computed exactly)."""

    def rows_of(fine_group, coarse_group) -> list[int]:
        if coarse_group.kind == MLP_REST:
            return [0] * len(fine_group.labels)
        where = {label: i for i, label in enumerate(coarse_group.labels)}
        if fine_group.kind == EXPERT_NEURON:  # an expert neuron's row: its expert's
            return [where[label[: label.rindex("N")]] for label in fine_group.labels]
        return [where[label] for label in fine_group.labels]

    out = {}
    for src, dst in fine.blocks():
        c_src = coarse.source_by_key[_coarse_key(src.key)]
        c_dst = coarse.input_by_key[_coarse_key(dst.key)]
        block = mask[(c_src.key, c_dst.key)]
        rows = torch.tensor(rows_of(src, c_src), dtype=torch.long, device=block.device)
        cols = torch.tensor(rows_of(dst, c_dst), dtype=torch.long, device=block.device)
        out[(src.key, dst.key)] = block[rows][:, cols].clone()
    return out


__all__ = [
    "coarse_nodes",
    "expand_mask",
    "node_patching_metric",
    "top_nodes",
]
