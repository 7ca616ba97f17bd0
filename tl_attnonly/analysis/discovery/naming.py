"""Naming neurons in a coarse circuit: each MLP node split into named neurons and a remainder.

Steps 3 and 4 of :func:`~.search.discover_circuit` (:mod:`.search`' module docstring): inside each
MLP node of the coarse circuit the best neurons by ``opts.neuron_ranking`` (node attribution,
RelP relevance, or the score along the node's circuit edges) are named, a fixed number or
(``neurons_per_mlp="auto"``) as many as exact runs need (:mod:`.neuron_stage`); the graph is
rebuilt with them as nodes, the coarse circuit expanded onto it (:func:`~.node_selection.
expand_mask`), its edges scored again, and per layer the exact effect of the named neurons'
edges, the remainder's and both is measured (``Circuit.mlp_split``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pandas as pd
import torch

from tl_attnonly.analysis.discovery.circuit import Circuit, faithfulness
from tl_attnonly.analysis.discovery.circuit_neurons import circuit_neuron_scores
from tl_attnonly.analysis.discovery.counts import kind_layer
from tl_attnonly.analysis.discovery.edge_scores import edge_attribution_scores
from tl_attnonly.analysis.discovery.expert_kept import KeptKey
from tl_attnonly.analysis.discovery.expert_naming import (
    by_layer,
    fine_split,
    rank_expert_neurons,
    without_remainders,
)
from tl_attnonly.analysis.discovery.expert_nodes import EXPERT_LABEL
from tl_attnonly.analysis.discovery.graph import mlp_rest_label
from tl_attnonly.analysis.discovery.neuron_stage import (
    NeuronStage,
    kept_key,
    neuron_mask,
    resolve_neurons,
    resolve_neurons_jointly,
)
from tl_attnonly.analysis.discovery.node_selection import coarse_nodes, expand_mask, top_nodes
from tl_attnonly.analysis.discovery.options import DiscoveryOptions
from tl_attnonly.analysis.discovery.relevance import neuron_relevance
from tl_attnonly.analysis.discovery.run_metrics import circuit_metrics
from tl_attnonly.analysis.discovery.sites import Mask

if TYPE_CHECKING:
    from tl_attnonly.analysis.task import DiscoveryTask


def _without_sources(mask: Mask, keys: set[str]) -> Mask:
    return {k: (torch.zeros_like(m) if k[0] in keys else m) for k, m in mask.items()}


#: A neuron node of a layer (``"L{l}N{j}"``, a neuron-head ``"L{l}N{j}..."``): its layer.
_NEURON_OF_LAYER = re.compile(r"L(\d+)N")


def _neuron_scores(
    task: DiscoveryTask, opts: DiscoveryOptions, layers: list[int], coarse: Circuit
) -> pd.Series:
    """Every neuron's score by ``opts.neuron_ranking`` (``L{l}N{i}`` -> score; RelP and circuit:
    the neurons of ``layers`` only): node attribution (:func:`top_nodes`), RelP relevance
    (:func:`~.relevance.neuron_relevance`) or the score along the ``coarse`` circuit's edges of
    the neuron's MLP node (:func:`~.circuit_neurons.circuit_neuron_scores`)."""
    model, clean, corrupted, metric = task.model, task.clean, task.corrupted, task.metric
    if opts.neuron_ranking == "attribution":
        return top_nodes(
            model, clean, corrupted, metric, 1, batch_size=opts.batch_size, progress=opts.progress
        )[1]
    if opts.neuron_ranking == "circuit":
        return circuit_neuron_scores(
            model, coarse.graph, coarse.mask, clean, corrupted, metric, layers,
            method=opts.neuron_method, ig_steps=opts.ig_steps, batch_size=opts.batch_size,
            positions=task.positions, progress=opts.progress,
        )  # fmt: skip
    relevance = neuron_relevance(
        model, clean, corrupted, metric, layers=layers, rule="relp", batch_size=opts.batch_size
    )
    return pd.Series(
        {f"L{li}N{i}": float(v) for li in layers for i, v in enumerate(relevance[li].tolist())}
    )


#: Below this share of the MLP layers' effect carried by the named neurons
#: (:func:`named_share`), the circuit warns that its named neurons carry little.
NAMED_SHARE_WARNING = 0.1


def named_share(with_all: float, named_only: float, without: float) -> float | None:
    """The share of the named MLP layers' effect their named neurons carry: ``(named_only -
    without) / (with_all - without)``, the metric with every remainder cut, with every named
    layer cut and with both kept; None where the layers move the metric by (nearly) nothing."""
    effect = with_all - without
    if abs(effect) <= 1e-9 * max(1.0, abs(with_all), abs(without)):
        return None
    return (named_only - without) / effect


def _expert_nodes_to_name(coarse: Circuit, opts: DiscoveryOptions) -> list[str]:
    """The expert nodes of the coarse circuit whose neurons are named (``expert_nodes``; the
    layers of ``whole_mlps`` kept whole)."""
    if not opts.expert_nodes:
        return []
    whole = set(opts.whole_mlps)
    return [n for n in coarse.nodes() if EXPERT_LABEL.match(n) and kind_layer(n)[1] not in whole]


def name_neurons(task: DiscoveryTask, coarse: Circuit, opts: DiscoveryOptions):
    """Step 3 and 4 of :mod:`.search`' module docstring: the circuit on the graph with named
    neurons (the task's model, prompts, metric, position classes and corrupted runs); with
    ``expert_nodes``, the expert nodes' neurons too (:mod:`.expert_naming`)."""
    model, clean, corrupted, metric = task.model, task.clean, task.corrupted, task.metric
    base_nodes = coarse_nodes(model, experts=opts.expert_nodes)  # the coarse graph's
    layers = sorted(int(n[1:-3]) for n in coarse.nodes() if n.startswith("L") and n.endswith("MLP"))
    layers = [li for li in layers if li not in coarse.graph.expert_layers]  # no neurons of its own
    layers = [li for li in layers if li not in opts.whole_mlps]  # kept whole by the user
    experts = _expert_nodes_to_name(coarse, opts)
    coarse.extra["coarse"] = coarse
    if not layers and not experts:
        coarse.extra["named"] = {}
        return coarse, base_nodes
    auto = opts.neurons_per_mlp == "auto"
    count = opts.max_neurons_per_mlp if auto else int(opts.neurons_per_mlp)
    named: dict[int, list[str]] = {}
    node_scores = _neuron_scores(task, opts, layers, coarse) if layers else pd.Series(dtype=float)
    of_layer: dict[int, list[str]] = {li: [] for li in layers}
    for label in node_scores.index.tolist():  # one pass: "L{l}N..." is a neuron of layer l
        found = _NEURON_OF_LAYER.match(label)
        if found and int(found.group(1)) in of_layer:
            of_layer[int(found.group(1))].append(label)
    for li in layers:
        ranked = node_scores[of_layer[li]].abs().sort_values(ascending=False, kind="stable")
        named[li] = list(ranked.index[:count])
    expert_ranked, expert_scores = rank_expert_neurons(task, experts, count, opts)
    expert_named = by_layer(expert_ranked)
    stage: dict = {}
    cut: set[int] = set()
    expert_cut: list[str] = []  # expert nodes whose remainder the adaptive stage cut
    measured: dict = {}  # the adaptive stage's runs (kept_key -> metric value)
    if auto:
        candidates: dict[KeptKey, list[str]] = {li: named[li] for li in layers}
        candidates.update(expert_ranked)
        ground = NeuronStage(task, coarse, candidates, opts, base_nodes)
        if expert_ranked:  # one order across dense layers and experts
            node_scores = pd.concat([node_scores, expert_scores])
        try:
            if opts.neuron_search == "joint":
                chosen, cut_nodes, table, n_runs = resolve_neurons_jointly(ground, node_scores)
            else:
                chosen, cut_nodes, table = resolve_neurons(ground)
                n_runs = int(table.runs.sum())
        finally:
            ground.bar.close()  # closed with its summary unless the search raised
        named = {li: chosen[li] for li in layers}
        cut = {li for li in cut_nodes if isinstance(li, int)}
        expert_cut = [e for e in expert_ranked if e in cut_nodes]
        expert_named = by_layer({e: chosen[e] for e in expert_ranked})
        stage = {"neuron_stage": table, "neuron_stage_runs": n_runs}
        measured = ground.measured
    fine_nodes = base_nodes + [n for li in layers for n in named[li]]
    fine_nodes += [n for li in expert_named for n in expert_named[li]]
    scores = edge_attribution_scores(
        model, clean, corrupted, metric, method=opts.neuron_method, ig_steps=opts.ig_steps,
        nodes=fine_nodes, batch_size=opts.batch_size, progress=opts.progress,
        positions=task.positions,
    )  # fmt: skip
    mask = _without_sources(
        expand_mask(coarse.graph, coarse.mask, scores.graph), {f"mlp.{li}" for li in cut}
    )
    mask = without_remainders(scores.graph, mask, expert_cut)
    m_no_mlp: float | None  # (None: every named layer cut by the adaptive stage)
    if expert_named or expert_cut:  # every split by runs on the graph with the named neurons
        named_all = {**{li: named[li] for li in layers if named[li]}, **expert_named}
        raw, (m_fine, m_named_only, m_no_mlp) = fine_split(
            task, scores.graph, mask, named_all, opts
        )
        if not named_all:  # no neuron named: nothing to cut
            m_no_mlp = None
        named = {**named, **expert_named}
    else:
        raw, (m_fine, m_named_only, m_no_mlp) = _kept_split(
            task, coarse, opts, layers, named, cut, measured
        )
    m_clean, m_corr = coarse.metric_clean, coarse.metric_corrupted
    denom = m_clean - m_corr
    split = pd.DataFrame(
        dict(
            node=raw.node,
            named=raw.named,
            named_effect=(m_fine - raw.no_named) / denom,
            rest_effect=(m_fine - raw.no_rest) / denom,
            layer_effect=(m_fine - raw.no_layer) / denom,
        ),
        columns=["node", "named", "named_effect", "rest_effect", "layer_effect"],
    )
    share = None if m_no_mlp is None else named_share(m_fine, m_named_only, m_no_mlp)
    notes = list(coarse.warnings)
    if share is not None and share < NAMED_SHARE_WARNING:
        assert m_no_mlp is not None
        notes.append(
            f"the named neurons carry {share:.0%} of the MLP layers' effect (faithfulness "
            f"{faithfulness(m_named_only, m_clean, m_corr):.3f} with every remainder cut, "
            f"{faithfulness(m_no_mlp, m_clean, m_corr):.3f} with every named layer cut, "
            f"{faithfulness(m_fine, m_clean, m_corr):.3f} with both): the layers' effect is in "
            "neurons not named. neurons_per_mlp='auto' chooses neurons by exact runs; "
            "circuit.mlp_split gives each layer's split."
        )
    fine = Circuit(
        scores, mask, m_clean, m_corr, m_fine, faithfulness(m_fine, m_clean, m_corr),
        extra={**coarse.extra, "named": named, **stage,
               "faithfulness_named_only": faithfulness(m_named_only, m_clean, m_corr),
               **({} if share is None else {"named_share": share})},
        ceiling=coarse.ceiling, curve=coarse.curve, warnings=notes, mlp_split=split,
    )  # fmt: skip
    return fine, fine_nodes


def _kept_split(
    task: DiscoveryTask,
    coarse: Circuit,
    opts: DiscoveryOptions,
    layers: list[int],
    named: dict[int, list[str]],
    cut: set[int],
    measured: dict,
) -> tuple[pd.DataFrame, tuple[float, float, float | None]]:
    """Per named layer, the circuit without its named neurons' edges, its remainder's, both (as
    :func:`~.expert_naming.fine_split` returns them), and the circuit's metric, with every
    remainder cut and with every named layer cut (None where every layer is cut). Where a run
    would repeat another (a cut remainder: without it is the circuit itself; no named neuron:
    the same), it is not made. Each is run on the coarse graph, each layer's MLP node passing
    on the changes of the neurons whose edges the circuit keeps (the same runs as on the graph
    with named neurons: circuit_metrics' kept_neurons); the adaptive stage's runs
    (``measured``) are not made again."""
    d_mlp = int(task.model.cfg.d_mlp or 0)

    def neurons(li: int, named_in: bool = True, rest_in: bool = False) -> torch.Tensor:
        """``bool [d_mlp]``: layer ``li``'s named neurons if ``named_in``, the others if
        ``rest_in``."""
        mine = neuron_mask(d_mlp, named[li])
        return (mine & named_in) | (~mine & rest_in)

    def without(li: int, named_out: bool, rest_out: bool) -> dict[KeptKey, torch.Tensor]:
        """The circuit's kept neurons without layer ``li``'s named neurons and/or remainder."""
        return {**base, li: neurons(li, not named_out, li not in cut and not rest_out)}

    # a cut layer passes on its named neurons only
    base: dict[KeptKey, torch.Tensor] = {li: neurons(li) for li in cut}
    kept: list[dict[KeptKey, torch.Tensor]] = [base]
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
    named_only = no_mlp = 0
    if set(layers) - cut:
        kept.append({**base, **{li: neurons(li) for li in layers}})
        named_only = len(kept) - 1
        # every named layer passing on nothing: the MLP nodes' whole effect removed
        kept.append({**base, **{li: neurons(li, named_in=False) for li in layers}})
        no_mlp = len(kept) - 1
    # the runs the adaptive stage made already (the returned circuit; without each kept layer,
    # its step 5) are not made again
    todo = list({kept_key(k): k for k in kept if kept_key(k) not in measured}.values())
    fresh = circuit_metrics(
        task.model, [coarse.mask] * len(todo), task.clean, task.corrupted, task.metric,
        nodes=coarse_nodes(task.model, experts=opts.expert_nodes),
        batch_size=task.batch_size, progress=opts.progress, positions=task.positions,
        corrupted_runs=task.corrupted_runs, kept_neurons=todo,
    ) if todo else []  # fmt: skip
    known = {**measured, **{kept_key(k): v for k, v in zip(todo, fresh, strict=True)}}
    values = [known[kept_key(k)] for k in kept]
    rows = [
        (mlp_rest_label(li), ", ".join(named[li]), values[i_named], values[i_rest], values[i_layer])
        for li, (i_named, i_rest, i_layer) in zip(layers, runs, strict=True)
    ]
    raw = pd.DataFrame(rows, columns=["node", "named", "no_named", "no_rest", "no_layer"])
    return raw, (values[0], values[named_only], values[no_mlp] if no_mlp else None)


__all__ = ["NAMED_SHARE_WARNING", "name_neurons", "named_share"]
