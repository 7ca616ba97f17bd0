"""Exact circuit runs against their definition, edge by edge (fp64).

``circuit_metrics`` merges sources with identical outgoing edges and builds each distinct reader
input once (``run_plan.py``). The reference here does neither: every kept reader's input is the
corrupted residual input plus, one edge at a time, the change its source writes, and every reader
outside the graph reads the corrupted run.
"""

from __future__ import annotations

import pytest
import torch
from conftest import GATED_ZOO, make_tokens
from models import facts, make_converted, tl3_extra

from tl_attnonly.analysis import HeadGraph, circuit_metrics, logit_diff_metric
from tl_attnonly.analysis.discovery.exact_run import _recompute
from tl_attnonly.analysis.discovery.graph import EXPERTS, LATENT_ATTN, LOGITS, MLP_REST
from tl_attnonly.analysis.discovery.run_plan import CircuitPlan
from tl_attnonly.analysis.discovery.search import coarse_nodes, expand_mask
from tl_attnonly.analysis.discovery.sites import (
    input_hook_name,
    input_site,
    source_hook_names,
    source_values,
    writer_matrix,
)

CLEAN, CORRUPTED = make_tokens(3, 7, seed=0), make_tokens(3, 7, seed=1)
METRIC = logit_diff_metric(torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7]))
MODELS = {
    "llama": ("silu", GATED_ZOO["llama"], True),
    "gqa_rotary": (
        "silu",
        dict(normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=4,
             n_heads=4, d_head=4, n_key_value_heads=2),
        True,
    ),
    "ln_gelu_heads": ("gelu", dict(normalization_type="LN"), False),
    "parallel": ("silu", dict(normalization_type="LN", parallel_attn_mlp=True), True),
    # ALiBi (BLOOM, MPT): a position bias inside the scores, which the model adds to rebuilt q/k
    "alibi": ("silu", dict(normalization_type="LN", positional_embedding_type="alibi"), True),
}  # fmt: skip


def _reference(
    model, graph: HeadGraph, mask, clean=CLEAN, corrupted=CORRUPTED, metric=METRIC, *,
    changed=None, extra_hooks=(),
):  # fmt: skip
    """The circuit's metric by its definition, one edge at a time. A mixture of experts' input
    and a latent attention layer's (one reader: the layer) are normalised by the Hugging Face
    norm the bridge wraps. ``changed(src, change, current, corr)``: a source group's change
    (``[batch, pos, n, r]``) as the caller defines it, from the current run's recorded hooks
    (``extra_hooks`` too) and the corrupted cache."""
    adapter = facts(model)  # what the package's helpers read of the model
    with torch.no_grad():
        _, cache = model.run_with_cache(corrupted)
        corr = dict(cache.cache_dict)
        current: dict[str, torch.Tensor] = {}

        # hooks by the names they are added by (a bridge's hook point has its own name)
        def record(name):
            def hook(act, hook):
                current[name] = act
                return act

            return hook

        def reader_input(dst, j):
            x = corr[input_site(adapter, dst)[1]].clone()
            for src in graph.sources:
                if not (src.labels and src.order < dst.order):
                    continue
                change = source_values(current, src, graph, adapter) - source_values(
                    corr, src, graph, adapter
                )
                if changed is not None:
                    change = changed(src, change, current, cache)
                U = writer_matrix(adapter, src, graph, x)
                for u in mask[(src.key, dst.key)][:, j].nonzero().flatten().tolist():
                    x = x + change[:, :, u] @ U[u]
            return x

        groups: dict[str, list] = {}
        for dst in graph.inputs:
            if dst.labels:
                groups.setdefault(input_hook_name(dst, graph), []).append(dst)

        def patch(name):
            def hook(act, hook):
                out = corr[name].clone()  # readers outside the graph: corrupted
                for dst in groups[name]:
                    if dst.kind == LOGITS:
                        return reader_input(dst, 0)
                    if dst.kind == EXPERTS:
                        return model.blocks[dst.layer].ln2.original_component(reader_input(dst, 0))
                    if dst.kind == LATENT_ATTN:
                        return model.blocks[dst.layer].ln1.original_component(reader_input(dst, 0))
                    for j in range(len(dst.labels)):
                        which = dst.index if dst.kind == MLP_REST else (dst.index[j],)
                        x = reader_input(dst, j).unsqueeze(2)
                        new, heads = _recompute(adapter, dst, graph, x, torch.tensor(which))
                        out[:, :, heads] = new
                return out

            return hook

        hooks = [
            (n, record(n)) for n in dict.fromkeys([*source_hook_names(model, graph), *extra_hooks])
        ]
        hooks += [(name, patch(name)) for name in groups]
        logits = model.run_with_hooks(clean, fwd_hooks=hooks)
        return metric(logits, torch.arange(clean.shape[0])).item()


def _branch_gradient(model, at: str, names: list[str], clean, corrupted, metric):
    """``(grad, clean acts, corrupted acts)``: the gradient of ``metric`` on the corrupted run
    at a copy of the activation taken at hook ``at`` (a norm's input: the branch through that
    norm only, the residual path around it not counted), and the two runs' ``names``."""
    held = {}

    def branch(act, hook):
        held["x"] = act.detach().clone().requires_grad_(True)
        return held["x"]

    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean, names_filter=names)
        _, corrupted_cache = model.run_with_cache(corrupted, names_filter=names)
    logits = model.run_with_hooks(corrupted, fwd_hooks=[(at, branch)])
    (grad,) = torch.autograd.grad(metric(logits, torch.arange(clean.shape[0])), [held["x"]])
    return grad, clean_cache, corrupted_cache


def _check_exact_runs(model, nodes, clean, corrupted, metric, *, ends: float, rel: float):
    """Four circuits of the graph of ``nodes`` (full, empty, two random) run exactly: the full
    graph gives the clean run's metric and the empty graph the corrupted run's (to ``ends``),
    each equals :func:`_reference` (to ``rel``, and ``ends`` absolute), and they differ."""
    graph = HeadGraph(model, nodes=nodes)
    masks = [
        graph.full_mask(),
        graph.full_mask(False),
        _random_mask(graph, 0.3, seed=1),
        _random_mask(graph, 0.7, seed=2),
    ]
    got = circuit_metrics(model, masks, clean, corrupted, metric, nodes=nodes, batch_size=2)
    rows = torch.arange(clean.shape[0])
    with torch.no_grad():
        want_clean = metric(model(clean), rows).item()
        want_corrupted = metric(model(corrupted), rows).item()
    assert got[0] == pytest.approx(want_clean, abs=ends)
    assert got[1] == pytest.approx(want_corrupted, abs=ends)
    for value, mask in zip(got, masks, strict=True):
        want = _reference(model, graph, mask, clean, corrupted, metric)
        assert value == pytest.approx(want, rel=rel, abs=ends)
    assert len({round(v, 4) for v in got}) == len(got)  # the circuits differ
    return graph


def _random_mask(graph: HeadGraph, p: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.rand(m.shape, generator=g) < p for k, m in graph.full_mask().items()}


def _masks(model, graph: HeadGraph, coarse: HeadGraph, named: list[str]):
    """Random circuits of the fine graph, a coarse circuit expanded to it (named neurons and
    remainders with identical edges), and that circuit without a layer's named neurons' or
    remainder's outgoing edges (the masks of discover_circuit's neuron stage)."""
    expanded = expand_mask(coarse, _random_mask(coarse, 0.4, seed=3), graph)
    layer = int(named[0][1:].split("N")[0])
    masks = [
        graph.full_mask(),
        graph.full_mask(False),
        _random_mask(graph, 0.3, seed=1),
        _random_mask(graph, 0.7, seed=2),
        expanded,
    ]
    for keys in ({f"neuron.{layer}"}, {f"mlp.{layer}"}, {f"neuron.{layer}", f"mlp.{layer}"}):
        masks.append({k: m & (k[0] not in keys) for k, m in expanded.items()})
    return masks


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=tl3_extra("llama")) if n == "gqa_rotary" else n for n in sorted(MODELS)],
)
def test_circuit_runs_equal_the_edge_by_edge_definition(name):
    act_fn, overrides, neuron_level = MODELS[name]
    model = make_converted(act_fn, **overrides)
    named = ["L0N2", "L0N5", "L1N0", "L1N9"]
    if not neuron_level:  # neuron-heads
        named = [f"{n}.{k}" for n in named for k in range(facts(model).n_heads_per_neuron)]
    nodes = coarse_nodes(model) + named
    graph = HeadGraph(model, neuron_level=neuron_level, nodes=nodes)
    coarse = HeadGraph(model, neuron_level=neuron_level, nodes=coarse_nodes(model))
    masks = _masks(model, graph, coarse, named)
    got = circuit_metrics(
        model, masks, CLEAN, CORRUPTED, METRIC, neuron_level=neuron_level, nodes=nodes,
        batch_size=2,
    )  # fmt: skip
    for value, mask in zip(got, masks, strict=True):
        assert value == pytest.approx(_reference(model, graph, mask), rel=1e-10, abs=1e-12)
    # and on the full (unrestricted) graph
    full = HeadGraph(model, neuron_level=neuron_level)
    mask = _random_mask(full, 0.2, seed=4)
    (value,) = circuit_metrics(model, [mask], CLEAN, CORRUPTED, METRIC, neuron_level=neuron_level)
    assert value == pytest.approx(_reference(model, full, mask), rel=1e-10, abs=1e-12)


def test_an_expanded_coarse_circuit_merges_back_to_the_coarse_sources():
    """A named neuron and its layer's remainder with the same edges are one merged row: the
    fine run's source rows are the coarse run's."""
    model = make_converted("silu", **GATED_ZOO["llama"])
    coarse = HeadGraph(model, nodes=coarse_nodes(model))
    fine = HeadGraph(model, nodes=coarse_nodes(model) + ["L0N2", "L0N5", "L1N0"])
    mask = _random_mask(coarse, 0.5, seed=0)
    coarse_plan = CircuitPlan(coarse, mask)
    fine_plan = CircuitPlan(fine, expand_mask(coarse, mask, fine))
    assert fine_plan.n_rows == coarse_plan.n_rows
    assert fine_plan.offsets[-1] < sum(len(s.labels) for s in fine.sources)


def _record_source_values(monkeypatch) -> list:
    """The source groups whose values the exact runs read, in order (``run_plan.source_values``
    recorded)."""
    from tl_attnonly.analysis.discovery import run_plan

    read: list = []
    source_values = run_plan.source_values

    def recorded(acts, src, graph, model):
        read.append(src)
        return source_values(acts, src, graph, model)

    monkeypatch.setattr(run_plan, "source_values", recorded)
    return read


@pytest.mark.parametrize("name", ["llama", "ln_gelu_heads", "parallel"])
def test_a_whole_mlp_layer_changes_by_its_output(name, monkeypatch):
    """A merged row that holds every neuron of a layer (a coarse MLP node, or named neurons
    merged with their remainder) takes its change from the layer's output (``hook_mlp_out``)
    instead of its neurons' values times ``W_out``: no MLP source's values are read, and the
    run is the edge-by-edge definition."""
    act_fn, overrides, neuron_level = MODELS[name]
    model = make_converted(act_fn, **overrides)
    sources = _record_source_values(monkeypatch)
    coarse = HeadGraph(model, neuron_level=neuron_level, nodes=coarse_nodes(model))
    mask = _random_mask(coarse, 0.5, seed=5)
    assert any(CircuitPlan(coarse, mask).whole.values())
    (value,) = circuit_metrics(
        model, [mask], CLEAN, CORRUPTED, METRIC, neuron_level=neuron_level,
        nodes=coarse_nodes(model),
    )  # fmt: skip
    read = [src.kind for src in sources]
    assert read and MLP_REST not in read  # the heads' values only
    assert value == pytest.approx(_reference(model, coarse, mask), rel=1e-10, abs=1e-12)


def test_alibi_s_full_and_empty_graphs_are_the_clean_and_corrupted_runs():
    """ALiBi's position bias is inside the attention scores, added by the model to any q and k:
    discovery runs (it refused), and its full and empty graphs are the unconverted model's clean
    and corrupted runs."""
    from models import make_pair

    original, converted = make_pair(
        "silu", normalization_type="LN", positional_embedding_type="alibi"
    )
    graph = HeadGraph(converted)
    rows = torch.arange(CLEAN.shape[0])
    got = circuit_metrics(
        converted, [graph.full_mask(), graph.full_mask(False)], CLEAN, CORRUPTED, METRIC
    )
    with torch.no_grad():
        expected = [METRIC(original(tokens), rows).item() for tokens in (CLEAN, CORRUPTED)]
    assert got == pytest.approx(expected, rel=1e-8, abs=1e-10)
    assert abs(expected[0] - expected[1]) > 1e-3


@pytest.mark.parametrize("name", ["llama", "ln_gelu_heads"])
def test_analysis_s_norms_fire_no_hook(name):
    """The protocol's norms (``Block.ln1`` / ``ln2``) compute the model's norm without firing
    its hooks (``hook_scale``, ``hook_normalized``), as the protocol says: a hook there belongs to
    the model's run (a patch of it must not reach an input analysis rebuilds through the norm).
    On an ``AttnOnlyTransformer`` the norm called TransformerLens's module, hooks and all."""
    from tl_attnonly.adapt import analysis_model

    act_fn, overrides, _ = MODELS[name]
    model = make_converted(act_fn, **overrides)
    adapted = analysis_model(model)
    x = torch.randn(2, 5, adapted.cfg.d_model, dtype=torch.float64)
    fired: list[str] = []

    def hook(act, hook):
        fired.append(hook.name)

    with model.hooks(fwd_hooks=[(lambda n: ".ln" in n, hook)]):
        for block in adapted.blocks:
            for norm in (block.ln1, block.ln2):
                reference = norm(x)  # inside the hooks: none may fire
                assert reference.shape == x.shape
    assert fired == []
    _, cache = model.run_with_cache(CLEAN)  # the norm's values are the model's own
    norm = adapted.blocks[1].ln2
    site = "blocks.1.hook_resid_pre" if adapted.cfg.parallel_attn_mlp else "blocks.1.hook_resid_mid"
    (mlp_in,) = [n for n in cache.keys() if n == "blocks.1.ln2.hook_normalized"]
    w = norm.w if norm.w is not None else 1.0
    b = norm.b if norm.b is not None else 0.0
    torch.testing.assert_close(norm(cache[site]), cache[mlp_in] * w + b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["llama", "ln_gelu_heads", "parallel"])
@pytest.mark.parametrize("same_edges", [False, True], ids=["own-value-edges", "same-edges"])
def test_a_whole_mlp_layer_s_gate_is_rebuilt_before_its_projections(name, same_edges, monkeypatch):
    """A whole MLP layer (a coarse MLP node) whose gate input is rebuilt is patched at its
    normalised input (``mlp_input_hook``: the model then projects it once); its value is
    patched after its projection as before, or not at all where its edges are the gate's. The
    run is the edge-by-edge definition either way."""
    from tl_attnonly.analysis.discovery import exact_run

    act_fn, overrides, neuron_level = MODELS[name]
    model = make_converted(act_fn, **overrides)
    coarse = HeadGraph(model, neuron_level=neuron_level, nodes=coarse_nodes(model))
    mask = _random_mask(coarse, 0.5, seed=6)
    if same_edges:  # each layer's value reads what its gate reads
        for src, dst in list(mask):
            if dst.startswith("mlp.") and dst.endswith(".value"):
                mask[(src, dst)] = mask[(src, dst.replace(".value", ".gate"))].clone()
    patched: list[str] = []
    normalised_input = exact_run._normalised_input

    def spied(run, dst, value_of, site_name):
        hook = normalised_input(run, dst, value_of, site_name)

        def recorded(act, hook_point):
            patched.append(dst.key)
            return hook(act, hook_point)

        return recorded

    monkeypatch.setattr(exact_run, "_normalised_input", spied)
    (value,) = circuit_metrics(
        model, [mask], CLEAN, CORRUPTED, METRIC, neuron_level=neuron_level,
        nodes=coarse_nodes(model),
    )  # fmt: skip
    assert patched  # the gate of some whole layer was rebuilt before its projections
    assert value == pytest.approx(_reference(model, coarse, mask), rel=1e-10, abs=1e-12)
