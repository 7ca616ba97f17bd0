"""Circuit discovery on restricted graphs (``nodes=``) and in two stages (``n_nodes=``).

A restricted graph's edge scores must equal the corresponding entries of the full graph's, and its
circuit runs the full graph's runs with every edge touching a dropped node removed.
"""

from __future__ import annotations

import pytest
import torch
from conftest import GATED_ZOO, make_tokens
from models import make_converted, tl3_extra

import tl_attnonly.vis  # noqa: F401 - registers circuit_figure, which Circuit.figure() calls
from tl_attnonly.analysis import (
    HeadGraph,
    circuit_metric,
    discover_circuit,
    edge_attribution_scores,
    logit_diff_metric,
    prune,
    top_edges,
    top_nodes,
)
from tl_attnonly.analysis.discovery.node_circuits import ModelInputs, node_attribution_scores

CLEAN, CORRUPTED = make_tokens(4, 8, seed=0), make_tokens(4, 8, seed=1)
METRIC = logit_diff_metric(torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8]))
MODELS = {
    "ln_gelu": ("gelu", dict(normalization_type="LN")),
    "gqa": ("silu", dict(normalization_type="RMS", n_heads=4, d_head=4, n_key_value_heads=2)),
    "llama": ("silu", GATED_ZOO["llama"]),
}
NODES = ["L0H1", "L0H3", "L0N2", "L0N5", "L0N17", "L1H2", "L1N0", "L1N9", "L1N20"]
#: On TL 4 gqa's bridge is llama's (a LLaMA bridge of the same sizes).
NAMES = [pytest.param(n, marks=tl3_extra("llama")) if n == "gqa" else n for n in sorted(MODELS)]


def _model(name: str):
    act_fn, overrides = MODELS[name]
    return make_converted(act_fn, **overrides)


def _nodes(model) -> list[str]:
    return [n for n in NODES if "H" not in n or int(n.split("H")[1]) < model.cfg.n_heads]


def _embed(restricted: HeadGraph, full: HeadGraph, blocks: dict) -> dict:
    """A restricted graph's mask as a mask of the full graph (False outside it)."""
    out = full.full_mask(False)
    for (s, d), m in blocks.items():
        rows = torch.tensor(restricted.source_by_key[s].index)
        cols = torch.tensor(restricted.input_by_key[d].index)
        out[(s, d)][rows[:, None], cols[None, :]] = m
    return out


@pytest.mark.parametrize("name", NAMES)
def test_restricted_scores_are_entries_of_the_full_scores(name):
    model = _model(name)
    nodes = _nodes(model)
    full = edge_attribution_scores(model, CLEAN, CORRUPTED, METRIC, batch_size=3, progress=False)
    part = edge_attribution_scores(
        model, CLEAN, CORRUPTED, METRIC, nodes=nodes, batch_size=3, progress=False
    )
    graph = part.graph
    assert graph.restricted and set(graph.node_labels()) == set(nodes)
    assert graph.n_edges() < full.graph.n_edges() / 4
    assert part.metric_clean == full.metric_clean
    for (s, d), block in part.scores.items():
        rows = torch.tensor(graph.source_by_key[s].index)
        cols = torch.tensor(graph.input_by_key[d].index)
        expected = full.scores[(s, d)][rows[:, None], cols[None, :]]
        torch.testing.assert_close(block, expected, rtol=1e-12, atol=1e-14)
    # the frame names the same edges with the same scores
    frame, full_frame = part.frame(), full.frame().set_index("edge")
    assert frame.score.tolist() == pytest.approx(full_frame.loc[frame.edge].score.tolist())


@pytest.mark.parametrize("name", NAMES)
def test_restricted_circuit_runs_equal_full_runs_without_dropped_nodes(name):
    model = _model(name)
    nodes = _nodes(model)
    graph, full = HeadGraph(model, nodes=nodes), HeadGraph(model)
    g = torch.Generator().manual_seed(0)
    some = {k: torch.rand(m.shape, generator=g) < 0.5 for k, m in graph.full_mask().items()}
    for mask in (graph.full_mask(True), some, graph.full_mask(False)):
        got = circuit_metric(model, mask, CLEAN, CORRUPTED, METRIC, nodes=nodes)
        expected = circuit_metric(model, _embed(graph, full, mask), CLEAN, CORRUPTED, METRIC)
        assert got == pytest.approx(expected, rel=1e-10, abs=1e-12)
    # the empty restricted graph is the corrupted run
    corrupted = METRIC(model(CORRUPTED), torch.arange(4)).item()
    empty = circuit_metric(model, graph.full_mask(False), CLEAN, CORRUPTED, METRIC, nodes=nodes)
    assert empty == pytest.approx(corrupted, rel=1e-12)


def test_two_stage_discovery_keeps_the_top_attributed_nodes():
    model = _model("llama")
    circuit = discover_circuit(
        model, CLEAN, CORRUPTED, METRIC, n_nodes=6, top_n=10, batch_size=3,
        max_gate_value_neurons=2, progress=False,
    )  # fmt: skip
    node_metric = lambda out, inputs: METRIC(out, torch.arange(4))  # noqa: E731
    scores = node_attribution_scores(
        model, ModelInputs(CLEAN), ModelInputs(CORRUPTED), node_metric
    ).scores.drop("embed")
    expected = list(scores.abs().sort_values(ascending=False, kind="stable").index[:6])
    assert circuit.extra["nodes"] == expected
    assert set(circuit.graph.node_labels()) == set(expected)
    assert set(circuit.edges().source) <= set(expected) | {"embed"}
    again = circuit_metric(model, circuit.mask, CLEAN, CORRUPTED, METRIC, nodes=expected)
    assert circuit.metric_circuit == pytest.approx(again, rel=1e-12)
    # batched node attribution sums to the unbatched one
    labels, batched = top_nodes(model, CLEAN, CORRUPTED, METRIC, 6, batch_size=3, progress=False)
    assert labels == expected
    torch.testing.assert_close(
        torch.tensor(batched[scores.index].values), torch.tensor(scores.values), rtol=1e-10, atol=0
    )


def test_restricted_graphs_refuse_unknown_nodes_and_name_the_fix():
    model = _model("ln_gelu")
    with pytest.raises(ValueError, match="L0N5.1"):
        HeadGraph(model, nodes=["L0H1", "L0N5.1"])
    with pytest.raises(ValueError, match="not both"):
        discover_circuit(model, CLEAN, CORRUPTED, METRIC, top_n=3, nodes=["L0H1"], n_nodes=2)
    with pytest.raises(MemoryError, match="n_nodes"):
        edge_attribution_scores(model, CLEAN, CORRUPTED, METRIC, max_bytes=1000, progress=False)
    with pytest.raises(ValueError, match="mlp_rest=True"):
        discover_circuit(model, CLEAN, CORRUPTED, METRIC, top_n=3, mlp_rest=True)
    heads = HeadGraph(model, neuron_level=False, nodes=["L0N5.1", "L1H0"])
    assert heads.node_labels() == ["L0N5.1", "L1H0"]


@pytest.mark.parametrize("neuron_level", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_restricted_groups_are_the_full_graphs_kept_entries(neuron_level, seed):
    """Every group of a restricted graph holds exactly the full group's nodes named in
    ``nodes=``, in the full group's order, at their full positions; an MLP remainder the layer's
    neurons not named (the graph looks neurons up by label instead of testing each)."""
    model = _model("ln_gelu")
    full = HeadGraph(model, neuron_level=neuron_level)
    labels = [label for g in full.sources if g.kind != "embed" for label in g.labels]
    gen = torch.Generator().manual_seed(seed)
    picked = [labels[i] for i in torch.randperm(len(labels), generator=gen)[:40].tolist()]
    nodes = picked + ["L1MLP"] * seed  # seed 1: layer 1's remainder too
    graph = HeadGraph(model, neuron_level=neuron_level, nodes=nodes)
    groups = [(g, full.source_by_key) for g in graph.sources]
    groups += [(g, full.input_by_key) for g in graph.inputs if not (full.gqa and g.input in "kv")]
    for group, of_full in groups:  # (key/value heads of a GQA model go with their query heads)
        if group.kind == "mlp":
            whole = full.source_by_key[f"neuron.{group.layer}"]
            named = {j for j, label in enumerate(whole.labels) if label in nodes}
            assert group.index == tuple(j for j in range(whole.size) if j not in named)
            continue
        kin = of_full[group.key]
        fixed = group.kind in ("embed", "logits")
        expected = tuple(j for j, label in enumerate(kin.labels) if fixed or label in nodes)
        assert group.index == expected, group.key
        assert group.labels == tuple(kin.labels[j] for j in expected), group.key
        assert group.size == kin.size
    assert any(g.kind == "mlp" for g in graph.sources) == bool(seed)


@pytest.mark.slow
def test_gpt2_small_sized_two_stage_discovery_runs_where_the_full_graph_is_refused():
    """12 layers, d_model 768, d_mlp 3072 (GELU, K=4), vocab 1000, fp32 (TL 4: a GPT-2 bridge of
    that size): the full graph (1.26e9 edges) is refused before any work; the two stages complete
    (timed in ``benchmarks/bench_discovery.py``) and the circuit's run is reproducible exactly."""
    model = make_converted(
        "gelu", torch.float32, n_layers=12, d_model=768, n_heads=12, d_head=64, d_mlp=3072,
        d_vocab=1000, n_ctx=16, normalization_type="LN", share_weights=True,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 1000, (4, 12), generator=g)
    corrupted = torch.cat([clean[:, :6], torch.randint(0, 1000, (4, 6), generator=g)], 1)
    metric = logit_diff_metric(torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8]))
    assert HeadGraph(model).n_edges() == 1_258_897_825
    with pytest.raises(MemoryError, match="n_nodes"):
        edge_attribution_scores(model, clean, corrupted, metric, progress=False)
    circuit = discover_circuit(
        model, clean, corrupted, metric, n_nodes=200, top_n=100, batch_size=2,
        max_gate_value_neurons=1, progress=False,
    )  # fmt: skip
    assert circuit.graph.n_edges() < 60_000 and len(circuit.extra["nodes"]) == 200
    again = circuit_metric(
        model, circuit.mask, clean, corrupted, metric, nodes=circuit.extra["nodes"]
    )
    assert again == pytest.approx(circuit.metric_circuit, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(
    "name, method, absolute",
    [("ln_gelu", "eap", True), ("gqa", "eap", False), ("llama", "eap", True),
     ("llama", "eap-ig", True)],
)  # fmt: skip
def test_streamed_top_n_equals_the_full_top_n(name, method, absolute):
    model = _model(name)
    kwargs = dict(method=method, ig_steps=2, batch_size=3, progress=False)
    full = edge_attribution_scores(model, CLEAN, CORRUPTED, METRIC, **kwargs)
    top = top_edges(model, 40, CLEAN, CORRUPTED, METRIC, absolute=absolute, **kwargs)
    frame = full.frame()
    if not absolute:
        frame = frame.sort_values("score", ascending=False, kind="stable")
    expected = frame.head(40)
    assert top.frame.edge.tolist() == expected.edge.tolist()
    assert top.frame.score.tolist() == pytest.approx(expected.score.tolist(), rel=1e-9, abs=1e-12)
    assert (top.metric_clean, top.metric_corrupted) == (full.metric_clean, full.metric_corrupted)
    assert top.n_scored == full.graph.n_edges()
    # the streamed edges run exactly on the restricted graph of their nodes
    if absolute:
        nodes, mask = top.restricted_mask(model)
        got = circuit_metric(model, mask, CLEAN, CORRUPTED, METRIC, nodes=nodes)
        dense = prune(full, top_n=40, drop_dangling=False)
        assert got == pytest.approx(
            circuit_metric(model, dense, CLEAN, CORRUPTED, METRIC), rel=1e-10
        )


@pytest.mark.parametrize("name", ["ln_gelu", "llama"])
def test_ig_sums_each_inputs_read_direction_over_steps_before_the_sources_read_it(
    name, monkeypatch
):
    """EAP-IG on the coarse graph: what the sources write is built once per batch, not once
    per interpolation step (each input's read direction is summed over the steps first), and
    the scores are the streamed per-step scores (``top_edges``, every edge)."""
    from tl_attnonly.analysis.discovery import edge_scores
    from tl_attnonly.analysis.discovery.search import coarse_nodes

    model = _model(name)
    nodes = coarse_nodes(model)
    calls = [0]
    written = edge_scores._written

    def counted(*args, **kwargs):
        calls[0] += 1
        return written(*args, **kwargs)

    monkeypatch.setattr(edge_scores, "_written", counted)
    counts = []
    for steps in (1, 4):
        calls[0] = 0
        scores = edge_attribution_scores(
            model, CLEAN, CORRUPTED, METRIC, method="eap-ig", ig_steps=steps, nodes=nodes,
            batch_size=2, progress=False,
        )  # fmt: skip
        counts.append(calls[0])
    assert counts[0] == counts[1] > 0  # two batches either way
    streamed = top_edges(
        model, scores.graph.n_edges(), CLEAN, CORRUPTED, METRIC, method="eap-ig", ig_steps=4,
        nodes=nodes, batch_size=2, progress=False,
    )  # fmt: skip
    frame = scores.frame().set_index("edge").score
    assert streamed.frame.set_index("edge").score.loc[frame.index].tolist() == pytest.approx(
        frame.tolist(), rel=1e-9, abs=1e-12
    )


def _expand(graph: HeadGraph, full: HeadGraph, mask: dict) -> dict:
    """A mask of a graph with MLP remainders as a mask of the full graph: an edge out of (into)
    ``L{l}MLP`` is the same edge out of (into) each of its neurons."""
    out = full.full_mask(False)

    def positions(group):
        key = group.key.replace("mlp.", "neuron.")
        return key, torch.tensor(group.index)

    for (s, d), m in mask.items():
        (fs, rows), (fd, cols) = positions(graph.source_by_key[s]), positions(graph.input_by_key[d])
        if graph.source_by_key[s].kind == "mlp":
            m = m.expand(len(rows), -1)
        if graph.input_by_key[d].kind == "mlp":
            m = m.expand(-1, len(cols))
        out[(fs, fd)][rows[:, None], cols[None, :]] |= m
    return out


@pytest.mark.parametrize("name", ["ln_gelu", "llama"])
def test_mlp_remainders_sum_their_neurons_and_run_exactly(name):
    """``L{l}MLP`` holds layer l's neurons left out of ``nodes``: its edge scores are the sums of
    its neurons' (EAP is linear in both ends), and its circuit runs are the full graph's with the
    same edges into and out of each of its neurons; with every head kept, the full graph is the
    clean run."""
    model = _model(name)
    nodes = _nodes(model) + ["L0MLP", "L1MLP"]
    full = edge_attribution_scores(model, CLEAN, CORRUPTED, METRIC, batch_size=3, progress=False)
    part = edge_attribution_scores(
        model, CLEAN, CORRUPTED, METRIC, nodes=nodes, batch_size=3, progress=False
    )
    graph = part.graph
    assert graph.members("L0MLP") == [f"L0N{i}" for i in range(24) if i not in (2, 5, 17)]
    for (s, d), block in part.scores.items():
        src, dst = graph.source_by_key[s], graph.input_by_key[d]
        fs, fd = s.replace("mlp.", "neuron."), d.replace("mlp.", "neuron.")
        rows, cols = torch.tensor(src.index), torch.tensor(dst.index)
        expected = full.scores[(fs, fd)][rows[:, None], cols[None, :]]
        if src.kind == "mlp":
            expected = expected.sum(0, keepdim=True)
        if dst.kind == "mlp":
            expected = expected.sum(1, keepdim=True)
        torch.testing.assert_close(block, expected, rtol=1e-10, atol=1e-13)
    full_graph = HeadGraph(model)
    g = torch.Generator().manual_seed(1)
    some = {k: torch.rand(m.shape, generator=g) < 0.6 for k, m in graph.full_mask().items()}
    got = circuit_metric(model, some, CLEAN, CORRUPTED, METRIC, nodes=nodes)
    expected = circuit_metric(model, _expand(graph, full_graph, some), CLEAN, CORRUPTED, METRIC)
    assert got == pytest.approx(expected, rel=1e-10, abs=1e-12)
    heads = [f"L{li}H{h}" for li in range(2) for h in range(model.cfg.n_heads)]
    everything = heads + ["L0N3", "L1N7", "L0MLP", "L1MLP"]
    clean = METRIC(model(CLEAN), torch.arange(4)).item()
    whole = HeadGraph(model, nodes=everything).full_mask(True)
    assert circuit_metric(model, whole, CLEAN, CORRUPTED, METRIC, nodes=everything) == (
        pytest.approx(clean, rel=1e-12)
    )
    circuit = discover_circuit(
        model, CLEAN, CORRUPTED, METRIC, nodes=heads, mlp_rest=True, top_n=30,
        gate_value=False, progress=False,
    )  # fmt: skip
    assert {"L0MLP", "L1MLP"} <= set(circuit.graph.node_labels())
    circuit.figure()


@pytest.mark.parametrize("norm", [None, "ln", "rms"])
def test_block_scores_by_pairs_and_by_rows_agree(norm):
    """The two ways of scoring one block (writer x reader products, or each row's residual
    vectors) give the same scores, chunked or not."""
    from tl_attnonly.analysis.discovery.eap_blocks import (
        _block_scores_from_rows,
        _read,
        _read_direction,
        block_scores,
    )
    from tl_attnonly.analysis.discovery.edge_scores import _written

    g = torch.Generator().manual_seed(3)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    B, u, v, r, s, d = 7, 5, 4, 3, 6, 8
    a, U, grad, R = rand(B, u, r), rand(u, r, d), rand(B, v, s), rand(v, d, s)
    lin = None
    if norm is not None:
        lin = (rand(B, d), rand(B).abs() + 0.5, rand(d), norm == "ln")
    pairs = block_scores(a, U, grad, R, lin, 2**20, path="pairs")
    for budget in (2**20, 1):
        rows = block_scores(a, U, grad, R, lin, budget, path="rows")
        torch.testing.assert_close(rows, pairs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block_scores(a, U, grad, R, lin, 1), pairs, rtol=1e-12, atol=1e-12)
    # from each group's written and read residual vectors, computed once per group
    W = _written(a, U).transpose(0, 1)  # source-major -> [B, u, d]
    from_rows = _block_scores_from_rows(W, _read(grad, R), lin)
    torch.testing.assert_close(from_rows, pairs, rtol=1e-12, atol=1e-12)
    # with the reader's normalisation moved onto what it reads (every source in one product)
    moved = torch.einsum("bud,bvd->uv", W, _read_direction(_read(grad, R), lin))
    torch.testing.assert_close(moved, pairs, rtol=1e-12, atol=1e-12)


def test_named_neuron_groups_are_scored_with_the_narrow_groups(monkeypatch):
    """A restricted graph's neuron groups no wider than a layer's heads are scored with the
    attention heads (each row's written and read vectors, every group at once): no block is
    scored on its own, and the scores stay the entries of the full graph's."""
    from tl_attnonly.analysis.discovery import edge_scores as module

    model = _model("llama")
    nodes = _nodes(model)  # at most 3 neurons per layer, 4 heads
    full = edge_attribution_scores(model, CLEAN, CORRUPTED, METRIC, batch_size=3, progress=False)
    blocks = [0]
    block_scores = module.block_scores

    def counted(*args, **kwargs):
        blocks[0] += 1
        return block_scores(*args, **kwargs)

    monkeypatch.setattr(module, "block_scores", counted)
    part = edge_attribution_scores(
        model, CLEAN, CORRUPTED, METRIC, nodes=nodes, batch_size=3, progress=False
    )
    assert blocks[0] == 0
    for (s, d), block in part.scores.items():
        rows = torch.tensor(part.graph.source_by_key[s].index)
        cols = torch.tensor(part.graph.input_by_key[d].index)
        expected = full.scores[(s, d)][rows[:, None], cols[None, :]]
        torch.testing.assert_close(block, expected, rtol=1e-10, atol=1e-12)


def test_attribution_terms_mark_each_batchs_last_step():
    """``attribution_terms`` says which step ends a batch (EAP-IG reads a batch's summed
    directions then), and a batch's changes are the same at every step."""
    from tl_attnonly.analysis.discovery.edge_scores import attribution_terms
    from tl_attnonly.analysis.discovery.search import coarse_nodes
    from tl_attnonly.analysis.task import DiscoveryTask

    model = _model("llama")
    graph = HeadGraph(model, nodes=coarse_nodes(model))
    task = DiscoveryTask.make(model, CLEAN, CORRUPTED, METRIC, batch_size=2)
    terms = list(attribution_terms(task, graph, "eap-ig", 3, False, [0.0, 0.0]))
    assert [done for *_, done in terms] == [False, False, True] * 2  # two batches of 2
    assert [weight for _, _, weight, _ in terms] == [pytest.approx(1 / 3)] * 6
    assert terms[0][0] is terms[2][0] and terms[3][0] is not terms[0][0]
