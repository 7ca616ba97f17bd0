"""``evaluate_circuit``: a found circuit's exact faithfulness on other prompts.

On the bundled model (agreement prompts in its tokenizer; an ``AttnOnlyTransformer`` and a
converted bridge on TransformerLens 3, the bridge on 4), with circuits resolved by position and
not: on the search prompts it gives the search's figures back (the clean and corrupted metrics
exactly; the circuit's to float rounding, since the search measured it on the coarse graph and
``evaluate_circuit`` runs the graph with the neurons named, which sums each layer's named neurons
and remainder apart: 6e-8 apart in fp32 on one CPU, equal on another); on fresh prompts it equals
an exact run built here from the search's own node list (coarse nodes and named neurons) and the
metric of plain runs; position classes that do not fit the circuit are refused before any work.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from models import BRIDGES

import tl_attnonly
from tl_attnonly.analysis import (
    circuit_metrics,
    discover_circuit,
    evaluate_circuit,
    make_sva_dataset,
)
from tl_attnonly.analysis.discovery.search import coarse_nodes
from tl_attnonly.bundled import load_bundled_bridge, load_bundled_model

# one token each in the bundled tokenizer, singular and plural alike
WORDS = dict(
    subjects=[("key", "keys"), ("item", "items"), ("value", "values"), ("name", "names")],
    attractors=[("file", "files"), ("class", "classes")],
)
# a small search: plain EAP, no pruning pass, two neurons named per MLP node
SEARCH = dict(
    method="eap", prune_runs=0, neurons_per_mlp=2, gate_value=False, progress=False, batch_size=4
)
KINDS = ["bridge"] if BRIDGES else ["hooked", "bridge"]


@pytest.fixture(scope="module", params=KINDS)
def found(request):
    """(model, search data, fresh data, circuit by position, circuit over every position)."""
    loaded = load_bundled_model() if request.param == "hooked" else load_bundled_bridge()
    model = tl_attnonly.convert(loaded)
    data = make_sva_dataset(model, 8, seed=0, **WORDS)
    fresh = make_sva_dataset(model, 6, seed=1, exclude=data.prompts, **WORDS)
    assert not set(fresh.prompts) & set(data.prompts)
    args = (model, data.tokens, data.corrupted_tokens, data.additive_metric())
    by_position = discover_circuit(*args, positions=data.position_classes(), **SEARCH)
    everywhere = discover_circuit(*args, **SEARCH)
    return model, data, fresh, by_position, everywhere


def _classes(data, circuit):
    return None if circuit.graph.positions is None else data.position_classes()


def _circuit(found, which: str):
    return found[3] if which == "by_position" else found[4]


@pytest.mark.parametrize("which", ["by_position", "everywhere"])
def test_on_the_search_prompts_it_gives_the_search_figures_back(found, which):
    model, data, circuit = found[0], found[1], _circuit(found, which)
    assert circuit.extra["named"]  # a circuit with named neurons: a restricted graph
    got = evaluate_circuit(
        model, circuit, data.tokens, data.corrupted_tokens, data.additive_metric(),
        positions=_classes(data, circuit), batch_size=4,
    )  # fmt: skip
    assert got.n_prompts == len(data)
    assert got.metric_clean == circuit.metric_clean
    assert got.metric_corrupted == circuit.metric_corrupted
    assert got.metric_circuit == pytest.approx(circuit.metric_circuit, rel=1e-6, abs=0)
    assert got.faithfulness == pytest.approx(circuit.faithfulness, rel=1e-6, abs=0)


@pytest.mark.parametrize("which", ["by_position", "everywhere"])
def test_on_fresh_prompts_it_is_the_exact_run_of_the_circuit(found, which):
    model, fresh, circuit = found[0], found[2], _circuit(found, which)
    got = evaluate_circuit(
        model, circuit, fresh.tokens, fresh.corrupted_tokens, fresh.additive_metric(),
        positions=_classes(fresh, circuit),
    )  # fmt: skip
    # the graph the search named its neurons in: every head, every MLP layer, the named neurons
    nodes = coarse_nodes(model) + [n for named in circuit.extra["named"].values() for n in named]
    (expected,) = circuit_metrics(
        model, [circuit.mask], fresh.tokens, fresh.corrupted_tokens, fresh.metric, nodes=nodes,
        positions=_classes(fresh, circuit),
    )  # fmt: skip
    with torch.no_grad():  # the plain runs, on all fresh prompts at once
        clean, corrupted = (
            fresh.metric(model(tokens)).item() for tokens in (fresh.tokens, fresh.corrupted_tokens)
        )
    assert got.metric_circuit == pytest.approx(expected, abs=1e-5)
    assert got.metric_clean == pytest.approx(clean, abs=1e-5)
    assert got.metric_corrupted == pytest.approx(corrupted, abs=1e-5)
    assert got.faithfulness == pytest.approx((expected - corrupted) / (clean - corrupted), abs=1e-4)
    # other prompts, other figures: nothing is read back from the search
    assert not math.isclose(got.metric_clean, circuit.metric_clean, abs_tol=1e-3)
    assert not math.isclose(got.faithfulness, circuit.faithfulness, abs_tol=1e-3)


def test_position_classes_that_do_not_fit_the_circuit_are_refused(found):
    model, _, fresh, by_position, everywhere = found
    args = (fresh.tokens, fresh.corrupted_tokens, fresh.additive_metric())
    with pytest.raises(ValueError, match=r"give positions=\.\.\."):
        evaluate_circuit(model, by_position, *args)
    renamed = dataclasses.replace(
        fresh.position_classes(), names=("subj", "end", "other")
    )  # same ids, other names
    with pytest.raises(ValueError, match=r"positions= has the classes \('subj', 'end', 'other'\)"):
        evaluate_circuit(model, by_position, *args, positions=renamed)
    more = fresh.position_classes(("subject", "attractor", "end"))
    with pytest.raises(ValueError, match="positions= has the classes"):
        evaluate_circuit(model, by_position, *args, positions=more)
    with pytest.raises(ValueError, match="not resolved by position"):
        evaluate_circuit(model, everywhere, *args, positions=fresh.position_classes())
