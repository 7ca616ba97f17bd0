"""The site in a real browser (issue 48): headless Chromium, driven by selenium and chromedriver,
opens a small atlas of the bundled model from ``file://`` (no server) and the rendered DOM is
read back: the index, a neuron page from its lazily loaded shard (its numbers against the
atlas's own record), search by label and by token, a layer page and its sorting, a circuit's
link (``Circuit.to_graph_json(atlas=...)``'s ``vis_link``) opening the neuron, and a circuit
figure's (``neuron_circuit_figure(circuit, atlas=...)``, saved as HTML) labels and markers
opening their pages; no page logs a JavaScript error. Skipped where Chromium, chromedriver or
selenium is missing.

Chromium runs as root here, in a closed network: ``--no-sandbox`` and the flags that keep it from
opening connections of its own (``browser.CHROME_FLAGS``), with a fresh profile.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from browser import CHROME, CHROMEDRIVER, chrome, close, shown_neuron, url  # noqa: E402
from helpers import BATCH, bundled, corpus_rows  # noqa: E402

from tl_attnonly.atlas import Atlas, AtlasOptions, build_atlas  # noqa: E402

pytestmark = pytest.mark.skipif(
    CHROME is None or CHROMEDRIVER is None,
    reason="needs Chromium (or Chrome) and chromedriver on PATH (Debian: apt-get install "
    "chromium chromium-driver)",
)
pytest.importorskip("selenium", reason="needs selenium (pip install selenium, in the [test] extra)")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

WAIT_S = 20
READ_CONTEXTS = """return Array.from(document.querySelectorAll('#main .ctx'), c => ({
  text: c.textContent, act: c.querySelector('.muted').textContent,
  tokens: Array.from(c.querySelectorAll('.tok'), s => ({text: s.textContent, title: s.title,
    class: s.className, colour: getComputedStyle(s).backgroundColor}))}));"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    model = bundled("bridge")
    out = tmp_path_factory.mktemp("browser") / "atlas"
    opts = AtlasOptions(k=4, before=3, after=2, max_len=48)
    build_atlas(model, corpus_rows(model), out, options=opts, batch_size=BATCH, progress=False)
    return Atlas.load(out)


@pytest.fixture(scope="module")
def browser():
    driver = chrome()
    yield driver
    close(driver)


@pytest.fixture
def page(browser):
    """The browser; after the test, its console must hold no error (a script's exception, a file
    that failed to load)."""
    browser.get_log("browser")  # drop what earlier tests left
    yield browser
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"the browser's console logged errors: {errors}"


def vis(token: str) -> str:
    """A token as the pages show it (``vis`` in the pages' JavaScript)."""
    return token.replace("\n", "\u21b5").replace(" ", "\u00a0")


def test_index_renders(page, site):
    page.get(url(site.directory / "index.html"))
    WebDriverWait(page, WAIT_S).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#layers a"))
    n_layers, d_mlp = site.meta["manifest"]["n_layers"], site.meta["manifest"]["d_mlp"]
    assert page.title == "neuron atlas"
    intro = page.find_element(By.TAG_NAME, "p").text
    assert f"{n_layers} layers x {d_mlp} neurons, {site.meta['n_tokens']} tokens" in intro
    layers = page.find_elements(By.CSS_SELECTOR, "#layers a")
    assert [a.get_attribute("href") for a in layers] == [
        url(site.directory / f"layer_{li}.html") for li in range(n_layers)]  # fmt: skip
    assert page.find_element(By.ID, "hits").text == ""  # nothing asked yet


def test_neuron_page_shows_the_record_from_its_shard(page, site):
    """``neuron.html#L1N34`` loads ``neurons/L1/S2.js``, inflates the record and renders it: the
    summary, the logit effect, the histogram, the top contexts (each token coloured by its self
    weight, its activation and self weight in its hover text) and the quantile samples, every
    number as the atlas's record holds it."""
    record, vocab, before = site["L1N34"].record, site.vocab, site.meta["options"]["before"]
    page.get(url(site.directory / "neuron.html", "#L1N34"))
    shown_neuron(page, "L1N34")
    main = page.find_element(By.ID, "main")
    assert main.find_element(By.TAG_NAME, "h1").text == "L1N34"
    summary = main.find_elements(By.TAG_NAME, "p")[1].text
    numbers = re.fullmatch(r"fires \(pre > 0\) on (\S+)% of (\d+) tokens · activation min (\S+), "
                           r"max (\S+), mean (\S+)", summary).groups()  # fmt: skip
    numbers = [float(x) for x in numbers]
    assert numbers[0] == pytest.approx(100 * record["activation_frequency"], abs=6e-4)
    assert numbers[1:] == [record["n_tokens"], record["act_min"], record["act_max"],
                           record["act_mean"]]  # fmt: skip
    top_table, bottom_table = main.find_elements(By.CSS_SELECTOR, ".grid table")
    for table, want in ((top_table, record["top_logits"]), (bottom_table, record["bottom_logits"])):
        rows = [[td.get_attribute("textContent") for td in tr.find_elements(By.TAG_NAME, "td")]
                for tr in table.find_elements(By.TAG_NAME, "tr")]  # fmt: skip
        assert [r[0] for r in rows] == [vis(t) for t, _ in want]
        assert [float(r[1]) for r in rows] == pytest.approx([v for _, v in want], abs=5.1e-4)
    assert len(main.find_elements(By.CSS_SELECTOR, ".grid svg rect")) == len(
        record["histogram"]["counts"])  # fmt: skip

    # every context as rendered, read in one call: its activation, and per token the text, the
    # hover text, the class and the background colour Chromium computed
    contexts = page.execute_script(READ_CONTEXTS)
    samples = [e for q in record["examples_quantiles"] for e in q["examples"]]
    wants = record["top_examples"] + samples
    assert len(record["top_examples"]) == 4 and len(contexts) == len(wants)
    for ctx, want in zip(contexts, wants):
        assert float(ctx["act"]) == pytest.approx(want["act"], abs=5.1e-4)
        kept = [j for j, t in enumerate(want["tokens"]) if t >= 0]
        assert [s["text"] for s in ctx["tokens"]] == [vis(vocab[want["tokens"][j]]) for j in kept]
        for span, j in zip(ctx["tokens"], kept):
            act, self_w = map(float, re.fullmatch(r"act (\S+), self (\S+)", span["title"]).groups())
            assert act == pytest.approx(want["acts"][j], abs=1e-4)
            assert self_w == pytest.approx(want["self"][j], abs=1e-4)
            r, g, b, alpha = map(float, re.fullmatch(r"rgba\((.*)\)", span["colour"])[1].split(","))
            assert (r, g, b) == (220, 50, 32) and alpha == pytest.approx(self_w, abs=3e-3)
            assert ("centre" in span["class"].split()) == (j == before)
    # the top context, as a reader sees it: its activation, then its tokens
    first = record["top_examples"][0]
    text = "".join(vis(vocab[t]) for t in first["tokens"] if t >= 0)
    assert contexts[0]["text"] == f"{first['act']:.3f} \u00a0{text}"
    headings = [h.text for h in main.find_elements(By.TAG_NAME, "h2")]
    assert headings == ["Top contexts", "Quantile samples"]
    assert len(main.find_elements(By.TAG_NAME, "h4")) == len(record["examples_quantiles"])


def test_another_neuron_by_the_fragment_and_a_missing_one(page, site):
    """Changing the fragment shows that neuron (its shard loaded then); a label beyond the
    layer's neurons says so."""
    page.get(url(site.directory / "neuron.html", "#L0N0"))
    shown_neuron(page, "L0N0")
    page.execute_script("location.hash = '#L1N511'")  # the last shard's last neuron
    WebDriverWait(page, WAIT_S).until(lambda d: d.title == "L1N511")
    assert page.find_element(By.TAG_NAME, "h1").text == "L1N511"
    first = site["L1N511"].record["top_examples"][0]
    muted = page.find_element(By.CSS_SELECTOR, "#main .ctx .muted").get_attribute("textContent")
    assert float(muted) == pytest.approx(first["act"], abs=5.1e-4)
    page.get(url(site.directory / "neuron.html", "#L0N9999"))
    WebDriverWait(page, WAIT_S).until(lambda d: "no neuron" in d.find_element(By.ID, "main").text)
    assert page.find_element(By.ID, "main").text == "This atlas has no neuron L0N9999."
    # the missing shard's script fails to load: the one console error this page may log
    errors = [e for e in page.get_log("browser") if e["level"] == "SEVERE"]
    assert all("S624.js" in e["message"] for e in errors), errors


def test_search_by_label_and_by_token(page, site):
    """Typing a label lists that neuron, and its link opens it; typing a token lists the neurons
    whose top contexts centre on it (the index's top tokens), each one that ``Atlas.search``
    finds too."""
    page.get(url(site.directory / "index.html"))
    box = WebDriverWait(page, WAIT_S).until(lambda d: d.find_element(By.ID, "q"))
    box.send_keys("L0N7")
    hits = page.find_element(By.ID, "hits")
    assert hits.text.startswith("1 neuron(s)")
    links = hits.find_elements(By.TAG_NAME, "a")
    assert [a.text for a in links] == ["L0N7"]
    links[0].click()
    shown_neuron(page, "L0N7")
    assert page.current_url == url(site.directory / "neuron.html", "#L0N7")

    neurons = site.index["neurons"]
    tokens = sorted({t.strip() for n in neurons for t in n[3] if t.strip().isalpha()})
    found = {t: [n[0] for n in neurons if any(s.strip() == t for s in n[3])] for t in tokens}
    token = max((t for t in tokens if len(found[t]) <= 200), key=lambda t: (len(found[t]), t))
    assert len(found[token]) >= 2
    page.get(url(site.directory / "index.html"))
    WebDriverWait(page, WAIT_S).until(lambda d: d.find_element(By.ID, "q")).send_keys(token)
    hits = page.find_element(By.ID, "hits")
    assert hits.text.startswith(f"{len(found[token])} neuron(s)")
    listed = [a.text for a in hits.find_elements(By.TAG_NAME, "a")]
    assert listed == found[token]
    assert set(listed) <= set(site.search(token).label)


def test_layer_page_renders_and_sorts(page, site):
    page.get(url(site.directory / "layer_1.html"))
    table = page.find_element(By.ID, "t")
    rows = table.find_elements(By.CSS_SELECTOR, "tbody tr")
    assert len(rows) == site.meta["manifest"]["d_mlp"]
    assert page.find_elements(By.CSS_SELECTOR, "svg rect")  # the firing-frequency density
    record = site["L1N34"].record
    cells = [td.text for td in rows[34].find_elements(By.TAG_NAME, "td")]
    assert cells[:4] == ["L1N34", f"{100 * record['activation_frequency']:.3f}%",
                         str(record["act_max"]), str(record["act_min"])]  # fmt: skip
    fires = table.find_elements(By.TAG_NAME, "th")[1]
    freqs = sorted(n[1] for n in site.index["neurons"] if n[0].startswith("L1N"))

    def column() -> list[float]:
        script = "return Array.from(arguments[0].tBodies[0].rows, r => +r.cells[1].dataset.v)"
        return page.execute_script(script, table)

    fires.click()
    assert column() == pytest.approx(freqs, abs=1e-6)
    fires.click()
    assert column() == pytest.approx(freqs[::-1], abs=1e-6)


@pytest.fixture(scope="module")
def circuit():
    """A circuit of the bundled model with two named neurons (L0N7, L1N34), their layers'
    remainders and two heads: every edge of that graph kept."""
    import torch

    from tl_attnonly.analysis import Circuit, edge_attribution_scores
    from tl_attnonly.report.circuit import next_token_metric

    model = bundled("bridge")
    tokens = model.to_tokens("def f(x):\n    return x + 1")
    nodes = ["L0N7", "L1N34", "L0MLP", "L1MLP", "L0H0", "L1H0"]
    scores = edge_attribution_scores(model, tokens, tokens.flip(-1), next_token_metric(tokens),
                                     nodes=nodes, progress=False)  # fmt: skip
    mask = {key: torch.ones_like(s, dtype=torch.bool) for key, s in scores.scores.items()}
    return Circuit(scores, mask, scores.metric_clean, scores.metric_corrupted, 0.0, 0.5)


def _shows_l1n34(page, site) -> None:
    """The page is neuron L1N34's, showing its first top context's activation."""
    assert page.current_url == url(site.directory / "neuron.html", "#L1N34")
    assert page.find_element(By.TAG_NAME, "h1").text == "L1N34"
    first = site["L1N34"].record["top_examples"][0]
    muted = page.find_element(By.CSS_SELECTOR, "#main .ctx .muted").get_attribute("textContent")
    assert float(muted) == pytest.approx(first["act"], abs=5.1e-4)


def test_a_circuits_link_opens_the_neuron(page, site, circuit):
    """A circuit of the bundled model with two named neurons, written as an attribution graph
    with ``atlas=`` the atlas's folder (relative): a page of the graph's nodes, each MLP node a
    link to its ``vis_link`` (what Neuronpedia's and circuit-tracer's viewers open), opens the
    neuron's page showing that neuron, and the MLP layer node its layer's page."""
    import html

    graph = circuit.to_graph_json(atlas=site.directory.name)  # relative to the circuit's page
    links = {n["node_id"]: n["vis_link"] for n in graph["nodes"] if "vis_link" in n}
    assert links["L1N34_0"] == "atlas/neuron.html#L1N34"
    items = "".join(
        f'<li><a href="{html.escape(links[n["node_id"]])}">{n["node_id"]}</a></li>'
        if n["node_id"] in links else f"<li>{n['node_id']}</li>"
        for n in graph["nodes"]
    )  # fmt: skip
    circuit_page = site.directory.parent / "circuit.html"
    circuit_page.write_text(f"<!DOCTYPE html><title>circuit</title><ul>{items}</ul>", "utf-8")

    page.get(url(circuit_page))
    page.find_element(By.LINK_TEXT, "L1N34_0").click()
    shown_neuron(page, "L1N34")
    _shows_l1n34(page, site)
    page.back()
    page.find_element(By.LINK_TEXT, "L1MLP_0").click()
    WebDriverWait(page, WAIT_S).until(lambda d: d.title == "layer 1")
    assert page.find_element(By.TAG_NAME, "h1").text.endswith("layer 1")


#: Each labelled point's centre in the page (px), by its label (its trace's ``customdata``).
POINT_CENTRES = """const gd = document.querySelector('.js-plotly-plot'), out = {};
gd.querySelectorAll('.scatterlayer .trace').forEach((trace, i) => {
  trace.querySelectorAll('path.point').forEach((p, j) => {
    const r = p.getBoundingClientRect(), labels = gd.data[i].customdata;
    if (labels) out[labels[j]] = [Math.round(r.x + r.width / 2), Math.round(r.y + r.height / 2)];
  });
});
return out;"""


def _open_in_new_tab(page, click) -> None:
    """Runs ``click()`` and switches to the tab it opens."""
    before = set(page.window_handles)
    click()
    WebDriverWait(page, WAIT_S).until(lambda d: set(d.window_handles) - before)
    page.switch_to.window((set(page.window_handles) - before).pop())


def _shown_in_tab(page, label: str) -> None:
    """Waits until a tab the page opened shows neuron ``label`` with its top contexts (such a tab
    has no ``browser.SHOWN_PROBE``: it is installed in the first tab only)."""
    WebDriverWait(page, WAIT_S).until(
        lambda d: d.title == label and d.find_elements(By.CSS_SELECTOR, "#main .ctx")
    )


def test_a_circuit_figures_labels_open_their_pages(page, site, circuit):
    """``neuron_circuit_figure(circuit, atlas=<the atlas's folder>)`` saved as HTML
    (``save_figure``: plotly.js inline) and opened from ``file://``: the named neuron's label is
    drawn as a link; clicking it opens the neuron's page showing that neuron (its first top
    context's activation), clicking the layer node ``L1MLP``'s label opens the layer's page, and
    clicking the marker of ``L0N7`` its page (plotly.js drops ``file:`` hrefs itself, so the
    figure's own handler opens them)."""
    from selenium.webdriver.common.actions.action_builder import ActionBuilder

    from tl_attnonly.vis import neuron_circuit_figure, save_figure

    fig = neuron_circuit_figure(circuit, atlas=site.directory)  # a Path: its file:// URI
    saved = save_figure(fig, site.directory.parent / "figures" / "circuit.html")
    page.get(url(saved))
    WebDriverWait(page, WAIT_S).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".textpoint a"))
    anchors = {a.text: a for a in page.find_elements(By.CSS_SELECTOR, ".textpoint a")}
    assert {"L0N7", "L1N34", "L0MLP", "L1MLP"} <= set(anchors)
    assert not {"L0H0", "L1H0", "embed", "logits"} & set(anchors)
    figure_tab = page.current_window_handle

    _open_in_new_tab(page, anchors["L1N34"].click)
    _shown_in_tab(page, "L1N34")
    _shows_l1n34(page, site)
    page.close()
    page.switch_to.window(figure_tab)

    _open_in_new_tab(page, anchors["L1MLP"].click)
    WebDriverWait(page, WAIT_S).until(lambda d: d.title == "layer 1")
    assert page.current_url == url(site.directory / "layer_1.html")
    page.close()
    page.switch_to.window(figure_tab)

    centres = page.execute_script(POINT_CENTRES)
    click = ActionBuilder(page)
    click.pointer_action.move_to_location(*centres["L0N7"]).click()
    _open_in_new_tab(page, click.perform)
    _shown_in_tab(page, "L0N7")
    page.close()
    page.switch_to.window(figure_tab)


def test_the_docs_circuit_tables_open_their_neurons(page, tmp_path):
    """docs/atlas.md's tables of the SmolLM2 circuits' neurons link each label to the shipped
    subset site (``assets/atlas_smollm2/neuron.html#L26N1262``): a page of those links, clicked
    (the first) or followed (the rest), shows each neuron with its stored top context."""
    from tl_attnonly.atlas.site import read_record

    docs = Path(__file__).parents[2] / "docs"
    links = re.findall(r"\]\((assets/atlas_smollm2/neuron\.html)#(L(\d+)N(\d+))\)",
                       (docs / "atlas.md").read_text("utf-8"))  # fmt: skip
    assert len(links) >= 10
    items = "".join(f'<li><a href="{url(docs / p, "#" + name)}">{name}</a></li>'
                    for p, name, _, _ in links)  # fmt: skip
    table_page = tmp_path / "tables.html"
    table_page.write_text(f"<!DOCTYPE html><title>tables</title><ul>{items}</ul>", "utf-8")
    page.get(url(table_page))
    page.find_element(By.LINK_TEXT, links[0][1]).click()
    for i, (path, name, layer, neuron) in enumerate(links):
        if i:
            page.get(url(docs / path, "#" + name))
        shown_neuron(page, name)
        first = read_record(docs / "assets" / "atlas_smollm2", int(layer), int(neuron))
        first = first["top_examples"][0]
        muted = page.find_element(By.CSS_SELECTOR, "#main .ctx .muted").get_attribute("textContent")
        assert float(muted) == pytest.approx(first["act"], abs=5.1e-4), name
