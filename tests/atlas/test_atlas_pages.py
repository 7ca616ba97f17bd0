"""The site's pages run: their inline JavaScript, executed by node with a small DOM stub (where
node is installed), renders a neuron page and finds neurons by label and by token."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import BATCH, bundled, corpus_rows  # noqa: E402

from tl_attnonly.atlas import AtlasOptions, build_atlas  # noqa: E402
from tl_attnonly.atlas.site import read_js_data  # noqa: E402

NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="needs node to run the pages' scripts")

RUNNER = r"""// A page's inline scripts in node, a tiny DOM stub; prints #main's and #hits' HTML.
const fs = require('fs'), path = require('path'), vm = require('vm');
const [page, hash, query] = process.argv.slice(2);
const dir = path.dirname(page), html = fs.readFileSync(page, 'utf8');
const els = {};
function el(id) {
  return els[id] || (els[id] = {id, innerHTML: '', textContent: '', value: query || ''});
}
const ctx = {
  location: {hash: hash || ''}, console,
  atob: (s) => Buffer.from(s, 'base64').toString('binary'),
  DecompressionStream, Blob, Response,
  window: {addEventListener() {}},
  document: {
    title: '', getElementById: el, querySelectorAll: () => [],
    createElement: () => ({}),
    head: {appendChild(e) {  // a missing file calls the script's onerror, as a browser does
      const file = path.join(dir, e.src);
      if (!fs.existsSync(file)) { if (e.onerror) e.onerror(); return; }
      vm.runInContext(fs.readFileSync(file, 'utf8'), ctx);
    }},
  },
};
vm.createContext(ctx);
for (const m of html.matchAll(/<script>([\s\S]*?)<\/script>/g)) vm.runInContext(m[1], ctx);
if (query !== undefined) vm.runInContext('search()', ctx);
process.once('beforeExit', () => {  // once the record is inflated and rendered
  const main = el('main'), shown = {main: main.innerHTML, hits: el('hits').innerHTML};
  shown.text = main.textContent;
  console.log(JSON.stringify({...shown, title: ctx.document.title}));
});
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    model = bundled("bridge")
    out = tmp_path_factory.mktemp("atlas")
    opts = AtlasOptions(k=4, before=3, after=2, max_len=48)
    build_atlas(model, corpus_rows(model), out, options=opts, batch_size=BATCH, progress=False)
    runner = out.parent / "run_page.js"
    runner.write_text(RUNNER)
    return out, runner


def run_page(site, page: str, hash_: str = "", query: str | None = None) -> dict:
    out, runner = site
    args = [NODE, str(runner), str(out / page), hash_] + ([] if query is None else [query])
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout)


@pytest.mark.parametrize("label", ["L1N34", "L0N0", "L1N511"])  # a shard's middle, first, last
def test_neuron_page_renders(site, label):
    shown = run_page(site, "neuron.html", f"#{label}")
    assert shown["title"] == label
    for part in (f"<h1>{label}</h1>", "Top logits", "Top contexts", "Quantile samples", "rgba("):
        assert part in shown["main"]


def test_index_search_by_label_and_token(site):
    hits = run_page(site, "index.html", "", "L0N7")["hits"]
    assert 'href="neuron.html#L0N7"' in hits and hits.startswith("1 neuron")
    label, _, _, tokens = read_js_data(site[0] / "index.js")["neurons"][0]
    hits = run_page(site, "index.html", "", tokens[0])["hits"]
    assert f'href="neuron.html#{label}"' in hits


def test_neuron_page_shows_the_stored_values(site):
    """The page's JavaScript unpacks a record (inflated token ids, int8 activations, uint8 self
    weights) to the values Python reads back: each top context's tokens, in order, with the
    activation and self weight of every token in its hover text."""
    import html
    import re

    from tl_attnonly.atlas.site import read_record

    shown = run_page(site, "neuron.html", "#L1N34")["main"]
    record = read_record(site[0], 1, 34)
    vocab = read_js_data(site[0] / "vocab.js")
    spans = re.findall(r'title="act ([-0-9.e]+), self ([-0-9.e]+)">([^<]*)</span>', shown)
    want = [(a, s, t) for c in record["top_examples"]
            for t, a, s in zip(c["tokens"], c["acts"], c["self"]) if t >= 0]  # fmt: skip
    assert len(want) > 20 and len(spans) >= len(want)
    for (act, self_w, text), (a, s, t) in zip(spans, want):
        assert float(act) == pytest.approx(a, abs=1e-4)
        assert float(self_w) == pytest.approx(s, abs=1e-4)
        assert html.unescape(text) == vocab[t].replace("\n", "\u21b5").replace(" ", "\u00a0")


def test_a_subset_site_holds_those_neurons_as_the_atlas_shows_them(site, tmp_path):
    """``Atlas.subset``: the named neurons' records as in the full atlas, an index, search and
    layer pages of those neurons only, and its neuron page renders."""
    from tl_attnonly.atlas import Atlas

    full = Atlas.load(site[0])
    labels = ["L1N34", "L0N7", "L1N2", "L0N7"]
    sub = full.subset(labels, tmp_path / "sub")
    assert sub.meta["subset"] == ["L0N7", "L1N2", "L1N34"]
    assert [n[0] for n in sub.index["neurons"]] == ["L0N7", "L1N2", "L1N34"]
    files = sorted(str(p.relative_to(tmp_path / "sub")) for p in (tmp_path / "sub").rglob("S*.js"))
    assert files == ["neurons/L0/S0.js", "neurons/L1/S0.js", "neurons/L1/S2.js"]
    assert sorted(read_js_data(tmp_path / "sub" / files[1])) == ["2"]  # only those neurons
    for name in sub.meta["subset"]:
        assert sub[name].record == full[name].record
    token = full.vocab[full["L1N34"]["top_examples"][0]["tokens"][full.meta["options"]["before"]]]
    want = full.search(token)
    want = want[want.label.isin(sub.meta["subset"])].reset_index(drop=True)
    assert sub.search(token).equals(want) and len(want) >= 1
    layer_page = (tmp_path / "sub" / "layer_1.html").read_text()
    assert "L1N34" in layer_page and "L1N2" in layer_page and "L1N3<" not in layer_page
    shown = run_page((tmp_path / "sub", site[1]), "neuron.html", "#L1N34")
    assert shown["title"] == "L1N34" and "Top contexts" in shown["main"]
    shown = run_page((tmp_path / "sub", site[1]), "neuron.html", "#L1N35")  # in S2.js, not kept
    assert shown["main"] == "" and "This atlas has no neuron L1N35" in shown["text"]
    shown = run_page((tmp_path / "sub", site[1]), "neuron.html", "#L1N100")  # S6.js, not kept
    assert shown["main"] == "" and shown["text"] == "This atlas has no neuron L1N100."
    with pytest.raises(KeyError, match="not a neuron of this atlas"):
        full.subset(["L9N0"], tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    with pytest.raises(KeyError, match="No neuron L1N35"):  # in range, not in the subset
        sub.subset(["L1N34", "L1N35"], tmp_path / "bad2")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("bad")) == []


def test_the_site_is_sharded_and_an_earlier_format_is_refused(site, tmp_path):
    """Records are stored 16 neurons a file (``neurons/L{l}/S{s}.js``); a site of the earlier
    format (a file per neuron, no ``shard`` in its manifest) is refused with the way out."""
    import shutil

    out = site[0]
    assert not list(out.rglob("N*.js"))
    shards = sorted(p.name for p in (out / "neurons" / "L1").iterdir())
    assert len(shards) == 512 // 16 and sorted(read_js_data(out / "neurons/L1/S2.js"), key=int) == [
        str(i) for i in range(32, 48)]  # fmt: skip
    old = tmp_path / "old"
    shutil.copytree(out, old)
    meta = json.loads((old / "atlas.json").read_text())
    del meta["shard"]
    (old / "atlas.json").write_text(json.dumps(meta))
    from tl_attnonly.atlas import Atlas

    with pytest.raises(ValueError, match="earlier version.*write_atlas"):
        Atlas.load(old)["L1N34"]
    with pytest.raises(ValueError, match="earlier version.*write_atlas"):
        Atlas.load(old).subset(["L1N34"], tmp_path / "sub")
    assert not (tmp_path / "sub").exists() and not (tmp_path / "sub.tmp-subset").exists()
