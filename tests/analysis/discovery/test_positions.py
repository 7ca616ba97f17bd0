"""Graphs resolved by position class: scores and exact circuit runs against independent references.

- Scores: each edge's score at a class is the directional derivative of the corrupted run whose
  reader reads ``resid + t * delta(source)`` at that class's positions only (autograd, fp64); the
  classes' scores sum to the unresolved score.
- Circuit runs: the full graph is the clean run and the empty graph the corrupted one; a mask
  repeated over every class is the unresolved circuit; full edges at one class and none at the
  others equals a run with every reader's input hook set to the corrupted run at the other
  classes' positions (plain TransformerLens hooks).
"""

from __future__ import annotations

import pytest
import torch
from conftest import GATED_ZOO, make_tokens
from models import facts, make_converted, tl3_extra
from test_circuit_discovery import _edge_run  # the unresolved edges' independent reference

from tl_attnonly.analysis import (
    HeadGraph,
    IOIDataset,
    PositionClasses,
    circuit_metric,
    circuit_metrics,
    discover_circuit,
    edge_attribution_scores,
)
from tl_attnonly.analysis.discovery.positions import resolve_name

CLEAN, CORRUPTED = make_tokens(3, 8, seed=0), make_tokens(3, 8, seed=1)
WEIGHTS = torch.randn(61, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
#: Three classes: the first two positions, the last one, the rest.
IDS = torch.tensor([[0, 0, 2, 2, 2, 2, 2, 1]] * 3)
CLASSES = PositionClasses(("start", "end", "other"), IDS)


def _metric(logits):  # reads every position, so every class matters
    return (logits.sum(1) @ WEIGHTS).sum()


def _model(name: str):
    if name == "llama":
        return make_converted("silu", **GATED_ZOO["llama"])
    if name == "gqa":
        return make_converted(
            "silu", normalization_type="RMS", n_heads=4, d_head=4, n_key_value_heads=2
        )
    return make_converted("silu", normalization_type="LN")


#: On TL 4 gqa's bridge is llama's (a LLaMA bridge of the same sizes).
GQA = pytest.param("gqa", marks=tl3_extra("llama"))


def _resolved_score(es, src: str, dst: str, inp: str, position: str) -> float:
    frame = es.frame()
    row = frame[
        (frame.source == src)
        & (frame.target == dst)
        & (frame.input == inp)
        & (frame.position == position)
    ]
    assert len(row) == 1, (src, dst, inp, position)
    return float(row.score.iloc[0])


@pytest.mark.parametrize("name", ["llama", GQA, "ln_silu"])
def test_resolved_scores_are_directional_derivatives_at_each_class(name, monkeypatch):
    model = _model(name)
    import test_circuit_discovery as reference

    monkeypatch.setattr(reference, "CLEAN", CLEAN)
    monkeypatch.setattr(reference, "CORRUPTED", CORRUPTED)
    es = edge_attribution_scores(
        model, CLEAN, CORRUPTED, _metric, positions=CLASSES, progress=False
    )
    plain = edge_attribution_scores(model, CLEAN, CORRUPTED, _metric, progress=False).frame()
    cases = [
        ("embed", "L0H1", "q"),
        ("embed", "L0N3", "gate"),
        ("L0H0", "L1H1", "v"),
        ("L0N5", "L1N2", "value"),
        ("L0H1", "L1N2", "gate"),
        ("L1N8", "logits", ""),
    ]
    gqa = bool(facts(model).cfg.n_key_value_heads)
    for src, dst, inp in cases:
        label = dst.replace("H", "KV") if gqa and inp in "kv" else dst
        total = 0.0
        for c, position in enumerate(CLASSES.names):
            where = (IDS == c).to(torch.float64)[:, :, None]
            t = torch.zeros((), dtype=torch.float64, requires_grad=True)
            value = _edge_run(model, src, dst, inp, _metric, t * where)
            expected = torch.autograd.grad(value, t)[0].item()
            got = _resolved_score(es, src, label, inp, position)
            assert got == pytest.approx(expected, rel=1e-8, abs=1e-10), (src, dst, inp, position)
            total += got
        row = plain[(plain.source == src) & (plain.target == label) & (plain.input == inp)]
        assert total == pytest.approx(float(row.score.iloc[0]), rel=1e-9, abs=1e-10)


def _repeated(graph: HeadGraph, resolved: HeadGraph, mask) -> dict:
    return {(s, d): mask[(s, resolve_name(d)[0])].clone() for s, d in resolved.block_keys()}


@pytest.mark.parametrize("name", ["llama", GQA, "ln_silu"])
def test_resolved_runs_full_empty_and_repeated_masks_are_the_unresolved_runs(name):
    model = _model(name)
    graph, resolved = HeadGraph(model), HeadGraph(model, positions=CLASSES.names)
    assert resolved.n_edges() == 3 * graph.n_edges()
    full, empty = resolved.full_mask(True), resolved.full_mask(False)
    clean, corrupted = _metric(model(CLEAN)).item(), _metric(model(CORRUPTED)).item()
    gen = torch.Generator().manual_seed(0)
    randoms = [
        {k: torch.rand(m.shape, generator=gen) < p for k, m in graph.full_mask().items()}
        for p in (0.2, 0.6, 0.9)
    ]
    values = circuit_metrics(
        model, [full, empty, *(_repeated(graph, resolved, m) for m in randoms)], CLEAN,
        CORRUPTED, _metric, positions=CLASSES, batch_size=2,
    )  # fmt: skip
    assert values[0] == pytest.approx(clean, rel=1e-12)
    assert values[1] == pytest.approx(corrupted, rel=1e-12)
    expected = circuit_metrics(model, randoms, CLEAN, CORRUPTED, _metric)
    assert values[2:] == pytest.approx(expected, rel=1e-12)
    assert len({round(v, 6) for v in expected}) == 3  # the random circuits differ


def _input_hooks(model) -> list[str]:
    names = [f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    for li in range(model.cfg.n_layers):
        names += [f"blocks.{li}.attn.hook_{x}" for x in "qkv"]
        if facts(model).cfg.gated_mlp:
            names += [f"blocks.{li}.mlp.hook_pre", f"blocks.{li}.mlp.hook_pre_linear"]
    return names


@pytest.mark.parametrize("name", ["llama", GQA])
def test_full_edges_at_one_class_equal_corrupted_inputs_at_the_others(name):
    model = _model(name)
    resolved = HeadGraph(model, positions=CLASSES.names)
    names = _input_hooks(model)
    _, corr = model.run_with_cache(CORRUPTED, names_filter=lambda n: n in names)
    for c, position in enumerate(CLASSES.names):
        mask = {
            (s, d): torch.full(m.shape, resolve_name(d)[1] == position)
            for (s, d), m in resolved.full_mask().items()
        }
        got = circuit_metric(model, mask, CLEAN, CORRUPTED, _metric, positions=CLASSES)
        frozen = IDS != c

        def hook(name, frozen=frozen):  # by the name it is added by (a bridge's hook point's
            def fn(act, hook):  # own name may be another)
                shape = frozen.shape + (1,) * (act.ndim - 2)
                return torch.where(frozen.view(shape), corr[name], act)

            return fn

        reference = model.run_with_hooks(CLEAN, fwd_hooks=[(n, hook(n)) for n in names])
        assert got == pytest.approx(_metric(reference).item(), rel=1e-12), position
        assert got != pytest.approx(_metric(model(CLEAN)).item(), rel=1e-6)


def test_position_classes_are_checked_and_ioi_has_its_roles():
    with pytest.raises(ValueError, match="unique"):
        PositionClasses(("a", "a"), IDS)
    with pytest.raises(ValueError, match="class indices"):
        PositionClasses(("a", "b"), IDS)
    with pytest.raises(ValueError, match="integer"):
        PositionClasses(("a", "b", "c"), IDS.float())
    model = _model("llama")
    with pytest.raises(ValueError, match="shape"):
        circuit_metric(
            model, HeadGraph(model, positions=CLASSES.names).full_mask(), CLEAN[:, :6],
            CORRUPTED[:, :6], _metric, positions=PositionClasses(CLASSES.names, IDS),
        )  # fmt: skip
    with pytest.raises(ValueError, match="lacks blocks"):  # an unresolved mask, resolved run
        circuit_metric(model, HeadGraph(model).full_mask(), CLEAN, CORRUPTED, _metric,
                       positions=CLASSES)  # fmt: skip
    with pytest.raises(ValueError, match="positions=..."):  # a resolved mask, unresolved run
        circuit_metric(
            model, HeadGraph(model, positions=CLASSES.names).full_mask(False), CLEAN, CORRUPTED,
            _metric,
        )  # fmt: skip
    classes = PositionClasses.from_positions(
        (2, 5), {"a": torch.tensor([1, 2]), "b": torch.tensor([4, 4])}
    )
    assert classes.names == ("a", "b", "other")
    assert classes.ids.tolist() == [[2, 0, 2, 2, 1], [2, 2, 0, 2, 1]]


def _ioi_like(n: int = 6):
    """IOI-shaped token rows of a tiny model: IO at 2, S at 4 and 7, END last; names replaced."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(20, 61, (n, 10), generator=gen)
    names = torch.randint(1, 10, (n, 2), generator=gen)
    names[:, 1] = (names[:, 0] + 1 + torch.randint(0, 8, (n,), generator=gen)) % 10
    tokens[:, 2], tokens[:, 4], tokens[:, 7] = names[:, 0], names[:, 1], names[:, 1]
    corrupted = tokens.clone()
    corrupted[:, [2, 4, 7]] = torch.randint(10, 20, (n, 3), generator=gen)
    pos = lambda p: torch.full((n,), p)  # noqa: E731
    return IOIDataset.from_tokens(tokens, corrupted, pos(2), pos(4), pos(7))


def test_discover_circuit_resolved_by_ioi_roles_is_exact():
    model = _model("llama")
    data = _ioi_like()
    classes = data.position_classes()
    assert classes.names == ("io", "s1", "s1_plus1", "s2", "end", "other")
    assert classes.ids[0].tolist() == [5, 5, 0, 5, 1, 2, 5, 3, 5, 4]
    metric = data.additive_metric()
    circuit = discover_circuit(
        model, data.tokens, data.corrupted_tokens, metric, positions=classes,
        neurons_per_mlp=2, progress=False,
    )  # fmt: skip
    frame = circuit.edges()
    assert set(frame.position) <= set(classes.names)
    assert frame.edge.str.contains("@").all()
    assert circuit.faithfulness >= 0.8
    again = circuit_metric(
        model, circuit.mask, data.tokens, data.corrupted_tokens, metric,
        nodes=circuit.graph.node_labels(), positions=classes,
    )  # fmt: skip
    assert again == pytest.approx(circuit.metric_circuit, rel=1e-9, abs=1e-9)
    coarse = circuit.extra["coarse"]
    assert circuit.faithfulness == pytest.approx(coarse.faithfulness, rel=1e-9, abs=1e-9)
