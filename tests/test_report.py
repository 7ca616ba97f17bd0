"""The demo command writes one self-contained report, with the right contents, fast."""

from __future__ import annotations

import base64
import gzip
import json
import re
import subprocess
import tempfile
import time
from html.parser import HTMLParser

import pytest
import torch

from tl_attnonly.cli import DEFAULT_PROMPT, main
from tl_attnonly.hooks import neuron_act_name
from tl_attnonly.report import DEFERRED_TYPE, PACKED_TYPE
from tl_attnonly.vis import BIAS_TOKEN

#: The issue's budget for the whole demo on a 2-core machine.
DEMO_SECONDS = 60


class _Tables(HTMLParser):
    """Rows of every <table> after a given <h3> title."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._title: str | None = None
        self._in_h3 = False
        self._cell: list[str] | None = None
        self._row: list[str] | None = None
        self._current: list[list[str]] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "h3":
            self._in_h3, self._title = True, ""
        elif tag == "table" and self._title is not None:
            self._current = self.tables.setdefault(self._title, [])
        elif tag == "tr" and self._current is not None:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "h3":
            self._in_h3 = False
        elif tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self._current.append(self._row)
            self._row = None
        elif tag == "table":
            self._current = None

    def handle_data(self, data):
        if self._in_h3:
            self._title += data
        elif self._cell is not None:
            self._cell.append(data)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo") / "report.html"
    start = time.perf_counter()
    code = main(["demo", "--report", str(path)])
    seconds = time.perf_counter() - start
    return code, path, seconds


def test_demo_succeeds_fast(demo):
    code, path, seconds = demo
    assert code == 0 and path.is_file()
    # includes loading the bundled model; imports are shared with the rest of the test session
    assert seconds < DEMO_SECONDS, f"demo took {seconds:.1f} s"


def test_report_is_self_contained(demo):
    _, path, _ = demo
    text = path.read_text(encoding="utf-8")
    assert not re.search(r"<script[^>]*\ssrc=", text), "a script is loaded from elsewhere"
    assert "unpkg.com/circuitsvis" not in text
    libraries = _packed_libraries(text)  # plotly.js and circuitsvis, inlined once each, gzipped
    assert sorted(libraries) == ["CircuitsVis", "Plotly"]
    assert libraries["CircuitsVis"].count("var CircuitsVis=") == 1
    assert libraries["Plotly"].startswith("/**\n* plotly.js v")
    deferred = re.findall(rf'<script type="{DEFERRED_TYPE}">(.*?)</script>', text, flags=re.S)
    assert sum("Plotly.newPlot(" in js for js in deferred) >= 4  # strips, patching, GELU curves
    assert sum("CircuitsVis.render(" in js for js in deferred) == 2  # one square view a layer
    # every inline script is a library, the unpacker, or deferred until the libraries are there
    assert len(re.findall(r"<script", text)) == len(libraries) + 1 + len(deferred)
    assert len(text) < 3.5e6  # was 6.6 MB with the libraries as plain text


def _packed_libraries(text: str) -> dict[str, str]:
    found = re.findall(
        rf'<script type="{PACKED_TYPE}" data-library="(\w+)">([A-Za-z0-9+/=]+)</script>', text
    )
    return {name: gzip.decompress(base64.b64decode(data)).decode() for name, data in found}


@pytest.mark.slow
def test_report_draws_every_figure_in_chromium(demo):
    from tl_attnonly.vis.export import find_chromium

    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no chromium on PATH")
    _, path, _ = demo
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
             "--virtual-time-budget=20000", f"--user-data-dir={profile}", path.resolve().as_uri()],
            capture_output=True, text=True, timeout=180,
        ).stdout  # fmt: skip
    text = path.read_text(encoding="utf-8")
    n_figures = sum(
        "Plotly.newPlot(" in js
        for js in re.findall(rf'<script type="{DEFERRED_TYPE}">(.*?)</script>', text, flags=re.S)
    )
    assert dom.count('class="plot-container plotly"') == n_figures  # plotly drew each one
    assert dom.count("<canvas") >= 2  # circuitsvis drew its views


def test_report_shows_equivalence_numbers(demo):
    _, path, _ = demo
    parser = _Tables()
    parser.feed(path.read_text(encoding="utf-8"))
    for dtype, tolerance in (("float32", 1e-3), ("float64", 1e-9)):
        rows = parser.tables[dtype]
        header, body = rows[0], rows[1:]
        assert header[:3] == ["activation", "n_hooks", "max_abs_diff"]
        activations = [r[0] for r in body]
        assert activations[0] == "logits" and "mlp post" in activations
        diffs = [float(r[2]) for r in body]
        assert all(0 <= d < tolerance for d in diffs), (dtype, diffs)
        assert float(body[0][-1]) > 1  # max |logit|: the table holds real numbers


def test_report_draws_the_models_neuron_heads_with_the_bias_token_first(demo):
    from tl_attnonly.bundled import load_bundled_model

    _, path, _ = demo
    text = path.read_text(encoding="utf-8")
    model = load_bundled_model()
    calls = re.findall(
        r'CircuitsVis\.render\("cv-layer-(\d+)", CircuitsVis\.AttentionHeads, (.*?)\);', text
    )
    assert [int(layer) for layer, _ in calls] == list(range(model.cfg.n_layers))
    _, cache = model.run_with_cache(DEFAULT_PROMPT)
    str_tokens = model.to_str_tokens(DEFAULT_PROMPT)
    for layer, props_json in calls:
        props = json.loads(props_json)
        assert props["tokens"] == [BIAS_TOKEN, *str_tokens]
        attention = torch.tensor(props["attention"])
        n_heads = len(props["attentionHeadNames"])
        assert attention.shape == (n_heads, len(str_tokens) + 1, len(str_tokens) + 1)
        assert 0 < n_heads <= 64
        # SiLU neuron i = neuron-head i: its weight on self is sigmoid(pre) of the original model
        neurons = [int(name.split("N")[1]) for name in props["attentionHeadNames"]]
        pre = cache[neuron_act_name("pre", int(layer))][0][:, neurons].T
        diag = attention[:, 1:, 1:].diagonal(dim1=-2, dim2=-1)
        torch.testing.assert_close(diag, torch.sigmoid(pre), atol=2e-4, rtol=0)
        torch.testing.assert_close(attention[:, 1:, 0], 1 - torch.sigmoid(pre), atol=2e-4, rtol=0)
        # ... and they are the layer's most active neurons (largest |post|)
        post = cache[neuron_act_name("post", int(layer))][0].abs().amax(0)
        assert post[neurons].min() >= post.topk(n_heads).values.min() - 1e-4


def test_report_has_the_plotly_sections(demo):
    _, path, _ = demo
    text = path.read_text(encoding="utf-8")
    for anchor in ("equivalence", "patterns", "activity", "patching", "gelu"):
        assert f'<section id="{anchor}">' in text
    assert "Neuron-head activity" in text and "GELU" in text and "Attribution patching" in text


def test_report_shows_few_squares_many_strips_and_only_the_errors_it_discusses(demo):
    from tl_attnonly.report import REPORT_SQUARE_K

    _, path, _ = demo
    text = path.read_text(encoding="utf-8")
    names = re.findall(r'"attentionHeadNames": (\[.*?\])', text)
    assert [len(json.loads(n)) for n in names] == [REPORT_SQUARE_K] * 2  # a few square views
    activity = text.split('<section id="activity">')[1].split("</section>")[0]
    assert activity.count("Plotly.newPlot(") == 2  # one strip figure per layer
    assert "weight on self (red) and on &lt;bias&gt; (grey)" in activity
    tables = _Tables()
    tables.feed(text)
    rows = tables.tables["Error per activation and K"][1:]
    assert {row[0] for row in rows} == {"silu", "gelu"}  # this model's activation and GELU
