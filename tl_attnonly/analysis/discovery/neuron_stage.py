"""The adaptive neuron stage (``neurons_per_mlp="auto"``): as few named neurons per MLP node as
keep the circuit's exact faithfulness at the goal, no layer remainder where none is needed.

Inside each MLP node ``L{l}MLP`` of the coarse circuit, the layer's neurons are ranked by their
node attribution ``|score|`` (:func:`~.search.top_nodes`, the ranking of the fixed stage; or
``|relevance|`` by RelP, ``neuron_ranking="relp"``) and the best ``max_neurons_per_mlp`` are the
candidates. A layer's remainder is ``L{l}MLP`` (the neurons
not named); *cutting* it removes its outgoing edges, and a named neuron left out loses its
outgoing edges too, so both read the corrupted run. The goal is ``min(target, coarse
faithfulness)``; every figure is an exact circuit run (:func:`~.runs.circuit_metrics`), made on
the coarse graph with each cut layer's MLP node passing on its kept neurons' changes only
(``kept_neurons``: the runs of the graph with the candidates named, without building it).

``neuron_search="joint"`` (default) chooses all layers together, in three searches, a trim and
a last check of the kept layers:

1. **Shares.** For each MLP node, the circuit with that layer's remainder cut (its candidates
   named), every other layer whole: ``share_alone`` is the faithfulness it loses (negative where
   cutting helps). One call for all layers.
2. **Which remainders go.** Layers ordered by ``share_alone``, smallest first: the fewest kept
   remainders (the largest shares) such that the circuit with all the others cut reaches the
   goal (doubling, then bisection).
3. **How many neurons.** In the layers whose remainder is cut, their candidates in one order by
   ``|score|`` across layers: the smallest count ``N`` whose top ``N`` named (the rest of those
   layers cut) reach the goal (doubling, then bisection, down to one neuron). A layer may end
   with no named neuron: it is not needed.
4. **Trim** (``neuron_trim=True``, default): one order across layers gives a layer more neurons
   than it needs where its scores are large. Each cut layer in turn (most named first) keeps the
   fewest of its own top named neurons that hold the goal, the others as they then are: first
   none of them (one run: a layer often needs none once the others hold the goal, 6 of 14 on
   SmolLM2's IOI circuit), else bisection down from the passing count (about ``log2(count)``
   runs per layer).

5. **Kept layers working against the circuit.** Step 2 chose the kept layers by their shares
   alone, with every candidate named; in the returned circuit (fewer named neurons) a kept
   layer's share can be negative: cutting it raises the faithfulness. While one is, the most
   negative is cut (``dropped``; the run without it is above the circuit's, so above the goal)
   and the remaining kept layers' shares are measured again (one call each time).

**Expert nodes** (``expert_nodes=True``): each expert node ``L{l}E{e}`` / ``L{l}S`` of the coarse
circuit is an MLP node here like ``L{l}MLP``, its candidates its neurons best by node attribution
(:func:`~.expert_naming.expert_neuron_scores`); *cut*, it passes on its kept neurons' changes only
(not its routing-weighted output bias, which is its remainder's; :mod:`.expert_kept`), each run
with its own routing. The rows and searches below then say "layer" for either kind.

A layer whose remainder is kept is not resolved: it stays one node ``L{l}MLP`` (no neuron named;
its candidates alone cannot replace it), and its share is measured in the returned circuit: the
faithfulness with the layer minus without it.

About ``L + 2 log2(L) + 2 log2(N)`` runs for ``L`` MLP nodes before the trim, one per resolved
layer in it and ``log2`` of its count where it needs a neuron, and one call per kept layer cut in
step 5, against up to
``3 log2(cap)`` per layer layer by layer.

``neuron_search="layers"`` resolves the layers one at a time (lowest first): the top ``k`` of the
layer named with its remainder cut, ``k`` chosen by doubling then bisection, earlier layers as
resolved; where even ``max_neurons_per_mlp`` do not hold the goal, that many are named and the
remainder is kept. The goal's slack is spent by the first layers that cost anything.

``circuit.extra["neuron_stage"]`` has one row per MLP node: ``node``, ``named`` (count),
``remainder`` (whether kept), ``remainder_share`` (the faithfulness it carries in the returned
circuit: with it minus without it; 0 where cut; joint: a kept remainder is the whole layer),
then ``share_alone`` (joint: lost when the remainder beyond the candidates is cut alone) and
``dropped`` (joint: kept by step 2, cut by step 5) or ``faithfulness`` (layers: after that layer
was resolved) and ``runs`` (layers).

Each call's circuits start from a kept run (:class:`~.runs.KeptRun`, :meth:`NeuronStage.keep`):
the coarse circuit's in steps 1 to 3, the returned circuit's so far before each layer's trim
and before the check of step 5 (``"layers"``: the layers resolved so far; made again only where
it differs below the layer), so a circuit runs the blocks from its first layer cut otherwise
than in the kept one, not from block 0.

The doublings and bisections run one size per :func:`~.runs.circuit_metrics` call where the
kept runs are held (every batch's: :attr:`NeuronStage.speculate`): the circuits of one call
then share nothing that those of the next do not. Where a batch's kept run is beyond its budget
(run again in each call that meets it), a call runs several sizes (its kept circuit's run
shared): the doubling ``k``, ``2k`` and ``4k`` together, the bisection its middle and both
halves' middles; they are read in the order of one at a time, so the choice is the same either
way, and some runs are made that the choice did not need.

With ``progress`` (the search's option) one bar counts the stage's exact runs (their number is
known only at the end), names the step running (joint: ``1/5`` to ``5/5``, the trim per layer;
layers: the layer) and ends with the goal, the named neurons and the remainders kept.

Every search is monotone only where the faithfulness is: the ``k`` found reaches the goal and
``k - 1`` (when run) does not, but a smaller ``k`` below the last failing one might.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import pandas as pd
import torch
from tqdm.auto import tqdm

from tl_attnonly.analysis.discovery.circuit import Circuit, faithfulness
from tl_attnonly.analysis.discovery.expert_kept import (
    KeptKey,
    expert_width,
    kept_layer,
    kept_sort_key,
)
from tl_attnonly.analysis.discovery.expert_nodes import EXPERT_NEURON_LABEL
from tl_attnonly.analysis.discovery.graph import mlp_rest_label
from tl_attnonly.analysis.discovery.options import DiscoveryOptions
from tl_attnonly.analysis.discovery.profiles import parse_neuron_label
from tl_attnonly.analysis.discovery.run_metrics import circuit_metrics
from tl_attnonly.analysis.discovery.run_reuse import KeptRun

if TYPE_CHECKING:
    from tl_attnonly.analysis.task import DiscoveryTask

#: Doubling sizes run in one call where the stage speculates (``k``, ``2k``, ``4k``).
LADDER = 3

#: The per-layer table of ``neuron_search="layers"``.
COLUMNS = ["node", "named", "remainder", "remainder_share", "faithfulness", "runs"]
#: The per-layer table of ``neuron_search="joint"``.
JOINT_COLUMNS = ["node", "named", "remainder", "remainder_share", "share_alone", "dropped"]


#: The circuit of a neuron-stage run: the coarse circuit with each MLP node of the dict cut (its
#: remainder's outgoing edges removed) but for its named neurons in the set; nodes absent whole.
#: A node is a dense layer ``l`` (its node ``L{l}MLP``) or an expert node's label ``"L{l}E{e}"``,
#: ``"L{l}S"`` (``expert_nodes=True``): the keys of ``kept_neurons`` (:mod:`.expert_kept`).
Cuts = dict[KeptKey, set[str]]


def node_label(node: KeptKey) -> str:
    """An MLP node's label: ``L{l}MLP`` for a dense layer ``l``, an expert node's its own."""
    return node if isinstance(node, str) else mlp_rest_label(node)


def _neuron_index(label: str) -> int:
    """The index of a neuron within its MLP node (``L{l}N{i}``: ``i``; ``L{l}E{e}N{j}``: ``j``)."""
    match = EXPERT_NEURON_LABEL.match(label)
    return int(match.group(3)) if match is not None else parse_neuron_label(label)[1]


def neuron_mask(d_mlp: int, names: Iterable[str]) -> torch.Tensor:
    """``bool [d_mlp]``: True at the neurons ``names`` (``L{l}N{i}``, one layer's; or one expert
    node's ``L{l}E{e}N{j}``, ``d_mlp`` its neurons)."""
    keep = torch.zeros(d_mlp, dtype=torch.bool)
    keep[[_neuron_index(n) for n in names]] = True
    return keep


def kept_neurons(cuts: Cuts, widths: int | Mapping[KeptKey, int]) -> dict[KeptKey, torch.Tensor]:
    """The :func:`~.runs.circuit_metrics` ``kept_neurons`` entry of ``cuts``: per cut MLP node,
    its kept named neurons as ``bool [width]`` (``widths``: per node, or ``d_mlp`` for all)."""
    return {
        node: neuron_mask(widths if isinstance(widths, int) else widths[node], names)
        for node, names in cuts.items()
    }


def kept_key(kept: Mapping[KeptKey, torch.Tensor]) -> tuple[tuple[KeptKey, bytes], ...]:
    """A key of a :func:`~.runs.circuit_metrics` ``kept_neurons`` entry: equal for entries of
    the same run (a dense layer keeping every neuron is a layer absent; an expert node keeping
    every neuron is not the whole expert: :mod:`.expert_kept`)."""
    return tuple(
        (node, mask.cpu().numpy().tobytes())
        for node, mask in sorted(kept.items(), key=lambda item: kept_sort_key(item[0]))
        if isinstance(node, str) or not bool(mask.all())
    )


def _cut(cuts: Cuts, layer: KeptKey, keep: set[str]) -> Cuts:
    """``cuts`` with MLP node ``layer``'s remainder cut and its named neurons not in ``keep``."""
    return _cut_all(cuts, {layer: keep})


def _cut_all(cuts: Cuts, keep: Mapping[KeptKey, set[str]]) -> Cuts:
    """``cuts`` with every layer of ``keep`` cut but its named neurons in ``keep[layer]``."""
    return {**cuts, **{layer: set(names) for layer, names in keep.items()}}


class NeuronStage:
    """The neuron stage's ground: the coarse circuit, the candidates, and exact runs of the
    circuit with layers cut (:data:`Cuts`), counted.

    A run is the coarse circuit on the graph with every candidate named (each coarse edge of
    ``L{l}MLP`` on each named neuron and the remainder) with the outgoing edges of each cut
    layer's remainder and left-out named neurons removed. It is computed on the coarse graph:
    each cut layer's MLP node passes on the change of its kept neurons only
    (:func:`~.runs.circuit_metrics`' ``kept_neurons``; the same run, without a graph of the
    candidates and a mask per circuit).

    Args:
        task: The search's model, prompts, metric, position classes, batch size and corrupted
            runs (:class:`~tl_attnonly.analysis.task.DiscoveryTask`).
        coarse: The coarse circuit.
        ranked: Per MLP node (a dense layer, or an expert node's label: :data:`Cuts`), its
            candidates best first (at most ``max_neurons_per_mlp``).
        opts: The search's options (``target``, ``neuron_trim``, ``progress``).
        nodes: The coarse graph's nodes (every head and MLP node).
    """

    def __init__(
        self,
        task: DiscoveryTask,
        coarse: Circuit,
        ranked: Mapping[KeptKey, list[str]],
        opts: DiscoveryOptions,
        nodes: list[str],
    ):
        self.task, self.model = task, task.model
        self.coarse, self.opts, self.ranked = coarse, opts, ranked
        self.nodes = nodes
        d_mlp = int(self.model.cfg.d_mlp or 0)
        #: per MLP node, its neurons (the width of its kept_neurons entry)
        self.widths: dict[KeptKey, int] = {
            node: d_mlp if isinstance(node, int) else expert_width(coarse.graph, node)
            for node in ranked
        }
        self.goal = min(opts.target, coarse.faithfulness)
        self.n_runs = 0
        #: every run's metric value (:func:`kept_key` of its kept neurons -> value), for the
        #: returned circuit's table of the same runs (:func:`~.search.discover_circuit`)
        self.measured: dict[tuple[tuple[KeptKey, bytes], ...], float] = {}
        self.kept: tuple[Cuts, KeptRun] | None = None
        self.held = False  # the last call's kept run held every batch's run
        # one bar over the stage's exact runs (their number is known only at the end)
        self.bar = tqdm(desc="neuron stage", unit=" runs", disable=not opts.progress)
        self.bar.set_postfix_str(f"goal {self.goal:.3f}")

    def step(self, name: str) -> None:
        """Show the search's current step on the progress bar (``opts.progress``)."""
        self.bar.set_description_str(f"neuron stage: {name}")

    def close(self, summary: str = "") -> None:
        """Close the progress bar, with ``summary`` (e.g. the names chosen) beside the goal."""
        self.bar.set_description_str("neuron stage")
        self.bar.set_postfix_str(f"goal {self.goal:.3f}" + (f", {summary}" if summary else ""))
        self.bar.close()

    @property
    def speculate(self) -> bool:
        """Whether a search runs several sizes per call (:func:`_smallest`): not where the
        last call's kept run held every batch, so that each call's circuits start from it and
        share nothing more within the call; else the sizes of one call share its kept circuit's
        run (made again in each call that meets a batch beyond the kept run's budget)."""
        return not self.held

    def keep(self, cuts: Cuts, below: int | None = None) -> None:
        """Keep the run of ``cuts`` (:class:`~.runs.KeptRun`): the next calls' circuits start at
        their first layer cut otherwise than in ``cuts`` instead of at block 0 (the run is made
        in the next call). ``below``: the next circuits differ from ``cuts`` in layers
        ``>= below`` only; the run kept already serves them as well where it agrees with
        ``cuts`` below that layer, and is kept instead. A new kept run is made from the old
        one (``parent``): from the first block where their circuits differ, not from block 0."""
        if self.kept is not None and below is not None:
            old = self.kept[0]
            differ = (li for li in set(old) | set(cuts) if kept_layer(li) < below)
            if all(old.get(li) == cuts.get(li) for li in differ):
                return
        parent = None if self.kept is None else self.kept[1]  # its runs start from the old's
        self.kept = (
            dict(cuts),
            KeptRun(self.coarse.mask, kept_neurons(cuts, self.widths), parent=parent),
        )

    def faithfulness(self, circuits: list[Cuts]) -> list[float]:
        """The exact faithfulness of each circuit, in one call (from the run of :meth:`keep`)."""
        kept = [kept_neurons(cuts, self.widths) for cuts in circuits]
        task = self.task
        values = circuit_metrics(
            self.model, [self.coarse.mask] * len(circuits), task.clean, task.corrupted,
            task.metric, nodes=self.nodes, batch_size=task.batch_size, positions=task.positions,
            corrupted_runs=task.corrupted_runs, kept_neurons=kept,
            kept_run=None if self.kept is None else self.kept[1],
        )  # fmt: skip
        self.n_runs += len(circuits)
        self.bar.update(len(circuits))
        self.measured.update((kept_key(k), v) for k, v in zip(kept, values, strict=True))
        self.held = self.kept is not None and self.kept[1].missed == 0
        c = self.coarse
        return [faithfulness(v, c.metric_clean, c.metric_corrupted) for v in values]

    def sizes(self, build: Callable[[int], Cuts]):
        """``evaluate(ks)`` for :func:`_smallest`: the circuits ``build(k)``, run in one call."""

        def evaluate(ks: list[int]) -> dict[int, tuple[Cuts, float]]:
            circuits = [build(k) for k in ks]
            return dict(
                zip(ks, zip(circuits, self.faithfulness(circuits), strict=True), strict=True)
            )

        return evaluate


def _smallest(
    evaluate: Callable[[list[int]], dict[int, tuple[Cuts, float]]],
    first: int,
    cap: int,
    goal: float,
    passing: tuple[Cuts, float] | None = None,
    speculate: bool = True,
    none_first: bool = False,
) -> tuple[int | None, dict[int, tuple[Cuts, float]]]:
    """The smallest ``k`` in ``[first, cap]`` whose run reaches ``goal``: doubling from
    ``first``, then bisection between the last failing and the first passing size, down to one.
    ``evaluate(ks)`` runs the sizes ``ks`` in one call and returns ``{k: (circuit,
    faithfulness)}``. ``passing``: ``cap``'s run, known to reach the goal: no doubling,
    bisection between ``first - 1`` and ``cap``. ``speculate``: each call runs the next
    ``LADDER`` sizes of the doubling, or the bisection's middle and both halves' middles (two
    steps), some of which the choice does not need; else one size per call. The sizes are read
    in the same order either way: the same ``k``. ``none_first`` (with ``passing``): ``first``
    is run alone before the bisection and returned if it reaches the goal (a size the bisection
    might not have run where the faithfulness is not monotone: then a smaller ``k``); else the
    bisection is the same as without it (one run more).

    Returns:
        ``(k, tried)``: ``k`` (None where even ``cap`` fails) and every run made.
    """
    tried: dict[int, tuple[Cuts, float]] = {}

    def run(ks: list[int]) -> None:
        ks = list(dict.fromkeys(k for k in ks if k not in tried))
        if ks:
            tried.update(evaluate(ks))

    def grow(k: int) -> int:
        return max(1, 2 * k)

    lo, hi, k = first - 1, None, first
    if passing is not None:
        tried[cap], hi = passing, cap
        if none_first and first < cap:
            run([first])
            if tried[first][1] >= goal:
                return first, tried
    while hi is None:
        k = min(k, cap)
        if k not in tried:  # the next sizes of the doubling in one call
            ladder = [k]
            for _ in range(LADDER - 1 if speculate else 0):
                ladder.append(min(grow(ladder[-1]), cap))
            run(ladder)
        if tried[k][1] >= goal:
            hi = k
        elif k == cap:
            break
        else:
            lo, k = k, grow(k)
    while hi is not None and hi - lo > 1:
        # speculating, two bisection steps in one call: the middle, then either half's middle
        mid = (lo + hi) // 2
        ahead = ((lo + mid) // 2, (mid + hi) // 2) if speculate else ()
        run([m for m in (mid, *ahead) if lo < m < hi])
        for _ in range(2 if speculate else 1):
            if hi - lo <= 1:
                break
            mid = (lo + hi) // 2
            if tried[mid][1] >= goal:
                hi = mid
            else:
                lo = mid
    return hi, tried


def resolve_neurons(
    stage: NeuronStage,
) -> tuple[dict[KeptKey, list[str]], set[KeptKey], pd.DataFrame]:
    """Choose the named neurons of each MLP node one layer at a time (``neuron_search="layers"``,
    module docstring).

    Args:
        stage: The coarse circuit, its candidates per layer and the runs
            (:class:`NeuronStage`).

    Returns:
        ``(named, cut, table)``: per layer the named neurons, the layers whose remainder lost
        its outgoing edges, and the per-layer table.
    """
    ranked = stage.ranked
    cuts: Cuts = {}
    current = stage.coarse.faithfulness
    named: dict[KeptKey, list[str]] = {}
    cut: set[KeptKey] = set()
    rows = []
    for li in sorted(ranked, key=kept_sort_key):
        order = ranked[li]

        def build(k: int, base=cuts, li=li, order=order) -> Cuts:
            return _cut(base, li, set(order[:k]))

        stage.keep(cuts, below=kept_layer(li))  # the runs differ from it in layer li only
        stage.step(node_label(li))
        k, tried = _smallest(
            stage.sizes(build), 1, len(order), stage.goal, speculate=stage.speculate
        )
        if k is None:  # the remainder is needed: name them all, keep it
            named[li] = list(order)
            share = current - tried[len(order)][1]
            rows.append((node_label(li), len(order), True, share, current, len(tried)))
            continue
        cuts, current = tried[k]
        named[li] = list(order[:k])
        cut.add(li)
        rows.append((node_label(li), k, False, 0.0, current, len(tried)))
    stage.close(_summary(named, len(ranked) - len(cut)))
    return named, cut, pd.DataFrame(rows, columns=COLUMNS)


def resolve_neurons_jointly(
    stage: NeuronStage, scores: pd.Series
) -> tuple[dict[KeptKey, list[str]], set[KeptKey], pd.DataFrame, int]:
    """Choose the named neurons of all MLP nodes together (``neuron_search="joint"``, module
    docstring).

    Args:
        stage: The coarse circuit, its candidates per layer (at most ``max_neurons_per_mlp``,
            best first) and the runs (:class:`NeuronStage`).
        scores: Every candidate's node attribution score (``L{l}N{i}``, an expert node's
            ``L{l}E{e}N{j}`` -> score); the candidates of the MLP nodes whose remainder is cut
            are ordered by ``|score|`` across them.

    Returns:
        ``(named, cut, table, runs)``: per layer the named neurons (none in a kept layer, and
        none in a cut layer that is not needed), the layers whose remainder lost its outgoing
        edges, the per-layer table and the number of exact runs made.
    """
    ranked, coarse, opts = stage.ranked, stage.coarse, stage.opts
    layers = sorted(ranked, key=kept_sort_key)
    base: Cuts = {}  # the coarse circuit
    goal = stage.goal
    candidates = {li: set(ranked[li]) for li in layers}
    stage.keep(base)  # steps 1-3 cut layers of the coarse circuit: each run from its lowest
    # 1. each layer's remainder cut alone
    stage.step("1/5 shares")
    alone = stage.faithfulness([_cut(base, li, candidates[li]) for li in layers])
    share_alone = {li: coarse.faithfulness - f for li, f in zip(layers, alone, strict=True)}
    # 2. the fewest kept remainders (largest shares kept)
    by_share = sorted(layers, key=lambda li: share_alone[li])

    def keep_remainders(q: int) -> Cuts:
        return _cut_all(base, {li: candidates[li] for li in by_share[: len(layers) - q]})

    stage.step("2/5 which remainders go")
    q, tried_q = _smallest(
        stage.sizes(keep_remainders), 0, len(layers), goal, speculate=stage.speculate
    )
    if q is None:  # rounding below a goal the coarse circuit sits on: keep every remainder
        q, tried_q = len(layers), {len(layers): (base, coarse.faithfulness)}
    cut = sorted(by_share[: len(layers) - q], key=kept_sort_key)
    final_cuts, final = tried_q[q]
    # 3. the fewest named neurons in the cut layers, one order across them
    pool = [n for li in cut for n in ranked[li]]
    pool.sort(key=lambda n: -abs(float(scores[n])))
    layer_of = {n: li for li in cut for n in ranked[li]}

    def top(n_named: int) -> Cuts:
        keep: dict[KeptKey, set[str]] = {li: set() for li in cut}
        for n in pool[:n_named]:
            keep[layer_of[n]].add(n)
        return _cut_all(base, keep)

    n_named = len(pool)
    if pool:
        stage.step("3/5 how many neurons")
        found, tried_n = _smallest(stage.sizes(top), 0, len(pool), goal, speculate=stage.speculate)
        if found is not None:
            n_named = found
            final_cuts, final = tried_n[found]
    chosen = set(pool[:n_named])
    named = {li: [n for n in ranked[li] if n in chosen] for li in layers}
    # 4. trim: each cut layer's named neurons (most first) to the fewest of its own top ones
    # that keep the goal, the other layers as they are then (bisection from a passing circuit)
    if opts.neuron_trim:
        for li in sorted(cut, key=lambda li: (-len(named[li]), kept_sort_key(li))):
            mine = named[li]
            if not mine:
                continue
            others = {lj: set(named[lj]) for lj in cut if lj != li}

            def trimmed(k: int, li=li, mine=mine, others=others) -> Cuts:
                return _cut_all(base, {**others, li: set(mine[:k])})

            stage.keep(final_cuts, below=kept_layer(li))  # the runs differ from it there only
            stage.step(f"4/5 trim {node_label(li)}")
            k, tried_k = _smallest(
                stage.sizes(trimmed), 0, len(mine), goal, passing=(final_cuts, final),
                speculate=stage.speculate, none_first=True,
            )  # fmt: skip
            assert k is not None  # len(mine) passes
            named[li] = mine[:k]
            final_cuts, final = tried_k[k]
    # 5. each kept layer's share in the returned circuit (with it minus without it); while one
    # is negative, the most negative is cut (the run without it is above the circuit's, so
    # above the goal) and the others' shares are measured again
    kept = [li for li in layers if li not in cut]
    dropped: list[KeptKey] = []
    stage.step("5/5 kept layers")
    while True:
        circuits = [_cut(final_cuts, li, set()) for li in kept]
        if kept:
            stage.keep(final_cuts, below=min(kept_layer(li) for li in kept))
        without = dict(zip(kept, stage.faithfulness(circuits) if circuits else [], strict=True))
        share = {li: final - without[li] for li in kept}
        if not kept or min(share.values()) >= 0:
            break
        worst = min(kept, key=lambda li: (share[li], kept_sort_key(li)))
        final_cuts, final = circuits[kept.index(worst)], without[worst]
        kept.remove(worst)
        dropped.append(worst)
    rows = [
        (
            node_label(li), len(named[li]), li in share, share.get(li, 0.0),
            share_alone[li], li in dropped,
        )
        for li in layers
    ]  # fmt: skip
    cut_all = set(cut) | set(dropped)
    stage.close(_summary(named, len(kept)))
    return named, cut_all, pd.DataFrame(rows, columns=JOINT_COLUMNS), stage.n_runs


def _summary(named: Mapping[KeptKey, list[str]], n_kept: int) -> str:
    """``"469 named, 14 remainder(s) kept"``: the progress bar's last words."""
    return f"{sum(map(len, named.values())):,} named, {n_kept} remainder(s) kept"


__all__ = [
    "NeuronStage",
    "kept_key",
    "kept_neurons",
    "neuron_mask",
    "node_label",
    "resolve_neurons",
    "resolve_neurons_jointly",
]
