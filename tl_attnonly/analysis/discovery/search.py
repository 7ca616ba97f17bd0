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
3. **Neurons** (where asked for: the default ``neurons_per_mlp=0`` keeps each MLP node its whole
   layer, and the report says how to resolve it). Inside each MLP node of that circuit, the
   ``neurons_per_mlp`` neurons with the largest node attribution ``|score|`` (or RelP
   relevance, or the score along the node's circuit edges: ``neuron_ranking="relp"``,
   ``"circuit"``) are named:
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
   are kept: :func:`~.runs.circuit_metrics`' ``kept_neurons``). With ``expert_nodes=True`` each
   expert node of the coarse circuit gets its ``neurons_per_mlp`` best neurons by node
   attribution named too (``L{l}E{e}N{j}``, the expert's node then its remainder; ``"auto"``:
   resolved by the adaptive stage as a dense MLP node is, :mod:`.expert_kept`), and every
   split is run on the graph with the named neurons instead (:mod:`.expert_naming`).

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

import warnings
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from jaxtyping import Int
from tqdm.auto import tqdm

from tl_attnonly.analysis.discovery.circuit import Circuit, faithfulness
from tl_attnonly.analysis.discovery.edge_scores import EdgeScores, edge_attribution_scores
from tl_attnonly.analysis.discovery.gate_value import circuit_gate_value_split
from tl_attnonly.analysis.discovery.graph import EMBED, mlp_rest_label
from tl_attnonly.analysis.discovery.naming import name_neurons
from tl_attnonly.analysis.discovery.node_selection import (
    coarse_nodes,
    expand_mask,
    node_patching_metric,
    top_nodes,
)
from tl_attnonly.analysis.discovery.options import DiscoveryOptions, resolve_options
from tl_attnonly.analysis.discovery.positions import PositionClasses
from tl_attnonly.analysis.discovery.pruning import mask_size, prune_ranked
from tl_attnonly.analysis.discovery.refine import prune_by_runs
from tl_attnonly.analysis.discovery.relevance import check_relevance
from tl_attnonly.analysis.discovery.run_metrics import run_circuits
from tl_attnonly.analysis.discovery.run_reuse import CorruptedRuns
from tl_attnonly.analysis.discovery.sites import DiscoveryMetric, call_metric, check_discoverable
from tl_attnonly.analysis.discovery.sweep import FIRST_SIZE as FIRST_SIZE
from tl_attnonly.analysis.discovery.sweep import MONOTONE_TOLERANCE as MONOTONE_TOLERANCE
from tl_attnonly.analysis.discovery.sweep import sweep_to_target
from tl_attnonly.analysis.discovery.timing import StageTimer
from tl_attnonly.analysis.patching.dense_layers import expert_layers
from tl_attnonly.analysis.task import DiscoveryTask

if TYPE_CHECKING:
    from tl_attnonly.protocol import ModelLike


#: A circuit whose faithfulness exceeds ``1 + OVERSHOOT`` is warned about (it overshoots).
OVERSHOOT = 0.2


def _weighted_by_batch(metric: DiscoveryMetric, n_examples: int) -> DiscoveryMetric:
    """A per-batch mean turned additive: each batch's value times its share of the examples."""

    def additive(logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        return call_metric(metric, logits, indices) * (len(indices) / n_examples)

    if hasattr(metric, "logit_positions"):  # the same logits read
        additive.logit_positions = metric.logit_positions  # type: ignore[attr-defined]
    return additive


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
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` or a ``TransformerBridge``
            converted with :func:`tl_attnonly.convert` (in place).
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
        ``"named"`` (layer -> named neurons, an expert layer's experts' included), with
        ``neurons_per_mlp="auto"`` ``"neuron_stage"`` (:mod:`.neuron_stage`), with ``mib_curve``
        (default) ``"mib_curve"``, ``"mib_cpr"`` and ``"mib_cmd"`` (:mod:`.scoring`), ``"seconds"``
        (time per stage), after a pruning pass ``"swept"`` (the sweep's circuit: edges,
        faithfulness) and ``"pruning"`` (one row per exact run: round, removed, edges, faithfulness,
        accepted) and, with ``n_nodes``, ``"nodes"`` and ``"node_scores"``.

    Raises:
        ValueError: For options that contradict each other, or a metric that is not additive
            over examples with ``metric_reduction="sum"`` and several batches.
    """
    task = DiscoveryTask.make(model, clean_tokens, corrupted_tokens, metric, positions=positions)
    model = task.model
    opts = resolve_options(options, overrides)
    task = task.replace(batch_size=opts.batch_size)
    check_discoverable(model, opts.neuron_level)
    outside = sorted(li for li in opts.whole_mlps if li >= model.cfg.n_layers)
    if outside:
        raise ValueError(
            f"whole_mlps names layer(s) {outside}; the model has layers 0 to "
            f"{model.cfg.n_layers - 1}."
        )
    if opts.expert_nodes and not expert_layers(model):
        raise ValueError(
            "expert_nodes=True names a mixture of experts' experts as nodes, but this model has "
            "no mixture-of-experts layer."
        )
    if opts.neuron_ranking == "relp":  # refused before any work where RelP cannot run
        check_relevance(model, "relp", range(model.cfg.n_layers), None)
    if opts.metric_reduction == "mean":
        task = task.replace(metric=_weighted_by_batch(metric, task.n_examples))
    else:
        task.check_additive()
    timer = StageTimer()
    # each batch's corrupted run once for every exact run
    task = task.replace(corrupted_runs=CorruptedRuns())
    extra: dict = {}
    with timer("node attribution"):  # a stage only where n_nodes picks the nodes
        nodes = _graph_nodes(task, opts, extra)
    if "nodes" not in extra:
        del timer.seconds["node attribution"]
    with timer("edge scores"):
        scores = edge_attribution_scores(
            model, task.clean, task.corrupted, task.metric, method=opts.method,
            ig_steps=opts.ig_steps, neuron_level=opts.neuron_level, nodes=nodes,
            batch_size=opts.batch_size, progress=opts.progress, positions=positions,
        )  # fmt: skip
    m_clean, m_corr = scores.metric_clean, scores.metric_corrupted
    # the coarse circuit's own target (coarse_target: slack for the neuron stage)
    coarse_opts = (
        opts if opts.coarse_target is None else opts.with_overrides(target=opts.coarse_target)
    )
    with timer("sweep"):
        mask, m_circ, curve, ceiling, notes = _sized(task, scores, nodes, opts, coarse_opts)
    swept = faithfulness(m_circ, m_clean, m_corr)
    if (
        opts.top_n is None
        and opts.threshold is None
        and opts.prune_runs > 0
        and (ceiling >= coarse_opts.target and swept >= coarse_opts.target)
    ):
        with timer("pruning"):
            extra["swept"] = {"edges": mask_size(mask), "faithfulness": swept}
            mask, m_circ, extra["pruning"] = prune_by_runs(
                task, scores, mask, m_circ, nodes, coarse_opts
            )
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
            f"{timer.total():.0f} s so far)"
        )
    circuit = Circuit(
        scores, mask, m_clean, m_corr, m_circ, faithfulness(m_circ, m_clean, m_corr),
        extra=extra, ceiling=ceiling, curve=curve, warnings=notes,
    )  # fmt: skip
    if opts.mib_curve and opts.graph == "coarse":
        with timer("MIB curve"):
            _mib_curve(task, circuit, opts)
    fine_nodes = nodes
    if opts.graph == "coarse" and opts.neurons_per_mlp != 0:
        with timer("neurons"):
            circuit, fine_nodes = name_neurons(task, circuit, opts)
    with timer("node patching"):
        circuit.node_patching = _node_patching(task, circuit, opts)
    if opts.gate_value:
        with timer("gate/value"):
            circuit.gate_value = _gate_value(task, circuit, fine_nodes, opts)
    for note in circuit.warnings:
        warnings.warn(note, stacklevel=2)
    if circuit.gate_value is not None:  # circuit_gate_value_split warned of these itself
        for row in circuit.gate_value.itertuples():
            for kind in ("gate", "value"):
                if getattr(row, f"n_{kind}_edges") == 0:
                    circuit.warnings.append(
                        f"{row.node}: {kind} not measured: no {kind} edge kept (NaN in gate_value)"
                    )
    circuit.extra["seconds"] = timer.seconds
    return circuit


def _mib_curve(task: DiscoveryTask, circuit: Circuit, opts: DiscoveryOptions) -> None:
    """``circuit.extra``'s ``"mib_curve"`` (the ranking's top-``k`` circuits at MIB's edge
    fractions, exact runs, with ``distance = |1 - faithfulness|``), ``"mib_cpr"`` and
    ``"mib_cmd"`` (:mod:`.scoring`)."""
    from tl_attnonly.analysis.discovery.scoring import faithfulness_curve, score_curve

    curve = faithfulness_curve(
        task.model, circuit.scores, task.clean, task.corrupted, task.metric,
        ranking=opts.ranking, positions=task.positions, batch_size=opts.batch_size,
        progress=opts.progress, corrupted_runs=task.corrupted_runs,
    )  # fmt: skip
    scored = score_curve(curve, circuit.scores.graph.n_edges())
    circuit.extra["mib_curve"] = curve.assign(distance=(1.0 - curve.faithfulness).abs())
    circuit.extra["mib_cpr"], circuit.extra["mib_cmd"] = scored.cpr, scored.cmd


def _graph_nodes(task: DiscoveryTask, opts: DiscoveryOptions, extra: dict) -> list[str] | None:
    """The nodes of the search's graph: the coarse graph's, the options' ``nodes``, or the
    ``n_nodes`` best by node attribution (then ``extra`` gets ``"nodes"`` and
    ``"node_scores"``); with ``mlp_rest`` each layer's remainder too."""
    model = task.model
    nodes: list[str] | None
    if opts.graph == "coarse":
        return coarse_nodes(model, experts=opts.expert_nodes)
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
            model, task.clean, task.corrupted, task.metric, opts.n_nodes,
            neuron_level=opts.neuron_level, batch_size=opts.batch_size,
            progress=opts.progress,
        )  # fmt: skip
        extra.update({"nodes": nodes, "node_scores": node_scores})
    if opts.mlp_rest and nodes is not None:
        nodes = [*nodes, *(mlp_rest_label(li) for li in range(model.cfg.n_layers))]
    return nodes


def _sized(
    task: DiscoveryTask,
    scores: EdgeScores,
    nodes: list[str] | None,
    opts: DiscoveryOptions,
    coarse_opts: DiscoveryOptions,
):
    """The sweep's circuit (:func:`~.sweep.sweep_to_target`, to ``coarse_opts.target``), or the
    options' ``top_n`` / ``threshold`` circuit with the full graph's run as its ceiling.

    Returns ``(mask, metric_circuit, curve, ceiling, warnings)``.
    """
    if opts.top_n is None and opts.threshold is None:
        return sweep_to_target(task, scores, nodes, coarse_opts)
    m_clean, m_corr = scores.metric_clean, scores.metric_corrupted
    notes: list[str] = []
    mask = prune_ranked(scores, opts.ranking, top_n=opts.top_n, threshold=opts.threshold)
    m_full, m_circ = run_circuits(
        task, task.graph(opts.neuron_level, nodes), [scores.graph.full_mask(), mask]
    )
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
    return mask, m_circ, curve, ceiling, notes


def _node_patching(task: DiscoveryTask, circuit: Circuit, opts: DiscoveryOptions) -> float:
    """The node-patching baseline's faithfulness: the clean outputs of the circuit's sources
    (nodes with an outgoing edge; coarse: heads and whole MLP layers) patched in."""
    base = circuit.extra["coarse"] if "coarse" in circuit.extra else circuit
    patched = list(dict.fromkeys(n.split(".")[0] for n in base.edges().source))
    return faithfulness(
        node_patching_metric(
            task.model,
            task.clean,
            task.corrupted,
            task.metric,
            [n for n in patched if n != EMBED],
            batch_size=opts.batch_size,
        ),
        circuit.metric_clean,
        circuit.metric_corrupted,
    )


def _gate_value(
    task: DiscoveryTask, circuit: Circuit, fine_nodes: list[str] | None, opts: DiscoveryOptions
) -> pd.DataFrame | None:
    """The gate/value split of the ``max_gate_value_neurons`` neurons with the largest summed
    ``|score|`` of incoming circuit edges (:func:`~.gate_value.circuit_gate_value_split`); None
    where no neuron of the circuit has one (its MLP nodes whole layers: the default)."""
    frame = circuit.edges()
    into = frame[frame.target_kind == "neuron"]
    if into.empty:
        return None
    ranked = (
        into.groupby("target").score.apply(lambda s: s.abs().sum()).sort_values(ascending=False)
    )
    return circuit_gate_value_split(
        task.model, circuit.mask, task.clean, task.corrupted, task.metric,
        neurons=list(ranked.index[: opts.max_gate_value_neurons]),
        neuron_level=opts.neuron_level, nodes=fine_nodes, batch_size=opts.batch_size,
        progress=opts.progress, positions=task.positions, corrupted_runs=task.corrupted_runs,
    )  # fmt: skip


__all__ = [
    "coarse_nodes",
    "discover_circuit",
    "expand_mask",
    "node_patching_metric",
    "top_nodes",
]
