"""``faithfulness_curve_figure``: a found circuit's faithfulness against its size, as measured by
``discover_circuit`` (MIB's grid with CPR and CMD, the sweep's sizes, the circuit itself)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import tl_attnonly
from tl_attnonly.analysis import discover_circuit
from tl_attnonly.analysis.discovery.pruning import mask_size
from tl_attnonly.bundled import load_bundled_bridge
from tl_attnonly.report.circuit import next_token_metric
from tl_attnonly.vis import faithfulness_curve_figure


@pytest.fixture(scope="module")
def circuit():
    model = tl_attnonly.convert(load_bundled_bridge())
    tokens = model.to_tokens("def f(x):\n    return x + 1\n")
    corrupted = tokens.clone()
    corrupted[:, 1:] = tokens[:, 1:].flip(-1)
    return discover_circuit(model, tokens, corrupted, next_token_metric(tokens), progress=False)


def test_the_figure_draws_the_measured_curves_and_the_circuit(circuit):
    fig = faithfulness_curve_figure(circuit)
    mib, sweep = circuit.extra["mib_curve"], circuit.curve
    grid, swept, found = fig.data
    assert list(grid.y) == pytest.approx(list(mib["faithfulness"]))
    assert list(grid.x) == [max(1, e) for e in mib["edges"]]
    assert list(swept.y) == pytest.approx(list(sweep["faithfulness"]))
    assert list(found.x) == [max(1, mask_size(circuit.mask))]
    assert list(found.y) == pytest.approx([circuit.faithfulness])
    cpr, cmd = circuit.extra["mib_cpr"], circuit.extra["mib_cmd"]
    assert f"CPR {cpr:.3f}, CMD {cmd:.3f}" in fig.layout.title.text
    assert fig.layout.xaxis.type == "log"


def test_a_circuit_without_a_curve_is_refused():
    bare = SimpleNamespace(extra={}, curve=None, mask={}, faithfulness=0.5)
    with pytest.raises(ValueError, match="mib_curve=True"):
        faithfulness_curve_figure(bare)
