"""Circuit discovery over the unified graph of attention heads and neuron-heads.

Edge attribution patching (EAP; Syed et al. 2023) on :class:`~.graph.HeadGraph`:
the score of an edge ``u -> v:input`` estimates how the metric changes when the corrupted run's
``input`` of ``v`` receives the clean change of ``u``'s output (``clean - corrupted``) through the
residual stream, to first order:

    ``score = (out_u(clean) - out_u(corrupted)) . d metric / d (v's residual input)``

with the gradient taken on the corrupted run. The reader's normalisation (LayerNorm, RMSNorm, with
or without weights) belongs to the reader and is linearised exactly (its Jacobian, in closed form),
so one forward and one backward pass per batch score every edge, including the separate ``gate``
and ``value`` inputs of every neuron-head, which share one residual input in the model.
``method="eap-ig"`` averages the gradients over ``ig_steps`` runs whose embeddings are interpolated
from the corrupted to the clean input (EAP-IG, Hanna et al. 2024).

Gated MLPs (SwiGLU, GeGLU, ReGLU): a neuron's ``gate`` input is its gate ``g = x W_gate``
(``hook_pre``; the query, hence the pattern, and the factor ``f_k g + e_k - g_k`` of the value) and
its ``value`` input the linear branch ``u = x W_in`` (``hook_pre_linear``); it writes
``act_K(g) * u``. Gradients are taken at those two hooks (the fused path keeps running).

Scores are exact where the path is linear: an edge into the logits (no final normalisation, a
metric linear in the logits), or into the value input of a last-layer neuron (plain: its pattern
is unchanged; gated: its output is linear in ``u``), whose output only reaches the logits.
Elsewhere they are estimates; check a circuit with
:func:`~tl_attnonly.analysis.discovery.runs.circuit_metric`, which is exact: the model runs on the
clean input, and every input of every node receives the corrupted residual stream plus the
current run's change of the sources joined to it by circuit edges:

    ``input_v = resid(corrupted) + sum_{u -> v in circuit} (out_u(current) - out_u(corrupted))``

So the full graph gives the clean run and the empty graph the corrupted run, exactly, and
``faithfulness = (metric(circuit) - metric(corrupted)) / (metric(clean) - metric(corrupted))`` is 1
and 0 for them.

The metric is ``metric(logits)`` or ``metric(logits, indices)`` (``indices``: the examples of the
batch, a LongTensor, for per-example answers), returning a scalar; the dataset's metric is the sum
over batches, so make it additive over examples (a sum, or a mean divided by the number of batches:
see :func:`logit_diff_metric`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Int
from tqdm.auto import tqdm

from tl_attnonly._types import tokens_on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.eap_blocks import block_scores, read_directions
from tl_attnonly.analysis.discovery.graph import HeadGraph, InputGroup, SourceGroup
from tl_attnonly.analysis.discovery.positions import PositionClasses

# pruning lives in .pruning; its public names stay importable from here too
from tl_attnonly.analysis.discovery.pruning import drop_dangling_edges, mask_size, prune
from tl_attnonly.analysis.discovery.scored_edges import EdgeScores
from tl_attnonly.analysis.discovery.sites import (
    BLOCK_BUDGET,
    DiscoveryMetric,
    batch_indices,
    call_metric,
    check_additive,
    check_discoverable,
    check_scoring_args,
    input_hook_name,
    input_site,
    logit_diff_metric,
    norm_linearisation,
    read_gradient,
    reader_matrix,
    source_hook_names,
    source_values,
    writer_matrix,
)
from tl_attnonly.analysis.task import DiscoveryTask

if TYPE_CHECKING:
    from tl_attnonly.protocol import AttnOnlyModel, ModelLike


def _written(a: torch.Tensor, U: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[u, B, d]``: what each of ``u`` sources writes at each row (``a [B, u, r] @ U[u]``),
    source-major; into ``out`` (a contiguous ``[u, B, d]``) if given."""
    dtype = torch.promote_types(a.dtype, torch.float32)
    return torch.bmm(a.transpose(0, 1).to(dtype), U.to(dtype), out=out)


# ---------------------------------------------------------------------------------------------
# edge attribution patching
# ---------------------------------------------------------------------------------------------


def edge_attribution_scores(
    model: ModelLike,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    metric: DiscoveryMetric,
    *,
    method: str = "eap",
    ig_steps: int = 5,
    neuron_level: bool = True,
    nodes: Collection[str] | None = None,
    batch_size: int | None = None,
    max_bytes: int = 2**30,
    block_bytes: int = BLOCK_BUDGET,
    progress: bool = True,
    positions: PositionClasses | None = None,
) -> EdgeScores:
    """Score every edge of the head graph by edge attribution patching.

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` or a ``TransformerBridge``
            converted with :func:`tl_attnonly.convert` (in place).
        clean_tokens, corrupted_tokens: ``[n_examples, pos]``, same shape.
        metric: ``metric(logits)`` or ``metric(logits, indices)`` -> scalar, additive over batches.
        method: ``"eap"`` (gradient on the corrupted run) or ``"eap-ig"`` (gradients averaged over
            ``ig_steps`` runs with embeddings ``corrupted + t (clean - corrupted)``,
            ``t = 1/ig_steps .. 1``).
        neuron_level: One node per neuron (default) or per neuron-head (``K > 1``).
        nodes: Score only the edges among these attention heads and neurons (and the embeddings
            and logits): a restricted :class:`HeadGraph`. Its scores equal the corresponding
            entries of the full graph's.
        batch_size: Examples per forward/backward pass; default all at once.
        max_bytes: Refuse when the score tensors alone would exceed this.
        block_bytes: Budget for the intermediates of one block (they are chunked to fit).
        progress: Show progress bars.
        positions: Resolve the edges by position class (:mod:`.positions`): each input's
            gradient is summed over the positions of its class only.

    Returns:
        :class:`EdgeScores`.
    """
    model = analysis_model(model)
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    check_scoring_args(model, clean_tokens, corrupted_tokens, method, ig_steps, neuron_level)
    if positions is not None:
        positions.check_tokens(clean_tokens)
    check_additive(model, clean_tokens, metric, batch_indices(clean_tokens.shape[0], batch_size))
    graph = HeadGraph(
        model, neuron_level=neuron_level, nodes=nodes,
        positions=None if positions is None else positions.names,
    )  # fmt: skip
    dtype = next(model.parameters()).dtype
    size = graph.n_edges() * torch.tensor([], dtype=dtype).element_size()
    if size > max_bytes:
        raise MemoryError(
            f"{graph.n_edges():,} edges need {size / 2**30:.2f} GiB of scores (budget "
            f"{max_bytes / 2**30:.2f} GiB). Score the edges among fewer nodes (nodes=[...], or "
            "discover_circuit(..., n_nodes=...), which picks them by node attribution), or "
            "raise max_bytes=...."
        )
    device = clean_tokens.device
    scores = {
        (s.key, d.key): torch.zeros(len(s.labels), len(d.labels), dtype=dtype, device=device)
        for s, d in graph.blocks()
    }
    metrics = [0.0, 0.0]
    task = DiscoveryTask(
        model, clean_tokens, corrupted_tokens, metric, positions=positions, batch_size=batch_size
    )
    terms = attribution_terms(task, graph, method, ig_steps, progress, metrics)
    # writing and reading matrices: weights, the same for every batch and step
    writers: dict[str, torch.Tensor] = {}
    readers: dict[str, torch.Tensor] = {}
    # narrow groups (embeddings, a layer's attention heads, an MLP remainder, a restricted
    # graph's few named neurons: _narrow; sources in residual order, so those a reader reads are
    # a prefix): each row's written residual vectors once, in one source-major matrix, read by
    # each narrow input group in one product (not once per block). The
    # score is linear in what an input reads back into the residual stream (``H``,
    # :func:`~.eap_blocks.read_directions`), and the sources' changes are the same at every
    # interpolation step of a batch: ``H`` is summed over the steps and read by the changes once
    # per batch (up to ``4 * block_bytes`` of ``H`` kept; an input beyond it, and every input of
    # a method with one step, is scored at every step).
    narrow = [s for s in graph.sources if s.labels and _narrow(model, s)]
    ends = {s.key: sum(len(t.labels) for t in narrow[: i + 1]) for i, s in enumerate(narrow)}
    narrow_inputs = [d for d in graph.inputs if d.labels and _narrow(model, d)]
    narrow_sources, narrow_readers = {s.key for s in narrow}, {d.key for d in narrow_inputs}
    summed: dict[str, torch.Tensor] = {}  # input key -> sum over the batch's steps of H * weight

    def score_narrow(deltas, directions: dict[str, torch.Tensor], reads) -> None:
        """Add ``W . H`` of each narrow input (``directions``: its ``H``, weight included)."""
        if not directions:
            return
        with torch.no_grad():
            for src in narrow:
                if src.key not in writers:
                    writers[src.key] = writer_matrix(model, src, graph, deltas[src.key])
            # source-major [u, rows, d]: the sources a reader reads are a contiguous prefix,
            # read by one matrix product without a copy
            like = deltas[narrow[0].key]
            W = torch.empty(
                ends[narrow[-1].key], like.shape[0], model.cfg.d_model,
                dtype=torch.promote_types(like.dtype, torch.float32), device=like.device,
            )  # fmt: skip
            start = 0
            for src in narrow:  # written in place: no second copy of the rows
                _written(deltas[src.key], writers[src.key], out=W[start : ends[src.key]])
                start = ends[src.key]
            W, spans = _rows_by_class(W, graph, reads)
            for dst in narrow_inputs:
                if dst.key not in directions:
                    continue
                before = [s for s in narrow if s.order < dst.order]
                n = ends[before[-1].key]
                Wd = W[:n] if dst.position is None else W[:n, spans[dst.position]]
                H = directions[dst.key]  # [rows, v, d]
                block = Wd.flatten(1) @ H.transpose(0, 1).flatten(1).T  # [u, v]
                start = 0
                for src in before:
                    stop = start + len(src.labels)
                    scores[(src.key, dst.key)] += block[start:stop].to(dtype)
                    start = stop

    for deltas, reads, weight, batch_done in terms:
        with torch.no_grad():
            kept = sum(t.numel() * t.element_size() for t in summed.values())
            now: dict[str, torch.Tensor] = {}  # beyond the budget: scored at this step
            for dst in narrow_inputs:
                if not any(s.order < dst.order for s in narrow):
                    continue
                g, lin = reads[dst.key][:2]
                if dst.key not in readers:
                    readers[dst.key] = reader_matrix(model, dst, graph, g)
                H = read_directions(g, readers[dst.key], lin) * weight
                if dst.key in summed:
                    summed[dst.key] += H
                elif weight < 1 and kept + H.numel() * H.element_size() <= 4 * block_bytes:
                    summed[dst.key] = H
                    kept += H.numel() * H.element_size()
                else:
                    now[dst.key] = H
            if now:
                score_narrow(deltas, now, reads)
        for src, dst in graph.blocks():
            if src.key in narrow_sources and dst.key in narrow_readers:
                continue  # scored above
            g, lin, *class_rows = reads[dst.key]
            if dst.key not in readers:
                readers[dst.key] = reader_matrix(model, dst, graph, g)
            if src.key not in writers:
                writers[src.key] = writer_matrix(model, src, graph, g)
            delta = deltas[src.key][class_rows[0]] if class_rows else deltas[src.key]
            with torch.no_grad():
                block = block_scores(delta, writers[src.key], g, readers[dst.key], lin, block_bytes)
            scores[(src.key, dst.key)] += block.to(dtype) * weight
        if batch_done:  # the batch's summed directions, read by its changes once
            score_narrow(deltas, summed, reads)
            summed = {}
    return EdgeScores(graph, scores, metrics[0], metrics[1], method)


def _narrow(model: AttnOnlyModel, group: SourceGroup | InputGroup) -> bool:
    """Whether a group is scored with the narrow ones (each row's written or read residual
    vectors, every group at once): all but neuron groups, and neuron groups of a restricted
    graph with at most as many neurons as a layer has attention heads (named neurons: no wider
    than a layer's heads, which always are)."""
    return group.kind != "neuron" or len(group.labels) <= model.cfg.n_heads


def _rows_by_class(W: torch.Tensor, graph: HeadGraph, reads) -> tuple[torch.Tensor, dict]:
    """``W [u, rows, d]`` with its rows grouped by position class (one copy), and each class's
    slice of it; unchanged without classes."""
    if graph.positions is None:
        return W, {}
    rows = {}
    for dst in graph.inputs:
        if dst.position is not None and dst.labels and dst.position not in rows:
            rows[dst.position] = reads[dst.key][2]
    spans, start = {}, 0
    for name, where in rows.items():
        spans[name] = slice(start, start + len(where))
        start += len(where)
    return W[:, torch.cat(list(rows.values()))], spans


#: What :func:`attribution_terms` yields per batch and interpolation step: every source group's
#: change ``[rows, n, r]`` (the same at every step of a batch), every input group's read gradient
#: ``[rows, n, s]`` with its normalisation linearised at each row (an input of a position class:
#: those of its class's rows, and the rows), the weight of the step (``1 / ig_steps``), and
#: whether it is the batch's last step.
Terms = tuple[dict[str, torch.Tensor], dict[str, tuple[Any, ...]], float, bool]


def attribution_terms(
    task: DiscoveryTask,
    graph: HeadGraph,
    method: str,
    ig_steps: int,
    progress: bool,
    metrics: list[float],
) -> Iterator[Terms]:
    """The per-row terms of the EAP scores of the task's model, prompts and metric, batch by
    batch (the task's ``batch_size``; ``rows = batch * pos``).

    Adds each batch's clean and corrupted metric to ``metrics[0]`` and ``metrics[1]``. An input
    group of a position class (``graph.positions``) reads the gradient at its class's rows only:
    its read is ``(g, lin, rows)``, restricted to the rows (indices into ``batch * pos``) of its
    class, the only rows where its score has terms.
    """
    model, metric, positions = task.model, task.metric, task.positions
    clean_tokens, corrupted_tokens = task.clean, task.corrupted
    source_names = source_hook_names(model, graph)
    input_names = sorted({input_hook_name(d, graph) for d in graph.inputs})
    site_names = sorted({input_site(model, d)[1] for d in graph.inputs})
    alphas = [1.0 * k / ig_steps for k in range(1, ig_steps + 1)] if method == "eap-ig" else [0.0]
    batches = task.batches()
    bar = tqdm(total=len(batches) * len(alphas), desc="edge attribution", disable=not progress)
    for idx in batches:
        clean, corrupted = clean_tokens[idx], corrupted_tokens[idx]
        with torch.no_grad():
            logits, clean_cache = model.run_with_cache(
                clean, names_filter=lambda n: n in source_names
            )
            metrics[0] += call_metric(metric, logits, idx).item()
            logits, corr_cache = model.run_with_cache(
                corrupted, names_filter=lambda n: n in source_names
            )
            metrics[1] += call_metric(metric, logits, idx).item()
        clean_cache, corr_cache = dict(clean_cache.cache_dict), dict(corr_cache.cache_dict)
        deltas = {
            s.key: (
                source_values(clean_cache, s, graph, model)
                - source_values(corr_cache, s, graph, model)
            ).flatten(0, 1)
            for s in graph.sources
            if s.labels
        }
        for step, alpha in enumerate(alphas):
            grads, sites = _gradient_pass(
                task, corrupted, idx, input_names, site_names, clean_cache, corr_cache, alpha
            )
            reads: dict[str, tuple[Any, ...]] = {}
            for dst in graph.inputs:
                if not dst.labels:
                    continue
                module, site_name = input_site(model, dst)
                lin = norm_linearisation(module, sites[site_name].flatten(0, 1))
                g = read_gradient(model, dst, graph, grads[input_hook_name(dst, graph)])
                g = g.flatten(0, 1)
                if dst.position is not None and positions is not None:
                    rows = positions.mask(dst.position, idx, g.device).flatten().nonzero()[:, 0]
                    lin = None if lin is None else (lin[0][rows], lin[1][rows], *lin[2:])
                    reads[dst.key] = (g[rows], lin, rows)
                    continue
                reads[dst.key] = (g, lin)
            yield deltas, reads, 1.0 / len(alphas), step == len(alphas) - 1
            bar.update()
    bar.close()


def _gradient_pass(
    task: DiscoveryTask,
    tokens,
    idx,
    input_names,
    site_names,
    clean_cache,
    corr_cache,
    alpha,
):
    """One forward and backward pass of the task's model on ``tokens`` (the batch ``idx`` of
    its corrupted tokens): gradients of its metric at every input hook, residual at every site."""
    model, metric = task.model, task.metric
    acts: dict[str, torch.Tensor] = {}
    sites: dict[str, torch.Tensor] = {}

    def embed(act, hook):
        if alpha:
            act = corr_cache[hook.name] + alpha * (clean_cache[hook.name] - corr_cache[hook.name])
        return act.detach().requires_grad_(True) if not act.requires_grad else act

    def keep(act, hook):
        acts[hook.name] = act
        return act

    def site(act, hook):
        sites[hook.name] = act.detach()
        return act

    hooks: list[tuple[str | Callable[..., Any], Callable[..., Any]]] = [
        (name, embed) for name in model.embed_hooks
    ]
    hooks += [(name, site) for name in site_names if name not in input_names]
    hooks += [(name, keep) for name in input_names]
    with torch.enable_grad():
        logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
        value = call_metric(metric, logits, idx)
        names = list(acts)
        grads = torch.autograd.grad(value, [acts[n] for n in names], allow_unused=True)
    out = {}
    for name, grad in zip(names, grads, strict=True):
        out[name] = (grad if grad is not None else torch.zeros_like(acts[name])).detach()
        if name in site_names:
            sites[name] = acts[name].detach()
    return out, sites


__all__ = [
    "EdgeScores",
    "check_discoverable",
    "logit_diff_metric",
    "drop_dangling_edges",
    "edge_attribution_scores",
    "mask_size",
    "prune",
]
