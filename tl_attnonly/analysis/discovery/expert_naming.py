"""Naming expert neurons in a coarse circuit whose expert layers are their experts.

With ``discover_circuit(..., expert_nodes=True, neurons_per_mlp=N)`` an expert node of the coarse
circuit (``L{l}E{e}``, ``L{l}S``: :mod:`.expert_nodes`) gets its ``N`` best neurons named, as a
dense MLP node does (:mod:`.naming`): ranked by node attribution ``|score|``
(:func:`expert_neuron_scores`: a neuron's change of contribution, clean less corrupted, dotted
with the gradient of the metric at the layer's output on the corrupted run, as a dense neuron's
attribution is its ``hook_post`` change times the gradient along its row of ``W_out``); the
expert's node is then the expert's remainder.

Its split (``Circuit.mlp_split``: the circuit without the named neurons' outgoing edges, without
the remainder's, without both) is measured by exact runs on the graph with the named neurons, as
is the share of the MLP nodes' effect the named neurons carry (:func:`fine_split`): a dense
layer's by the same runs there, which equal the coarse graph's runs with the layer passing on
some neurons' changes that :mod:`.naming` makes without expert neurons.

With ``neurons_per_mlp="auto"`` the expert nodes' candidates (:func:`rank_expert_neurons`) are
chosen by the adaptive stage (:mod:`.neuron_stage`) with the dense layers', its runs made on the
coarse graph with each cut expert passing on its kept neurons' changes (:mod:`.expert_kept`); a
cut expert's remainder loses its outgoing edges (:func:`without_remainders`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from tqdm.auto import tqdm

from tl_attnonly.analysis.discovery.counts import kind_layer
from tl_attnonly.analysis.discovery.expert_nodes import (
    EXPERT_LABEL,
    expert_neuron_values,
    expert_neuron_writer,
    expert_parts,
    expert_source_hooks,
    expert_widths,
)
from tl_attnonly.analysis.discovery.graph import (
    EXPERT,
    EXPERT_NEURON,
    MLP_REST,
    HeadGraph,
    mlp_rest_label,
)
from tl_attnonly.analysis.discovery.run_metrics import circuit_metrics
from tl_attnonly.analysis.discovery.sites import Mask, batch_indices, call_metric
from tl_attnonly.hooks import block_act_name

if TYPE_CHECKING:
    from tl_attnonly.analysis.discovery.options import DiscoveryOptions
    from tl_attnonly.analysis.task import DiscoveryTask
    from tl_attnonly.protocol import AttnOnlyModel


def _component_neurons(model: AttnOnlyModel, layer: int, suffix: str) -> list[str]:
    """Every neuron label of the component ``L{layer}{suffix}``."""
    (parts,) = expert_parts(model, [layer])
    (widths,) = expert_widths(model, [layer])
    return [f"L{layer}{suffix}N{j}" for j in range(widths[parts.index(suffix)])]


def _recorder(
    acts: dict[str, torch.Tensor],
    live: dict[str, torch.Tensor] | None = None,
    outs: Collection[str] = (),
) -> Callable[..., torch.Tensor]:
    """A hook that records its activation in ``acts`` (detached) and, at ``outs``, keeps it in
    ``live`` requiring a gradient (the first in the graph becomes a leaf where the weights do
    not require one)."""

    def hook(act: torch.Tensor, hook: Any) -> torch.Tensor:
        acts[hook.name] = act.detach()
        if live is not None and hook.name in outs:
            act = act if act.requires_grad else act.detach().requires_grad_(True)
            live[hook.name] = act
        return act

    return hook


def expert_neuron_scores(
    task: DiscoveryTask, experts: Sequence[str], *, progress: bool = False
) -> pd.Series:
    """Node attribution of every neuron of the expert nodes ``experts`` (``L{l}E{e}``,
    ``L{l}S``): ``sum_(batch, pos) (c_clean - c_corrupted) * (g . W_out[j])``, with ``c`` the
    neuron's coefficient on its row ``W_out[j]`` (:func:`~.expert_nodes.expert_neuron_values`:
    routing weight times ``hook_post - b_post`` at its expert's tokens, a shared expert's gated)
    and ``g`` the gradient of the metric at the layer's output ``hook_mlp_out`` on the corrupted
    run (every path after it, the later layers' routers included). Summed over the task's
    batches.

    Args:
        task: The model (converted bridge), prompts, metric and batch size.
        experts: Expert node labels (``L1E0``, ``L1S``).
        progress: Progress bar over batches.

    Returns:
        ``label -> score`` (``L{l}E{e}N{j}``, ``L{l}SN{j}``), every neuron of ``experts``.

    Raises:
        ValueError: For a label that is not an expert node.
    """
    model = task.model
    neurons: dict[int, list[str]] = {}
    for label in experts:
        match = EXPERT_LABEL.match(label)
        if match is None:
            raise ValueError(f"{label!r} is not an expert node ('L1E0', 'L1S').")
        layer = int(match.group(1))
        neurons.setdefault(layer, []).extend(_component_neurons(model, layer, match.group(2)))
    names = {n for li in neurons for n in expert_source_hooks(model, li, neurons=True)}
    outs = {block_act_name("mlp_out", li): li for li in neurons}
    totals: dict[int, torch.Tensor] = {}
    batches = batch_indices(task.n_examples, task.batch_size)
    for idx in tqdm(batches, desc="expert neuron attribution", disable=not progress):
        clean: dict[str, torch.Tensor] = {}
        corrupted: dict[str, torch.Tensor] = {}
        live: dict[str, torch.Tensor] = {}  # the corrupted run's layer outputs, for gradients
        with torch.no_grad():
            hooks = [(n, _recorder(clean)) for n in names]
            task.model.run_with_hooks(task.clean[idx], fwd_hooks=hooks)
        with torch.enable_grad():
            hooks = [(n, _recorder(corrupted, live, outs)) for n in names]
            logits = task.model.run_with_hooks(task.corrupted[idx], fwd_hooks=hooks)
            keys = list(live)
            grads = torch.autograd.grad(
                call_metric(task.metric, logits, idx), [live[k] for k in keys], allow_unused=True
            )
        for key, grad in zip(keys, grads, strict=True):
            li = outs[key]
            labels = neurons[li]
            change = (
                expert_neuron_values(clean, model, li, labels)
                - expert_neuron_values(corrupted, model, li, labels)
            )[..., 0]  # [batch, pos, n]
            if grad is None:  # the metric does not read the layer
                grad = torch.zeros_like(live[key])
            U = expert_neuron_writer(model, li, labels, change)[:, 0]  # [n, d_model]
            score = (change * (grad.to(U.dtype) @ U.T)).sum((0, 1)).double().cpu()
            totals[li] = score if li not in totals else totals[li] + score
    return pd.Series(
        {label: float(v) for li in neurons for label, v in zip(neurons[li], totals[li].tolist())}
    )


def rank_expert_neurons(
    task: DiscoveryTask, experts: Sequence[str], count: int, opts: DiscoveryOptions
) -> tuple[dict[str, list[str]], pd.Series]:
    """The best neurons of each expert node (the fixed count's names, the adaptive stage's
    candidates), and every neuron's score.

    Args:
        task: The model, prompts, metric and batch size.
        experts: Expert node labels of the coarse circuit (``L1E0``, ``L1S``).
        count: Neurons per expert node.
        opts: The search's options (``progress``).

    Returns:
        ``(ranked, scores)``: expert node -> its ``count`` neurons of largest
        :func:`expert_neuron_scores` ``|score|``, best first; ``scores`` every neuron's of
        ``experts`` (empty where there are none, or ``count < 1``).
    """
    if not experts or count < 1:
        return {}, pd.Series(dtype=float)
    scores = expert_neuron_scores(task, experts, progress=opts.progress)
    ranked: dict[str, list[str]] = {}
    for label in experts:
        mine = scores[[n for n in scores.index if n.startswith(f"{label}N")]]
        best = mine.abs().sort_values(ascending=False, kind="stable")
        ranked[label] = list(best.index[:count])
    return ranked, scores


def by_layer(named: Mapping[str, Sequence[str]]) -> dict[int, list[str]]:
    """Expert node -> its named neurons, as layer -> the named neurons of its expert nodes
    (expert by expert in ``named``'s order), layers naming none left out."""
    out: dict[int, list[str]] = {}
    for label, neurons in named.items():
        if neurons:
            out.setdefault(kind_layer(label)[1], []).extend(neurons)
    return out


def name_expert_neurons(
    task: DiscoveryTask, experts: Sequence[str], count: int, opts: DiscoveryOptions
) -> dict[int, list[str]]:
    """The best neurons of each expert node (the fixed count's names of the expert nodes).

    Returns:
        Layer -> the ``count`` neurons of largest :func:`expert_neuron_scores` ``|score|`` of
        each of its expert nodes, expert by expert in ``experts``' order, each best first
        (:func:`rank_expert_neurons`).
    """
    return by_layer(rank_expert_neurons(task, experts, count, opts)[0])


def _rows(graph: HeadGraph, unit: str, named: Sequence[str]) -> tuple[dict, dict]:
    """``(named rows, remainder rows)`` of an MLP node of ``graph``: per source group key, the
    rows of the node's named neurons (a dense layer ``L{l}MLP``'s neuron group, or an expert's
    named neurons) and of its remainder (``L{l}MLP``'s group, or the expert's own row)."""
    of_named: dict[str, list[int]] = {}
    rest: dict[str, list[int]] = {}
    mine = set(named)
    for src in graph.sources:
        rows = [i for i, label in enumerate(src.labels) if label in mine]
        if rows and src.kind in ("neuron", EXPERT_NEURON):
            of_named[src.key] = rows
        if src.kind in (MLP_REST, EXPERT) and unit in src.labels:
            rest[src.key] = [src.labels.index(unit)]
    return of_named, rest


def without_remainders(graph: HeadGraph, mask: Mask, experts: Collection[str]) -> Mask:
    """``mask`` (on ``graph``, with the experts' named neurons) with the outgoing edges of the
    expert nodes ``experts`` (each its remainder there) cut: the adaptive stage's cut experts."""
    return _without(mask, *(_rows(graph, label, ())[1] for label in experts))


def _without(mask: Mask, *rows: Mapping[str, Sequence[int]]) -> Mask:
    """``mask`` with the outgoing edges of the source rows ``rows`` (group key -> rows) cut."""
    out = dict(mask)
    for group in rows:
        for key in {k for k in out if k[0] in group}:
            block = out[key].clone()
            block[group[key[0]]] = False
            out[key] = block
    return out


def fine_split(
    task: DiscoveryTask,
    graph: HeadGraph,
    mask: Mask,
    named: Mapping[int, Sequence[str]],
    opts: DiscoveryOptions,
) -> tuple[pd.DataFrame, list[float]]:
    """The split of each MLP node with named neurons, by exact runs of ``mask`` on ``graph``.

    Args:
        task: The model, prompts, metric, position classes and corrupted runs.
        graph: The graph with the named neurons (the circuit's).
        mask: The circuit on it (``(source group, input group) -> bool [n_sources, n_inputs]``).
        named: Layer -> its named neurons (a dense layer's ``L{l}N{i}``, experts'
            ``L{l}E{e}N{j}``).
        opts: The search's options (``progress``).

    Returns:
        ``(split, [circuit, named only, no MLP])``: ``split`` has a row per MLP node with
        named neurons, columns ``node`` (``L{l}MLP`` or the expert ``L{l}E{e}``), ``named``
        (its named neurons, joined by ``", "``), and the metric without the named neurons'
        outgoing edges (``no_named``), without the remainder's (``no_rest``), without both
        (``no_layer``); then the metric of the circuit, with every remainder's outgoing edges
        cut, with every such node's cut.
    """
    units: dict[str, list[str]] = {}  # MLP node -> its named neurons
    for layer, labels in named.items():
        for label in labels:
            owner = label[: label.rindex("N")]  # an expert neuron's expert, else its layer
            unit = owner if EXPERT_LABEL.match(owner) else mlp_rest_label(layer)
            units.setdefault(unit, []).append(label)
    rows = {unit: _rows(graph, unit, labels) for unit, labels in units.items()}
    masks = [mask]
    for of_named, rest in rows.values():
        masks += [_without(mask, of_named), _without(mask, rest), _without(mask, of_named, rest)]
    every_named = [r[0] for r in rows.values()]
    every_rest = [r[1] for r in rows.values()]
    masks += [_without(mask, *every_rest), _without(mask, *every_named, *every_rest)]
    values = circuit_metrics(
        task.model, masks, task.clean, task.corrupted, task.metric,
        nodes=graph.node_labels(), batch_size=task.batch_size, progress=opts.progress,
        positions=task.positions, corrupted_runs=task.corrupted_runs,
    )  # fmt: skip
    split = []
    for j, (unit, labels) in enumerate(units.items()):
        no_named, no_rest, no_layer = values[1 + 3 * j : 4 + 3 * j]
        split.append((unit, ", ".join(labels), no_named, no_rest, no_layer))
    frame = pd.DataFrame(split, columns=["node", "named", "no_named", "no_rest", "no_layer"])
    return frame, [values[0], values[-2], values[-1]]


__all__ = [
    "by_layer",
    "expert_neuron_scores",
    "fine_split",
    "name_expert_neurons",
    "rank_expert_neurons",
    "without_remainders",
]
