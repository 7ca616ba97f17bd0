"""Expert nodes that pass on only some of their neurons' changes in an exact run.

:func:`~.run_metrics.circuit_metrics`' ``kept_neurons`` entry maps a dense layer ``l`` to the
neurons (``bool [d_mlp]``) whose change its MLP sources pass on; here an entry may also map an
expert node ``"L{l}E{e}"`` / ``"L{l}S"`` (:mod:`.expert_nodes`) to ``bool [n]`` over its ``n``
neurons. The run is that of the same circuit on the graph with each of the expert's neurons a
node of its own (the expert's edges on each) and the neurons left out and the expert's remainder
without outgoing edges, computed on the graph without them: the expert's row changes by

    ``sum_{j kept} (c_j(current) - c_j(corrupted)) W_out[j]``

with ``c_j`` neuron ``j``'s coefficient on its row of ``W_out`` in that run, each run with its
own routing (a routed expert: its routing weight times ``hook_post - b_post`` at the tokens routed
to it, 0 elsewhere; a shared expert: its gated ``hook_post - b_post``;
:func:`~tl_attnonly.analysis.experts.components.expert_neuron_activations`). What the expert
writes beyond its neurons (its output bias ``b_O`` times its routing weight) is its remainder's
and is not passed on, so an entry keeping every neuron is not the expert's whole change, as it
is for a dense layer (whose bias cancels). Where the graph names some of the expert's neurons
(:data:`~.graph.EXPERT_NEURON`), a named neuron passes on its change if kept and its remainder
the kept neurons not named: the dense case's split into named neurons and remainder.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from jaxtyping import Float

from tl_attnonly.analysis.discovery.expert_nodes import (
    EXPERT_LABEL,
    EXPERT_NEURON_LABEL,
    component_index,
    component_neuron_values,
)
from tl_attnonly.analysis.discovery.graph import EXPERT, EXPERT_NEURON, HeadGraph, SourceGroup

if TYPE_CHECKING:
    from tl_attnonly.protocol import AttnOnlyModel

#: A key of a ``kept_neurons`` entry: a dense layer, or an expert node's label.
KeptKey = int | str
#: A ``kept_neurons`` entry as callers give it: dense layers, expert nodes, or both.
KeptEntry = Mapping[int, torch.Tensor] | Mapping[str, torch.Tensor] | Mapping[KeptKey, torch.Tensor]


def kept_layer(key: KeptKey) -> int:
    """The layer of a ``kept_neurons`` key (a dense layer, or an expert node ``L{l}E{e}``)."""
    if isinstance(key, str):
        match = EXPERT_LABEL.match(key)
        assert match is not None, key
        return int(match.group(1))
    return key


def kept_sort_key(key: KeptKey) -> tuple[int, int, int]:
    """Orders ``kept_neurons`` keys by layer, a dense layer before an expert node, then the
    routed experts by index and the shared ones after them."""
    if not isinstance(key, str):
        return key, -1, 0
    match = EXPERT_LABEL.match(key)
    assert match is not None, key
    suffix = match.group(2)
    number = int(suffix[1:] or 0)
    return int(match.group(1)), 0 if suffix[0] == "E" else 1, number


def expert_width(graph: HeadGraph, label: str) -> int:
    """The neurons of expert node ``label`` of ``graph`` (a layer named by its experts).

    Raises:
        ValueError: Where ``label`` is not one of the graph's expert nodes.
    """
    match = EXPERT_LABEL.match(label)
    found = match is not None and int(match.group(1)) in graph.split_experts
    if not found or not any(s.kind == EXPERT and label in s.labels for s in graph.sources):
        have = [p for s in graph.sources if s.kind == EXPERT for p in s.labels]
        raise ValueError(
            f"kept_neurons: {label!r} is neither a layer nor an expert node of this graph (a "
            f"layer in [0, {graph.n_layers}), or one of its expert nodes {have}: a graph of "
            "coarse_nodes(model, experts=True))."
        )
    assert match is not None
    layer, shape = int(match.group(1)), graph.shape
    parts = shape.expert_parts[shape.expert_layers.index(layer)]
    return shape.expert_widths[shape.expert_layers.index(layer)][parts.index(match.group(2))]


def check_expert_kept(graph: HeadGraph, label: str, keep: torch.Tensor) -> None:
    """Refuse a ``kept_neurons`` entry for ``label`` that is not an expert node of ``graph``
    with ``bool [n]`` over its ``n`` neurons.

    Raises:
        ValueError: Naming what is supported.
    """
    width = expert_width(graph, label)
    if keep.dtype != torch.bool or tuple(keep.shape) != (width,):
        raise ValueError(
            f"kept_neurons[...][{label!r}] must be bool [n] over its {width} neurons, got "
            f"{keep.dtype} {tuple(keep.shape)}."
        )


def _component(model: AttnOnlyModel, label: str) -> tuple[int, int]:
    """``(layer, component index)`` of an expert node label."""
    found = component_index(model, label)
    assert found is not None, label
    return found


def _neuron_changes(
    model: AttnOnlyModel,
    label: str,
    current: dict[str, torch.Tensor],
    corr: dict[str, torch.Tensor],
    memo: dict,
) -> Float[torch.Tensor, "batch pos n"]:
    """Each neuron's coefficient on its row of ``W_out`` of expert node ``label``, current less
    corrupted run, each with its own routing (the corrupted run's kept in ``memo``)."""
    layer, c = _component(model, label)
    key = ("expert_kept", label)
    if key not in memo:
        memo[key] = component_neuron_values(corr, model, layer, c)
    return component_neuron_values(current, model, layer, c) - memo[key]


def _out_rows(model: AttnOnlyModel, label: str) -> Float[torch.Tensor, "n d_model"]:
    """Expert node ``label``'s ``W_out`` (``out_matrix``): neuron ``j`` writes row ``j``."""
    from tl_attnonly.analysis.experts.components import component_layer
    from tl_attnonly.analysis.experts.routing import moe_layer

    layer, c = _component(model, label)
    return component_layer(moe_layer(model, layer), c)[1].out_matrix


def _named_of(graph: HeadGraph, label: str, width: int) -> torch.Tensor:
    """``bool [width]``: the neurons of expert node ``label`` named in ``graph``."""
    named = torch.zeros(width, dtype=torch.bool)
    match = EXPERT_LABEL.match(label)
    assert match is not None, label
    for neuron in graph.expert_neurons.get(int(match.group(1)), ()):
        if neuron.startswith(f"{label}N") and EXPERT_NEURON_LABEL.match(neuron):
            named[int(neuron[len(label) + 1 :])] = True
    return named


def expert_kept_change(
    model: AttnOnlyModel,
    graph: HeadGraph,
    src: SourceGroup,
    change: torch.Tensor,
    runs: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    kept: Mapping[KeptKey, torch.Tensor],
    memo: dict,
) -> torch.Tensor:
    """An expert source group's ``change`` (:func:`~.sites.source_values`, current less
    corrupted: ``[batch, pos, n, d_model]`` for :data:`~.graph.EXPERT`, ``[batch, pos, n, 1]``
    for :data:`~.graph.EXPERT_NEURON`) with each expert of ``kept`` passing on its kept
    neurons' changes only (module docstring): an expert's row becomes its kept neurons' (those
    not named in the graph) changes times their rows of ``W_out``, a named neuron's row is kept
    or zeroed. ``runs``: the current and the corrupted run's recorded activations."""
    current, corr = runs
    if src.kind == EXPERT:
        rows = [i for i, label in enumerate(src.labels) if label in kept]
        if not rows:
            return change
        change = change.clone()
        for i in rows:
            label = src.labels[i]
            keep = kept[label].cpu() & ~_named_of(graph, label, len(kept[label]))
            cols = keep.nonzero().flatten()
            delta = _neuron_changes(model, label, current, corr, memo)
            delta = delta[..., cols.to(delta.device)]
            W = _out_rows(model, label)[cols.to(delta.device)]
            change[:, :, i] = (delta @ W.to(delta.dtype)).to(change.dtype)
        return change
    if src.kind == EXPERT_NEURON:
        bits = torch.ones(len(src.labels), dtype=change.dtype)
        for i, neuron in enumerate(src.labels):
            match = EXPERT_NEURON_LABEL.match(neuron)
            assert match is not None, neuron
            owner = f"L{match.group(1)}{match.group(2)}"
            if owner in kept:
                bits[i] = float(bool(kept[owner][int(match.group(3))]))
        return change * bits.to(change.device)[:, None]
    return change


def expert_kept_counts(
    graph: HeadGraph, src: SourceGroup, kept: Mapping[KeptKey, torch.Tensor]
) -> torch.Tensor | None:
    """Per row of an expert source group, what it passes on in units of half a node: 2 (its
    whole change), 1 (some of it: an expert passing on some neurons, or every neuron without its
    remainder's bias term) or 0 (nothing); None where no expert of ``kept`` is in the group."""
    if src.kind == EXPERT:
        if not any(label in kept for label in src.labels):
            return None
        out = torch.full((len(src.labels),), 2, dtype=torch.long)
        for i, label in enumerate(src.labels):
            if label in kept:
                keep = kept[label].cpu() & ~_named_of(graph, label, len(kept[label]))
                out[i] = 1 if bool(keep.any()) else 0
        return out
    if src.kind == EXPERT_NEURON:
        owners = [EXPERT_NEURON_LABEL.match(n) for n in src.labels]
        if not any(m is not None and f"L{m.group(1)}{m.group(2)}" in kept for m in owners):
            return None
        out = torch.full((len(src.labels),), 2, dtype=torch.long)
        for i, m in enumerate(owners):
            assert m is not None
            owner = f"L{m.group(1)}{m.group(2)}"
            if owner in kept and not bool(kept[owner][int(m.group(3))]):
                out[i] = 0
        return out
    return None


__all__ = [
    "KeptEntry",
    "KeptKey",
    "check_expert_kept",
    "expert_kept_change",
    "expert_kept_counts",
    "expert_width",
    "kept_layer",
    "kept_sort_key",
]
