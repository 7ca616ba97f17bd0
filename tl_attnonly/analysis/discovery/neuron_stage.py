"""The adaptive neuron stage (``neurons_per_mlp="auto"``): as few named neurons per MLP node as
keep the circuit's exact faithfulness at the target, no layer remainder where none is needed.

Inside each MLP node ``L{l}MLP`` of the coarse circuit, the layer's neurons are ranked by their
node attribution ``|score|`` (:func:`~.search.top_nodes`, the ranking of the fixed stage). Layer by
layer (lowest first), the circuit keeps the outgoing edges of the top ``k`` neurons only -- the
rest of the layer (its remainder ``L{l}MLP`` and the lower-ranked neurons) loses its outgoing
edges, so it reads the corrupted run -- and ``k`` is chosen by exact circuit runs
(:func:`~.runs.circuit_metrics`): ``k = 1, 2, 4, ...`` until the faithfulness reaches the goal,
then bisection between the last failing and the first passing ``k`` down to one neuron. Earlier
layers stay resolved while a later one is searched, so every accepted run is the circuit as it
then is and the returned circuit reaches the goal by construction (its faithfulness is its own
exact run's). The goal is ``min(target, coarse faithfulness)``.

Where even ``max_neurons_per_mlp`` neurons do not hold the goal without the rest of the layer,
that many are named and the remainder is kept; its *share* is the faithfulness it carries there
(the circuit with it minus the circuit without it). ``circuit.extra["neuron_stage"]`` has one row
per MLP node: ``node``, ``named`` (count), ``remainder`` (whether kept), ``remainder_share``,
``faithfulness`` (after that layer was resolved) and ``runs`` (exact runs made for it).

The runs are made a few at a time, in one :func:`~.runs.circuit_metrics` call each (one
corrupted run, the circuit below the layer shared): the doubling runs ``k``, ``2k`` and ``4k``
together, the bisection its middle and both halves' middles; they are read in the order of one
at a time, so the choice is that of one run at a time and ``runs`` counts some that the choice
did not need.

The search is monotone only where the faithfulness is: the ``k`` found reaches the goal and
``k - 1`` (when run) does not, but a smaller ``k`` below the last failing one might.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd
import torch

from tl_attnonly.analysis.discovery.circuit import Circuit, faithfulness
from tl_attnonly.analysis.discovery.graph import HeadGraph, mlp_rest_label
from tl_attnonly.analysis.discovery.options import DiscoveryOptions
from tl_attnonly.analysis.discovery.positions import PositionClasses
from tl_attnonly.analysis.discovery.runs import CorruptedRuns, circuit_metrics
from tl_attnonly.analysis.discovery.sites import DiscoveryMetric, Mask

if TYPE_CHECKING:
    from tl_attnonly.protocol import AttnOnlyModel

#: Doubling sizes run in one call (``k``, ``2k``, ``4k``).
LADDER = 3

COLUMNS = ["node", "named", "remainder", "remainder_share", "faithfulness", "runs"]


def _cut(mask: Mask, graph: HeadGraph, layer: int, keep: set[str]) -> Mask:
    """``mask`` without the outgoing edges of layer ``layer``'s remainder and of its named
    neurons not in ``keep``."""
    out = dict(mask)
    for group in graph.sources:
        if group.key == f"mlp.{layer}":
            drop = torch.ones(len(group.labels), dtype=torch.bool)
        elif group.key == f"neuron.{layer}":
            drop = torch.tensor([label not in keep for label in group.labels], dtype=torch.bool)
        else:
            continue
        for key, block in mask.items():
            if key[0] == group.key:
                out[key] = block & ~drop.to(block.device)[:, None]
    return out


def resolve_neurons(
    model: AttnOnlyModel,
    coarse: Circuit,
    expand,
    ranked: dict[int, list[str]],
    clean,
    corrupted,
    metric: DiscoveryMetric,
    opts: DiscoveryOptions,
    nodes: list[str],
    positions: PositionClasses | None = None,
    corrupted_runs: CorruptedRuns | None = None,
) -> tuple[dict[int, list[str]], set[int], pd.DataFrame]:
    """Choose the named neurons of each MLP node (module docstring).

    Args:
        coarse: The coarse circuit.
        expand: ``expand(coarse_graph, mask, fine_graph)``: the coarse mask on a finer graph.
        ranked: Per layer, its neurons best first (at most ``max_neurons_per_mlp``).
        nodes: The coarse graph's nodes (every head and MLP node).
        corrupted_runs: A :class:`~.runs.CorruptedRuns` shared with other calls.

    Returns:
        ``(named, cut, table)``: per layer the named neurons, the layers whose remainder lost
        its outgoing edges, and the per-layer table.
    """
    layers = sorted(ranked)
    fine_nodes = nodes + [n for li in layers for n in ranked[li]]
    graph = HeadGraph(
        model, nodes=fine_nodes, positions=None if positions is None else positions.names
    )
    mask = expand(coarse.graph, coarse.mask, graph)
    m_clean, m_corr = coarse.metric_clean, coarse.metric_corrupted
    goal = min(opts.target, coarse.faithfulness)
    current = coarse.faithfulness
    named: dict[int, list[str]] = {}
    cut: set[int] = set()
    rows = []
    for li in layers:
        order = ranked[li]
        tried: dict[int, tuple[Mask, float]] = {}

        def run(ks: list[int], li=li, order=order, tried=tried, base=mask) -> None:
            """Exact runs of the candidates ``ks`` not yet tried, in one call (one corrupted run;
            the runs share the circuit below layer ``li``: :func:`~.runs.circuit_metrics`)."""
            ks = list(dict.fromkeys(k for k in ks if k not in tried))
            if not ks:
                return
            candidates = [_cut(base, graph, li, set(order[:k])) for k in ks]
            values = circuit_metrics(
                model, candidates, clean, corrupted, metric, nodes=fine_nodes,
                batch_size=opts.batch_size, positions=positions, corrupted_runs=corrupted_runs,
            )  # fmt: skip
            for k, candidate, value in zip(ks, candidates, values, strict=True):
                tried[k] = (candidate, faithfulness(value, m_clean, m_corr))

        cap, lo, hi, k = len(order), 0, None, 1
        while hi is None:
            k = min(k, cap)
            if k not in tried:  # the next LADDER sizes of the doubling in one call
                run([min(k << i, cap) for i in range(LADDER)])
            if tried[k][1] >= goal:
                hi = k
            elif k == cap:
                break
            else:
                lo, k = k, 2 * k
        while hi is not None and hi - lo > 1:
            # two bisection steps in one call: the middle, then either half's middle
            mid = (lo + hi) // 2
            run([m for m in (mid, (lo + mid) // 2, (mid + hi) // 2) if lo < m < hi])
            for _ in range(2):
                if hi - lo <= 1:
                    break
                mid = (lo + hi) // 2
                if tried[mid][1] >= goal:
                    hi = mid
                else:
                    lo = mid
        if hi is None:  # the remainder is needed: name them all, keep it
            named[li] = list(order)
            share = current - tried[cap][1]
            rows.append((mlp_rest_label(li), cap, True, share, current, len(tried)))
            continue
        mask, current = tried[hi]
        named[li] = list(order[:hi])
        cut.add(li)
        rows.append((mlp_rest_label(li), hi, False, 0.0, current, len(tried)))
    return named, cut, pd.DataFrame(rows, columns=COLUMNS)


__all__ = ["resolve_neurons"]
