"""Find a circuit in one call: score edges, sweep sizes by exact runs, name neurons, show evidence.

:func:`discover_circuit` with its defaults (:class:`~.options.DiscoveryOptions`) works coarse to
fine:

1. **Coarse graph.** Every attention head (its ``q``, ``k`` and ``v`` inputs apart), every MLP
   layer as one node ``L{l}MLP`` (a restricted :class:`~.graph.HeadGraph` holding no neuron and
   every layer's remainder), the embeddings and the logits. Edges are scored by EAP-IG and ranked
   by their signed effect toward the clean run (``ranking="signed"``; edges that work against the
   behaviour come last, and ``Circuit.opposing()`` lists the largest of them; ``"absolute"``
   ranks by ``|score|``).
2. **Sweep.** Exact circuit runs (:func:`~.runs.circuit_metrics`) of the top ``n`` edges for
   geometric ``n`` (64, 128, ...; small graphs from 1/64 of their edges) until one reaches the
   faithfulness ``target`` (default 0.8), then bisection between the largest size below the
   target and the smallest above it: the smallest size run that reaches the target.
2b. **Pruning** (``prune_runs``, default 30 exact runs; :mod:`.refine`). That circuit's edges
   are removed in chunks, lowest rank first, each removal kept only if the exact faithfulness
   stays at the target. The circuit returned is the last one kept; its faithfulness is its exact
   run's, and ``circuit.extra["swept"]`` / ``["pruning"]`` hold the sweep's circuit and every
   pruning run.
3. **Neurons.** Inside each MLP node of that circuit, the ``neurons_per_mlp`` neurons with the
   largest node attribution ``|score|`` (or RelP relevance, or the score along the node's circuit
   edges: ``neuron_ranking="relp"``, ``"circuit"``) are named:
   the graph is rebuilt with them as nodes (the rest of the layer stays one node ``L{l}MLP``), and
   every coarse edge into or out of ``L{l}MLP`` becomes the same edge into or out of each named
   neuron and the remainder. That circuit computes exactly what the coarse one does (the layer's
   output is the sum of its neurons'), so its faithfulness is the coarse circuit's; the edges are
   scored again (``neuron_method``, plain EAP by default: one gradient pass; the named neurons' gate
   and value edges apart) and the gate/value split (:func:`~.runs.circuit_gate_value_split`) is run
   for the named neurons.
   With ``neurons_per_mlp="auto"`` the counts are chosen by exact runs instead
   (:mod:`.neuron_stage`; ``neuron_search="joint"``, default: all layers together): as few as
   keep the faithfulness at the target with the rest of their layers cut, a remainder kept (its
   share stated) only where the ``max_neurons_per_mlp`` candidates of its layer cannot replace
   it.
4. **What the names carry.** For each MLP node, ``Circuit.mlp_split``: the exact effect
   (faithfulness units) of removing the named neurons' outgoing edges, the remainder's, and both
   (run on the coarse graph, each MLP node passing on the changes of the neurons whose edges
   are kept: :func:`~.runs.circuit_metrics`' ``kept_neurons``).

Why coarse first: under a corruption that changes the tokens (IOI's ABC names), the token's change
enters through the embeddings and the first MLP layers and reaches every later node; a graph of a
few hundred selected neurons freezes every other neuron to the corrupted run, and its full graph
(the ceiling) may recover little. A whole MLP layer as one node loses nothing of that.

**Resolved by position** (``positions=``, :mod:`.positions`): every input of the graph is split
by position class (for IOI ``data.position_classes()``: the IO, S1, S1+1, S2 and END positions and
the rest), so an identity path such as ``embed -> L0MLP`` can be kept at the name positions
without keeping it everywhere. The full graph is still the clean run, so the ceiling is 1.

**Evidence.** Every :class:`~.runs.Circuit` carries its ceiling (faithfulness of the graph's every
edge), the faithfulness-vs-size curve, a node-patching baseline (the clean outputs of the
circuit's nodes patched into the corrupted run, every other node recomputed:
:func:`node_patching_metric`), the clean and corrupted metrics, and warnings: a ceiling below the
target, a curve that falls as edges are added, a gate/value row with no edge of that kind.

**Neuron graphs** (``graph="neurons"``; the earlier single stage, kept): at neuron level the full
graph of a GPT-2-small-sized model has ~1.3e9 edges (SmolLM2-135M: ~2.1e9). With ``n_nodes=N``,
:func:`top_nodes` first keeps the ``N`` attention heads and neurons with the largest node
attribution ``|score|``; edges are then scored among them. Every left-out node reads the corrupted
run, so check ``Circuit.ceiling``.
"""

from __future__ import annotations

import re
import time
import warnings
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from jaxtyping import Int
from tqdm.auto import tqdm

from tl_attnonly._types import tokens_on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.circuit_neurons import circuit_neuron_scores
from tl_attnonly.analysis.discovery.edge_scores import (
    edge_attribution_scores,
    mask_size,
)
from tl_attnonly.analysis.discovery.graph import EMBED, MLP_REST, HeadGraph, mlp_rest_label
from tl_attnonly.analysis.discovery.neuron_stage import (
    NeuronStage,
    kept_key,
    neuron_mask,
    resolve_neurons,
    resolve_neurons_jointly,
)
from tl_attnonly.analysis.discovery.options import DiscoveryOptions, resolve_options
from tl_attnonly.analysis.discovery.positions import PositionClasses
from tl_attnonly.analysis.discovery.pruning import prune_ranked
from tl_attnonly.analysis.discovery.refine import prune_by_runs
from tl_attnonly.analysis.discovery.relevance import check_relevance, neuron_relevance
from tl_attnonly.analysis.discovery.runs import (
    Circuit,
    CorruptedRuns,
    circuit_gate_value_split,
    circuit_metrics,
    faithfulness,
)
from tl_attnonly.analysis.discovery.sites import (
    DiscoveryMetric,
    Mask,
    batch_indices,
    call_metric,
    check_additive,
    check_discoverable,
)
from tl_attnonly.analysis.discovery.sweep import FIRST_SIZE as FIRST_SIZE
from tl_attnonly.analysis.discovery.sweep import MONOTONE_TOLERANCE as MONOTONE_TOLERANCE
from tl_attnonly.analysis.discovery.sweep import sweep_to_target
from tl_attnonly.hooks import attn_head_label, head_act_name, neuron_act_name

if TYPE_CHECKING:
    from tl_attnonly.protocol import AttnOnlyModel, ModelLike


#: A circuit whose faithfulness exceeds ``1 + OVERSHOOT`` is warned about (it overshoots).
OVERSHOOT = 0.2


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
        model: An :class:`~tl_attnonly.AttnOnlyTransformer`.
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


def coarse_nodes(model: ModelLike) -> list[str]:
    """The coarse graph's nodes: every attention head and every MLP layer as one node."""
    model = analysis_model(model)
    cfg = model.cfg
    heads = [attn_head_label(li, h) for li in range(cfg.n_layers) for h in range(cfg.n_heads)]
    return heads + [mlp_rest_label(li) for li in range(cfg.n_layers)]


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
            neuron of the layer); ``"embed"`` patches the token and position embeddings.
            :func:`discover_circuit` gives the circuit's sources (a neuron-head's whole neuron at
            neuron-head level).
        Others: As in :func:`~tl_attnonly.analysis.circuit_metric`.

    Returns:
        The metric summed over batches.
    """
    model = analysis_model(model)
    heads: dict[int, list[int]] = {}
    neurons: dict[int, list[int] | None] = {}
    embed = False
    for label in nodes:
        if label == EMBED:
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
                f"node_patching_metric patches heads 'L0H1', neurons 'L0N5', MLP layers 'L0MLP' "
                f"and 'embed'; got {label!r}."
            )
    names: dict[str, list[int] | None] = {}
    if embed:
        names["hook_embed"] = None
        if model.cfg.positional_embedding_type == "standard":
            names["hook_pos_embed"] = None
    for li, hs in heads.items():
        names[head_act_name("z", li, "attn")] = hs
    for li, idx in neurons.items():
        names[neuron_act_name("post", li)] = idx
    total = 0.0
    for rows in batch_indices(clean_tokens.shape[0], batch_size):
        with torch.no_grad():
            _, cache = model.run_with_cache(clean_tokens[rows], names_filter=lambda n: n in names)

            def patch(act, hook, cache=cache):
                which = names[hook.name]
                act = act.clone()
                if which is None:
                    return cache[hook.name].to(act.dtype)
                act[:, :, which] = cache[hook.name][:, :, which].to(act.dtype)
                return act

            logits = model.run_with_hooks(
                corrupted_tokens[rows], fwd_hooks=[(n, patch) for n in names]
            )
            total += call_metric(metric, logits, rows).item()
    return total


def _weighted_by_batch(metric: DiscoveryMetric, n_examples: int) -> DiscoveryMetric:
    """A per-batch mean turned additive: each batch's value times its share of the examples."""

    def additive(logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return call_metric(metric, logits, indices) * (len(indices) / n_examples)

    if hasattr(metric, "logit_positions"):  # the same logits read
        additive.logit_positions = metric.logit_positions  # type: ignore[attr-defined]
    return additive


def _coarse_key(key: str) -> str:
    """The coarse group key of a fine group key (a layer's neurons belong to its MLP node)."""
    return "mlp." + key.split(".", 1)[1] if key.startswith("neuron.") else key


def expand_mask(coarse: HeadGraph, mask: Mask, fine: HeadGraph) -> Mask:
    """A coarse circuit on a finer graph: each edge into or out of ``L{l}MLP`` goes into or out of
    each of the layer's named neurons and its remainder (the same circuit, computed exactly)."""

    def rows_of(fine_group, coarse_group) -> list[int]:
        if coarse_group.kind == MLP_REST:
            return [0] * len(fine_group.labels)
        where = {label: i for i, label in enumerate(coarse_group.labels)}
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


def _without_sources(mask: Mask, keys: set[str]) -> Mask:
    return {k: (torch.zeros_like(m) if k[0] in keys else m) for k, m in mask.items()}


def discover_circuit(
    model: ModelLike,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    metric: DiscoveryMetric,
    options: DiscoveryOptions | None = None,
    *,
    positions: PositionClasses | None = None,
    **overrides: Any,
) -> Circuit:
    """Find the smallest circuit reaching a faithfulness target, with its evidence.

    Coarse to fine by default (module docstring): attention heads and whole MLP layers scored by
    EAP-IG and ranked by signed effect, the smallest top-``n`` circuit reaching ``target`` found
    by exact runs and pruned by more exact runs, then the circuit's MLP layers split into named
    neurons (gate and value apart) and their remainder.

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer`.
        clean_tokens, corrupted_tokens: ``[n_examples, pos]``, same shape.
        metric: ``metric(logits)`` or ``metric(logits, indices)`` -> scalar, additive over
            examples (``metric_reduction="sum"``, checked when there are several batches) or a
            per-batch mean (``metric_reduction="mean"``).
        options: A :class:`~.options.DiscoveryOptions` (default: its defaults).
        positions: Resolve the graph's edges by position class (:mod:`.positions`; for IOI
            ``data.position_classes()``): every input is split per class, so an edge such as
            ``embed -> L0MLP:value@s2`` is kept at the S2 positions without keeping it at the
            others. Default: edges cover every position.
        **overrides: Fields of :class:`~.options.DiscoveryOptions` given one by one (they win),
            e.g. ``target=0.9``, ``batch_size=8``. The earlier keywords ``top_n``,
            ``threshold``, ``nodes``, ``n_nodes``, ``mlp_rest`` (without ``options`` or
            ``graph``) keep their earlier meaning: a neuron-level graph ranked by plain EAP.

    Returns:
        A :class:`~tl_attnonly.analysis.Circuit` with ``ceiling``, ``curve``, ``node_patching``,
        ``warnings``, ``gate_value`` and (coarse graph, named neurons) ``mlp_split``;
        ``circuit.extra`` holds ``"coarse"`` (the coarse circuit before neurons were named),
        ``"named"`` (layer -> named neurons), with ``neurons_per_mlp="auto"``
        ``"neuron_stage"`` (:mod:`.neuron_stage`), ``"seconds"`` (time per stage), after a pruning
        pass ``"swept"`` (the sweep's circuit: edges, faithfulness) and ``"pruning"`` (one row per
        exact run: round, removed, edges, faithfulness, accepted) and, with ``n_nodes``,
        ``"nodes"`` and ``"node_scores"``.

    Raises:
        ValueError: For options that contradict each other, or a metric that is not additive
            over examples with ``metric_reduction="sum"`` and several batches.
    """
    model = analysis_model(model)
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    opts = resolve_options(options, overrides)
    check_discoverable(model, opts.neuron_level)
    if opts.neuron_ranking == "relp":  # refused before any work where RelP cannot run
        check_relevance(model, "relp", range(model.cfg.n_layers), None)
    batches = batch_indices(clean_tokens.shape[0], opts.batch_size)
    if opts.metric_reduction == "mean":
        metric = _weighted_by_batch(metric, clean_tokens.shape[0])
    else:
        check_additive(model, clean_tokens, metric, batches)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    corrupted_runs = CorruptedRuns()  # each batch's corrupted run once for every exact run
    extra: dict = {}
    nodes: list[str] | None
    if opts.graph == "coarse":
        nodes = coarse_nodes(model)
    else:
        if opts.mlp_rest and opts.nodes is None and opts.n_nodes is None:
            raise ValueError(
                "mlp_rest=True keeps the neurons left out of a restricted graph; give nodes=[...] "
                "or n_nodes=N too (the full graph leaves none out)."
            )
        if opts.nodes is not None and opts.n_nodes is not None:
            raise ValueError(
                "Give nodes=[...] (your own) or n_nodes=N (picked by attribution), not both."
            )
        nodes = None if opts.nodes is None else list(opts.nodes)
        if opts.n_nodes is not None:
            nodes, node_scores = top_nodes(
                model, clean_tokens, corrupted_tokens, metric, opts.n_nodes,
                neuron_level=opts.neuron_level, batch_size=opts.batch_size,
                progress=opts.progress,
            )  # fmt: skip
            extra = {"nodes": nodes, "node_scores": node_scores}
            seconds["node attribution"] = time.perf_counter() - start
        if opts.mlp_rest and nodes is not None:
            nodes = [*nodes, *(mlp_rest_label(li) for li in range(model.cfg.n_layers))]
    t = time.perf_counter()
    scores = edge_attribution_scores(
        model, clean_tokens, corrupted_tokens, metric, method=opts.method,
        ig_steps=opts.ig_steps, neuron_level=opts.neuron_level, nodes=nodes,
        batch_size=opts.batch_size, progress=opts.progress, positions=positions,
    )  # fmt: skip
    seconds["edge scores"] = time.perf_counter() - t
    m_clean, m_corr = scores.metric_clean, scores.metric_corrupted
    t = time.perf_counter()
    notes: list[str] = []
    # the coarse circuit's own target (coarse_target: slack for the neuron stage)
    coarse_opts = (
        opts if opts.coarse_target is None else opts.with_overrides(target=opts.coarse_target)
    )
    if opts.top_n is None and opts.threshold is None:
        mask, m_circ, curve, ceiling, notes = sweep_to_target(
            model,
            scores,
            clean_tokens,
            corrupted_tokens,
            metric,
            nodes,
            coarse_opts,
            positions,
            corrupted_runs,
        )
    else:
        mask = prune_ranked(scores, opts.ranking, top_n=opts.top_n, threshold=opts.threshold)
        m_full, m_circ = circuit_metrics(
            model, [scores.graph.full_mask(), mask], clean_tokens, corrupted_tokens, metric,
            neuron_level=opts.neuron_level, nodes=nodes, batch_size=opts.batch_size,
            positions=positions, corrupted_runs=corrupted_runs,
        )  # fmt: skip
        ceiling = faithfulness(m_full, m_clean, m_corr)
        curve = pd.DataFrame(
            [
                dict(top_n=opts.top_n, edges=mask_size(mask), metric=m_circ,
                     faithfulness=faithfulness(m_circ, m_clean, m_corr)),
                dict(top_n=None, edges=scores.graph.n_edges(), metric=m_full,
                     faithfulness=ceiling),
            ]
        )  # fmt: skip
        if ceiling < opts.target:
            notes.append(
                f"the ceiling is low: the graph's every edge reaches faithfulness {ceiling:.3f} < "
                f"target {opts.target}; the nodes left out of the graph are frozen to the "
                "corrupted run."
            )
    seconds["sweep"] = time.perf_counter() - t
    swept = faithfulness(m_circ, m_clean, m_corr)
    if (
        opts.top_n is None
        and opts.threshold is None
        and opts.prune_runs > 0
        and (ceiling >= coarse_opts.target and swept >= coarse_opts.target)
    ):
        t = time.perf_counter()
        extra["swept"] = {"edges": mask_size(mask), "faithfulness": swept}
        mask, m_circ, extra["pruning"] = prune_by_runs(
            model, scores, mask, m_circ, clean_tokens, corrupted_tokens, metric,
            target=coarse_opts.target, max_runs=opts.prune_runs, ranking=opts.ranking, nodes=nodes,
            neuron_level=opts.neuron_level, batch_size=opts.batch_size, positions=positions,
            progress=opts.progress, corrupted_runs=corrupted_runs,
        )  # fmt: skip
        seconds["pruning"] = time.perf_counter() - t
    found = faithfulness(m_circ, m_clean, m_corr)
    if found > 1 + OVERSHOOT:
        notes.append(
            f"faithfulness {found:.3f} is above 1: the circuit moves the metric past the clean "
            "run, because edges that work against the behaviour are left out (circuit.opposing() "
            "lists the largest); it exaggerates the behaviour rather than reproducing it. "
            "ranking='absolute' keeps such edges when their |score| is large."
        )
    if opts.progress:
        tqdm.write(
            f"discover_circuit: {mask_size(mask):,} of {scores.graph.n_edges():,} edges, "
            f"faithfulness {faithfulness(m_circ, m_clean, m_corr):.3f} (ceiling {ceiling:.3f}; "
            f"clean {m_clean:.4g}, corrupted {m_corr:.4g}; "
            f"{sum(seconds.values()):.0f} s so far)"
        )
    circuit = Circuit(
        scores, mask, m_clean, m_corr, m_circ, faithfulness(m_circ, m_clean, m_corr),
        extra=extra, ceiling=ceiling, curve=curve, warnings=notes,
    )  # fmt: skip
    fine_nodes = nodes
    if opts.graph == "coarse" and opts.neurons_per_mlp != 0:
        t = time.perf_counter()
        circuit, fine_nodes = _name_neurons(
            model,
            circuit,
            clean_tokens,
            corrupted_tokens,
            metric,
            opts,
            positions,
            corrupted_runs,
        )
        seconds["neurons"] = time.perf_counter() - t
    t = time.perf_counter()
    # the circuit's sources (nodes with an outgoing edge); coarse: heads and whole MLP layers
    base = circuit.extra["coarse"] if "coarse" in circuit.extra else circuit
    patched = list(dict.fromkeys(n.split(".")[0] for n in base.edges().source))
    circuit.node_patching = faithfulness(
        node_patching_metric(
            model,
            clean_tokens,
            corrupted_tokens,
            metric,
            [n for n in patched if n != EMBED],
            batch_size=opts.batch_size,
        ),
        m_clean,
        m_corr,
    )
    seconds["node patching"] = time.perf_counter() - t
    if opts.gate_value:
        t = time.perf_counter()
        frame = circuit.edges()
        into = frame[frame.target_kind == "neuron"]
        ranked = (
            into.groupby("target").score.apply(lambda s: s.abs().sum()).sort_values(ascending=False)
        )
        circuit.gate_value = circuit_gate_value_split(
            model, circuit.mask, clean_tokens, corrupted_tokens, metric,
            neurons=list(ranked.index[: opts.max_gate_value_neurons]),
            neuron_level=opts.neuron_level, nodes=fine_nodes, batch_size=opts.batch_size,
            progress=opts.progress, positions=positions, corrupted_runs=corrupted_runs,
        )  # fmt: skip
        seconds["gate/value"] = time.perf_counter() - t
    for note in circuit.warnings:
        warnings.warn(note, stacklevel=2)
    if circuit.gate_value is not None:  # circuit_gate_value_split warned of these itself
        for row in circuit.gate_value.itertuples():
            for kind in ("gate", "value"):
                if getattr(row, f"n_{kind}_edges") == 0:
                    circuit.warnings.append(
                        f"{row.node}: {kind} not measured: no {kind} edge kept (NaN in gate_value)"
                    )
    circuit.extra["seconds"] = seconds
    return circuit


#: A neuron node of a layer (``"L{l}N{j}"``, a neuron-head ``"L{l}N{j}..."``): its layer.
_NEURON_OF_LAYER = re.compile(r"L(\d+)N")


def _neuron_scores(
    model: AttnOnlyModel,
    clean,
    corrupted,
    metric,
    opts: DiscoveryOptions,
    layers: list[int],
    coarse: Circuit,
    positions: PositionClasses | None = None,
) -> pd.Series:
    """Every neuron's score by ``opts.neuron_ranking`` (``L{l}N{i}`` -> score; RelP and circuit:
    the neurons of ``layers`` only): node attribution (:func:`top_nodes`), RelP relevance
    (:func:`~.relevance.neuron_relevance`) or the score along the ``coarse`` circuit's edges of
    the neuron's MLP node (:func:`~.circuit_neurons.circuit_neuron_scores`)."""
    if opts.neuron_ranking == "attribution":
        return top_nodes(
            model, clean, corrupted, metric, 1, batch_size=opts.batch_size, progress=opts.progress
        )[1]
    if opts.neuron_ranking == "circuit":
        return circuit_neuron_scores(
            model, coarse.graph, coarse.mask, clean, corrupted, metric, layers,
            method=opts.neuron_method, ig_steps=opts.ig_steps, batch_size=opts.batch_size,
            positions=positions, progress=opts.progress,
        )  # fmt: skip
    relevance = neuron_relevance(
        model, clean, corrupted, metric, layers=layers, rule="relp", batch_size=opts.batch_size
    )
    return pd.Series(
        {f"L{li}N{i}": float(v) for li in layers for i, v in enumerate(relevance[li].tolist())}
    )


def _name_neurons(
    model: AttnOnlyModel,
    coarse: Circuit,
    clean,
    corrupted,
    metric,
    opts: DiscoveryOptions,
    positions: PositionClasses | None = None,
    corrupted_runs: CorruptedRuns | None = None,
):
    """Step 3 and 4 of the module docstring: the circuit on the graph with named neurons."""
    layers = sorted(int(n[1:-3]) for n in coarse.nodes() if n.startswith("L") and n.endswith("MLP"))
    coarse.extra["coarse"] = coarse
    if not layers:
        coarse.extra["named"] = {}
        return coarse, coarse_nodes(model)
    node_scores = _neuron_scores(model, clean, corrupted, metric, opts, layers, coarse, positions)
    auto = opts.neurons_per_mlp == "auto"
    count = opts.max_neurons_per_mlp if auto else int(opts.neurons_per_mlp)
    named: dict[int, list[str]] = {}
    of_layer: dict[int, list[str]] = {li: [] for li in layers}
    for label in node_scores.index.tolist():  # one pass: "L{l}N..." is a neuron of layer l
        found = _NEURON_OF_LAYER.match(label)
        if found and int(found.group(1)) in of_layer:
            of_layer[int(found.group(1))].append(label)
    for li in layers:
        ranked = node_scores[of_layer[li]].abs().sort_values(ascending=False, kind="stable")
        named[li] = list(ranked.index[:count])
    stage: dict = {}
    cut: set[int] = set()
    measured: dict = {}  # the adaptive stage's runs (kept_key -> metric value)
    if auto:
        ground = NeuronStage(
            model, coarse, named, clean, corrupted, metric, opts, coarse_nodes(model),
            positions, corrupted_runs,
        )  # fmt: skip
        try:
            if opts.neuron_search == "joint":
                named, cut, table, n_runs = resolve_neurons_jointly(ground, node_scores)
            else:
                named, cut, table = resolve_neurons(ground)
                n_runs = int(table.runs.sum())
        finally:
            ground.bar.close()  # closed with its summary unless the search raised
        stage = {"neuron_stage": table, "neuron_stage_runs": n_runs}
        measured = ground.measured
    fine_nodes = coarse_nodes(model) + [n for li in layers for n in named[li]]
    scores = edge_attribution_scores(
        model, clean, corrupted, metric, method=opts.neuron_method, ig_steps=opts.ig_steps,
        nodes=fine_nodes, batch_size=opts.batch_size, progress=opts.progress, positions=positions,
    )  # fmt: skip
    mask = _without_sources(
        expand_mask(coarse.graph, coarse.mask, scores.graph), {f"mlp.{li}" for li in cut}
    )
    # Per layer, the circuit without its named neurons' edges, its remainder's, both. Where a
    # run would repeat another (a cut remainder: without it is the circuit itself; no named
    # neuron: the same), it is not made. Each is run on the coarse graph, each layer's MLP node
    # passing on the changes of the neurons whose edges the circuit keeps (the same runs as on
    # the graph with named neurons: circuit_metrics' kept_neurons).
    d_mlp = int(model.cfg.d_mlp or 0)

    def neurons(li: int, named_in: bool = True, rest_in: bool = False) -> torch.Tensor:
        """``bool [d_mlp]``: layer ``li``'s named neurons if ``named_in``, the others if
        ``rest_in``."""
        mine = neuron_mask(d_mlp, named[li])
        return (mine & named_in) | (~mine & rest_in)

    def without(li: int, named_out: bool, rest_out: bool) -> dict[int, torch.Tensor]:
        """The circuit's kept neurons without layer ``li``'s named neurons and/or remainder."""
        return {**base, li: neurons(li, not named_out, li not in cut and not rest_out)}

    base = {li: neurons(li) for li in cut}  # a cut layer passes on its named neurons only
    kept: list[dict[int, torch.Tensor]] = [base]
    runs: list[tuple[int, int, int]] = []
    for li in layers:
        j_named = j_layer = j_rest = 0
        if named[li]:
            kept.append(without(li, named_out=True, rest_out=False))
            j_named = j_layer = len(kept) - 1
        if li not in cut:
            kept.append(without(li, named_out=False, rest_out=True))
            j_rest = j_layer = len(kept) - 1
            if named[li]:
                kept.append(without(li, named_out=True, rest_out=True))
                j_layer = len(kept) - 1
        runs.append((j_named, j_rest, j_layer))
    named_only = 0
    if set(layers) - cut:
        kept.append({**base, **{li: neurons(li) for li in layers}})
        named_only = len(kept) - 1
    # the runs the adaptive stage made already (the returned circuit; without each kept layer,
    # its step 5) are not made again
    todo = list({kept_key(k): k for k in kept if kept_key(k) not in measured}.values())
    fresh = circuit_metrics(
        model, [coarse.mask] * len(todo), clean, corrupted, metric, nodes=coarse_nodes(model),
        batch_size=opts.batch_size, progress=opts.progress, positions=positions,
        corrupted_runs=corrupted_runs, kept_neurons=todo,
    ) if todo else []  # fmt: skip
    known = {**measured, **{kept_key(k): v for k, v in zip(todo, fresh, strict=True)}}
    values = [known[kept_key(k)] for k in kept]
    m_clean, m_corr = coarse.metric_clean, coarse.metric_corrupted
    denom = m_clean - m_corr
    m_fine = values[0]
    rows = []
    for li, (i_named, i_rest, i_layer) in zip(layers, runs, strict=True):
        no_named, no_rest, no_layer = values[i_named], values[i_rest], values[i_layer]
        rows.append(
            dict(
                node=mlp_rest_label(li),
                named=", ".join(named[li]),
                named_effect=(m_fine - no_named) / denom,
                rest_effect=(m_fine - no_rest) / denom,
                layer_effect=(m_fine - no_layer) / denom,
            )
        )
    columns = ["node", "named", "named_effect", "rest_effect", "layer_effect"]
    split = pd.DataFrame(rows, columns=columns)
    fine = Circuit(
        scores, mask, m_clean, m_corr, m_fine, faithfulness(m_fine, m_clean, m_corr),
        extra={**coarse.extra, "named": named, **stage,
               "faithfulness_named_only": faithfulness(values[named_only], m_clean, m_corr)},
        ceiling=coarse.ceiling, curve=coarse.curve, warnings=list(coarse.warnings),
        mlp_split=split,
    )  # fmt: skip
    return fine, fine_nodes


__all__ = [
    "coarse_nodes",
    "discover_circuit",
    "expand_mask",
    "node_patching_metric",
    "top_nodes",
]
