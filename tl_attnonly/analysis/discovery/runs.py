"""Exact circuit runs over the head graph and gate/value splits (:class:`Circuit`: :mod:`.circuit`).

A circuit is a set of edges of :class:`~tl_attnonly.analysis.discovery.HeadGraph`. Its run is exact:
the model runs on the clean input, and every input of every node receives the corrupted residual
stream plus the current run's change of the sources joined to it by circuit edges,

    ``input_v = resid(corrupted) + sum_{u -> v in circuit} (out_u(current) - out_u(corrupted))``

(each node's normalisation applied to its own input). So the full graph gives the clean run, the
empty graph the corrupted run, and ``faithfulness = (m(circuit) - m(corrupted)) / (m(clean) -
m(corrupted))`` is 1 and 0 for them.

A gated neuron's two inputs are its gate ``g = x W_gate`` (``hook_pre``) and linear branch
``u = x W_in`` (``hook_pre_linear``), rebuilt each from its own residual input; its heads then
compute ``sigmoid(b_k g + d_k) (f_k g + e_k - g_k) u`` as in the model.

On a restricted graph (``nodes=``) a circuit is the circuit of the full graph whose edges touching
a dropped node are absent: a dropped node's inputs are corrupted, so its output is too.

``discover_circuit`` (score, prune, check in one call, and the two-stage recipe for large models):
:mod:`.search`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from jaxtyping import Int
from tqdm.auto import tqdm

from tl_attnonly._types import check_token_pair, tokens_on_model_device
from tl_attnonly.adapt import analysis_model

# Circuit and faithfulness live in .circuit; they stay importable from here too
from tl_attnonly.analysis.discovery.circuit import Circuit, faithfulness
from tl_attnonly.analysis.discovery.graph import (
    LOGITS,
    MLP_REST,
    HeadGraph,
    InputGroup,
    SourceGroup,
)
from tl_attnonly.analysis.discovery.positions import PositionClasses
from tl_attnonly.analysis.discovery.run_plan import CircuitPlan, PlanRun, source_kept
from tl_attnonly.analysis.discovery.sites import (
    BLOCK_BUDGET,
    DiscoveryMetric,
    Mask,
    batch_indices,
    call_metric,
    check_additive,
    check_discoverable,
    check_logit_positions,
    input_hook_name,
    input_site,
    logit_positions,
    neuron_head_coef,
    neuron_read_matrix,
    qkv_weights,
    source_hook_names,
)
from tl_attnonly.analysis.patching.resume import hook_layer
from tl_attnonly.hooks import block_act_name

if TYPE_CHECKING:
    from tl_attnonly.protocol import AttnOnlyModel, ModelLike

# ---------------------------------------------------------------------------------------------
# exact circuit runs
# ---------------------------------------------------------------------------------------------


def _recorded_names(model: AttnOnlyModel, graph: HeadGraph) -> list[str]:
    """The hooks a run records: the sources' and each block's MLP output (the change of a
    merged row holding a whole layer: :class:`~.run_plan.CircuitPlan`'s ``whole``)."""
    mlp_out = [block_act_name("mlp_out", li) for li in range(graph.n_layers)]
    return source_hook_names(model, graph) + mlp_out


def _corrupted_names(model: AttnOnlyModel, graph: HeadGraph) -> list[str]:
    names = set(_recorded_names(model, graph))
    for dst in graph.inputs:
        names.add(input_hook_name(dst, graph))
        names.add(input_site(model, dst)[1])
    return sorted(names)


def _recompute(
    model: AttnOnlyModel,
    dst: InputGroup,
    graph: HeadGraph,
    x: torch.Tensor,
    nodes: torch.Tensor,
    which: torch.Tensor | None = None,
    memo: dict | None = None,
):
    """What input group ``dst`` of ``nodes`` computes from residual inputs ``x [b, p, m, d]``
    (or, with ``which [m]``, from the distinct inputs ``x [b, p, n_distinct, d]``, reader ``i``
    reading ``x[:, :, which[i]]``: each distinct input is normalised once).

    ``memo``: a dict in which the readers' weights are kept per input group and node set (the
    same in every run of one call: :class:`FirstRun`'s memo), instead of gathered per call.

    Returns ``[b, p, m, d_head]`` (attention), the neuron-heads' ``q``/``v`` ``[b, p, m', 1]``
    together with the head indices ``m'`` they go to, or, for gated MLPs, the gates ``g`` or
    linear branches ``u`` of the neurons, ``[b, p, m]`` (``hook_pre`` / ``hook_pre_linear``).
    """
    module, _ = input_site(model, dst)
    normalised = module(x) if module is not None else x
    weights = _reader_weights(model, dst, graph, nodes, memo)
    if dst.kind == "attn":
        if which is not None:
            normalised = normalised[:, :, which.to(normalised.device)]
        W, b = weights
        out = torch.einsum("bpmd,mde->bpme", normalised, W) + b
        return out, nodes
    if graph.gated:  # TL's GatedMLP: g = x W_gate, u = x W_in, no biases before the product
        return _project(normalised, weights[0], which), nodes
    mlp = model.blocks[dst.layer].mlp
    K = graph.n_heads_per_neuron
    neurons = nodes if graph.neuron_level else nodes // K
    W_in, b_in = weights  # [d, m], [m]
    pre = _project(normalised, W_in, which) + b_in
    scale = neuron_head_coef(mlp, pre, 0 if dst.input == "gate" else 2)
    shift = neuron_head_coef(mlp, pre, 1 if dst.input == "gate" else 3)
    if graph.neuron_level:
        heads = (neurons[:, None] * K + torch.arange(K, device=nodes.device)).flatten()
        out = (pre.unsqueeze(-1) * scale + shift).flatten(-2)  # [b, p, m*K]
    else:
        heads = nodes
        k = nodes % K
        out = pre * scale[k] + shift[k]
    return out.unsqueeze(-1), heads


def _reader_weights(
    model: AttnOnlyModel,
    dst: InputGroup,
    graph: HeadGraph,
    nodes: torch.Tensor,
    memo: dict | None,
) -> tuple[torch.Tensor, ...]:
    """The weights ``nodes`` of ``dst`` read with: ``(W [m, d, d_head], b [m, d_head])``
    (attention), ``(W [d, m],)`` (gated MLPs) or ``(W_in [d, m], b_in [m])`` (neuron-heads),
    gathered once per ``(dst, nodes)`` where a ``memo`` keeps them."""
    key = ("read", dst.key, nodes.cpu().numpy().tobytes())
    if memo is not None and key in memo:
        return memo[key]
    if dst.kind == "attn":
        W, b = qkv_weights(model.blocks[dst.layer].attn, dst.input)
        weights: tuple[torch.Tensor, ...] = (W[nodes], b[nodes])
    elif graph.gated:
        weights = (neuron_read_matrix(model, dst, graph)[:, nodes],)
    else:
        mlp = model.blocks[dst.layer].mlp
        neurons = nodes if graph.neuron_level else nodes // graph.n_heads_per_neuron
        weights = (mlp.W_in[:, neurons], mlp.b_in[neurons])
    if memo is not None:
        memo[key] = weights
    return weights


def _project(
    normalised: torch.Tensor, W: torch.Tensor, which: torch.Tensor | None = None
) -> torch.Tensor:
    """``[b, p, m]``: each of ``m`` readers' normalised input ``[b, p, m, d]`` times its column of
    ``W [d, m]``; one input ``[b, p, 1, d]`` (an MLP remainder) is read by every column. With
    ``which [m]``: the inputs are the distinct ones, reader ``i`` reads ``which[i]``."""
    if which is not None:
        which = which.to(W.device)
        out = normalised.new_empty(normalised.shape[:2] + (W.shape[1],))
        for u in range(normalised.shape[2]):
            cols = (which == u).nonzero().flatten()
            out[:, :, cols] = normalised[:, :, u] @ W[:, cols]
        return out
    if normalised.shape[2] != W.shape[1]:
        return normalised[:, :, 0] @ W
    return torch.einsum("bpmd,dm->bpm", normalised, W)


class CorruptedRuns:
    """The corrupted run's activations per batch, kept across the exact-run calls of one search
    (:func:`~.search.discover_circuit`'s sweep, pruning, neuron stage and gate/value split), so
    that each batch's corrupted run is made once instead of once per call.

    Bound to the first model and corrupted tokens it serves (others are refused). Activations
    are kept up to ``budget`` bytes in all; a batch beyond it is run again at each call.

    Args:
        budget: Most bytes of activations kept.
    """

    def __init__(self, budget: int = 4 * BLOCK_BUDGET):
        self.budget = budget
        self.kept_bytes = 0
        self._bound: tuple[Any, torch.Tensor] | None = None
        self._store: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
        self._asked: dict[tuple[int, ...], set[str]] = {}

    def activations(
        self,
        model: AttnOnlyModel,
        corrupted_tokens: Int[torch.Tensor, "batch pos"],
        idx: torch.Tensor,
        names: Collection[str],
    ) -> dict[str, torch.Tensor]:
        """The corrupted run's activations at ``names`` for the batch ``idx`` (rows of
        ``corrupted_tokens``)."""
        if self._bound is None:
            self._bound = (model.model, corrupted_tokens)
        elif self._bound[0] is not model.model or self._bound[1] is not corrupted_tokens:
            raise ValueError(
                "This CorruptedRuns holds another model's or other tokens' corrupted runs: use "
                "one per model and token pair."
            )
        key = tuple(idx.tolist())
        have = self._store.get(key, {})
        asked = self._asked.get(key, set())
        missing = set(names) - asked
        if missing:
            _, cache = model.run_with_cache(
                corrupted_tokens[idx], names_filter=lambda n: n in missing
            )
            fresh = dict(cache.cache_dict)
            size = sum(t.numel() * t.element_size() for t in fresh.values())
            if self.kept_bytes + size > self.budget:
                return {**have, **fresh}
            self.kept_bytes += size
            have = self._store[key] = {**have, **fresh}
            self._asked[key] = asked | missing
        return have


def circuit_metric(
    model: ModelLike,
    mask: Mask,
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
) -> float:
    """The metric of the circuit ``mask``, exactly (see the module docstring).

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer`.
        mask: ``(source group, input group) -> bool [n_sources, n_inputs]``
            (:func:`~tl_attnonly.analysis.prune`, ``HeadGraph.full_mask``).
        clean_tokens, corrupted_tokens: ``[n_examples, pos]``.
        metric: As in :func:`~tl_attnonly.analysis.edge_attribution_scores`.
        neuron_level: The graph's granularity (must match the mask).
        nodes: The restricted graph's nodes (:class:`HeadGraph`), if the mask is over one.
        batch_size: Examples per pass.
        block_bytes: Budget for the residual inputs rebuilt at once (chunked to fit).
        progress: Progress bar over batches.
        positions: The mask's position classes (:mod:`.positions`), if it is over a graph
            resolved by position: each class's positions are rebuilt from its own edges.

    Returns:
        The metric summed over batches.
    """
    model = analysis_model(model)
    return circuit_metrics(
        model, [mask], clean_tokens, corrupted_tokens, metric, neuron_level=neuron_level,
        nodes=nodes, batch_size=batch_size, block_bytes=block_bytes, progress=progress,
        positions=positions,
    )[0]  # fmt: skip


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
    kept_neurons: Sequence[Mapping[int, torch.Tensor] | None] | None = None,
    kept_run: KeptRun | None = None,
) -> list[float]:
    """:func:`circuit_metric` of several circuits; the corrupted run is made once per batch
    (once per search with ``corrupted_runs``, a :class:`CorruptedRuns` shared by its calls).

    ``kept_neurons`` (one entry per mask, or None): layer -> ``bool [d_mlp]``, the neurons
    whose change that layer's MLP sources pass on along their edges; the others' outputs count
    as the corrupted run's. The run is then that of the same circuit on a graph with every
    neuron of the layer a node of its own (the layer's edges on each) and the neurons left out
    without outgoing edges, computed on this graph (the neuron stage's runs on the coarse graph,
    :mod:`.neuron_stage`). Neuron-level graphs only.

    The runs of circuits whose edges into the inputs below some residual position equal the
    first circuit's take those inputs from the first run (:func:`_shared_prefix`; the same up
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
    model = analysis_model(model)
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    check_discoverable(model, neuron_level)
    check_token_pair(clean_tokens, corrupted_tokens)
    if positions is not None:
        positions.check_tokens(clean_tokens)
    graph = HeadGraph(
        model, neuron_level=neuron_level, nodes=nodes,
        positions=None if positions is None else positions.names,
    )  # fmt: skip
    for mask in masks:
        missing = set(graph.block_keys()) - set(mask)
        if missing:
            raise ValueError(
                f"The mask lacks blocks {sorted(missing)[:3]}...: build it for this model with "
                f"prune() or HeadGraph(model, neuron_level={neuron_level}, nodes=...).full_mask() "
                "(a restricted graph's mask needs the same nodes=..., and a mask resolved by "
                "position the same positions=...)."
            )
    kept = _check_kept(model, graph, kept_neurons, len(masks), clean_tokens.device)
    totals = [0.0] * len(masks)
    parent: KeptRun | None = None
    parent_start = 0
    if kept_run is not None:  # every run takes from the kept circuit's run
        kept_run.bind(model, clean_tokens, corrupted_tokens, metric, graph, positions)
        reference_mask = kept_run.mask
        reference_kept = _check_kept(model, graph, [kept_run.kept], 1, clean_tokens.device)[0]
        parent = kept_run.parent if model.can_resume else None
        if parent is not None and parent.serves(kept_run):
            # the kept circuit's runs start where it differs from the parent's
            parent_kept = _check_kept(model, graph, [parent.kept], 1, clean_tokens.device)[0]
            shared_with_parent, parent_below = _shared_prefix(
                graph, parent.mask, reference_mask, parent_kept, reference_kept
            )
            parent_start = _start_layer(graph, shared_with_parent)
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
        shared[i], same_below[i] = _shared_prefix(
            graph, reference_mask, masks[i], reference_kept, kept[i]
        )
        plans[i] = CircuitPlan(graph, masks[i], reference_plan, same_below[i])
    # the block each later run starts at, from the reference run's residual stream entering it
    starts = [_start_layer(graph, shared[i]) if i in later else 0 for i in range(len(masks))]
    resume = model.can_resume and (kept_run is not None or any(starts))
    if not resume:
        starts = [0] * len(masks)
    names = _corrupted_names(model, graph)
    if corrupted_runs is None:  # nothing kept: each batch's corrupted run for this call only
        corrupted_runs = CorruptedRuns(budget=0)
    batches = batch_indices(clean_tokens.shape[0], batch_size)
    check_additive(model, clean_tokens, metric, batches)
    bar = tqdm(total=len(batches) * len(masks), desc="circuit runs", disable=not progress)
    for idx in batches:
        with torch.no_grad():
            corr = corrupted_runs.activations(model, corrupted_tokens, idx, names)
            where = (
                None
                if positions is None
                else {p: positions.mask(p, idx, clean_tokens.device) for p in positions.names}
            )
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
                    logits = _circuit_run(
                        model, graph, reference_mask, clean_tokens[idx], corr, block_bytes,
                        reference_plan, where, first=first, keep=True, reads=reads,
                        kept=reference_kept, start=start,
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
            for i, mask in enumerate(masks):
                lead = i == 0 and kept_run is None
                logits = _circuit_run(
                    model, graph, mask, clean_tokens[idx], corr, block_bytes, plans[i], where,
                    first=first, keep=lead, shared=shared[i], start=starts[i], reads=reads,
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


def _check_kept(
    model: AttnOnlyModel,
    graph: HeadGraph,
    kept_neurons: Sequence[Mapping[int, torch.Tensor] | None] | None,
    n_masks: int,
    device: torch.device,
) -> list[dict[int, torch.Tensor]]:
    """``kept_neurons`` checked (one entry per mask; each ``bool [d_mlp]`` of a layer) and made
    one dict per mask (empty: every neuron passes its change on)."""
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
        checked = {}
        for layer, keep in (entry or {}).items():
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


def _shared_prefix(
    graph: HeadGraph,
    reference: Mask,
    mask: Mask,
    kept_reference: Mapping[int, torch.Tensor] | None = None,
    kept: Mapping[int, torch.Tensor] | None = None,
) -> tuple[set[str], float]:
    """What a run of ``mask`` shares with a run of ``reference``: the keys of the input groups
    whose patched inputs are the same, and the residual position (``order``) below which every
    source's outgoing edges are the same (``inf``: every edge is).

    With ``kept`` neurons (:func:`circuit_metrics`' ``kept_neurons``) a layer whose kept
    neurons differ changes its MLP sources' changes: every input above them counts as changed.

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
    for src in graph.sources:
        if src.labels and src.layer in differ and src.kind in ("neuron", MLP_REST):
            above = [d.order for d in graph.inputs if d.labels and d.order > src.order]
            changed.append((src.order, min(above, default=math.inf)))
    first_dst = min((d for _, d in changed), default=math.inf)
    keys = {dst.key for dst in graph.inputs if dst.labels and dst.order < first_dst}
    return keys, min((s for s, _ in changed), default=math.inf)


def _start_layer(graph: HeadGraph, shared: Collection[str]) -> int:
    """The block a run whose input groups ``shared`` are the first run's can start at: the
    lowest block with an input group of its own (at most the last block, whose output the
    logits read)."""
    own = (dst.layer for dst in graph.inputs if dst.labels and dst.key not in shared)
    return min(min(own, default=graph.n_layers), graph.n_layers - 1)


def _before(name: str, start: int) -> bool:
    """Whether hook ``name`` fires before block ``start`` (the embeddings' do)."""
    layer = hook_layer(name)
    return layer is None or layer < start


class FirstRun:
    """What the later runs of one :func:`circuit_metrics` call (one batch) take from its first
    run: the hook outputs of the input groups they share with it (:func:`_shared_prefix`), the
    source activations it recorded, and the residual stream entering the blocks they start at;
    and what no run's mask changes (:class:`~.run_plan.PlanRun`'s ``memo``).

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
        agrees with this one below block ``start``: :func:`_shared_prefix`) what a run starting
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
    """One circuit's exact run, per batch, kept across :func:`circuit_metrics` calls
    (``kept_run=``): each circuit of a call takes from it what a later run of one call takes
    from the call's first run (:class:`FirstRun`: the merged changes of the sources below its
    first source with other edges, the residual stream entering the block it starts at, the
    sources' activations below it), so every circuit of the call, the first included, starts
    at its own first block with other edges or kept neurons (:func:`_shared_prefix`).

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
        kept_neurons: Its :func:`circuit_metrics` ``kept_neurons`` entry (None: every neuron
            passes its change on).
        budget: Most bytes kept.
        parent: Another kept run whose runs this one's start from (see above).

    Attributes:
        missed: How many times a batch's run was made and not kept (beyond the budget).
    """

    def __init__(
        self,
        mask: Mask,
        kept_neurons: Mapping[int, torch.Tensor] | None = None,
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

    def bind(
        self,
        model: AttnOnlyModel,
        clean_tokens: torch.Tensor,
        corrupted_tokens: torch.Tensor,
        metric: DiscoveryMetric,
        graph: HeadGraph,
        positions: PositionClasses | None,
    ) -> None:
        """Bind to the call's model, tokens, metric, graph and position classes (the first
        call's), or refuse others (the kept run and its constants were computed with them).

        Raises:
            ValueError: If they are not those it was first used with.
        """
        signature = (graph.neuron_level, tuple(graph.node_labels()), graph.positions)
        bound = (model.model, clean_tokens, corrupted_tokens, metric, positions, signature)
        if self._bound is None:
            self._bound = bound
        elif not _same_binding(self._bound, bound):
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
        return mine is not None and theirs is not None and _same_binding(mine, theirs)

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


def _same_binding(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two :meth:`KeptRun.bind` bindings are the same: the same model, tokens, metric and
    position classes (objects), and equal graph signatures."""
    return all(x is y for x, y in zip(a[:5], b[:5], strict=True)) and a[5] == b[5]


def _circuit_run(
    model: AttnOnlyModel,
    graph: HeadGraph,
    mask: Mask,
    tokens,
    corr,
    block_bytes: int,
    plan: CircuitPlan | None = None,
    where: dict[str, torch.Tensor] | None = None,
    *,
    first: FirstRun | None = None,
    keep: bool = False,
    shared: Collection[str] = (),
    start: int = 0,
    reads: torch.Tensor | None = None,
    kept: Mapping[int, torch.Tensor] | None = None,
):
    """The circuit's logits (``kept``: :func:`circuit_metrics`' ``kept_neurons`` entry);
    ``where``: position class -> ``[batch, pos]`` bool (a graph resolved by position: each
    class's hook changes its own positions only). A run from a block computes
    only the logits at ``reads`` (one position per row, the metric's :func:`logit_positions`;
    the others NaN) where the model's runner can.

    ``first``: the call's :class:`FirstRun`. With ``keep`` (the first run) it receives what the
    later runs reuse; else the input groups ``shared`` (:func:`_shared_prefix`) take their hook
    outputs from it instead of being rebuilt, the changes of the merged rows ``plan`` took from
    the first run's plan are copied from it, and with ``start > 0`` the run starts at block
    ``start`` from the first run's residual stream there."""
    current: dict[str, torch.Tensor] = {}
    if start:
        assert first is not None and first.runner is not None
        current.update({k: v for k, v in first.sources.items() if _before(k, start)})
    reuse: dict[str, torch.Tensor] = {}
    if first is not None and not keep:
        reuse = {key: first.outputs[key] for key in shared if key in first.outputs}
    # each merged source row's change once per run, inputs shared by readers with equal edges
    is_reference = keep and first is not None and first.keep_changes
    run = PlanRun(
        model, graph, plan or CircuitPlan(graph, mask), current, corr, block_bytes,
        None if first is None else first.memo,
        reference=None if first is None else first.base_reference if keep else first.reference,
        is_reference=is_reference, kept=kept,
    )  # fmt: skip
    if is_reference:
        assert first is not None
        first.reference = run

    def record(act, hook):
        current[hook.name] = act
        return act

    memo = run.memo
    # per source group of a layer passing on some neurons' changes: how many of its nodes'
    # changes each row passes on (an MLP remainder: its kept neurons; a named neuron: 0 or 1)
    kept_counts = {
        src.key: _kept_count(src, kept[src.layer])
        for src in graph.sources
        if kept and src.labels and src.layer in kept and src.kind in ("neuron", MLP_REST)
    }

    def fixed(dst: InputGroup):
        """What ``patch_for`` needs of ``dst`` that no mask changes (kept in the memo)."""
        key = ("input", dst.key)
        if key not in memo:
            srcs = [s for s in graph.sources if s.order < dst.order and s.labels and dst.labels]
            # each source row counts its nodes (an MLP remainder its neurons)
            covers = torch.cat(
                [
                    torch.full((len(s.labels),), len(s.index) if s.kind == MLP_REST else 1)
                    for s in srcs
                ]
                or [torch.zeros(0, dtype=torch.long)]
            )
            # Counts of the model's nodes whose change reaches each reader; a restricted
            # graph's dropped nodes have no edges.
            n_possible = sum(
                s.size for s in graph.sources if s.order < dst.order and s.kind != MLP_REST
            )
            index = torch.tensor(dst.index, dtype=torch.long)
            # the readers this group patches: an MLP remainder's neurons are its own
            ours = torch.ones(dst.size, dtype=torch.bool)
            ours[_readers_of_other_groups(graph, dst)] = False
            position = torch.full((dst.size,), -1, dtype=torch.long)
            position[index] = 0 if dst.kind == MLP_REST else torch.arange(len(index))
            _, site_name = input_site(model, dst)
            hook_name = input_hook_name(dst, graph)
            memo[key] = (srcs, covers, n_possible, index, ours, position, site_name, hook_name)
        return memo[key]

    def patch_for(dst: InputGroup):
        srcs, covers, n_possible, index, ours, position, site_name, hook_name = fixed(dst)
        if kept:  # a layer passing on some neurons' changes counts only those
            covers = _kept_covers(srcs, covers, kept_counts)
        included = torch.zeros(dst.size, dtype=torch.long)
        if srcs:
            edges = torch.cat([mask[(src.key, dst.key)] for src in srcs], 0).cpu()
            included[index] += covers @ edges.long()
        if bool((included == n_possible)[ours].all()):
            return None  # the full set of edges: the current run's input
        none = ((included == 0) & ours).nonzero().flatten()  # full indices: corrupted input
        # restricted indices (columns of the masks) of the readers whose input is rebuilt
        mixed = position[((included > 0) & (included < n_possible) & ours).nonzero().flatten()]
        mixed = mixed.unique()  # an MLP remainder: one column (0) for all its neurons
        patch = patch_inputs(dst, none, mixed, index, site_name, hook_name)
        if dst.position is not None:
            if where is None:
                raise ValueError(
                    "This mask is over a graph resolved by position: give positions=... (the "
                    "PositionClasses it was built with)."
                )
            sel = where[dst.position]
            return hook_name, _at_positions(patch, sel)
        return hook_name, patch

    def _at_positions(patch, sel: torch.Tensor):
        def hook(act, hook):
            new = patch(act, hook)
            shape = sel.shape + (1,) * (act.ndim - 2)
            return torch.where(sel.view(shape).to(act.device), new, act)

        return hook

    def patch_inputs(dst: InputGroup, none, mixed, index, site_name: str, hook_name: str):
        def patch(act, hook):
            act = act.clone()
            if dst.kind == LOGITS:
                if len(mixed) == 0:
                    return corr[hook_name].clone()
                return run.inputs(dst, hook_name, mixed)[:, :, 0]
            corr_act = corr[hook_name]
            if dst.kind in ("neuron", MLP_REST):
                none_heads = _heads_of(graph, dst, none)
                act[:, :, none_heads] = corr_act[:, :, none_heads]
            else:
                act[:, :, none] = corr_act[:, :, none]
            per = max(1, act.shape[0] * act.shape[1] * model.cfg.d_model * 3 * act.element_size())
            step = max(1, block_bytes // per)
            for start in range(0, len(mixed), step):
                chunk = mixed[start : start + step].to(act.device)
                x, which = run.distinct_inputs(dst, site_name, chunk.cpu())
                # the readers' indices in the model (an MLP remainder: all its neurons, one
                # reader column, whose input is the distinct one)
                rest = dst.kind == MLP_REST
                full = index.to(act.device) if rest else index.to(act.device)[chunk]
                new, heads = _recompute(
                    model, dst, graph, x.to(act.dtype), full, None if rest else which, memo
                )
                act[:, :, heads] = new.to(act.dtype)
            return act

        return patch

    def reused(key: str, patch):
        def hook(act, hook):
            if key in reuse:
                return reuse[key]
            out = patch(act, hook)
            if keep and first is not None and key in first.keys:
                first.outputs[key] = out
            return out

        return hook

    hooks: list[tuple[str | Callable[..., Any], Callable[..., Any]]] = [
        (name, record)
        for name in _recorded_names(model, graph)
        if not start or not _before(name, start)  # below: the first run's
    ]
    for dst in graph.inputs:
        if dst.layer < start:  # below the block the run starts at: the first run's
            continue
        patch = patch_for(dst)
        if patch is not None:
            hooks.append((patch[0], reused(dst.key, patch[1])))
    if keep and first is not None and first.runner is not None:
        first.sources = current  # filled by the run
        for layer in sorted(first.layers):

            def entering(act, hook, layer=layer):
                first.resid[layer] = act
                return act

            hooks.append((block_act_name("resid_pre", layer), entering))
    if start:
        assert first is not None and first.runner is not None
        logits = first.runner.run(first.resid[start], start, hooks, 0, None, logit_positions=reads)
    elif keep and first is not None and first.runner is not None:
        with first.runner.recording():  # what the later runs from a block need of a full pass
            logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
    else:
        logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
    run.built.clear()  # the reference keeps its changes, not its inputs
    if is_reference and first is not None:  # the rows it copied are its own now: let go of
        run.reference = first.base_reference = None  # the run they came from (and its chain)
    return logits


def _kept_count(src: SourceGroup, kept: torch.Tensor) -> torch.Tensor:
    """Per row of a neuron source group, the nodes whose change it passes on given the layer's
    ``kept`` neurons (``bool [d_mlp]``): an MLP remainder its kept neurons, a named neuron 1 if
    kept."""
    mine = source_kept(src, kept.cpu()).long()
    return mine.sum().reshape(1) if src.kind == MLP_REST else mine


def _kept_covers(
    srcs: list[SourceGroup], covers: torch.Tensor, counts: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """``covers`` (per source row of ``srcs``: the model's nodes whose change it passes on)
    with the groups of ``counts`` (:func:`_kept_count`) counting their kept neurons only: a
    reader joined to every source then has its input rebuilt (not the current run's) where a
    layer passes on fewer than all its neurons."""
    out, start = covers, 0
    for src in srcs:
        n = len(src.labels)
        if src.key in counts:
            out = out.clone() if out is covers else out
            out[start : start + n] = counts[src.key]
        start += n
    return out


def _readers_of_other_groups(graph: HeadGraph, dst: InputGroup) -> torch.Tensor:
    """Positions of ``dst``'s full group read by another group of the graph (an MLP remainder
    holds the neurons its layer's neuron group left out, and vice versa)."""
    if dst.kind == MLP_REST:
        mine = torch.zeros(dst.size, dtype=torch.bool)
        mine[list(dst.index)] = True
        return (~mine).nonzero().flatten()
    key = f"mlp.{dst.layer}.{dst.input}" + (f"@{dst.position}" if dst.position else "")
    rest = graph.input_by_key.get(key) if dst.kind == "neuron" else None
    return torch.tensor(rest.index if rest is not None else (), dtype=torch.long)


def _heads_of(graph: HeadGraph, dst: InputGroup, nodes: torch.Tensor) -> torch.Tensor:
    """Indices into ``dst``'s input hook of ``nodes`` (a neuron's ``K`` heads, or itself)."""
    if dst.kind not in ("neuron", MLP_REST) or not graph.neuron_level or graph.gated:
        return nodes
    K = graph.n_heads_per_neuron
    return (nodes[:, None] * K + torch.arange(K)).flatten()


def circuit_gate_value_split(
    model: ModelLike,
    mask: Mask,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    metric: DiscoveryMetric,
    *,
    neurons: Sequence[str] | None = None,
    neuron_level: bool = True,
    nodes: Collection[str] | None = None,
    batch_size: int | None = None,
    progress: bool = True,
    positions: PositionClasses | None = None,
    corrupted_runs: CorruptedRuns | None = None,
) -> pd.DataFrame:
    """For each neuron of the circuit: the effect of its gate edges alone, value edges alone, both.

    With ``C`` the circuit and ``C - X`` the circuit without the edges into input(s) ``X`` of the
    neuron (exact circuit runs, :func:`~tl_attnonly.analysis.circuit_metric`):

    - ``gate = m(C - value) - m(C - gate - value)``: its pattern receives the circuit, its value
      does not;
    - ``value = m(C - gate) - m(C - gate - value)``;
    - ``both = m(C) - m(C - gate - value)``;
    - ``interaction = both - gate - value`` (so ``both = gate + value + interaction`` exactly; the
      interaction is zero when the metric is linear in the neuron's pattern and value jointly,
      which a product ``pattern * value`` is not).

    A neuron with no circuit edge into its gate (value) has no gate (value) effect to measure:
    that column and ``interaction`` are NaN, with a warning (not 0, which would read as a
    measured zero); ``n_gate_edges`` / ``n_value_edges`` say how many edges each side has.

    For a gated neuron (``act_K(g) * u``) the gate is ``g`` (the pattern and the ``g`` factor of
    the value: *whether and how strongly it fires*) and the value is ``u`` (*what it scales*): for
    a last-layer neuron read linearly, ``gate = F(g_clean, u_corr) - F(g_corr, u_corr)`` with
    ``F(g, u) = act_K(g) u``.

    Args:
        neurons: Labels of neurons (or neuron-heads) to split; default every neuron with an
            incoming circuit edge.
        Others: As in :func:`~tl_attnonly.analysis.circuit_metric` (``nodes``: the mask's
            restricted graph; ``positions``: its position classes, whose gate (value) edges at
            every position count as the neuron's gate (value)).
        corrupted_runs: A :class:`CorruptedRuns` shared with other calls (:func:`circuit_metrics`).

    Returns:
        DataFrame with columns ``node, gate, value, both, interaction, n_gate_edges,
        n_value_edges`` (metric units).
    """
    model = analysis_model(model)
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    graph = HeadGraph(
        model, neuron_level=neuron_level, nodes=nodes,
        positions=None if positions is None else positions.names,
    )  # fmt: skip
    targets: dict[str, dict[str, list[tuple[tuple[str, str], int]]]] = {}
    for src, dst in graph.blocks():
        if dst.kind != "neuron":
            continue
        m = mask[(src.key, dst.key)]
        for v in m.any(0).nonzero().flatten().tolist():
            entry = targets.setdefault(dst.labels[v], {"gate": [], "value": []})
            entry[dst.input].append(((src.key, dst.key), v))
    labels = list(targets) if neurons is None else list(neurons)

    def without(entry, *inputs: str) -> Mask:
        out = {k: m.clone() for k, m in mask.items()}
        for inp in inputs:
            for key, v in entry[inp]:
                out[key][:, v] = False
        return out

    masks = [mask]
    entries = []
    for label in labels:
        entry = targets.get(label, {"gate": [], "value": []})
        entries.append(entry)
        masks += [without(entry, "gate"), without(entry, "value"), without(entry, "gate", "value")]
    values = circuit_metrics(
        model, masks, clean_tokens, corrupted_tokens, metric, neuron_level=neuron_level,
        nodes=nodes, batch_size=batch_size, progress=progress, positions=positions,
        corrupted_runs=corrupted_runs,
    )  # fmt: skip
    m_full = values[0]
    rows = []
    for i, (label, entry) in enumerate(zip(labels, entries, strict=True)):
        no_gate, no_value, none = values[1 + 3 * i : 4 + 3 * i]
        gate, value, both = no_value - none, no_gate - none, m_full - none
        # no edge of a kind: removing "its" edges changes nothing, which measures nothing
        for kind in ("gate", "value"):
            if not entry[kind]:
                warnings.warn(
                    f"{label}: {kind} not measured: no {kind} edge kept in the circuit (NaN in "
                    f"the {kind} and interaction columns; 0 would read as a measured zero).",
                    stacklevel=2,
                )
        gate = gate if entry["gate"] else math.nan
        value = value if entry["value"] else math.nan
        rows.append(
            dict(
                node=label,
                gate=gate,
                value=value,
                both=both,
                interaction=both - gate - value,
                n_gate_edges=_n_edges(mask, entry["gate"]),
                n_value_edges=_n_edges(mask, entry["value"]),
            )
        )
    return pd.DataFrame(
        rows,
        columns=["node", "gate", "value", "both", "interaction", "n_gate_edges", "n_value_edges"],
    )


def _n_edges(mask: Mask, columns: list[tuple[tuple[str, str], int]]) -> int:
    """How many circuit edges reach the input columns ``(block key, column)`` (one entry per
    source group: a group of several kept sources counts each)."""
    return sum(int(mask[key][:, v].sum()) for key, v in columns)


def path_gate_value_split(
    model: ModelLike,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    senders: Sequence[str],
    neurons: Sequence[str],
    metric: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, float]:
    """Gate/value split of the paths ``senders -> neurons`` by exact path patching.

    With :func:`~tl_attnonly.analysis.path_patch` (clean senders into the corrupted run, effect
    measured against the corrupted run's metric):

    - ``gate``: only the neurons' queries (hence patterns) receive the paths;
    - ``value``: only their values do;
    - ``both``: both do;
    - ``interaction = both - gate - value``.

    On gated MLPs this patches the neuron-heads' ``q`` and ``v`` as path patching does: ``gate`` is
    the pattern alone and ``value`` the product ``(f_k g + e_k - g_k) u`` (its ``g`` factor
    included), not the ``g`` / ``u`` split of :func:`circuit_gate_value_split`.

    Args:
        senders: Head labels (``"L0H1"``, ``"L0N5"``, ``"L0N5.1"``).
        neurons: Receiving neurons (``"L1N3"``: all its heads) or neuron-heads (``"L1N3.2"``).
        metric: Logits -> scalar.

    Returns:
        ``{"gate", "value", "both", "interaction", "corrupted"}`` (metric units).
    """
    model = analysis_model(model)
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    from tl_attnonly.analysis.patching.paths import path_patch, path_patch_caches

    K = model.n_heads_per_neuron
    heads = []
    for label in neurons:
        if K > 1 and "." not in label:
            heads += [f"{label}.{k}" for k in range(K)]
        else:
            heads.append(label)
    if K > 1:
        senders = (
            [f"{s}.{k}" for s in senders for k in range(K)]
            if all("N" in s and "." not in s for s in senders)
            else list(senders)
        )
    caches = dict(
        zip(
            ("clean_cache", "corrupted_cache"),
            path_patch_caches(model, clean_tokens, corrupted_tokens),
            strict=True,
        )
    )
    with torch.no_grad():
        base = metric(model(corrupted_tokens)).item()
    out = {}
    for name, inputs in (("gate", "q"), ("value", "v"), ("both", "qv")):
        receivers = [f"{h}:{inputs}" for h in heads]
        out[name] = (
            path_patch(model, clean_tokens, corrupted_tokens, senders, receivers, metric, **caches)
            - base
        )
    out["interaction"] = out["both"] - out["gate"] - out["value"]
    out["corrupted"] = base
    return out


__all__ = [
    "Circuit",
    "CorruptedRuns",
    "KeptRun",
    "circuit_gate_value_split",
    "circuit_metric",
    "circuit_metrics",
    "faithfulness",
    "path_gate_value_split",
]
