"""Paper-ready circuit figures: only occupied layers, a width bound, no overlapping labels, the
title inside the figure, counts that agree with ``circuit.edges()``, and static export.

The circuit is built directly (EAP scores of a 6-layer grouped-query model, edges kept among
layers 0, 4 and 5 only), so layers 1-3 are empty; it has key/value groups and named neurons. A
SmolLM2-shaped circuit (30 layers, the issue's 10 heads and 96 edges; labels only) must fit a page.
"""

from __future__ import annotations

import html
import importlib.util
import itertools
import json
import random
import re

import pandas as pd
import pytest
import torch
from conftest import GATED_ZOO, make_tokens
from models import make_converted

import tl_attnonly.vis  # noqa: F401 - registers the figure builders
import tl_attnonly.vis.export as export
from tl_attnonly.analysis import logit_diff_metric
from tl_attnonly.analysis.discovery.circuit import Circuit
from tl_attnonly.analysis.discovery.counts import KV_GROUP_LEGEND
from tl_attnonly.analysis.discovery.edge_scores import edge_attribution_scores
from tl_attnonly.analysis.discovery.node_selection import coarse_nodes
from tl_attnonly.vis import circuit_figure, neuron_circuit_figure, save_figure
from tl_attnonly.vis.circuit import (
    LINE_HEIGHT,
    TITLE_FONT,
    circuit_counts,
    counts_text,
    label_box,
    text_size,
)

OCCUPIED = (0, 4, 5)
NAMED = {0: [f"L0N{i}" for i in range(6)], 4: [f"L4N{i}" for i in range(8)], 5: ["L5N0", "L5N1"]}


@pytest.fixture(scope="module")
def circuit():
    model = make_converted("silu", **dict(GATED_ZOO["llama"], n_layers=6, n_heads=8))
    metric = logit_diff_metric(torch.tensor([1, 2]), torch.tensor([5, 6]))
    nodes = coarse_nodes(model) + [n for layer in NAMED.values() for n in layer]
    scores = edge_attribution_scores(
        model, make_tokens(2, 6, seed=0), make_tokens(2, 6, seed=1), metric, nodes=nodes
    )

    def kept(label: str) -> bool:
        found = re.match(r"L(\d+)", label)
        return found is None or int(found.group(1)) in OCCUPIED

    mask = {}
    for src, dst in scores.graph.blocks():
        rows = torch.tensor([kept(n) for n in src.labels])[:, None]
        cols = torch.tensor([kept(n) for n in dst.labels])[None, :]
        mask[(src.key, dst.key)] = rows & cols
    values = torch.cat([scores.scores[k].abs()[m] for k, m in mask.items()]).sort().values
    cut = values[-120]  # about the 120 largest edges of the occupied layers
    mask = {k: m & (scores.scores[k].abs() >= cut) for k, m in mask.items()}
    return Circuit(scores, mask, 1.0, 0.0, 0.8, 0.8, extra={"named": NAMED})


def _boxes(fig) -> list[tuple[str, tuple[float, float, float, float]]]:
    """Every drawn label's box in figure pixels (y up from the figure's bottom edge): the
    trace's position in plot pixels (the axes span the plot area) plus the margins."""
    margin = fig.layout.margin
    plot = (fig.layout.width - margin.l - margin.r, fig.layout.height - margin.t - margin.b)
    level, other = (fig.layout.xaxis, fig.layout.yaxis)
    assert list(level.range) in ([0, plot[0]], [0, plot[1]])  # data units are plot pixels
    assert list(other.range) in ([0, plot[0]], [0, plot[1]])
    out = []
    for trace in fig.data:
        if trace.mode != "markers+text":
            continue
        sizes = trace.marker.size
        for i, (x, y, text) in enumerate(zip(trace.x, trace.y, trace.text, strict=True)):
            box = label_box(x, y, text, trace.textposition[i], sizes[i]) if text else None
            marker = (x - sizes[i] / 2, y - sizes[i] / 2, x + sizes[i] / 2, y + sizes[i] / 2)
            for b, what in ((box, text), (marker, f"marker of {trace.customdata[i]}")):
                if b is not None:
                    x0, y0, x1, y1 = b
                    out.append((what, (x0 + margin.l, y0 + margin.b, x1 + margin.l, y1 + margin.b)))
    return out


def _check_readable(fig, axis: str) -> None:
    assert fig.layout.width <= 1600
    boxes = _boxes(fig)
    labels = [(t, b) for t, b in boxes if not t.startswith("marker of")]
    for (ta, a), (tb, b) in itertools.combinations(boxes, 2):
        if ta.startswith("marker of") and tb.startswith("marker of"):
            continue  # markers may touch; labels may not meet a marker or each other
        meet = a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
        assert not meet, f"{ta!r} overlaps {tb!r}"
    margin = fig.layout.margin
    for text, (x0, y0, x1, y1) in labels:  # inside the plot area
        assert margin.l <= x0 and x1 <= fig.layout.width - margin.r, text
        assert margin.b <= y0 and y1 <= fig.layout.height - margin.t, text
    # the title: every line fits the width, all lines fit the top margin
    lines = fig.layout.title.text.split("<br>")
    assert all(text_size(line, TITLE_FONT)[0] <= fig.layout.width for line in lines)
    assert 32 + len(lines) * LINE_HEIGHT * TITLE_FONT <= margin.t  # below the mode bar
    assert fig.layout.title.yanchor == "top" and fig.layout.title.yref == "container"
    assert fig.layout.title.y * fig.layout.height == pytest.approx(fig.layout.height - 32)
    # only occupied layers: a tick per occupied layer's level, the empty run named once
    ticks = (fig.layout.xaxis if axis == "x" else fig.layout.yaxis).ticktext
    layers = {int(m.group(1)) for t in ticks if "empty" not in t for m in [re.match(r"L(\d+)", t)]
              if m}  # fmt: skip
    assert layers == set(OCCUPIED)
    assert [t for t in ticks if "empty" in t] == [t for t in ticks if t.startswith("L1–3")]
    assert len([t for t in ticks if "empty" in t]) == 1


def test_circuit_figure_is_readable_and_compact(circuit):
    fig = circuit_figure(circuit)
    _check_readable(fig, "x")
    assert fig.layout.meta["hidden_labels"] == 0  # room for every label here
    narrow = circuit_figure(circuit, max_width=300)
    assert narrow.layout.width <= 300
    _check_readable(narrow, "x")
    hidden = narrow.layout.meta["hidden_labels"]
    assert hidden > 0 and f"{hidden} labels on hover only" in narrow.layout.title.text


def test_neuron_circuit_figure_is_readable_and_compact(circuit):
    fig = neuron_circuit_figure(circuit)
    _check_readable(fig, "y")
    assert fig.layout.height <= 1200
    narrow = neuron_circuit_figure(circuit, max_width=300)
    _check_readable(narrow, "y")
    assert narrow.layout.meta["hidden_labels"] > 0


def test_counts_agree_with_the_edges_and_the_titles(circuit):
    frame = circuit.edges()
    nodes = set(frame.source) | set(frame.target)
    counts = circuit_counts(circuit)
    assert counts == dict(
        attention_heads=len({n for n in nodes if re.fullmatch(r"L\d+H\d+", n)}),
        kv_groups=len({n for n in nodes if re.fullmatch(r"L\d+KV\d+", n)}),
        latent_attn_inputs=0,
        experts=0,
        mlp_layers=len(
            {
                int(n[1:].split("N")[0].split("M")[0])
                for n in nodes
                if re.fullmatch(r"L\d+(N\d+|MLP)", n)
            }
            | set(NAMED)
        ),  # fmt: skip
        named_neurons=sum(len(v) for v in NAMED.values()),
        edges=len(frame),
        coarse_edges=len(frame),
    )
    assert counts["kv_groups"] > 0  # grouped-query attention: counted apart from heads
    # report() counts the same way, in the same words, and says what a key/value group is
    report = circuit.report()
    assert f"attention heads ({counts['attention_heads']})" in report
    assert "counts (as in the figures): " + counts_text(counts) in report
    assert KV_GROUP_LEGEND in report
    for fig in (circuit_figure(circuit), neuron_circuit_figure(circuit)):
        title = fig.layout.title.text.replace("<br>", " ")
        assert f"{counts['attention_heads']} attention heads" in title
        assert f"{counts['kv_groups']} key/value groups" in title
        assert f"{counts['named_neurons']} named neurons, {len(frame)} edges" in title
        names = {t.name for t in fig.data}
        assert any(n.startswith("key/value group") for n in names)


def test_named_neurons_are_drawn_by_what_they_carry(circuit):
    fig = neuron_circuit_figure(circuit)
    trace = next(t for t in fig.data if t.name == "named neuron")
    sizes = dict(zip(trace.customdata, trace.marker.size, strict=True))
    frame = circuit.edges()
    carry = frame.assign(a=frame.score.abs()).groupby("source").a.sum()
    ranked = sorted(sizes, key=lambda n: carry.get(n, 0.0))
    assert sizes[ranked[0]] < sizes[ranked[-1]]  # not all equally prominent
    assert [sizes[n] for n in ranked] == sorted(sizes[n] for n in ranked)


def test_static_export_needs_the_png_extra(circuit, tmp_path, monkeypatch):
    fig = circuit_figure(circuit)
    if importlib.util.find_spec("kaleido") is None:
        for suffix in (".svg", ".pdf", ".png"):
            with pytest.warns(RuntimeWarning, match=r"tl-attnonly\[png\]"):
                path = save_figure(fig, tmp_path / f"fig{suffix}")
            assert path.suffix == ".html" and path.exists()
    with pytest.raises(ValueError, match=r"\.svg or \.pdf"):
        save_figure(fig, tmp_path / "fig.gif")
    written = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(type(fig), "write_image", lambda self, p, **kw: written.append((p, kw)))
    for suffix in (".svg", ".pdf"):
        assert save_figure(fig, tmp_path / f"fig{suffix}") == tmp_path / f"fig{suffix}"
    assert [kw["format"] for _, kw in written] == ["svg", "pdf"]


class _Layers:
    n_layers = 30


class _Drawn(Circuit):
    """A circuit given by its edge table alone (what the figures read), SmolLM2's shape."""

    graph = _Layers()  # type: ignore[assignment]

    def edges(self):
        return self.frame


def _smollm2_shaped() -> Circuit:
    """30 layers; 10 query heads, key/value groups and 6 MLP layers of 8 named neurons each,
    96 edges (the issue's IOI circuit on SmolLM2-135M, with its labels)."""
    rng = random.Random(0)
    heads = ["L23H0", "L23H1", "L23H2", "L23H7", "L20H0", "L19H2", "L17H4", "L21H3", "L22H5",
             "L18H1", "L23KV0", "L23KV2", "L20KV0", "L17KV1"]  # fmt: skip
    named = {li: [f"L{li}N{rng.randrange(1536)}" for _ in range(8)] for li in (0, 3, 14, 25, 29)}
    mlp = [f"L{li}MLP" for li in named] + [n for v in named.values() for n in v]

    def level(n: str) -> float:
        found = re.match(r"L(\d+)(MLP|N)?", n)
        return -1 if n == "embed" else 99 if found is None else int(found[1]) + 0.5 * bool(found[2])

    pairs = [(s, t) for s in ["embed", *heads, *mlp] for t in [*heads, *mlp, "logits"]
             if level(s) < level(t) and "KV" not in s]  # fmt: skip
    rows = []
    for s, t in rng.sample(pairs, 96):
        inp = "" if t == "logits" else "q" if "H" in t else "k" if "KV" in t else "value"
        rows.append(dict(edge=f"{s}->{t}:{inp}", source=s, target=t, input=inp,
                         score=rng.gauss(0, 1)))  # fmt: skip
    circuit = _Drawn.__new__(_Drawn)
    circuit.frame = pd.DataFrame(rows).sort_values("score", key=abs, ascending=False)
    circuit.gate_value, circuit.faithfulness, circuit.extra = None, 0.804, {"named": named}
    circuit.mlp_split = None
    return circuit


def test_a_smollm2_shaped_circuit_fits_a_page():
    circuit = _smollm2_shaped()
    wide, tall = circuit_figure(circuit), neuron_circuit_figure(circuit)
    for fig in (wide, tall):  # the issue's: 5,580 x 500 and 700 x 4,340 px
        assert fig.layout.width <= 1600 and fig.layout.height <= 1600
        assert fig.layout.meta["hidden_labels"] == 0
        labels = [b for t, b in _boxes(fig) if not t.startswith("marker of")]
        assert not any(
            a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
            for a, b in itertools.combinations(labels, 2)
        )
        assert "10 attention heads" in fig.layout.title.text


_MEASURE_TEXT = """<script>
window.addEventListener('load', () => setTimeout(() => {
  const boxes = [...document.querySelectorAll('g.textpoint text, .gtitle')].map(t => {
    const r = t.getBoundingClientRect();
    return [t.classList.contains('gtitle'), r.left, r.top, r.right, r.bottom];
  });
  document.body.setAttribute('data-boxes', JSON.stringify(boxes));
}, 1000));
</script>"""


@pytest.mark.slow
def test_rendered_labels_do_not_overlap(circuit):
    """The same checks on the page Chromium renders (the DOM's text boxes), where it is on PATH."""
    if export.find_chromium() is None:
        pytest.skip("no chromium on PATH")
    for fig in (circuit_figure(circuit), neuron_circuit_figure(_smollm2_shaped())):
        page = fig.to_html(include_plotlyjs=True, full_html=True)
        page = page.replace("</body>", _MEASURE_TEXT + "</body>", 1)
        dom = export._chromium(page, fig.layout.width, fig.layout.height, "--dump-dom")
        found = re.search(r'data-boxes="([^"]*)"', dom)
        assert found is not None, "the page did not render"
        boxes = json.loads(html.unescape(found.group(1)))
        title = [b[1:] for b in boxes if b[0]]
        labels = [b[1:] for b in boxes if not b[0]]
        assert len(title) == 1 and len(labels) > 30
        x0, y0, x1, y1 = title[0]
        assert 0 <= x0 and 0 <= y0 and x1 <= fig.layout.width and y1 <= fig.layout.margin.t
        for a, b in itertools.combinations(labels, 2):
            assert not (a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]), (a, b)
