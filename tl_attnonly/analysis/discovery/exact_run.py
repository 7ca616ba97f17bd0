"""One circuit's exact run (:func:`circuit_run`): the hooks that rebuild each input of the graph.

What an exact run is: :mod:`.runs`. A run records each source's activation; at each input group
of the graph, its hook gives every reader the corrupted run's input where no circuit edge reaches
it, the current run's where every edge does, and otherwise rebuilds it from its residual input
(the corrupted residual stream plus the changes of the sources its edges join: the merged rows of
:mod:`.run_plan`) and recomputes what the reader computes from it (:func:`_recompute`: a head's
``q``/``k``/``v``, a neuron-head's query and value, a gated neuron's ``g`` or ``u``).

The calls that make the runs, batch by batch: :mod:`.run_metrics`; what a run takes from another
run of its call or from a kept run: :mod:`.run_reuse`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tl_attnonly.analysis.discovery.expert_kept import KeptKey, expert_kept_counts
from tl_attnonly.analysis.discovery.expert_nodes import expert_source_hooks
from tl_attnonly.analysis.discovery.graph import (
    EXPERTS,
    LATENT_ATTN,
    LOGITS,
    MLP_REST,
    HeadGraph,
    InputGroup,
    SourceGroup,
)
from tl_attnonly.analysis.discovery.run_plan import CircuitPlan, PlanRun, RunCall, source_kept
from tl_attnonly.analysis.discovery.run_reuse import FirstRun, fires_before
from tl_attnonly.analysis.discovery.sites import (
    Mask,
    input_hook_name,
    input_site,
    neuron_head_coef,
    neuron_read_matrix,
    qkv_weights,
    source_hook_names,
)
from tl_attnonly.hooks import block_act_name

if TYPE_CHECKING:
    from tl_attnonly.protocol import AttnOnlyModel


def _recorded_names(model: AttnOnlyModel, graph: HeadGraph) -> list[str]:
    """The hooks a run records: the sources' and each block's MLP output (the change of a
    merged row holding a whole layer: :class:`~.run_plan.CircuitPlan`'s ``whole``), and the
    neurons of the experts of a layer named by its experts (an expert passing on some
    neurons' changes: :mod:`.expert_kept`)."""
    mlp_out = [block_act_name("mlp_out", li) for li in range(graph.n_layers)]
    names = source_hook_names(model, graph) + mlp_out
    for li in sorted(graph.split_experts):
        names += [n for n in expert_source_hooks(model, li, neurons=True) if n not in names]
    return names


def corrupted_names(model: AttnOnlyModel, graph: HeadGraph) -> list[str]:
    """The hooks a run reads from the corrupted run: those it records, and each input group's
    hook and the residual input it is rebuilt from."""
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
    layer_weights: dict | None = None,
):
    """What input group ``dst`` of ``nodes`` computes from residual inputs ``x [b, p, m, d]``
    (or, with ``which [m]``, from the distinct inputs ``x [b, p, n_distinct, d]``, reader ``i``
    reading ``x[:, :, which[i]]``: each distinct input is normalised once).

    ``memo``: a dict in which the readers' weights are kept per input group and node set (the
    same in every run of one call: :class:`FirstRun`'s memo), instead of gathered per call.
    ``layer_weights``: a dict in which each layer's input weights are kept whole (a search's:
    :class:`~.run_plan.RunCall`'s ``weights``), instead of read from the model per call.

    Returns ``[b, p, m, d_head]`` (attention), the neuron-heads' ``q``/``v`` ``[b, p, m', 1]``
    together with the head indices ``m'`` they go to, or, for gated MLPs, the gates ``g`` or
    linear branches ``u`` of the neurons, ``[b, p, m]`` (``hook_pre`` / ``hook_pre_linear``).
    """
    module, _ = input_site(model, dst)
    normalised = module(x) if module is not None else x
    weights = _reader_weights(model, dst, graph, nodes, memo, layer_weights)
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
    layer_weights: dict | None = None,
) -> tuple[torch.Tensor, ...]:
    """The weights ``nodes`` of ``dst`` read with: ``(W [m, d, d_head], b [m, d_head])``
    (attention), ``(W [d, m],)`` (gated MLPs) or ``(W_in [d, m], b_in [m])`` (neuron-heads),
    gathered once per ``(dst, nodes)`` where a ``memo`` keeps them, from each layer input's
    whole weights read once where ``layer_weights`` keeps them."""
    key = ("read", dst.key, nodes.cpu().numpy().tobytes())
    if memo is not None and key in memo:
        return memo[key]
    whole = {} if layer_weights is None else layer_weights
    if dst.kind == "attn":
        qkv = ("qkv", dst.layer, dst.input)
        if qkv not in whole:
            whole[qkv] = qkv_weights(model.blocks[dst.layer].attn, dst.input)
        W, b = whole[qkv]
        weights: tuple[torch.Tensor, ...] = (W[nodes], b[nodes])
    elif graph.gated:
        read = ("mlp read", dst.layer, dst.input)
        if read not in whole:
            whole[read] = neuron_read_matrix(model, dst, graph)
        weights = (whole[read][:, nodes],)
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


@dataclass
class BatchRun:
    """What the circuit runs of one batch of a :func:`~.run_metrics.circuit_metrics` call share.

    Attributes:
        tokens: The batch's clean tokens.
        corr: The corrupted run's activations (:func:`corrupted_names`).
        where: Position class -> ``[batch, pos]`` bool (a graph resolved by position), or None.
        reads: The one logit position per row a run from a block computes (the metric's
            :func:`~.sites.logit_positions`), or None.
        first: The batch's :class:`~.run_reuse.FirstRun` (or a kept run's), or None.
        observe: More ``(hook name, hook)`` pairs added to each run (after its own), e.g. to
            read what it routed (:func:`~.circuit_routing.circuit_experts_used`).
    """

    tokens: torch.Tensor
    corr: dict[str, torch.Tensor]
    where: dict[str, torch.Tensor] | None = None
    reads: torch.Tensor | None = None
    first: FirstRun | None = None
    observe: Sequence[tuple[str, Callable[..., Any]]] = ()


def circuit_run(
    call: RunCall,
    batch: BatchRun,
    mask: Mask,
    plan: CircuitPlan | None = None,
    *,
    keep: bool = False,
    shared: Collection[str] = (),
    start: int = 0,
    kept: Mapping[KeptKey, torch.Tensor] | None = None,
):
    """The circuit's logits (``kept``: :func:`~.run_metrics.circuit_metrics`' ``kept_neurons``
    entry) on the call's model and graph (``call``) for one batch (``batch``); ``batch.where``:
    position class -> ``[batch, pos]`` bool (a graph resolved by position: each class's hook
    changes its own positions only). A run from a block computes only the logits at
    ``batch.reads`` (one position per row, the metric's :func:`logit_positions`; the others NaN)
    where the model's runner can.

    ``batch.first``: the call's :class:`FirstRun`. With ``keep`` (the first run) it receives what
    the later runs reuse; else the input groups ``shared`` (:func:`~.run_reuse.shared_prefix`)
    take their hook outputs from it instead of being rebuilt, the changes of the merged rows
    ``plan`` took from the first run's plan are copied from it, and with ``start > 0`` the run
    starts at block ``start`` from the first run's residual stream there."""
    model, graph, block_bytes = call.model, call.graph, call.block_bytes
    tokens, corr, where, reads, first = (
        batch.tokens, batch.corr, batch.where, batch.reads, batch.first
    )  # fmt: skip
    current: dict[str, torch.Tensor] = {}
    if start:
        assert first is not None and first.runner is not None
        current.update({k: v for k, v in first.sources.items() if fires_before(k, start)})
    reuse: dict[str, torch.Tensor] = {}
    if first is not None and not keep:
        reuse = {key: first.outputs[key] for key in shared if key in first.outputs}
    # each merged source row's change once per run, inputs shared by readers with equal edges
    is_reference = keep and first is not None and first.keep_changes
    run = PlanRun(
        call, plan or CircuitPlan(graph, mask), current, corr,
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
    # changes each row passes on, in halves (an MLP remainder: twice its kept neurons; a named
    # neuron: 0 or 2; an expert passing on some neurons' changes: 1)
    kept_counts = {
        src.key: 2 * _kept_count(src, kept[src.layer])
        for src in graph.sources
        if kept and src.labels and src.layer in kept and src.kind in ("neuron", MLP_REST)
    }
    for src in graph.sources if kept else ():
        halves = expert_kept_counts(graph, src, kept) if kept and src.labels else None
        if halves is not None:
            kept_counts[src.key] = halves

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

    def edges_into(dst: InputGroup) -> torch.Tensor:
        """``[rows of the sources below dst, readers]``: the mask's edges into ``dst``."""
        srcs = fixed(dst)[0]
        if not srcs:
            return torch.zeros(0, len(dst.labels), dtype=torch.bool)
        return torch.cat([mask[(src.key, dst.key)] for src in srcs], 0).cpu()

    def selection(dst: InputGroup):
        """None where every reader of ``dst`` has every edge (the current run's input), else
        ``(none, mixed)``: the readers (full indices) whose input is the corrupted run's, and
        the readers (columns of the masks) whose input is rebuilt."""
        srcs, covers, n_possible, index, ours, position, _, _ = fixed(dst)
        if kept:  # a layer passing on some neurons' changes counts only those (in halves)
            covers, n_possible = _kept_covers(srcs, 2 * covers, kept_counts), 2 * n_possible
        included = torch.zeros(dst.size, dtype=torch.long)
        if srcs:
            included[index] += covers @ edges_into(dst).long()
        if bool((included == n_possible)[ours].all()):
            return None  # the full set of edges: the current run's input
        none = ((included == 0) & ours).nonzero().flatten()  # full indices: corrupted input
        # restricted indices (columns of the masks) of the readers whose input is rebuilt
        mixed = position[((included > 0) & (included < n_possible) & ours).nonzero().flatten()]
        return none, mixed.unique()  # an MLP remainder: one column (0) for all its neurons

    def patch_for(dst: InputGroup):
        chosen = selection(dst)
        if chosen is None:
            return None  # the full set of edges: the current run's input
        none, mixed = chosen
        _, _, _, index, _, _, site_name, hook_name = fixed(dst)
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
            if dst.kind in (LOGITS, EXPERTS, LATENT_ATTN):  # one reader of the residual stream
                if len(mixed) == 0:
                    return corr[hook_name].clone()
                x = run.inputs(dst, site_name, mixed)[:, :, 0]
                norm = input_site(model, dst)[0]  # experts and latent attention: normalised
                return (x if norm is None else norm(x)).to(act.dtype)
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
                    model,
                    dst,
                    graph,
                    x.to(act.dtype),
                    full,
                    None if rest else which,
                    memo,
                    call.weights,
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
        if not start or not fires_before(name, start)  # below: the first run's
    ]
    # whole MLP layers whose first input (gate) is rebuilt: patched before the projections
    skip: set[str] = set()
    for layer, (gate, value, patch_site) in _whole_mlp_inputs(model, graph, memo).items():
        if layer < start:
            continue
        chosen = selection(gate)
        if chosen is None or len(chosen[1]) == 0 or selection(value) is None:
            continue  # as any input group (the value's current input is the model's own)
        name, value_of = patch_site
        hook = _normalised_input(run, gate, value_of, fixed(gate)[6])
        hooks.append((name, reused(gate.key, hook)))
        skip.add(gate.key)
        if torch.equal(edges_into(gate), edges_into(value)):
            skip.add(value.key)  # the same edges: the same input
    for dst in graph.inputs:
        if dst.layer < start or dst.key in skip:  # below the run's first block: the first
            continue  # run's; a whole MLP layer's gate (and a value like it): normalised above
        patch = patch_for(dst)
        if patch is not None:
            hooks.append((patch[0], reused(dst.key, patch[1])))
    hooks += batch.observe
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


def _whole_mlp_inputs(
    model: AttnOnlyModel, graph: HeadGraph, memo: dict
) -> dict[int, tuple[InputGroup, InputGroup, tuple[str, Callable]]]:
    """Layers whose two MLP inputs (``gate``, ``value``) are each one reader of every neuron
    (an MLP node of the whole layer: its remainder holds them all), at every position, whose
    normalised input a hook holds (:meth:`~tl_attnonly.protocol.AttnOnlyModel.mlp_input_hook`):
    layer -> ``(gate, value, (hook name, value of a residual input))``. A run whose circuit
    rebuilds such a layer's gate input patches that hook with it (:func:`_normalised_input`),
    so the model projects the gate once (instead of projecting the residual input and then the
    rebuilt one); the value is patched after its projection as any input (or not at all where
    its edges are the gate's). The same for every mask of a call (kept in the memo)."""
    key = ("whole mlp inputs",)
    if key not in memo:
        groups: dict[int, dict[str, InputGroup]] = {}
        others: set[int] = set()
        for dst in graph.inputs:
            if dst.kind == MLP_REST and dst.position is None and len(dst.index) == dst.size:
                groups.setdefault(dst.layer, {})[dst.input] = dst
            elif dst.kind in ("neuron", MLP_REST) and dst.labels:
                others.add(dst.layer)
        found = {}
        for layer, pair in groups.items():
            site = model.mlp_input_hook(layer) if layer not in others else None
            if site is not None and set(pair) == {"gate", "value"}:
                found[layer] = (pair["gate"], pair["value"], site)
        memo[key] = found
    return memo[key]


def _normalised_input(
    run: PlanRun,
    dst: InputGroup,
    value_of: Callable[[torch.Tensor], torch.Tensor],
    site_name: str,
):
    """The hook of a whole MLP layer's normalised input (:func:`_whole_mlp_inputs`): its value
    (``value_of``) at the corrupted residual input plus the changes of ``dst``'s edges."""
    column = torch.zeros(1, dtype=torch.long)

    def hook(act, hook):
        return value_of(run.inputs(dst, site_name, column)[:, :, 0]).to(act.dtype)

    return hook


def _kept_count(src: SourceGroup, kept: torch.Tensor) -> torch.Tensor:
    """Per row of a neuron source group, the nodes whose change it passes on given the layer's
    ``kept`` neurons (``bool [d_mlp]``): an MLP remainder its kept neurons, a named neuron 1 if
    kept."""
    mine = source_kept(src, kept.cpu()).long()
    return mine.sum().reshape(1) if src.kind == MLP_REST else mine


def _kept_covers(
    srcs: list[SourceGroup], covers: torch.Tensor, counts: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """``covers`` (per source row of ``srcs``: the model's nodes whose change it passes on, in
    halves) with the groups of ``counts`` counting what they pass on only (their kept neurons,
    :func:`_kept_count`; an expert passing on some neurons' changes half a node,
    :func:`~.expert_kept.expert_kept_counts`): a reader joined to every source then has its
    input rebuilt (not the current run's) where a layer passes on less than its whole change."""
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


__all__ = ["BatchRun", "circuit_run", "corrupted_names"]
