"""``neurons_per_mlp="auto"``: as few named neurons per MLP node as hold the target, by exact runs.

Every figure of the stage is checked against independent exact circuit runs (fp64 models) on a
graph built here from the named neurons: the returned circuit is the coarse circuit with each
resolved layer's remainder cut, it reaches the goal, one neuron fewer does not, and a kept
remainder's share is the difference of the two runs with and without it. Both searches:
``neuron_search="joint"`` (default; all layers together) and ``"layers"`` (one at a time).
"""

from __future__ import annotations

import pytest
import torch
from conftest import GATED_ZOO, make_tokens
from models import make_converted
from tqdm.auto import tqdm

from tl_attnonly.analysis import (
    DiscoveryOptions,
    HeadGraph,
    circuit_metric,
    discover_circuit,
    faithfulness,
    logit_diff_metric,
)
from tl_attnonly.analysis.discovery.neuron_stage import NeuronStage
from tl_attnonly.analysis.discovery.pruning import mask_size
from tl_attnonly.analysis.discovery.search import coarse_nodes, expand_mask

CLEAN, CORRUPTED = make_tokens(4, 8, seed=0), make_tokens(4, 8, seed=1)
METRIC = logit_diff_metric(torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8]))


#: discover_circuit's notes (an overshooting circuit, value edges not kept) are not the subject
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _discover(model, **kw):
    return discover_circuit(model, CLEAN, CORRUPTED, METRIC, gate_value=False, progress=False, **kw)


def _resolved_faithfulness(model, coarse, named: dict[int, list[str]], cut: set[int]) -> float:
    """The coarse circuit with ``named`` neurons as nodes and the remainders of ``cut`` layers
    without outgoing edges, run exactly on a graph built here."""
    nodes = coarse_nodes(model) + [n for v in named.values() for n in v]
    graph = HeadGraph(model, nodes=nodes)
    mask = expand_mask(coarse.graph, coarse.mask, graph)
    for key in mask:
        if key[0] in {f"mlp.{li}" for li in cut}:
            mask[key] = torch.zeros_like(mask[key])
    value = circuit_metric(model, mask, CLEAN, CORRUPTED, METRIC, nodes=nodes)
    return faithfulness(value, coarse.metric_clean, coarse.metric_corrupted)


def _ranking(model, layer: int) -> list[str]:
    """The layer's neurons by node attribution |score| (the ranking the stage names from)."""
    from tl_attnonly.analysis import top_nodes

    _, scores = top_nodes(model, CLEAN, CORRUPTED, METRIC, 1, progress=False)
    layer_scores = scores[[i for i in scores.index if i.startswith(f"L{layer}N")]]
    return list(layer_scores.abs().sort_values(ascending=False, kind="stable").index)


def test_layers_search_names_the_fewest_neurons_that_hold_the_target_exactly():
    model = make_converted("silu", **GATED_ZOO["llama"])
    circuit = _discover(model, neurons_per_mlp="auto", neuron_search="layers")
    coarse = circuit.extra["coarse"]
    stage = circuit.extra["neuron_stage"]
    named = circuit.extra["named"]
    goal = min(0.8, coarse.faithfulness)
    assert len(stage) == len(named) >= 1
    assert not stage.remainder.any()
    # the returned circuit: every resolved layer's remainder cut, its faithfulness an exact run's
    again = _resolved_faithfulness(model, coarse, named, set(named))
    assert circuit.faithfulness == pytest.approx(again, rel=1e-10)
    assert circuit.faithfulness >= goal
    assert circuit.extra["faithfulness_named_only"] == pytest.approx(again, rel=1e-10)
    assert (circuit.mlp_split.rest_effect.abs() < 1e-12).all()
    # layer by layer (lowest first, earlier layers resolved): k holds the goal, k - 1 does not
    done: dict[int, list[str]] = {}
    for row in stage.itertuples():
        li = int(row.node[1:-3])
        order = _ranking(model, li)
        assert named[li] == order[: row.named]
        here = _resolved_faithfulness(model, coarse, {**done, li: order[: row.named]}, {*done, li})
        assert here == pytest.approx(row.faithfulness, rel=1e-10) and here >= goal
        if row.named > 1:
            fewer = {**done, li: order[: row.named - 1]}
            assert _resolved_faithfulness(model, coarse, fewer, {*done, li}) < goal
        done[li] = order[: row.named]
    text = circuit.report()
    assert 'neurons_per_mlp="auto"' in text and "remainder_share" in text


def test_layers_search_keeps_a_needed_remainder_and_states_its_share():
    model = make_converted("silu", **GATED_ZOO["llama"])
    free = _discover(model, neurons_per_mlp="auto", neuron_search="layers")
    needed = int(free.extra["neuron_stage"].named.max())
    assert needed > 1, "the case needs a layer that one neuron cannot carry"
    circuit = _discover(
        model, neurons_per_mlp="auto", neuron_search="layers", max_neurons_per_mlp=needed - 1
    )
    coarse = circuit.extra["coarse"]
    stage = circuit.extra["neuron_stage"]
    assert stage.remainder.any()
    named, cut = circuit.extra["named"], set()
    for row in stage.itertuples():  # lowest layer first, earlier layers as resolved
        li = int(row.node[1:-3])
        top = _ranking(model, li)[: row.named]
        assert named[li] == top
        if not row.remainder:
            cut.add(li)
            continue
        assert row.named == needed - 1
        # the share: the circuit with the remainder minus the circuit without it
        done = {lj: named[lj] for lj in named if lj < li}
        with_rest = _resolved_faithfulness(model, coarse, {**done, li: top}, set(cut))
        without = _resolved_faithfulness(model, coarse, {**done, li: top}, {*cut, li})
        assert row.remainder_share == pytest.approx(with_rest - without, rel=1e-9, abs=1e-12)
        assert without < min(0.8, coarse.faithfulness)
    # a kept remainder changes nothing: the circuit is the coarse one, exactly
    if stage.remainder.all():
        assert circuit.metric_circuit == pytest.approx(coarse.metric_circuit, rel=1e-10)


def test_auto_options_are_checked_and_the_default_names_none():
    assert DiscoveryOptions().neurons_per_mlp == 0
    assert DiscoveryOptions(neurons_per_mlp="auto").max_neurons_per_mlp == 256
    with pytest.raises(ValueError, match="'auto'"):
        DiscoveryOptions(neurons_per_mlp="many")
    with pytest.raises(ValueError, match="max_neurons_per_mlp"):
        DiscoveryOptions(neurons_per_mlp="auto", max_neurons_per_mlp=0)
    assert DiscoveryOptions().neuron_search == "joint"
    with pytest.raises(ValueError, match="neuron_search must be one of"):
        DiscoveryOptions(neurons_per_mlp="auto", neuron_search="greedy")


def _scores(model):
    from tl_attnonly.analysis import top_nodes

    return top_nodes(model, CLEAN, CORRUPTED, METRIC, 1, progress=False)[1]


def _check_joint(model, circuit, **kw) -> None:
    """Every figure of the joint search (``_discover(model, **kw)``) against runs made here."""
    cap = kw["max_neurons_per_mlp"]
    coarse = circuit.extra["coarse"]
    stage = circuit.extra["neuron_stage"].set_index("node")
    named = circuit.extra["named"]
    goal = min(0.8, coarse.faithfulness)
    layers = sorted(named)
    candidates = {li: _ranking(model, li)[:cap] for li in layers}
    cut = {li for li in layers if not stage.loc[f"L{li}MLP", "remainder"]}
    # kept by step 2, cut by step 5 (a negative share in the circuit): steps 2-4 kept them
    dropped = {li for li in layers if stage.loc[f"L{li}MLP", "dropped"]}
    assert dropped <= cut
    # the returned circuit: the named neurons, the cut layers' remainders without edges
    final = _resolved_faithfulness(model, coarse, named, cut)
    assert circuit.faithfulness == pytest.approx(final, rel=1e-10) and final >= goal
    for li in layers:
        row = stage.loc[f"L{li}MLP"]
        assert row.named == len(named[li])
        # 1. each remainder cut alone, its candidates named
        alone = _resolved_faithfulness(model, coarse, {li: candidates[li]}, {li})
        assert row.share_alone == pytest.approx(coarse.faithfulness - alone, rel=1e-9, abs=1e-12)
        if li in cut:
            assert row.remainder_share == 0.0
            assert set(named[li]) <= set(candidates[li])
        else:  # a kept layer: not resolved, its share in the returned circuit, not negative
            assert named[li] == []
            without = _resolved_faithfulness(model, coarse, named, cut | {li})
            assert row.remainder_share == pytest.approx(final - without, rel=1e-9, abs=1e-12)
            assert row.remainder_share >= 0
    cut -= dropped  # steps 2 to 4 as they were
    # 2. the remainders kept are those of the largest shares alone
    if cut and len(cut) < len(layers):
        assert max(stage.loc[f"L{li}MLP", "share_alone"] for li in cut) <= min(
            stage.loc[f"L{li}MLP", "share_alone"] for li in set(layers) - cut
        )
    # 3. before the trim (the same call with neuron_trim=False): the top N by |score| across
    # the cut layers; N - 1 fails
    untrimmed = _discover(model, **{**kw, "neuron_trim": False})
    first = untrimmed.extra["named"]
    before_drop = stage.remainder | stage.dropped
    assert (
        untrimmed.extra["neuron_stage"].remainder | untrimmed.extra["neuron_stage"].dropped
    ).tolist() == before_drop.tolist()
    scores = _scores(model)
    pool = sorted(
        (n for li in sorted(cut) for n in candidates[li]), key=lambda n: -abs(float(scores[n]))
    )
    n_named = sum(len(first[li]) for li in cut)
    assert {n for li in cut for n in first[li]} == set(pool[:n_named])
    if n_named >= 1:
        fewer = {**first, **{li: [n for n in first[li] if n in pool[: n_named - 1]] for li in cut}}
        assert _resolved_faithfulness(model, coarse, fewer, cut) < goal
    # 4. the trim, replayed: most named first, each layer its fewest own top neurons holding the
    # goal with the others as they then are; one fewer fails, and so does none
    state = {li: list(first[li]) for li in layers}
    for li in sorted(cut, key=lambda li: (-len(first[li]), li)):
        k = len(named[li])
        assert named[li] == state[li][:k]
        here = _resolved_faithfulness(model, coarse, {**state, li: state[li][:k]}, cut)
        assert here >= goal
        if k >= 1:
            less = _resolved_faithfulness(model, coarse, {**state, li: state[li][: k - 1]}, cut)
            assert less < goal
            # none of the layer's neurons, run first: fails
            none = _resolved_faithfulness(model, coarse, {**state, li: []}, cut)
            assert none < goal
        state[li] = state[li][:k]
    assert state == named


#: A model whose coarse circuit has two MLP nodes (16 candidates: both cut; 5: one kept).
TWO_MLPS = {**GATED_ZOO["qwen2"], "n_layers": 3}


def test_joint_search_names_the_fewest_neurons_across_layers_exactly():
    model = make_converted("silu", **TWO_MLPS)
    kw = dict(neurons_per_mlp="auto", max_neurons_per_mlp=16)
    circuit = _discover(model, **kw)
    stage = circuit.extra["neuron_stage"]
    assert len(stage) == 2
    assert list(stage.columns) == [
        "node", "named", "remainder", "remainder_share", "share_alone", "dropped",
    ]  # fmt: skip
    assert not stage.remainder.any()
    assert circuit.extra["neuron_stage_runs"] >= len(stage)
    _check_joint(model, circuit, **kw)
    # every remainder cut: the split has no remainder effect, named-only is the circuit
    assert (circuit.mlp_split.rest_effect.abs() < 1e-12).all()
    assert circuit.extra["faithfulness_named_only"] == pytest.approx(circuit.faithfulness)
    text = circuit.report()
    assert "share lost when cut alone" in text and "exact runs" in text


def test_joint_search_keeps_the_remainders_it_needs_and_states_their_shares():
    model = make_converted("silu", **TWO_MLPS)
    kw = dict(neurons_per_mlp="auto", max_neurons_per_mlp=5)
    circuit = _discover(model, **kw)
    stage = circuit.extra["neuron_stage"]
    assert stage.remainder.any() and not stage.remainder.all(), "the case needs one of each"
    _check_joint(model, circuit, **kw)
    # the named-only circuit cuts the kept remainder too: below the circuit by its share
    kept = stage[stage.remainder]
    assert circuit.extra["faithfulness_named_only"] == pytest.approx(
        circuit.faithfulness - kept.remainder_share.sum(), rel=1e-9
    )


def test_coarse_target_leaves_the_neuron_stage_room_and_it_keeps_the_target():
    model = make_converted("silu", **TWO_MLPS)
    plain = _discover(model, neurons_per_mlp="auto", max_neurons_per_mlp=5)
    kw = dict(neurons_per_mlp="auto", max_neurons_per_mlp=5, coarse_target=0.95)
    roomy = _discover(model, **kw)
    coarse = roomy.extra["coarse"]
    assert coarse.faithfulness >= 0.95 > plain.extra["coarse"].faithfulness
    assert mask_size(coarse.mask) > mask_size(plain.extra["coarse"].mask)
    # the stage's goal is the target, not the coarse circuit's faithfulness: _check_joint's
    # replay finds one neuron fewer below min(0.8, coarse) = 0.8 at each choice
    assert roomy.faithfulness >= 0.8
    _check_joint(model, roomy, **kw)
    with pytest.raises(ValueError, match=r"coarse_target must be in \[target, 1\]"):
        DiscoveryOptions(coarse_target=0.7)
    with pytest.raises(ValueError, match="graph='coarse'"):
        DiscoveryOptions(graph="neurons", coarse_target=0.9)
    for fixed in (dict(top_n=10), dict(threshold=0.1)):  # no sweep for it to aim
        with pytest.raises(ValueError, match="fixed-size circuit without one"):
            DiscoveryOptions(coarse_target=0.9, **fixed)


class _Ruled(NeuronStage):
    """A :class:`~tl_attnonly.analysis.discovery.neuron_stage.NeuronStage` whose "faithfulness"
    of a circuit is a rule of which remainders and named neurons pass their changes on (the
    search itself, on a real model's stage, is what is tested; no coarse circuit, so
    ``__init__`` is its own).
    """

    def __init__(self, rule, n_layers: int = 4, per_layer: int = 4):
        from types import SimpleNamespace

        self.ranked = {li: [f"L{li}N{i}" for i in range(per_layer)] for li in range(n_layers)}
        self.rule, self.n_runs, self.held = rule, 0, False
        self.opts = DiscoveryOptions(neurons_per_mlp="auto")
        self.coarse = SimpleNamespace(faithfulness=self._value({}))
        self.goal = min(self.opts.target, self.coarse.faithfulness)
        self.bar = tqdm(disable=True)

    def _value(self, cuts) -> float:
        rest = {li: li not in cuts for li in self.ranked}
        named = {li: len(cuts.get(li, self.ranked[li])) for li in self.ranked}
        return self.rule(rest, named)

    def keep(self, cuts, below=None) -> None:  # no run to keep
        pass

    def faithfulness(self, circuits) -> list[float]:
        self.n_runs += len(circuits)
        return [self._value(c) for c in circuits]


def test_joint_search_cuts_a_kept_layer_whose_share_turns_negative():
    """A kept layer that helps only beside neurons the search then leaves out (layer 3 beside
    all four of layer 2's candidates) works against the returned circuit: it is cut, the
    faithfulness rises, and the other kept layers' shares are those of the new circuit."""
    import pandas as pd

    from tl_attnonly.analysis.discovery.neuron_stage import resolve_neurons_jointly

    def rule(rest, named) -> float:  # layers 0..3 = A, B, C, D
        together = 0.2 if named[2] == 4 else 0.0  # D's help needs all of C's candidates
        return (
            0.24 + 0.5 * rest[0] + 0.12 * rest[1] + 0.02 * rest[2] - 0.025 * named[2]
            + rest[3] * (together - 0.05)
        )  # fmt: skip

    stage = _Ruled(rule)
    scores = pd.Series({n: 1.0 - 0.1 * i for v in stage.ranked.values() for i, n in enumerate(v)})
    named, cut, table, runs = resolve_neurons_jointly(stage, scores)
    table = table.set_index("node")
    # shares alone: A 0.5, B 0.12, C 0.02, D 0.15; A, B, D kept (A and D alone: 0.79 < 0.8)
    assert table.share_alone.to_dict() == pytest.approx(
        {"L0MLP": 0.5, "L1MLP": 0.12, "L2MLP": 0.02, "L3MLP": 0.15}
    )
    # no named neuron of C is needed (0.81); D then costs 0.05: cut, 0.86
    assert named == {0: [], 1: [], 2: [], 3: []}
    assert cut == {2, 3}
    assert table.dropped.to_dict() == {
        "L0MLP": False,
        "L1MLP": False,
        "L2MLP": False,
        "L3MLP": True,
    }
    assert table.remainder.to_dict() == {
        "L0MLP": True,
        "L1MLP": True,
        "L2MLP": False,
        "L3MLP": False,
    }
    # the shares of the kept layers in the returned circuit (0.86 without A: 0.36, without B: 0.74)
    assert table.remainder_share.to_dict() == pytest.approx(
        {"L0MLP": 0.5, "L1MLP": 0.12, "L2MLP": 0.0, "L3MLP": 0.0}
    )
    assert runs == stage.n_runs


def test_held_kept_runs_give_the_same_choices_in_fewer_runs():
    """With its kept runs held (``NeuronStage.speculate`` False: one size per call) the joint
    search makes the choices it makes with the speculative sizes of a call, in fewer runs. Rule:
    each layer's remainder carries 0.15 of the faithfulness, or its named neurons
    ``min(named, need) / need`` of it (``need`` 20, 30, 40, 50 of 64 candidates)."""
    import pandas as pd

    from tl_attnonly.analysis.discovery.neuron_stage import resolve_neurons_jointly

    need = {0: 20, 1: 30, 2: 40, 3: 50}

    def rule(rest, named) -> float:
        return 0.2 + sum(
            0.15 if rest[li] else 0.15 * min(named[li], n) / n for li, n in need.items()
        )

    found = []
    for held in (True, False):
        stage = _Ruled(rule, per_layer=64)
        stage.held = held
        assert stage.speculate is not held
        scores = pd.Series(
            {n: 1.0 - 0.001 * i - 0.0001 * li for li, v in stage.ranked.items()
             for i, n in enumerate(v)}
        )  # fmt: skip
        found.append(resolve_neurons_jointly(stage, scores))
    (named, cut, table, runs), (named_s, cut_s, table_s, runs_s) = found
    assert {li: len(v) for li, v in named.items()} == need  # the rule's own minimum
    assert (named, cut) == (named_s, cut_s) and table.equals(table_s)
    assert runs < runs_s


def test_neuron_ranking_option_is_checked():
    assert DiscoveryOptions().neuron_ranking == "attribution"
    with pytest.raises(ValueError, match="neuron_ranking must be one of"):
        DiscoveryOptions(neuron_ranking="gradient")
    with pytest.raises(ValueError, match="graph='coarse'"):
        DiscoveryOptions(graph="neurons", neuron_ranking="relp")


def _orders(model, found, ranking: str, layers: list[int]) -> dict[int, list[str]]:
    """Per layer, its neurons best first by ``ranking`` ("relp": ``|RelP relevance|``;
    "circuit": ``|score|`` along the node's edges in the returned coarse circuit)."""
    from tl_attnonly.analysis.discovery import circuit_neuron_scores
    from tl_attnonly.analysis.discovery.relevance import neuron_relevance

    if ranking == "relp":
        relevance = neuron_relevance(model, CLEAN, CORRUPTED, METRIC, rule="relp")
        return {
            li: [f"L{li}N{i}" for i in relevance[li].abs().argsort(descending=True, stable=True)]
            for li in layers
        }
    coarse = found.extra["coarse"]
    scores = circuit_neuron_scores(
        model, coarse.graph, coarse.mask, CLEAN, CORRUPTED, METRIC, layers
    )
    return {
        li: list(
            scores[[f"L{li}N{i}" for i in range(model.cfg.d_mlp)]]
            .abs()
            .sort_values(ascending=False, kind="stable")
            .index
        )
        for li in layers
    }


@pytest.mark.parametrize("ranking", ["relp", "circuit"])
@pytest.mark.parametrize("neurons_per_mlp", [3, "auto"])
def test_other_rankings_name_the_neurons_they_rank_first(ranking, neurons_per_mlp):
    """``neuron_ranking="relp"`` / ``"circuit"``: each MLP node's named neurons (fixed count) or
    candidates (adaptive: the named ones are a prefix of them) are its neurons by ``|RelP
    relevance|`` / by ``|score|`` along the node's edges in the coarse circuit
    (:func:`circuit_neuron_scores` on the returned coarse circuit), which here differs from the
    attribution ranking; the circuit's faithfulness is that of the circuit it names, run here."""
    model = make_converted("silu", **GATED_ZOO["llama"])
    found = _discover(model, neurons_per_mlp=neurons_per_mlp, neuron_ranking=ranking,
                      max_neurons_per_mlp=3)  # fmt: skip
    layers = sorted(found.extra["named"])
    assert layers
    orders = _orders(model, found, ranking, layers)
    differs = False
    for li in layers:
        named = found.extra["named"][li]
        assert named == orders[li][: len(named)]
        if neurons_per_mlp == 3:
            assert len(named) == 3
        differs |= orders[li][:3] != _ranking(model, li)[:3]
    assert differs  # the two rankings name other neurons here
    if neurons_per_mlp == "auto":
        table = found.extra["neuron_stage"].set_index("node")
        cut = {li for li in layers if not table.loc[f"L{li}MLP", "remainder"]}
        named = {li: found.extra["named"][li] for li in layers}
        expected = _resolved_faithfulness(model, found.extra["coarse"], named, cut)
        assert found.faithfulness == pytest.approx(expected, rel=1e-9, abs=1e-12)


def _search_sizes(values: torch.Tensor, goal: float, passing: bool, speculate: bool):
    """``_smallest`` over sizes ``0..len(values) - 1`` whose faithfulness is ``values``: its
    ``k``, the sizes run and the sizes of each call."""
    from tl_attnonly.analysis.discovery.neuron_stage import _smallest

    cap = len(values) - 1
    calls: list[list[int]] = []

    def evaluate(ks):
        calls.append(list(ks))
        return {k: ({}, float(values[k])) for k in ks}

    known = ({}, float(values[cap])) if passing else None
    k, tried = _smallest(evaluate, 0, cap, goal, passing=known, speculate=speculate)
    return k, tried, calls


@pytest.mark.parametrize("passing", [False, True])
def test_smallest_one_size_per_call_chooses_as_with_speculative_sizes(passing):
    """The doubling and bisection read their sizes in the same order with or without the
    speculative sizes of a call: the same ``k`` (a faithfulness that is not monotone too) from
    the runs of a subset of the sizes, one per call."""
    saved = 0
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        cap = int(torch.randint(1, 300, (1,), generator=g))
        values = torch.rand(cap + 1, generator=g, dtype=torch.float64)
        if seed % 2:  # monotone in k
            values = values.sort().values
        goal = float(values[int(torch.randint(0, cap + 1, (1,), generator=g))])
        if passing:  # the known passing size
            values[cap] = max(float(values[cap]), goal)
        k, tried, _ = _search_sizes(values, goal, passing, speculate=True)
        k1, tried1, calls1 = _search_sizes(values, goal, passing, speculate=False)
        assert k1 == k
        assert set(tried1) <= set(tried)
        assert all(len(c) == 1 for c in calls1)
        saved += len(tried) - len(tried1)
    assert saved > 0


def test_smallest_runs_none_first_and_otherwise_bisects_as_before():
    """``none_first`` (the trim): the size ``first`` alone first, returned where it reaches the
    goal (one run, where the bisection could have missed it on a faithfulness that is not
    monotone); where it fails, the same bisection, one run more."""
    flat = torch.full((200,), 0.81, dtype=torch.float64)
    flat[[99, 149]] = 0.79  # not monotone: the bisection's middles fail, size 0 passes
    k, tried, calls = _search_sizes(flat, 0.8, passing=True, speculate=False)
    assert k != 0  # without it: a larger size
    k0, tried0, _ = _search_sizes_none_first(flat, 0.8)
    assert (k0, sorted(tried0)) == (0, [0, 199])
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        values = torch.rand(int(torch.randint(2, 300, (1,), generator=g)), generator=g).sort()
        values = values.values.double()
        goal = float(values[int(torch.randint(1, len(values), (1,), generator=g))])
        k, tried, _ = _search_sizes(values, goal, passing=True, speculate=False)
        k1, tried1, _ = _search_sizes_none_first(values, goal)
        assert k1 == k and set(tried1) - set(tried) <= {0}


def _search_sizes_none_first(values: torch.Tensor, goal: float):
    from tl_attnonly.analysis.discovery.neuron_stage import _smallest

    cap = len(values) - 1

    def evaluate(ks):
        return {k: ({}, float(values[k])) for k in ks}

    known = ({}, float(values[cap]))
    k, tried = _smallest(evaluate, 0, cap, goal, passing=known, speculate=False, none_first=True)
    return k, tried, None


@pytest.mark.parametrize("search", ["joint", "layers"])
def test_the_stage_shows_one_progress_bar_of_its_runs_and_steps(search, capsys):
    """With ``progress=True`` the stage's exact runs count on one bar (their calls show none of
    their own), which names the step running and ends with the goal and the names chosen."""
    model = make_converted("silu", **TWO_MLPS)
    circuit = discover_circuit(
        model, CLEAN, CORRUPTED, METRIC, gate_value=False, neurons_per_mlp="auto",
        max_neurons_per_mlp=16, neuron_search=search, progress=True,
    )  # fmt: skip
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if "neuron stage" in line]
    assert lines, "no neuron stage bar"
    n_runs = circuit.extra["neuron_stage_runs"]
    named = sum(map(len, circuit.extra["named"].values()))
    kept = int(circuit.extra["neuron_stage"].remainder.sum())
    last = lines[-1]
    assert f"neuron stage: {n_runs} runs " in last, last
    assert f"goal {min(0.8, circuit.extra['coarse'].faithfulness):.3f}, {named:,} named" in last
    assert f"{kept} remainder(s) kept" in last
    steps = ["1/5 shares", "2/5 which remainders go", "5/5 kept layers"]
    expected = steps if search == "joint" else ["L0MLP"]
    assert all(any(f"neuron stage: {s}" in line for line in lines) for s in expected), lines


def test_the_split_table_takes_the_runs_the_stage_made(monkeypatch):
    """The returned circuit and each kept layer without it were run by the stage (its last
    step): the split table (``Circuit.mlp_split``) does not run them again, nor any other run
    the stage made; its figures are still those of runs on the graph with the named neurons
    (``test_kept_neurons``' split test)."""
    from tl_attnonly.analysis.discovery import naming as search  # the split table's runs
    from tl_attnonly.analysis.discovery import neuron_stage
    from tl_attnonly.analysis.discovery.neuron_stage import kept_key

    def counting(module, into: list):
        real = module.circuit_metrics

        def counted(*args, **kw):
            into.extend(kw.get("kept_neurons") or [])
            return real(*args, **kw)

        monkeypatch.setattr(module, "circuit_metrics", counted)

    stage_runs: list = []
    split_runs: list = []  # search's calls: the sweep's and pruning's have no kept neurons
    counting(neuron_stage, stage_runs)
    counting(search, split_runs)
    model = make_converted("silu", **TWO_MLPS)
    circuit = _discover(model, neurons_per_mlp="auto", max_neurons_per_mlp=5)
    table = circuit.extra["neuron_stage"]
    assert table.remainder.any(), "the case needs a kept remainder"
    made = {kept_key(k) for k in stage_runs}
    assert not made & {kept_key(k) for k in split_runs}
    d_mlp = int(model.cfg.d_mlp)
    named = circuit.extra["named"]
    base = {
        li: neuron_stage.neuron_mask(d_mlp, named[li])
        for li, kept in zip(table.node.str[1:-3].astype(int), table.remainder, strict=True)
        if not kept
    }
    assert kept_key(base) in made
    for li in table.node[table.remainder].str[1:-3].astype(int):
        assert kept_key({**base, li: torch.zeros(d_mlp, dtype=torch.bool)}) in made
    # the split's figures: the layer cut is the circuit minus its share
    row = table[table.remainder].iloc[0]
    split = circuit.mlp_split.set_index("node")
    assert split.loc[row.node, "layer_effect"] == pytest.approx(row.remainder_share, abs=1e-12)


@pytest.mark.parametrize("neurons_per_mlp", ["auto", 2])
def test_whole_mlps_keeps_those_mlp_nodes_whole_and_names_the_others(neurons_per_mlp):
    """``whole_mlps=(l,)`` (MLP0 as an extension of the embedding, say): layer ``l``'s MLP node
    stays one node with its coarse edges, no neuron of it is named, the other layers are named
    as without the option, and the circuit's faithfulness is an exact run of that graph."""
    model = make_converted("silu", **TWO_MLPS)
    kw = dict(neurons_per_mlp=neurons_per_mlp, max_neurons_per_mlp=16)
    free = _discover(model, **kw)
    layers = sorted(free.extra["named"])
    assert len(layers) == 2, "the case needs two MLP nodes in the coarse circuit"
    whole = layers[0]
    circuit = _discover(model, whole_mlps=(whole,), **kw)
    named = circuit.extra["named"]
    assert whole not in named and set(named) == {layers[1]}
    assert not any(n.startswith(f"L{whole}N") for n in circuit.nodes())
    sources = set(circuit.edges().source)
    assert f"L{whole}MLP" in sources  # still one node, its edges kept
    if neurons_per_mlp == "auto":
        stage = circuit.extra["neuron_stage"]
        assert list(stage.node) == [f"L{layers[1]}MLP"]
        goal = min(0.8, circuit.extra["coarse"].faithfulness)
        assert circuit.faithfulness >= goal
        cut = {layers[1]} if not stage.remainder.any() else set()
    else:
        assert named[layers[1]] == free.extra["named"][layers[1]]
        cut = set()
    again = _resolved_faithfulness(model, circuit.extra["coarse"], named, cut)
    assert circuit.faithfulness == pytest.approx(again, rel=1e-10)


def test_whole_mlps_is_checked():
    with pytest.raises(ValueError, match="whole_mlps must hold MLP layer indices"):
        DiscoveryOptions(whole_mlps=(-1,))
    with pytest.raises(ValueError, match="give graph='coarse'"):
        DiscoveryOptions(graph="neurons", whole_mlps=(0,))
    model = make_converted("silu", **TWO_MLPS)
    with pytest.raises(ValueError, match=r"whole_mlps names layer\(s\) \[7\]"):
        _discover(model, whole_mlps=(7,))
