"""``neuron_profiles``: a circuit's named neurons with their gate/value split, top contexts and
sign quadrants, checked against independent references on both TransformerLens lines.

References: the gate/value split by exact circuit runs of masks edited here; every corpus
statistic from a plain ``run_with_hooks`` of each corpus row alone, reading ``hook_pre`` and
``hook_pre_linear`` and computing the neuron's output with torch's SiLU (``silu(g) * u``, not the
neuron-head path the tool reads), ranked and counted by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import GATED_ZOO, make_tokens
from models import BRIDGES, make_converted

from tl_attnonly.analysis import (
    circuit_metric,
    discover_circuit,
    logit_diff_metric,
    named_neurons,
    neuron_profiles,
)
from tl_attnonly.analysis.discovery.profiles import ALL, QUADRANTS, parse_neuron_label
from tl_attnonly.hooks import neuron_act_name

CLEAN, CORRUPTED = make_tokens(4, 8, seed=0), make_tokens(4, 8, seed=1)
METRIC = logit_diff_metric(torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7, 8]))
#: Six rows of 20 tokens: split at n_ctx = 12 into 12 documents of 12 and 8 tokens.
CORPUS = make_tokens(6, 20, seed=5)
K_TOP = 4

#: discover_circuit's notes (overshoot, a gate/value cell with no edge) are not the subject here
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _discover(model, **kw):
    return discover_circuit(
        model, CLEAN, CORRUPTED, METRIC, progress=False, prune_runs=0, method="eap", **kw
    )


@pytest.fixture(scope="module")
def gated():
    """A SwiGLU model, its circuit (3 neurons named, the split run for 2) and their profiles."""
    model = make_converted("silu", **GATED_ZOO["llama"])
    circuit = _discover(model, neurons_per_mlp=3, max_gate_value_neurons=2)
    profiles = neuron_profiles(model, circuit, [CORPUS], k=K_TOP, before=3, after=1)
    return model, circuit, profiles


def _documents(max_len: int = 12) -> list[torch.Tensor]:
    """The corpus rows as the tool streams them: each row split every ``max_len`` tokens."""
    return [row[s : s + max_len] for row in CORPUS for s in range(0, row.shape[0], max_len)]


def _reference(model, label: str) -> dict[str, torch.Tensor]:
    """Per document (run alone, no padding): the neuron's g, u and output silu(g) * u."""
    layer, index = parse_neuron_label(label)
    out: dict[str, list[torch.Tensor]] = {"g": [], "u": []}
    names = {"g": neuron_act_name("pre", layer), "u": neuron_act_name("pre_linear", layer)}
    for doc in _documents():

        def grab(key):  # keyed here: a bridge's hook.name is its own module's
            return lambda act, hook: out[key].append(act[0, :, index].detach().clone())

        with torch.no_grad():
            model.run_with_hooks(doc[None], fwd_hooks=[(names[key], grab(key)) for key in names])
    g, u = torch.cat(out["g"]), torch.cat(out["u"])
    doc = torch.cat([torch.full((len(d),), i) for i, d in enumerate(_documents())])
    pos = torch.cat([torch.arange(len(d)) for d in _documents()])
    token = torch.cat(_documents())
    return dict(g=g, u=u, o=F.silu(g) * u, doc=doc, pos=pos, token=token)


def test_the_named_neurons_are_the_neuron_stage_names_in_its_order(gated):
    model, circuit, profiles = gated
    named = circuit.extra["named"]
    stage = [n for li in sorted(named) for n in named[li]]
    assert len(stage) == 3 * len(named) >= 3
    assert named_neurons(circuit) == stage == profiles.neurons
    assert list(profiles.table.layer) == [parse_neuron_label(n)[0] for n in stage]
    assert profiles.table.gated.all()


def _split_by_runs(model, circuit, label: str) -> dict[str, float]:
    """The gate/value split of ``label`` by exact runs of the circuit's mask edited here."""
    graph = circuit.graph

    def without(*inputs: str):
        mask = {key: m.clone() for key, m in circuit.mask.items()}
        for src, dst in graph.blocks():
            if dst.kind == "neuron" and dst.input in inputs and label in dst.labels:
                mask[(src.key, dst.key)][:, dst.labels.index(label)] = False
        return mask

    def run(mask) -> float:
        return circuit_metric(
            model, mask, CLEAN, CORRUPTED, METRIC, nodes=graph.node_labels(), progress=False
        )

    full, none = run(circuit.mask), run(without("gate", "value"))
    no_gate, no_value = run(without("gate")), run(without("value"))
    return dict(gate=no_value - none, value=no_gate - none, both=full - none)


def test_gate_value_split_per_neuron_equals_exact_runs_and_is_measured_where_missing(gated):
    model, circuit, profiles = gated
    table = profiles.table.set_index("neuron")
    assert (table.gate_value_from == "circuit").sum() == 2  # max_gate_value_neurons
    missing = table.index[table.gate_value_from == "not measured"]
    assert len(missing) == len(table) - 2 >= 1
    assert table.loc[missing, "gate"].isna().all() and table.loc[missing, "both"].isna().all()
    assert any(missing[0] in note and "clean_tokens" in note for note in profiles.notes)
    measured = neuron_profiles(
        model, circuit, [CORPUS], k=1, max_rows=1, clean_tokens=CLEAN,
        corrupted_tokens=CORRUPTED, metric=METRIC,
    ).table.set_index("neuron")  # fmt: skip
    assert (measured.loc[missing, "gate_value_from"] == "measured here").all()
    compared = set()
    for label in profiles.neurons:
        expected = _split_by_runs(model, circuit, label)
        row = measured.loc[label]
        if row.n_gate_edges == 0 or row.n_value_edges == 0:  # a side with no edge: NaN
            continue
        compared.add(row.gate_value_from)
        for column, value in expected.items():
            assert row[column] == pytest.approx(value, rel=1e-9, abs=1e-12), (label, column)
        if table.loc[label, "gate_value_from"] == "circuit":  # the circuit's own row, as is
            assert table.loc[label, "both"] == pytest.approx(expected["both"], rel=1e-9)
    assert compared == {"circuit", "measured here"}


def test_corpus_statistics_and_quadrants_equal_a_hand_count_of_silu_g_times_u(gated):
    model, _, profiles = gated
    assert profiles.n_rows == len(_documents()) == 12
    assert profiles.n_positions == sum(len(d) for d in _documents())
    for label in profiles.neurons:
        ref = _reference(model, label)
        row = profiles.row(label)
        o, g, u = ref["o"], ref["g"], ref["u"]
        n = o.numel()
        assert row.mean_output == pytest.approx(float(o.mean()), rel=1e-9)
        assert row.max_abs_output == pytest.approx(float(o.abs().max()), rel=1e-9)
        # SwiGLU: a neuron-head's weight on itself is sigmoid(g), so it fires where g > 0
        assert row.firing_fraction == pytest.approx(float((g > 0).double().mean()), abs=1e-12)
        quadrant = {
            "g+u+": (g > 0) & (u > 0),
            "g+u-": (g > 0) & (u <= 0),
            "g-u+": (g <= 0) & (u > 0),
            "g-u-": (g <= 0) & (u <= 0),
        }
        assert tuple(quadrant) == QUADRANTS
        for q, inside in quadrant.items():
            assert row[f"share_{q}"] == pytest.approx(int(inside.sum()) / n, abs=1e-12)
            assert row[f"output_{q}"] == pytest.approx(float(o[inside].sum()) / n, abs=1e-9)
            share = float(o[inside].abs().sum() / o.abs().sum())
            assert row[f"abs_share_{q}"] == pytest.approx(share, abs=1e-9)
        # the four quadrants partition the positions and the neuron's mean output
        assert sum(row[f"output_{q}"] for q in QUADRANTS) == pytest.approx(row.mean_output)
        quads = profiles.quadrants(label)
        assert list(quads.quadrant) == list(QUADRANTS)
        assert quads.share.sum() == pytest.approx(1.0) and quads.abs_share.sum() == pytest.approx(1)


def _expected_top(ref: dict[str, torch.Tensor], where: torch.Tensor) -> list[tuple[int, int]]:
    """The ``K_TOP`` (document, position) with the largest |output| among ``where``."""
    values = ref["o"].abs().masked_fill(~where, -math.inf)
    order = values.argsort(descending=True, stable=True)[:K_TOP]
    return [(int(ref["doc"][i]), int(ref["pos"][i])) for i in order if values[i] > -math.inf]


def test_top_contexts_overall_and_per_quadrant_are_the_largest_outputs_by_hand(gated):
    model, _, profiles = gated
    for label in profiles.neurons:
        ref = _reference(model, label)
        g, u = ref["g"], ref["u"]
        wheres = {
            ALL: torch.ones_like(g, dtype=torch.bool),
            "g+u+": (g > 0) & (u > 0),
            "g+u-": (g > 0) & (u <= 0),
            "g-u+": (g <= 0) & (u > 0),
            "g-u-": (g <= 0) & (u <= 0),
        }
        for ranking, where in wheres.items():
            got = profiles.contexts(label, ranking)
            expected = _expected_top(ref, where)
            assert list(zip(got.document, got.position, strict=True)) == expected, (label, ranking)
            for r in got.itertuples():
                i = int(((ref["doc"] == r.document) & (ref["pos"] == r.position)).nonzero())
                assert r.output == pytest.approx(float(ref["o"][i]), rel=1e-9)
                # the window: 3 tokens before, the centre in brackets, 1 after, none past the row
                doc = _documents()[r.document]
                window = doc[max(r.position - 3, 0) : r.position + 2].tolist()
                centre = f"⟦[{int(doc[r.position])}]⟧"
                assert r.text == "".join(
                    centre if p == r.position else f"[{t}]"
                    for p, t in zip(range(max(r.position - 3, 0), r.position + 2), window)
                )
        # top tokens: the largest mean |output| over tokens seen >= 3 times
        first = profiles.row(label).top_tokens.split(",")[0]
        counts = torch.bincount(ref["token"], minlength=model.cfg.d_vocab)
        means = torch.zeros(model.cfg.d_vocab, dtype=torch.float64).index_add_(
            0, ref["token"], ref["o"]
        ) / counts.clamp(min=1)
        best = int(means.abs().masked_fill(counts < 3, -1).argmax())
        assert first.startswith(f"'[{best}]'") and f"(n={int(counts[best])})" in first


def test_plain_mlp_neurons_have_no_quadrants_and_read_a_real_tokenizer():
    """The bundled model (plain SiLU, a tokenizer) on both lines: contexts decode as text, the
    output is silu(pre) and quadrants are refused, not made up."""
    import tl_attnonly
    from tl_attnonly.bundled import load_bundled_bridge
    from tl_attnonly.corpora import load_sentences

    model = tl_attnonly.convert(load_bundled_bridge())
    text = [model.to_tokens(s)[0] for s in load_sentences()[:40]]
    rows = torch.stack([t[:8] for t in text if t.shape[0] >= 8][:4])
    corrupted = rows.clone()
    corrupted[:, 4] = rows.roll(1, 0)[:, 4]
    with torch.no_grad():
        metric = logit_diff_metric(
            model(rows)[:, -1].argmax(-1), model(corrupted)[:, -1].argmax(-1)
        )
    circuit = discover_circuit(
        model, rows, corrupted, metric, progress=False, method="eap", graph="coarse", top_n=20,
        neurons_per_mlp=2, gate_value=False,
    )  # fmt: skip
    corpus = load_sentences()[:6]
    profiles = neuron_profiles(model, circuit, corpus, k=2, before=4, after=1)
    label = profiles.neurons[0]
    row = profiles.row(label)
    assert not row.gated and math.isnan(row["share_g+u+"]) and math.isnan(row.gate)
    with pytest.raises(ValueError, match="plain MLP"):
        profiles.quadrants(label)
    assert set(profiles.examples.ranking) == {ALL}
    layer, index = parse_neuron_label(label)
    best = profiles.contexts(label).iloc[0]
    tokens = model.to_tokens(corpus[best.document])[0]
    pre = {}
    with torch.no_grad():
        model.run_with_hooks(
            tokens[None],
            fwd_hooks=[(neuron_act_name("pre", layer), lambda a, hook: pre.setdefault(0, a))],
        )
    o = F.silu(pre[0][0, :, index].double())
    assert best.position == int(o.abs().argmax())
    assert best.output == pytest.approx(float(o[best.position]), rel=1e-4, abs=1e-5)
    decoded = model.tokenizer.decode([int(tokens[best.position])])
    assert best.token == decoded and f"⟦{decoded}⟧" in best.text


def test_refusals_name_what_is_supported(gated):
    model, circuit, _ = gated
    with pytest.raises(TypeError, match="Circuit"):
        neuron_profiles(model, circuit.edges(), [CORPUS])
    with pytest.raises(ValueError, match="L\\{layer\\}N\\{index\\}"):
        neuron_profiles(model, circuit, [CORPUS], neurons=["L0N999"])
    with pytest.raises(ValueError, match="L\\{layer\\}N\\{index\\}"):
        neuron_profiles(model, circuit, [CORPUS], neurons=["L0H1"])
    with pytest.raises(ValueError, match="k and batch_size"):
        neuron_profiles(model, circuit, [CORPUS], k=0)
    with pytest.raises(MemoryError, match="token_stats=False"):
        neuron_profiles(model, circuit, [CORPUS], max_bytes=8)
    with pytest.raises(KeyError, match="not profiled"):
        neuron_profiles(model, circuit, [CORPUS], neurons=["L1N0"], max_rows=1).row("L0N0")
    coarse = _discover(model, neurons_per_mlp=0, gate_value=False)
    with pytest.raises(ValueError, match="neurons_per_mlp"):
        neuron_profiles(model, coarse, [CORPUS])


@pytest.mark.skipif(BRIDGES, reason="compares an AttnOnlyTransformer with a bridge (TL 3 only)")
def test_both_model_kinds_give_the_same_profiles():
    from kinds import make_pair

    hooked, bridge = make_pair("llama_gqa")
    circuit = discover_circuit(
        hooked, CLEAN, CORRUPTED, METRIC, progress=False, method="eap", graph="coarse", top_n=20,
        neurons_per_mlp=2, gate_value=False,
    )  # fmt: skip
    corpus = [make_tokens(3, 10, seed=7)]
    data = dict(clean_tokens=CLEAN, corrupted_tokens=CORRUPTED, metric=METRIC)
    a = neuron_profiles(hooked, circuit, corpus, k=3, **data)
    b = neuron_profiles(bridge, circuit, corpus, k=3, **data)
    assert len(a.table) == 2 and set(a.table.gate_value_from) == {"measured here"}
    assert list(a.table.columns) == list(b.table.columns)
    # the LLaMA bridge's attention softmax runs in float32 (tests/analysis/test_both_kinds.py)
    for column in a.table.select_dtypes("number").columns:
        scale = max(1.0, float(a.table[column].abs().max()))
        assert a.table[column].to_numpy() == pytest.approx(
            b.table[column].to_numpy(), rel=0, abs=1e-5 * scale, nan_ok=True
        ), column
    assert list(a.examples.text) == list(b.examples.text)
