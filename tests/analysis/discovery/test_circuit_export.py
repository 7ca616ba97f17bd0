"""Circuit.to_mib and Circuit.to_graph_json (issue 46 item 5): what MIB's loader reads, and
Neuronpedia's published attribution-graph schema.

MIB: :func:`mib_read` mirrors ``eap.graph.Graph.from_json`` (github.com/hannamw/EAP-IG,
``src/eap/graph.py``, the code MIB's ``run_evaluation.py`` calls; the MIB circuit track's
``MIB_circuit_track/circuit_loading.py``, ``load_graph_from_json``, is the same) over the graph
``Graph.from_model`` builds, written here from that function independently of the module. The
scores and memberships are checked against sums over the circuit's own edges, mapped here by
their labels. Graph JSON: validated with ``jsonschema`` against the copy of Neuronpedia's schema
in ``tests/data/`` (its source and licence in ``neuronpedia_graph_schema.md``).
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from conftest import make_tokens
from models import make_converted

from tl_attnonly.analysis import (
    Circuit,
    PositionClasses,
    discover_circuit,
    edge_attribution_scores,
    logit_diff_metric,
)

CLEAN, CORRUPTED = make_tokens(3, 7, seed=0), make_tokens(3, 7, seed=1)
METRIC = logit_diff_metric(torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7]))
GQA = dict(normalization_type="RMS", n_heads=4, d_head=4, n_key_value_heads=2)
SCHEMA = json.loads(
    (Path(__file__).parents[2] / "data" / "neuronpedia_graph_schema.json").read_text("utf-8")
)


def _discover(model, n, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return discover_circuit(
            model, CLEAN, CORRUPTED, METRIC, neurons_per_mlp=n, progress=False, **kwargs
        )


@functools.cache
def _model(gqa: bool):
    return make_converted("silu", **(GQA if gqa else {}))


@functools.cache
def _parallel():
    return make_converted("gelu", parallel_attn_mlp=True)  # MIB's m{l} does not read a{l}


@functools.cache
def _gelu():
    return make_converted("gelu")  # K = 4 heads per neuron


@functools.cache
def _circuit(name: str):
    """Each case's circuit, found once for the module: ``coarse``, ``named`` (8 neurons per
    MLP node), ``gqa`` (grouped-query attention, coarse), ``parallel`` (attention and MLP in
    parallel, coarse), ``neuron_heads`` (a GELU model's
    neuron-heads ``L{l}N{i}.{k}`` as nodes: the top 12 edges of a graph of 6 neuron-heads,
    heads and the rest of each layer, and the top 6 of the neuron-heads')."""
    if name == "parallel":
        return _discover(_parallel(), 0)
    if name == "neuron_heads":
        nodes = ["L0N1.0", "L0N1.3", "L0N5.2", "L1N0.1", "L1N7.0", "L1N7.3", "L0MLP", "L1MLP"]
        nodes += [f"L{li}H{h}" for li in range(2) for h in range(2)]
        scores = edge_attribution_scores(
            _gelu(), CLEAN, CORRUPTED, METRIC, neuron_level=False, nodes=nodes, progress=False
        )

        def top(keys, n):  # the n largest |score| of these blocks
            cut = torch.cat([scores.scores[k].flatten().abs() for k in keys]).topk(n).values[-1]
            return {k: scores.scores[k].abs() >= cut for k in keys}

        named = [k for k in scores.scores if "neuron" in k[0] or "neuron" in k[1]]
        mask = top(list(scores.scores), 12)
        mask = {k: m | top(named, 6).get(k, torch.zeros_like(m)) for k, m in mask.items()}
        return Circuit(scores, mask, scores.metric_clean, scores.metric_corrupted, 0.0, 0.5)
    return _discover(_model(name.startswith("gqa")), 8 if name.endswith("named") else 0)


@pytest.fixture(scope="module")
def model():
    return _model(False)


@pytest.fixture(scope="module", params=["coarse", "named", "gqa", "neuron_heads", "parallel"])
def case(request):
    if request.param in ("neuron_heads", "parallel"):
        return (_gelu() if request.param == "neuron_heads" else _parallel()), _circuit(
            request.param
        )
    return _model(request.param.startswith("gqa")), _circuit(request.param)


# --- MIB -----------------------------------------------------------------------------------


def mib_graph(cfg):
    """Node and edge names of ``Graph.from_model(cfg)`` (eap/graph.py): the residual stream
    starts with ``input``; per layer, every source so far feeds each head's q, k, v, then (not
    parallel) the heads join the stream and every source feeds ``m{l}``, which then joins."""
    nodes, edges, stream = {"input": {}}, {}, ["input"]
    for layer in range(cfg["n_layers"]):
        heads = [f"a{layer}.h{h}" for h in range(cfg["n_heads"])]
        nodes.update({h: {} for h in heads} | {f"m{layer}": {}})
        for node in stream:
            for head in heads:
                for letter in "qkv":
                    edges[f"{node}->{head}<{letter}>"] = {}
            if cfg["parallel_attn_mlp"]:
                edges[f"{node}->m{layer}"] = {}
        if not cfg["parallel_attn_mlp"]:
            stream += heads
            for node in stream:
                edges[f"{node}->m{layer}"] = {}
        else:
            stream += heads
        stream.append(f"m{layer}")
    for node in stream:
        edges[f"{node}->logits"] = {}
    nodes["logits"] = {}
    return nodes, edges


def mib_read(d):
    """``Graph.from_json``'s reading: the three keys; ``from_model(d['cfg'], neuron_level=True,
    node_scores=True)`` (needs n_layers, n_heads, parallel_attn_mlp, d_model); every node but
    ``logits`` looked up by name (a KeyError for a name MIB lacks) for ``in_graph`` and
    ``score``; every edge looked up by name for ``score`` and ``in_graph``."""
    assert all(k in d for k in ["cfg", "nodes", "edges"]), "Bad input JSON format - Missing keys"
    cfg = d["cfg"]
    for key in ("n_layers", "n_heads", "parallel_attn_mlp", "d_model"):
        assert key in cfg, key
    nodes, edges = mib_graph(cfg)
    for name, node in d["nodes"].items():
        if name == "logits":
            continue
        nodes[name]["in_graph"] = bool(node["in_graph"])
        if "score" in node:
            nodes[name]["score"] = float(node["score"])
    for name, info in d["edges"].items():
        edges[name]["score"] = float(info["score"])
        edges[name]["in_graph"] = bool(info["in_graph"])
    return nodes, edges


def _mib_source(label):
    if label == "embed":
        return "input"
    layer, rest = re.fullmatch(r"L(\d+)(.*)", label).groups()
    return f"a{layer}.h{rest[1:]}" if rest.startswith("H") else f"m{layer}"


def _mib_targets(label, inp, n_heads, n_kv):
    """(MIB reader, share) of our reader ``label`` at input ``inp``."""
    if label == "logits":
        return [("logits", 1.0)]
    layer, kind, j = re.fullmatch(r"L(\d+)(H|KV|N|MLP)(\d*).*", label).groups()
    if kind == "H":
        return [(f"a{layer}.h{j}<{inp}>", 1.0)]
    if kind == "KV":
        g = n_heads // n_kv
        return [(f"a{layer}.h{h}<{inp}>", 1 / g) for h in range(int(j) * g, (int(j) + 1) * g)]
    return [(f"m{layer}", 1.0)]


def test_mib_export_is_read_by_mibs_loader_with_the_sums_of_our_edges(case, tmp_path):
    m, circuit = case
    out = circuit.to_mib(tmp_path / "c.json", model=m)
    assert json.loads((tmp_path / "c.json").read_text()) == out
    cfg = m.cfg
    assert out["cfg"] == {
        "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
        "parallel_attn_mlp": bool(cfg.parallel_attn_mlp), "d_model": cfg.d_model,
    }  # fmt: skip
    nodes, edges = mib_read(out)
    # every node and edge of MIB's graph, in from_model's order, as Graph.to_json writes them
    assert list(out["nodes"]) == list(nodes) and list(out["edges"]) == list(edges)

    graph = circuit.graph
    n_kv = graph.n_kv
    alive = {_mib_source(s) for s in circuit.edges().source}  # heads with an edge out
    want = defaultdict(float)
    kept = set()
    for row in circuit.scores.frame().itertuples():  # every edge of our graph
        src = _mib_source(row.source)
        for reader, share in _mib_targets(row.target, row.input, graph.n_heads, n_kv):
            want[f"{src}->{reader}"] += share * row.score
    for row in circuit.edges().itertuples():  # the circuit's
        src = _mib_source(row.source)
        for reader, _ in _mib_targets(row.target, row.input, graph.n_heads, n_kv):
            if "KV" not in row.target or reader.split("<")[0] in alive:
                kept.add(f"{src}->{reader}")
    for name, edge in edges.items():
        assert edge["score"] == pytest.approx(want.get(name, 0.0), rel=1e-9, abs=1e-12), name
    assert {name for name, e in edges.items() if e["in_graph"]} == kept
    node_score = defaultdict(float)
    for name, edge in edges.items():
        node_score[name.split("->")[0]] += edge["score"]
    touched = {part.split("<")[0] for e in kept for part in e.split("->")}
    for name, node in nodes.items():
        if name != "logits":
            assert node["score"] == pytest.approx(node_score[name], rel=1e-9, abs=1e-12)
            assert node["in_graph"] == (name in touched), name
    if case[1].extra.get("named") is not None or graph.gqa:
        assert kept  # the cases are not empty circuits


def test_mib_grouped_query_edges_go_to_the_query_heads_they_serve():
    circuit = _circuit("gqa")
    out = circuit.to_mib(d_model=16)
    kv = circuit.scores.frame().query("input in ('k', 'v')").iloc[0]
    layer, j = map(int, re.fullmatch(r"L(\d+)KV(\d+)", kv.target).groups())
    src = _mib_source(kv.source)
    served = [f"{src}->a{layer}.h{h}<{kv.input}>" for h in (2 * j, 2 * j + 1)]
    # the two query heads' scores: an even split of the key/value head's, summing to it
    assert [out["edges"][e]["score"] for e in served] == pytest.approx([kv.score / 2] * 2)


def test_mib_refuses_the_neuron_level_and_a_missing_d_model(model):
    circuit = _circuit("named")
    with pytest.raises(ValueError, match="d_model dimensions of each node's output"):
        circuit.to_mib(level="neuron", model=model)
    with pytest.raises(ValueError, match="needs d_model"):
        circuit.to_mib()
    with pytest.raises(ValueError, match="level must be one of"):
        circuit.to_mib(level="edge", d_model=16)


# --- circuit-tracer / Neuronpedia graph JSON ----------------------------------------------


def _validate(graph_json):
    jsonschema = pytest.importorskip("jsonschema")  # comes with nbformat (the test extra)
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.Draft7Validator(SCHEMA).validate(graph_json)


def test_graph_json_validates_and_holds_the_circuits_edges(case, tmp_path):
    _, circuit = case
    tokens = ["a", "b", "c"]
    out = circuit.to_graph_json(tmp_path, slug="ioi-test", prompt_tokens=tokens)
    _validate(out)
    assert json.loads((tmp_path / "ioi-test.json").read_text()) == out
    listed = json.loads((tmp_path / "graph-metadata.json").read_text())["graphs"]
    assert [g["slug"] for g in listed] == ["ioi-test"]
    nodes = {n["node_id"]: n for n in out["nodes"]}
    # the viewer's key (utils.ts formatCLTGraphData: layer_feature_ctx) is unique
    assert len({(n["layer"], n["feature"], n["ctx_idx"]) for n in nodes.values()}) == len(nodes)
    assert {n["ctx_idx"] for n in nodes.values()} == {len(tokens) - 1}
    frame = circuit.edges()
    by_pair = defaultdict(dict)
    for row in frame.itertuples():
        by_pair[(f"{row.source}_2", f"{row.target}_2")][row.input or "resid"] = row.score
    links = {(lk["source"], lk["target"]): lk for lk in out["links"]}
    assert set(links) == set(by_pair)
    for pair, link in links.items():
        assert link["inputs"] == pytest.approx(by_pair[pair])
        assert link["weight"] == pytest.approx(sum(by_pair[pair].values()))
        assert set(pair) <= set(nodes)
    roles = {
        "embed": "embedding", "attn": "attention head",
        "neuron": "mlp neuron" if circuit.graph.neuron_level else "mlp neuron-head",
        "mlp": "mlp layer", "logits": "logit",
    }  # fmt: skip
    for row in frame.itertuples():
        assert nodes[f"{row.source}_2"]["feature_type"] == roles[row.source_kind]
        kind = "attention key/value head" if "KV" in row.target else roles[row.target_kind]
        assert nodes[f"{row.target}_2"]["feature_type"] == kind
    for node in nodes.values():
        assert node["clerp"]
        if node["feature_type"] == "logit":  # the viewer reads p from "(p=...)"
            assert float(node["clerp"].split("(p=")[1].split(")")[0]) == 1.0
    assert {"embed_2", "logits_2"} <= set(nodes)


def test_graph_json_by_position_class_puts_each_edge_at_its_class(model):
    ids = torch.tensor([[0, 0, 2, 2, 2, 2, 1]] * 3)
    classes = PositionClasses(("start", "end", "other"), ids)
    circuit = _discover(model, 0, positions=classes)
    out = circuit.to_graph_json()
    _validate(out)
    assert out["metadata"]["prompt_tokens"] == ["start", "end", "other"]
    ctx = {n["node_id"]: n["ctx_idx"] for n in out["nodes"]}
    want = {
        (
            f"{r.source}_{classes.names.index(r.position)}",
            f"{r.target}_{classes.names.index(r.position)}",
        )
        for r in circuit.edges().itertuples()
    }
    assert {(lk["source"], lk["target"]) for lk in out["links"]} == want
    for lk in out["links"]:
        assert ctx[lk["source"]] == ctx[lk["target"]]
    with pytest.raises(ValueError, match="one prompt_tokens entry per class"):
        circuit.to_graph_json(prompt_tokens=["x"])
    # MIB has no positions: the classes' edges merge into one (their scores summed)
    mib = circuit.to_mib(d_model=16)
    total = circuit.scores.frame().query("source == 'embed' and target == 'logits'").score.sum()
    assert mib["edges"]["input->logits"]["score"] == pytest.approx(total)


def test_graph_json_links_mlp_nodes_to_their_atlas_pages():
    out = _circuit("named").to_graph_json(atlas="https://example.org/atlas/")
    _validate(out)
    links = {n["node_id"]: n.get("vis_link") for n in out["nodes"]}
    mlp = [n for n in out["nodes"] if n["feature_type"] == "mlp layer"]
    neurons = [n for n in out["nodes"] if n["feature_type"] == "mlp neuron"]
    assert mlp and neurons
    for n in mlp:
        layer = n["node_id"][1 : n["node_id"].index("MLP")]
        assert n["vis_link"] == f"https://example.org/atlas/layer_{layer}.html"
    for n in neurons:  # the atlas site's neuron page (tl_attnonly.atlas.site: neuron.html#L1N34)
        assert n["vis_link"] == f"https://example.org/atlas/neuron.html#{n['node_id'][:-2]}"
    assert all(links[n["node_id"]] is None for n in out["nodes"] if "H" in n["node_id"])


def test_graph_json_links_a_path_atlas_by_its_file_uri(tmp_path):
    """A ``Path`` (the atlas's folder) links by its absolute ``file://`` URI; a neuron-head
    ``L{l}N{i}.{k}`` to its neuron's page."""
    atlas = tmp_path / "my atlas"
    out = _circuit("neuron_heads").to_graph_json(atlas=atlas)
    links = {n["node_id"][:-2]: n["vis_link"] for n in out["nodes"] if "vis_link" in n}
    base = atlas.resolve().as_uri()
    assert base.startswith("file:///") and "my%20atlas" in base
    heads = [label for label in links if "." in label]
    assert heads
    for label in heads:
        assert links[label] == f"{base}/neuron.html#{label.split('.')[0]}"
    assert links["L1MLP"] == f"{base}/layer_1.html"


@pytest.mark.parametrize("name", ["named", "neuron_heads"])
def test_report_lists_the_atlas_pages_of_its_named_neurons_and_mlp_nodes(name):
    """``Circuit.report(atlas=...)`` ends with a section of the named neurons (and neuron-heads)
    and MLP nodes, each with its page: the same URL as ``to_graph_json``'s ``vis_link``; no such
    section without ``atlas``."""
    from tl_attnonly.analysis.discovery.counts import named_neurons

    circuit = _circuit(name)
    atlas = "https://example.org/atlas/"
    plain, text = circuit.report(), circuit.report(atlas=atlas)
    assert "atlas pages" not in plain and "example.org" not in plain
    assert text.startswith(plain.rsplit("\nwarnings:", 1)[0].rsplit("\ntime:", 1)[0])
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("atlas pages"))
    listed = dict(line.split() for line in lines[start + 1 :] if line.startswith("  "))
    links = {n["node_id"][:-2]: n["vis_link"] for n in
             circuit.to_graph_json(atlas=atlas)["nodes"] if "vis_link" in n}  # fmt: skip
    assert listed == links and list(listed) == list(circuit.atlas_pages(atlas))
    assert lines[start] == (
        f"atlas pages of its named neurons and MLP nodes ({len(links)}, atlas "
        "https://example.org/atlas):"
    )
    mlp = [label for label in listed if label.endswith("MLP")]
    neurons = [label for label in listed if "N" in label]
    assert mlp and neurons
    named = named_neurons(circuit)  # neurons L{l}N{i} (not neuron-heads), listed first
    assert list(listed)[: len(named)] == named
    assert all(not any(c in label for c in "HE") for label in listed)


def test_graph_json_refuses_a_slug_that_is_no_file_name():
    with pytest.raises(ValueError, match="slug"):
        _circuit("coarse").to_graph_json(slug="../x")


def test_circuit_tracers_models_and_server_read_the_file(tmp_path):
    """Where circuit-tracer is installed: its pydantic models parse the file, and its local
    server serves it."""
    pytest.importorskip("circuit_tracer")
    from urllib.request import urlopen

    from circuit_tracer.frontend.graph_models import Model
    from circuit_tracer.frontend.local_server import serve

    out = _circuit("named").to_graph_json(tmp_path, slug="named")
    Model(**out)
    server = serve(str(tmp_path), port=0)
    try:
        port = server.httpd.server_address[1]
        with urlopen(f"http://localhost:{port}/graph_data/named.json") as response:
            assert json.loads(response.read()) == out
    finally:
        server.stop()
