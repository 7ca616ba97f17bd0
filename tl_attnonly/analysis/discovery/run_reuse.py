"""What exact circuit runs take from one another, so that none is made twice.

The runs of :func:`~.run_metrics.circuit_metrics` (what a run is: :mod:`.runs`; one run:
:mod:`.exact_run`) share

* each batch's corrupted run, across the calls of one search (:class:`CorruptedRuns`, owned by
  the search's :class:`~tl_attnonly.analysis.task.DiscoveryTask`);
* a call's first run, whose inputs, merged changes and residual stream its later runs take below
  their first change (:class:`FirstRun`; what they share: :func:`shared_prefix`, the block they
  start at: :func:`start_layer`);
* one circuit's run kept across calls (:class:`KeptRun`), from which every circuit of a call
  starts (the adaptive neuron stage's runs).

``kept_neurons`` entries are checked here too (:func:`check_kept`): a layer's kept neurons
change what a run shares.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from tl_attnonly.analysis.discovery.expert_kept import (
    KeptEntry,
    KeptKey,
    check_expert_kept,
    kept_layer,
)
from tl_attnonly.analysis.discovery.graph import EXPERT, EXPERT_NEURON, MLP_REST, HeadGraph
from tl_attnonly.analysis.discovery.run_plan import CircuitPlan, PlanRun
from tl_attnonly.analysis.discovery.sites import BLOCK_BUDGET, Mask
from tl_attnonly.analysis.patching.resume import hook_layer

# the task owns its corrupted runs (CorruptedRuns lives in task.py); importable from here too
from tl_attnonly.analysis.task import CorruptedRuns, DiscoveryTask, same_binding

if TYPE_CHECKING:
    from tl_attnonly.protocol import AttnOnlyModel

#: The source kinds whose changes a ``kept_neurons`` entry changes.
KEPT_KINDS = ("neuron", MLP_REST, EXPERT, EXPERT_NEURON)


def check_kept(
    model: AttnOnlyModel,
    graph: HeadGraph,
    kept_neurons: Sequence[KeptEntry | None] | None,
    n_masks: int,
    device: torch.device,
) -> list[dict[KeptKey, torch.Tensor]]:
    """``kept_neurons`` checked (one entry per mask; each ``bool [d_mlp]`` of a dense layer, or
    ``bool [n]`` of an expert node of the graph: :mod:`.expert_kept`) and made one dict per mask
    (empty: every neuron passes its change on)."""
    if kept_neurons is None:
        return [{} for _ in range(n_masks)]
    if len(kept_neurons) != n_masks:
        raise ValueError(
            f"kept_neurons has {len(kept_neurons)} entries for {n_masks} masks: give one per "
            "mask (None where every neuron passes its change on)."
        )
    if not graph.neuron_level:
        raise ValueError(
            "kept_neurons needs a neuron-level graph (neuron_level=True): a neuron-head graph "
            "has no single change per neuron."
        )
    d_mlp = model.cfg.d_mlp
    out = []
    for entry in kept_neurons:
        checked: dict[KeptKey, torch.Tensor] = {}
        for layer, keep in (entry or {}).items():
            if isinstance(layer, str):  # an expert node
                check_expert_kept(graph, layer, keep)
                checked[layer] = keep.to(device)
                continue
            if layer in graph.expert_layers:
                raise ValueError(
                    f"kept_neurons: layer {layer} is a mixture of experts, whose neurons are its "
                    "experts': key them by the expert nodes of a graph of coarse_nodes(model, "
                    f"experts=True) ('L{layer}E0', 'L{layer}S')."
                )
            if not 0 <= layer < graph.n_layers:
                raise ValueError(f"kept_neurons: layer {layer} is not in [0, {graph.n_layers}).")
            if keep.dtype != torch.bool or tuple(keep.shape) != (d_mlp,):
                raise ValueError(
                    f"kept_neurons[...][{layer}] must be bool [d_mlp] = [{d_mlp}], got "
                    f"{keep.dtype} {tuple(keep.shape)}."
                )
            checked[layer] = keep.to(device)
        out.append(checked)
    return out


def shared_prefix(
    graph: HeadGraph,
    reference: Mask,
    mask: Mask,
    kept_reference: Mapping[KeptKey, torch.Tensor] | None = None,
    kept: Mapping[KeptKey, torch.Tensor] | None = None,
) -> tuple[set[str], float]:
    """What a run of ``mask`` shares with a run of ``reference``: the keys of the input groups
    whose patched inputs are the same, and the residual position (``order``) below which every
    source's outgoing edges are the same (``inf``: every edge is).

    With ``kept`` neurons (:func:`~.run_metrics.circuit_metrics`' ``kept_neurons``) a layer whose
    kept neurons differ (a dense layer's, or an expert node's) changes its MLP sources' (its
    experts' and their neurons') changes: every input above them counts as changed.

    The input groups are every group below the first residual position at which an input's
    edges differ. Everything such a group reads (its sources, their inputs, the residual
    stream) is computed from groups below it, all with the same edges, so its input is the same
    up to rounding (the order of the additions of the runs' merged rows). Groups at that order
    are left out even where their own edges agree: the groups of one hook (a layer's neurons and
    its remainder) must be all reused or none. A source below the first source with other edges
    reads only such groups, so its merged rows and their changes are the same too."""
    changed: list[tuple[float, float]] = (
        []
        if mask is reference
        else [
            (src.order, dst.order)
            for src, dst in graph.blocks()
            if not torch.equal(reference[(src.key, dst.key)], mask[(src.key, dst.key)])
        ]
    )
    kept_reference, kept = kept_reference or {}, kept or {}
    differ = {
        li
        for li in set(kept_reference) | set(kept)
        if li not in kept_reference
        or li not in kept
        or not torch.equal(kept_reference[li], kept[li])
    }
    layers = {kept_layer(key) for key in differ}  # a dense layer's, or an expert node's
    for src in graph.sources:
        if src.labels and src.layer in layers and src.kind in KEPT_KINDS:
            above = [d.order for d in graph.inputs if d.labels and d.order > src.order]
            changed.append((src.order, min(above, default=math.inf)))
    first_dst = min((d for _, d in changed), default=math.inf)
    keys = {dst.key for dst in graph.inputs if dst.labels and dst.order < first_dst}
    return keys, min((s for s, _ in changed), default=math.inf)


def start_layer(graph: HeadGraph, shared: Collection[str]) -> int:
    """The block a run whose input groups ``shared`` are the first run's can start at: the
    lowest block with an input group of its own (at most the last block, whose output the
    logits read)."""
    own = (dst.layer for dst in graph.inputs if dst.labels and dst.key not in shared)
    return min(min(own, default=graph.n_layers), graph.n_layers - 1)


def fires_before(name: str, start: int) -> bool:
    """Whether hook ``name`` fires before block ``start`` (the embeddings' do)."""
    layer = hook_layer(name)
    return layer is None or layer < start


class FirstRun:
    """What the later runs of one :func:`~.run_metrics.circuit_metrics` call (one batch) take from
    its first run: the hook outputs of the input groups they share with it
    (:func:`shared_prefix`), the source activations it recorded, and the residual stream entering
    the blocks they start at; and what no run's mask changes (:class:`~.run_plan.PlanRun`'s
    ``memo``).

    A later run that shares every input group below block ``l`` starts at block ``l`` (the
    model's :meth:`~tl_attnonly.protocol.AttnOnlyModel.layer_runs`) from the first run's
    residual stream there, its earlier sources read from the first run: the blocks below ``l``
    are not run again. Everything they computed is the first run's, so the logits are those of
    a full run (the same hook outputs in the same order).

    Args:
        keys: Input groups some later run shares.
        layers: Blocks some later run starts at.
        runner: The model's runs from a block for this batch (None: every run is full).
        keep_changes: Keep the first run's merged changes (:class:`~.run_plan.PlanRun`): a
            later run copies the rows of the sources below its first source with other edges.
    """

    def __init__(
        self,
        keys: Collection[str],
        layers: Collection[int],
        runner: Any = None,
        keep_changes: bool = False,
    ):
        self.keys, self.layers, self.runner = set(keys), set(layers), runner
        self.keep_changes = keep_changes
        self.reference: PlanRun | None = None  # the first run's, with keep_changes
        self.outputs: dict[str, torch.Tensor] = {}  # input group -> its hook's output
        self.sources: dict[str, torch.Tensor] = {}  # source hook -> its activation
        self.resid: dict[int, torch.Tensor] = {}  # block -> [batch, pos, d_model] entering it
        self.memo: dict = {}  # what does not depend on the mask (PlanRun)
        # a kept run made from another's (chain): that run's merged changes, copied where the
        # plan took its rows
        self.base_reference: PlanRun | None = None

    def chain(self, base: FirstRun, start: int) -> None:
        """Take from ``base`` (another kept circuit's run of the same batch, whose circuit
        agrees with this one below block ``start``: :func:`shared_prefix`) what a run starting
        at block ``start`` needs: the residual stream entering the blocks up to it, the sources'
        activations, its merged changes (copied where the plan took its rows) and its memo."""
        self.resid.update({layer: t for layer, t in base.resid.items() if layer <= start})
        self.sources = dict(base.sources)
        self.memo = base.memo
        self.base_reference = base.reference

    def nbytes(self) -> int:
        """Bytes of the tensors it holds (each storage once)."""
        tensors = [*self.outputs.values(), *self.sources.values(), *self.resid.values()]
        if self.reference is not None and self.reference.changes is not None:
            tensors.append(self.reference.changes)
        seen: dict[int, int] = {}
        for t in tensors:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())


class KeptRun:
    """One circuit's exact run, per batch, kept across :func:`~.run_metrics.circuit_metrics` calls
    (``kept_run=``): each circuit of a call takes from it what a later run of one call takes
    from the call's first run (:class:`FirstRun`: the merged changes of the sources below its
    first source with other edges, the residual stream entering the block it starts at, the
    sources' activations below it), so every circuit of the call, the first included, starts
    at its own first block with other edges or kept neurons (:func:`shared_prefix`).

    The kept circuit is run once per batch, in the first call that meets the batch, and what
    later runs take of it is kept (every block's entering residual stream, the sources'
    activations and the merged changes: about ``(n_layers + n_merged_rows) * batch * pos *
    d_model`` floats and the sources' hooks) up to ``budget`` bytes in all; a batch beyond it
    runs the kept circuit again in each call. Its input groups' hook outputs are not kept (one
    per group, each up to ``n_heads`` residual streams): a run rebuilds the groups of the block
    it starts at. Bound to the first model, tokens, metric, graph and position classes it
    serves (others are refused). Used by the adaptive neuron stage (:mod:`.neuron_stage`), whose
    circuits differ from the one it keeps in one layer's kept neurons.

    A kept run made with a ``parent`` (the kept run it replaces, bound to the same model,
    tokens, metric and graph) runs the kept circuit, in its first call, from the first block
    where the two circuits differ, from the parent's run of the batch where the parent holds
    it (the parent is then let go); else from block 0.

    Args:
        mask: The kept circuit (a mask of the calls' graph).
        kept_neurons: Its :func:`~.run_metrics.circuit_metrics` ``kept_neurons`` entry (None:
            every neuron passes its change on).
        budget: Most bytes kept.
        parent: Another kept run whose runs this one's start from (see above).

    Attributes:
        missed: How many times a batch's run was made and not kept (beyond the budget).
    """

    def __init__(
        self,
        mask: Mask,
        kept_neurons: KeptEntry | None = None,
        budget: int = 4 * BLOCK_BUDGET,
        parent: KeptRun | None = None,
    ):
        self.mask, self.kept = mask, kept_neurons
        self.parent = parent
        self.budget = budget
        self.kept_bytes = 0
        self.missed = 0  # batches whose run was beyond the budget (made again in each call)
        self._bound: tuple[Any, ...] | None = None
        self._plan: CircuitPlan | None = None
        self._runs: dict[tuple[int, ...], FirstRun] = {}

    def bind(self, task: DiscoveryTask, graph: HeadGraph) -> None:
        """Bind to the call's task (model, tokens, metric, position classes) and graph (the first
        call's), or refuse others (the kept run and its constants were computed with them).

        Raises:
            ValueError: If they are not those it was first used with.
        """
        signature = (graph.neuron_level, tuple(graph.node_labels()), graph.positions)
        bound = (*task.binding(), signature)
        if self._bound is None:
            self._bound = bound
        elif not same_binding(self._bound, bound):
            raise ValueError(
                "This KeptRun holds a run of another model, other clean or corrupted tokens, "
                "another metric or another graph (nodes=, positions=): use one per search."
            )

    def plan(
        self, graph: HeadGraph, reference: CircuitPlan | None = None, same_below: float = 0
    ) -> CircuitPlan:
        """The kept circuit's :class:`~.run_plan.CircuitPlan` (built once; from the parent's
        ``reference`` plan below ``same_below``, as a later run's)."""
        if self._plan is None:
            self._plan = CircuitPlan(graph, self.mask, reference, same_below)
        return self._plan

    @property
    def bound(self) -> tuple[Any, ...] | None:
        """What it is bound to (:meth:`bind`): the model, clean and corrupted tokens, metric,
        position classes and the graph's signature; None before its first call."""
        return self._bound

    def serves(self, child: KeptRun) -> bool:
        """Whether ``child``'s runs can start from this run's (``parent=``): bound to the same
        model, tokens, metric, graph and position classes."""
        mine, theirs = self._bound, child.bound
        return mine is not None and theirs is not None and same_binding(mine, theirs)

    def first_run(self, idx: torch.Tensor) -> FirstRun | None:
        """The kept run of batch ``idx``, if it is kept."""
        return self._runs.get(tuple(idx.tolist()))

    def keep(self, idx: torch.Tensor, run: FirstRun) -> None:
        """Keep batch ``idx``'s run, if within the budget (else count it in ``missed``)."""
        size = run.nbytes()
        if self.kept_bytes + size <= self.budget:
            self._runs[tuple(idx.tolist())] = run
            self.kept_bytes += size
        else:
            self.missed += 1


__all__ = [
    "CorruptedRuns",
    "FirstRun",
    "KeptRun",
    "check_kept",
    "fires_before",
    "shared_prefix",
    "start_layer",
]
