"""Options of :func:`~tl_attnonly.analysis.discover_circuit`, in one object.

``discover_circuit(model, clean, corrupted, metric, options=DiscoveryOptions(...), **overrides)``:
the keywords given one by one replace the options' fields (:meth:`DiscoveryOptions.with_overrides`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from tl_attnonly._types import replace_options
from tl_attnonly.analysis.discovery.pruning import RANKINGS

#: Graphs :func:`~tl_attnonly.analysis.discover_circuit` searches.
GRAPHS = ("coarse", "neurons")
#: How the metric combines over batches.
REDUCTIONS = ("sum", "mean")
#: How ``neurons_per_mlp="auto"`` chooses the named neurons (:mod:`.neuron_stage`).
NEURON_SEARCHES = ("joint", "layers")
#: How the named neurons of an MLP node are ranked (``graph="coarse"``).
NEURON_RANKINGS = ("attribution", "relp", "circuit")


@dataclass(frozen=True)
class DiscoveryOptions:
    """How :func:`~tl_attnonly.analysis.discover_circuit` searches.

    Attributes:
        graph: ``"coarse"`` (default): every attention head (its ``q``, ``k``, ``v`` apart), every
            MLP layer as one node ``L{l}MLP``, the embeddings and the logits; the neurons of the
            circuit's MLP nodes are named where ``neurons_per_mlp`` asks for them.
            ``"neurons"``: the neuron-level graph (every neuron, or ``nodes`` / ``n_nodes`` of
            them).
        target: The faithfulness the smallest circuit must reach (sweep of exact circuit runs);
            used when neither ``top_n`` nor ``threshold`` is given.
        coarse_target: ``graph="coarse"``: the faithfulness the coarse circuit's sweep and
            pruning aim for instead (default: ``target``). Above ``target`` it leaves the
            adaptive neuron stage (``neurons_per_mlp="auto"``, which keeps ``target``) room to
            cut layer remainders; the coarse circuit is larger.
        top_n, threshold: A fixed-size circuit instead of the sweep
            (:func:`~tl_attnonly.analysis.prune`); at most one.
        method: Edge scores, ``"eap-ig"`` (default) or ``"eap"``.
        ranking: How the sweep orders the scored edges (:func:`~.pruning.ranking_values`).
            ``"signed"`` (default): by the estimated effect toward the clean run, so an edge that
            works against the behaviour (a negative name mover's) is ranked last and a small
            circuit holds what produces the behaviour (``Circuit.opposing`` lists the largest
            such edges left out). ``"absolute"``: by ``|score|`` (both kinds mixed; on real
            models the circuit at the target is far larger, ``docs/open_questions.md``).
        ig_steps: Interpolation steps of ``"eap-ig"``.
        neuron_level: One node per neuron (default) or per neuron-head (``graph="neurons"``).
        nodes, n_nodes, mlp_rest: ``graph="neurons"`` only: restrict the graph
            (:func:`~tl_attnonly.analysis.top_nodes`, :class:`~.graph.HeadGraph`).
        neurons_per_mlp: ``graph="coarse"``: neurons named in each MLP node of the circuit. 0
            (default) names none: each MLP node stays its whole layer, and
            :meth:`~.circuit.Circuit.report` says how to resolve it (a fixed count by node
            attribution often names neurons that carry little of their layer's effect; the
            report states their share either way). ``N``: the ``N`` with the largest node
            attribution ``|score|``, the rest of the layer one node ``L{l}MLP``. ``"auto"``: as
            few as keep the exact faithfulness at ``min(target, coarse faithfulness)`` with the
            rest of their layers cut (:mod:`~.neuron_stage`: doubling, then bisection, by exact
            runs; ``neuron_search``), a remainder kept only where its layer's
            ``max_neurons_per_mlp`` candidates cannot replace it
            (``circuit.extra["neuron_stage"]``).
        max_neurons_per_mlp: ``neurons_per_mlp="auto"``: most neurons named per MLP node (its
            candidates, the best by ``neuron_ranking``).
        whole_mlps: ``graph="coarse"``: MLP layers whose node is never split into named neurons
            (it stays one node ``L{l}MLP`` in the circuit where the coarse circuit has it). The IOI
            literature treats MLP0 as an extension of the embedding: ``whole_mlps=(0,)`` keeps
            it whole, so the named neurons are the ones past layer 0.
        expert_nodes: ``graph="coarse"``: a mixture-of-experts layer's nodes are its experts
            (``L{l}E{e}``, shared ``L{l}S``: each writes its weighted output;
            :mod:`~.expert_nodes`) instead of the whole layer ``L{l}MLP``; the layer keeps its
            one input ``L{l}MLP``. With ``neurons_per_mlp=N`` each expert node of the coarse
            circuit gets its ``N`` best neurons by node attribution named (``L{l}E{e}N{j}``,
            ``L{l}SN{j}``; the expert's node is then its remainder: :mod:`~.expert_naming`);
            with ``neurons_per_mlp="auto"`` each expert node is resolved as a dense MLP node is
            (its ``max_neurons_per_mlp`` candidates by node attribution within the expert,
            chosen by exact runs in which a cut expert passes on its kept neurons' changes
            only: :mod:`~.neuron_stage`, :mod:`~.expert_kept`). ``neuron_ranking`` other than
            ``"attribution"`` is refused with it where neurons are named. Refused on a model
            without experts.
        neuron_ranking: ``graph="coarse"``: how each MLP node's neurons are ranked (the fixed
            count's names, the adaptive stage's candidates and its order across layers):
            ``"attribution"`` (default: node attribution patching ``|score|``,
            :func:`~.search.top_nodes`), ``"relp"`` (``|relevance|`` by RelP,
            :func:`~.relevance.neuron_relevance`: one more backward pass with its rules; decoders
            with dense neuron-head layers) or ``"circuit"`` (``|score|`` along the MLP node's
            edges in the coarse circuit only, the readers a named neuron passes its change on to:
            :func:`~.circuit_neurons.circuit_neuron_scores`, by ``neuron_method``).
        neuron_search: ``neurons_per_mlp="auto"``: ``"joint"`` (default: every layer's
            remainder cut alone, then the fewest remainders kept and the fewest named neurons
            across the layers, each by exact runs) or ``"layers"`` (one layer at a time, lowest
            first); :mod:`~.neuron_stage`.
        neuron_trim: ``neuron_search="joint"``: after the count across layers, trim each
            resolved layer to the fewest of its own top named neurons that keep the goal (default;
            one more exact run per resolved layer where it needs none of them, else about
            ``1 + log2(count)``).
        neuron_method: Edge scores of the graph with named neurons (``"eap"``, default: one
            gradient pass; they rank and list its edges, the circuit itself is the coarse one's,
            expanded, with its exact faithfulness), and the scores of ``neuron_ranking="circuit"``.
        batch_size: Examples per pass; default all at once.
        metric_reduction: ``"sum"`` (default): the metric is additive over examples (a sum, or a
            dataset mean written as a sum divided by the dataset size), checked before any work
            when there are several batches. ``"mean"``: the metric is a mean over the batch it
            is given; each batch's value is weighted by its share of the examples.
        gate_value: Split the incoming edges of the circuit's neurons into gate and value.
        max_gate_value_neurons: Split at most this many neurons.
        max_runs: Most exact circuit runs of the sweep (geometric sizes, then bisection).
        resolution: The bisection stops when the largest failing size is within this factor of
            the smallest size reaching the target.
        prune_runs: Most exact runs of the greedy pruning pass after the sweep
            (:func:`~.refine.prune_by_runs`: the sweep's circuit loses its lowest-scored edges
            in chunks while its exact faithfulness stays at the target); 0: no pass, the
            circuit is the sweep's top-``n``.
        mib_curve: Also run the ranking's top-``k`` circuits at MIB's edge fractions
            (:data:`~.scoring.MIB_FRACTIONS`, exact runs on the coarse circuit's graph:
            ``circuit.extra["mib_curve"]``, with ``"mib_cpr"`` and ``"mib_cmd"``, its areas;
            :meth:`~.circuit.Circuit.report` prints them). Ten more exact runs.
        progress: Progress bars.
    """

    graph: str = "coarse"
    target: float = 0.8
    coarse_target: float | None = None
    top_n: int | None = None
    threshold: float | None = None
    method: str = "eap-ig"
    ranking: str = "signed"
    ig_steps: int = 5
    neuron_level: bool = True
    nodes: Collection[str] | None = None
    n_nodes: int | None = None
    mlp_rest: bool = False
    neurons_per_mlp: int | str = 0
    max_neurons_per_mlp: int = 256
    whole_mlps: Collection[int] = ()
    expert_nodes: bool = False
    neuron_search: str = "joint"
    neuron_ranking: str = "attribution"
    neuron_trim: bool = True
    neuron_method: str = "eap"
    batch_size: int | None = None
    metric_reduction: str = "sum"
    gate_value: bool = True
    max_gate_value_neurons: int = 4
    max_runs: int = 24
    resolution: float = 1.1
    prune_runs: int = 30
    mib_curve: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        if self.graph not in GRAPHS:
            raise ValueError(f"graph must be one of {GRAPHS}, got {self.graph!r}.")
        for name in ("method", "neuron_method"):
            if getattr(self, name) not in ("eap", "eap-ig"):
                raise ValueError(f"{name} must be 'eap' or 'eap-ig', got {getattr(self, name)!r}.")
        if self.ranking not in RANKINGS:
            raise ValueError(f"ranking must be one of {RANKINGS}, got {self.ranking!r}.")
        if self.metric_reduction not in REDUCTIONS:
            raise ValueError(
                f"metric_reduction must be one of {REDUCTIONS}, got {self.metric_reduction!r}."
            )
        if self.top_n is not None and self.threshold is not None:
            raise ValueError("Give top_n=... or threshold=..., not both (or neither: the sweep).")
        if not 0 < self.target <= 1:
            raise ValueError(f"target must be in (0, 1], got {self.target}.")
        if self.coarse_target is not None:
            if self.graph != "coarse":
                raise ValueError(
                    "coarse_target= is the coarse circuit's target: give graph='coarse' with it."
                )
            if self.top_n is not None or self.threshold is not None:
                raise ValueError(
                    "coarse_target= is the target of the coarse circuit's sweep; top_n= / "
                    "threshold= choose a fixed-size circuit without one: give one or the other."
                )
            if not self.target <= self.coarse_target <= 1:
                raise ValueError(
                    f"coarse_target must be in [target, 1] = [{self.target}, 1], got "
                    f"{self.coarse_target}."
                )
        if self.resolution <= 1:
            raise ValueError(f"resolution must be > 1, got {self.resolution}.")
        if self.max_runs < 1:
            raise ValueError(f"max_runs must be >= 1, got {self.max_runs}.")
        if self.prune_runs < 0:
            raise ValueError(
                f"prune_runs must be >= 0 (0: no pruning pass), got {self.prune_runs}."
            )
        if isinstance(self.neurons_per_mlp, str) or isinstance(self.neurons_per_mlp, bool):
            if self.neurons_per_mlp != "auto":
                raise ValueError(
                    f"neurons_per_mlp must be an int >= 0 or 'auto', got {self.neurons_per_mlp!r}."
                )
        elif self.neurons_per_mlp < 0:
            raise ValueError(f"neurons_per_mlp must be >= 0, got {self.neurons_per_mlp}.")
        if self.neuron_search not in NEURON_SEARCHES:
            raise ValueError(
                f"neuron_search must be one of {NEURON_SEARCHES}, got {self.neuron_search!r}."
            )
        if self.neuron_ranking not in NEURON_RANKINGS:
            raise ValueError(
                f"neuron_ranking must be one of {NEURON_RANKINGS}, got {self.neuron_ranking!r}."
            )
        if self.neuron_ranking != "attribution" and self.graph != "coarse":
            raise ValueError(
                "neuron_ranking= ranks the neurons named in the coarse circuit's MLP nodes: give "
                "graph='coarse' with it (graph='neurons' ranks nodes by node attribution)."
            )
        if any(isinstance(li, bool) or not isinstance(li, int) or li < 0 for li in self.whole_mlps):
            raise ValueError(
                f"whole_mlps must hold MLP layer indices (ints >= 0), got {self.whole_mlps!r}."
            )
        if self.whole_mlps and self.graph != "coarse":
            raise ValueError(
                "whole_mlps= keeps MLP nodes of the coarse circuit whole when its neurons are "
                "named: give graph='coarse' with it."
            )
        if self.expert_nodes and self.graph != "coarse":
            raise ValueError(
                "expert_nodes=True names a mixture of experts' experts as nodes of the coarse "
                "graph: give graph='coarse' with it (or name them in nodes=[...]: 'L1E0', 'L1S')."
            )
        if self.expert_nodes and self.neurons_per_mlp != 0 and self.neuron_ranking != "attribution":
            raise ValueError(
                f"neuron_ranking={self.neuron_ranking!r} with expert_nodes=True is not supported: "
                "an expert node's neurons are ranked by node attribution only. Give "
                "neuron_ranking='attribution' (the default), neurons_per_mlp=0 or "
                "expert_nodes=False."
            )
        if self.max_neurons_per_mlp < 1:
            raise ValueError(f"max_neurons_per_mlp must be >= 1, got {self.max_neurons_per_mlp}.")
        if self.graph == "coarse" and (
            self.nodes is not None or self.n_nodes is not None or self.mlp_rest
        ):
            raise ValueError(
                "nodes=, n_nodes= and mlp_rest= restrict the neuron-level graph; give "
                "graph='neurons' with them (graph='coarse' already holds every head and every MLP "
                "layer as one node)."
            )
        if self.graph == "coarse" and not self.neuron_level:
            raise ValueError(
                "graph='coarse' names neurons, not neuron-heads: use neuron_level=True, or "
                "graph='neurons' with neuron_level=False."
            )

    def with_overrides(self, **changes: Any) -> DiscoveryOptions:
        """A copy with the given fields replaced (``discover_circuit(..., target=0.9)``).

        Raises:
            TypeError: For a name that is not an option, listing the options.
        """
        return replace_options(
            self,
            changes,
            "Unknown discovery option(s) {unknown}; the options are {names} "
            "(tl_attnonly.analysis.DiscoveryOptions).",
        )


#: Keywords of the earlier ``discover_circuit`` that select its single-stage neuron-level search.
LEGACY_KEYWORDS = ("top_n", "threshold", "nodes", "n_nodes", "mlp_rest")


def resolve_options(
    options: DiscoveryOptions | None, overrides: dict[str, Any]
) -> DiscoveryOptions:
    """``options`` (default :class:`DiscoveryOptions`) with ``overrides`` applied.

    Without ``options`` and ``graph``, a call with the earlier keywords (``top_n``, ``threshold``,
    ``nodes``, ``n_nodes``, ``mlp_rest``) keeps their earlier meaning: the neuron-level graph,
    ranked by plain EAP and ``|score|`` unless ``method`` / ``ranking`` is given.
    """
    if options is None:
        options = DiscoveryOptions()
        legacy = any(overrides.get(k) not in (None, False) for k in LEGACY_KEYWORDS)
        if legacy and "graph" not in overrides:
            base: dict[str, Any] = {"graph": "neurons"}
            if "method" not in overrides:
                base["method"] = "eap"
            if "ranking" not in overrides:
                base["ranking"] = "absolute"
            overrides = {**base, **overrides}
    return options.with_overrides(**overrides)


__all__ = ["DiscoveryOptions", "GRAPHS", "NEURON_RANKINGS", "NEURON_SEARCHES", "REDUCTIONS"]
