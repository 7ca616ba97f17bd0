"""The circuit figures' links to a neuron atlas (``atlas=``, :mod:`tl_attnonly.vis.links`): each
named neuron's label links to its page and each MLP layer node's to its layer's, the hover names
the page, the figure lists its links in ``layout.meta`` and its saved HTML carries the handler that
opens them; without ``atlas`` nothing changes, and with it the labels sit where they did.
(``tests/atlas/test_atlas_browser.py`` clicks them in Chromium.)"""

from __future__ import annotations

import re

import pandas as pd
import pytest
import torch
from conftest import make_tokens
from models import make_converted

import tl_attnonly.vis  # noqa: F401 - registers the figure builders
from tl_attnonly.analysis import Circuit, edge_attribution_scores, logit_diff_metric
from tl_attnonly.vis import circuit_figure, neuron_circuit_figure, save_figure
from tl_attnonly.vis.circuit import text_size
from tl_attnonly.vis.links import LINK_SCRIPT, LINKS_META, link_script

ATLAS = "https://example.org/atlas/"
NODES = ["L0N1", "L0N5", "L1N2", "L0MLP", "L1MLP", "L0H0", "L1H0", "L1H1"]
#: The page of each node that has one.
PAGES = {
    "L0N1": "https://example.org/atlas/neuron.html#L0N1",
    "L0N5": "https://example.org/atlas/neuron.html#L0N5",
    "L1N2": "https://example.org/atlas/neuron.html#L1N2",
    "L0MLP": "https://example.org/atlas/layer_0.html",
    "L1MLP": "https://example.org/atlas/layer_1.html",
}
FIGURES = {"circuit_figure": circuit_figure, "neuron_circuit_figure": neuron_circuit_figure}
_TAG = re.compile(r"<[^>]+>")


@pytest.fixture(scope="module")
def circuit():
    """Every edge of a graph of three named neurons, both layers' remainders and three heads,
    with a gate/value split for L0N1 (``circuit_figure`` then labels it ``L0N1<br>g .. / v ..``)."""
    model = make_converted("silu")
    metric = logit_diff_metric(torch.tensor([1, 2]), torch.tensor([5, 6]))
    scores = edge_attribution_scores(model, make_tokens(2, 6, seed=0), make_tokens(2, 6, seed=1),
                                     metric, nodes=NODES, progress=False)  # fmt: skip
    mask = {key: torch.ones_like(s, dtype=torch.bool) for key, s in scores.scores.items()}
    split = pd.DataFrame({"node": ["L0N1"], "gate": [0.25], "value": [0.5]})
    return Circuit(scores, mask, 1.0, 0.0, 0.8, 0.8, gate_value=split)


def _nodes(fig) -> dict[str, tuple]:
    """label -> (x, y, text, text position, marker size, hover text), from the node traces."""
    out = {}
    for trace in fig.data:
        if trace.mode != "markers+text":
            continue
        sizes = trace.marker.size
        for i, label in enumerate(trace.customdata):
            size = sizes[i] if isinstance(sizes, tuple) else sizes
            out[label] = (trace.x[i], trace.y[i], trace.text[i], trace.textposition[i], size,
                          trace.hovertext[i])  # fmt: skip
    return out


@pytest.mark.parametrize("name", FIGURES)
def test_named_neurons_and_mlp_nodes_link_to_their_atlas_pages(circuit, name):
    nodes = _nodes(FIGURES[name](circuit, atlas=ATLAS))
    assert set(PAGES) <= set(nodes)
    for label, (_, _, text, _, _, hover) in nodes.items():
        if label not in PAGES:  # heads, the embeddings, the logits: no page
            assert "<a" not in text and "atlas page" not in hover, label
            continue
        link = f'<a href="{PAGES[label]}">{label}</a>'
        assert text.startswith(link), (label, text)
        assert hover.endswith(f"<br>atlas page: {PAGES[label]}")
    if name == "circuit_figure":  # the gate/value label: only the name is the link
        assert re.fullmatch(r'<a href="[^"]+">L0N1</a><br>g 0\.25 / v 0\.5', nodes["L0N1"][2])
    else:
        assert all(
            nodes[label][2] == f'<a href="{url}">{label}</a>' for label, url in PAGES.items()
        )


@pytest.mark.parametrize("name", FIGURES)
def test_the_figure_lists_its_links_and_its_html_opens_them(circuit, name, tmp_path):
    fig = FIGURES[name](circuit, atlas=ATLAS)
    assert fig.layout.meta[LINKS_META] == PAGES
    assert "hidden_labels" in fig.layout.meta
    assert link_script(fig) == LINK_SCRIPT
    page = save_figure(fig, tmp_path / "linked.html").read_text("utf-8")
    assert "gd.layout.meta || {}).atlas_links" in page and "{plot_id}" not in page
    plain = save_figure(FIGURES[name](circuit), tmp_path / "plain.html").read_text("utf-8")
    assert "atlas_links" not in plain


@pytest.mark.parametrize("name", FIGURES)
def test_without_an_atlas_nothing_links_and_with_one_labels_sit_where_they_did(circuit, name):
    draw = FIGURES[name]
    plain, linked = draw(circuit), draw(circuit, atlas=ATLAS)
    assert LINKS_META not in plain.layout.meta and link_script(plain) is None
    a, b = _nodes(plain), _nodes(linked)
    assert not any("<a" in n[2] or "atlas page" in n[5] for n in a.values())
    assert a.keys() == b.keys()
    for label in a:
        # the same place, position, size and visible text: the markup takes no room
        assert a[label][:2] + a[label][3:5] == b[label][:2] + b[label][3:5], label
        assert _TAG.sub("", b[label][2]) == _TAG.sub("", a[label][2])
        assert text_size(b[label][2]) == text_size(a[label][2])
    for key in ("width", "height", "margin"):
        assert plain.layout[key] == linked.layout[key]


def test_an_atlas_folder_links_by_its_file_uri_and_circuit_figure_passes_it_on(circuit, tmp_path):
    base = (tmp_path / "atlas").resolve().as_uri()
    fig = circuit.figure(atlas=tmp_path / "atlas")
    assert fig.layout.meta[LINKS_META] == {
        label: url.replace(ATLAS.rstrip("/"), base) for label, url in PAGES.items()
    }
