"""The metrics of several circuits by exact runs, batch by batch (:func:`circuit_metrics`).

What an exact run is, and one circuit's metric (:func:`~.runs.circuit_metric`): :mod:`.runs`.
Per batch, the corrupted run is made once (once per search with a shared
:class:`~.run_reuse.CorruptedRuns`), then each circuit's run (:func:`~.exact_run.circuit_run`);
the later runs take from the first (or from a :class:`~.run_reuse.KeptRun`) what they share with
it (:mod:`.run_reuse`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch
from jaxtyping import Int
from tqdm.auto import tqdm

from tl_attnonly.analysis.discovery.exact_run import BatchRun, circuit_run, corrupted_names
from tl_attnonly.analysis.discovery.expert_kept import KeptEntry
from tl_attnonly.analysis.discovery.graph import HeadGraph
from tl_attnonly.analysis.discovery.positions import PositionClasses
from tl_attnonly.analysis.discovery.run_plan import CircuitPlan, RunCall
from tl_attnonly.analysis.discovery.run_reuse import (
    FirstRun,
    KeptRun,
    check_kept,
    shared_prefix,
    start_layer,
)
from tl_attnonly.analysis.discovery.sites import (
    BLOCK_BUDGET,
    DiscoveryMetric,
    Mask,
    call_metric,
    check_discoverable,
    check_logit_positions,
    logit_positions,
)
from tl_attnonly.analysis.task import CorruptedRuns, DiscoveryTask

if TYPE_CHECKING:
    from tl_attnonly.protocol import ModelLike


def circuit_metrics(
    model: ModelLike,
    masks: Sequence[Mask],
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    metric: DiscoveryMetric,
    *,
    neuron_level: bool = True,
    nodes: Collection[str] | None = None,
    batch_size: int | None = None,
    block_bytes: int = BLOCK_BUDGET,
    progress: bool = False,
    positions: PositionClasses | None = None,
    corrupted_runs: CorruptedRuns | None = None,
    kept_neurons: Sequence[KeptEntry | None] | None = None,
    kept_run: KeptRun | None = None,
) -> list[float]:
    """:func:`~.runs.circuit_metric` of several circuits; the corrupted run is made once per batch
    (once per search with ``corrupted_runs``, a :class:`CorruptedRuns` shared by its calls).

    ``kept_neurons`` (one entry per mask, or None): layer -> ``bool [d_mlp]``, the neurons
    whose change that layer's MLP sources pass on along their edges; the others' outputs count
    as the corrupted run's. The run is then that of the same circuit on a graph with every
    neuron of the layer a node of its own (the layer's edges on each) and the neurons left out
    without outgoing edges, computed on this graph (the neuron stage's runs on the coarse graph,
    :mod:`.neuron_stage`). An expert node of the graph (``"L{l}E{e}"``, ``"L{l}S"``) -> ``bool
    [n]`` over its neurons: likewise, the expert's remainder (its routing-weighted output bias)
    without outgoing edges too (:mod:`.expert_kept`). Neuron-level graphs only.

    The runs of circuits whose edges into the inputs below some residual position equal the
    first circuit's take those inputs from the first run (:func:`shared_prefix`; the same up
    to rounding) instead of rebuilding them, copy the first run's merged changes of the sources
    below their first source with other edges (:class:`~.run_plan.PlanRun`), and where the
    model can start a run at a block (decoders:
    :meth:`~tl_attnonly.protocol.AttnOnlyModel.layer_runs`) they start at the first block with
    an input of their own, from the first run's residual stream (:class:`FirstRun`): the blocks
    below are not run again.

    ``kept_run`` (a :class:`KeptRun`, shared by the calls of one search): every circuit of the
    call, the first included, takes all that from the kept circuit's run instead of from the
    call's first run (the kept circuit is run once per batch, in the first call that meets the
    batch): where the calls' circuits differ from a kept circuit only in high layers, none of
    them runs the blocks below.
    """
    task = DiscoveryTask.make(
        model, clean_tokens, corrupted_tokens, metric, positions=positions,
        batch_size=batch_size, corrupted_runs=corrupted_runs,
    )  # fmt: skip
    check_discoverable(task.model, neuron_level)
    task.check_tokens()
    graph = task.graph(neuron_level, nodes)
    for mask in masks:
        missing = set(graph.block_keys()) - set(mask)
        if missing:
            raise ValueError(
                f"The mask lacks blocks {sorted(missing)[:3]}...: build it for this model with "
                f"prune() or HeadGraph(model, neuron_level={neuron_level}, nodes=...).full_mask() "
                "(a restricted graph's mask needs the same nodes=..., and a mask resolved by "
                "position the same positions=...)."
            )
    return run_circuits(
        task, graph, masks, block_bytes=block_bytes, progress=progress,
        kept_neurons=kept_neurons, kept_run=kept_run, checked=False,
    )  # fmt: skip


def run_circuits(
    task: DiscoveryTask,
    graph: HeadGraph,
    masks: Sequence[Mask],
    *,
    block_bytes: int = BLOCK_BUDGET,
    progress: bool = False,
    kept_neurons: Sequence[KeptEntry | None] | None = None,
    kept_run: KeptRun | None = None,
    checked: bool = True,
) -> list[float]:
    """:func:`circuit_metrics` of the task's model, tokens, metric, position classes, batch size
    and corrupted runs on ``graph`` (``task.graph(neuron_level, nodes)``): the internal form,
    without the checks of the task and masks a search made once. ``checked=False``: the metric's
    additivity is checked here (:meth:`~tl_attnonly.analysis.task.DiscoveryTask.check_additive`).
    """
    model, metric = task.model, task.metric
    clean_tokens, corrupted_tokens = task.clean, task.corrupted
    kept = check_kept(model, graph, kept_neurons, len(masks), clean_tokens.device)
    totals = [0.0] * len(masks)
    parent: KeptRun | None = None
    parent_start = 0
    if kept_run is not None:  # every run takes from the kept circuit's run
        kept_run.bind(task, graph)
        reference_mask = kept_run.mask
        reference_kept = check_kept(model, graph, [kept_run.kept], 1, clean_tokens.device)[0]
        parent = kept_run.parent if model.can_resume else None
        if parent is not None and parent.serves(kept_run):
            # the kept circuit's runs start where it differs from the parent's
            parent_kept = check_kept(model, graph, [parent.kept], 1, clean_tokens.device)[0]
            shared_with_parent, parent_below = shared_prefix(
                graph, parent.mask, reference_mask, parent_kept, reference_kept
            )
            parent_start = start_layer(graph, shared_with_parent)
            reference_plan = kept_run.plan(graph, parent.plan(graph), parent_below)
        else:
            parent = None
            reference_plan = kept_run.plan(graph)
        later = list(range(len(masks)))
    else:  # the later runs take from the first run
        reference_mask, reference_kept = masks[0], kept[0]
        reference_plan = CircuitPlan(graph, masks[0])
        later = list(range(1, len(masks)))
    # per later mask: the inputs it takes from the reference run (the same up to its first
    # change), and the residual position below which its sources' edges and changes are the
    # reference run's
    shared: list[set[str]] = [set() for _ in masks]
    same_below = [0.0] * len(masks)
    plans = [reference_plan] * len(masks)
    for i in later:
        shared[i], same_below[i] = shared_prefix(
            graph, reference_mask, masks[i], reference_kept, kept[i]
        )
        plans[i] = CircuitPlan(graph, masks[i], reference_plan, same_below[i])
    # the block each later run starts at, from the reference run's residual stream entering it
    starts = [start_layer(graph, shared[i]) if i in later else 0 for i in range(len(masks))]
    resume = model.can_resume and (kept_run is not None or any(starts))
    if not resume:
        starts = [0] * len(masks)
    names = corrupted_names(model, graph)
    call = RunCall(model, graph, block_bytes, task.corrupted_runs.weights)
    batches = task.batches()
    if not checked:
        task.check_additive()
    bar = tqdm(total=len(batches) * len(masks), desc="circuit runs", disable=not progress)
    for idx in batches:
        with torch.no_grad():
            corr = task.corrupted_runs.activations(model, corrupted_tokens, idx, names)
            where = task.position_masks(idx)
            reads = logit_positions(metric, idx, clean_tokens.shape[1])
            if kept_run is not None:
                first = kept_run.first_run(idx)
                if first is None:  # the kept circuit's run of this batch
                    base = None if parent is None else parent.first_run(idx)
                    first = FirstRun(
                        (),  # the input groups a run rebuilds: those of the block it starts at
                        set(range(1, graph.n_layers)),
                        base.runner
                        if base is not None
                        else (model.layer_runs(clean_tokens[idx]) if resume else None),
                        keep_changes=True,
                    )
                    start = 0
                    if base is not None and parent_start > 0:  # from the parent's run
                        first.chain(base, parent_start)
                        start = parent_start
                    logits = circuit_run(
                        call, BatchRun(clean_tokens[idx], corr, where, reads, first),
                        reference_mask, reference_plan, keep=True, kept=reference_kept,
                        start=start,
                    )  # fmt: skip
                    if reads is not None and resume:
                        check_logit_positions(metric, logits, idx, reads)
                    kept_run.keep(idx, first)
            else:
                first = FirstRun(
                    set().union(*shared),
                    {s for s in starts if s},
                    model.layer_runs(clean_tokens[idx]) if resume else None,
                    keep_changes=any(below > 0 for below in same_below[1:]),
                )
            batch = BatchRun(clean_tokens[idx], corr, where, reads, first)
            for i, mask in enumerate(masks):
                lead = i == 0 and kept_run is None
                logits = circuit_run(
                    call, batch, mask, plans[i], keep=lead, shared=shared[i], start=starts[i],
                    kept=kept[i],
                )  # fmt: skip
                if lead and reads is not None and resume:
                    check_logit_positions(metric, logits, idx, reads)
                totals[i] += call_metric(metric, logits, idx).item()
                bar.update()
    bar.close()
    if kept_run is not None:  # every batch met: the parent's runs are not needed again
        kept_run.parent = None
    return totals


__all__ = ["circuit_metrics", "run_circuits"]
