"""Exports of a found circuit to the field's formats: MIB's circuit files and the attribution-graph
JSON of circuit-tracer and Neuronpedia (:meth:`~.circuit.Circuit.to_mib`,
:meth:`~.circuit.Circuit.to_graph_json`). The circuit is taken as it is duck-typed: its
``scores`` (:class:`~.scored_edges.EdgeScores`: graph and score blocks), ``mask``, metrics and
``faithfulness``.

**MIB** (the Mechanistic Interpretability Benchmark's circuit track) reads circuits with
``eap.graph.Graph.from_json`` (github.com/hannamw/EAP-IG, ``src/eap/graph.py``; the MIB
repository's ``MIB_circuit_track/circuit_loading.py``, ``load_graph_from_json``, is the same
code): ``{"cfg": {n_layers, n_heads, parallel_attn_mlp, d_model}, "nodes": {name: {in_graph,
score}}, "edges": {name: {score, in_graph}}}``, over the graph ``Graph.from_model(cfg)`` builds:
nodes ``input``, ``a{l}.h{h}``, ``m{l}``, ``logits``; edges ``input->a0.h0<q>`` (one per
``q``/``k``/``v`` of a head), ``a0.h0->m1``, ``m0->logits``, each source to every later reader.
Our graph maps onto it so:

* ``embed`` is ``input``; ``L{l}H{h}`` is ``a{l}.h{h}``; every MLP source of layer ``l`` (named
  neurons ``L{l}N{i}``, neuron-heads ``L{l}N{i}.{k}`` and the remainder or whole layer
  ``L{l}MLP``) is ``m{l}``, and their ``gate`` and ``value`` inputs are ``m{l}``'s one input;
* grouped-query attention: MIB's evaluation ungroups it (``run_evaluation.py`` sets
  ``model.cfg.ungroup_grouped_query_attention = True``), so its ``k``/``v`` inputs are per query
  head. Our ``k``/``v`` edge into the key/value head ``L{l}KV{j}`` becomes the edges into the
  same input of each query head it serves, its score split evenly among them (the per-head split
  is not measured; the sum is kept), in the graph for those of them that are circuit nodes
  (heads with an edge out of them in the circuit: the others' inputs change nothing);
* multi-head latent attention: our edge into the layer's one input ``L{l}ATTN`` becomes the
  edges into the ``q``, ``k`` and ``v`` of each of its heads, its score split evenly among them,
  in the graph for the heads that are circuit nodes;
* edges resolved by position classes (``@io``) merge: MIB's edges cover every position, and the
  classes partition the positions;
* an MIB edge's ``score`` is the sum of the scores of the edges of ours it stands for (EAP and
  EAP-IG scores add: an input's gradient is the sum over what reads it), and it is in the graph
  when any of them is (so a circuit that keeps a neuron's edge and not its layer's remainder, a
  ``gate`` edge without the ``value`` one, or an edge at one position class only exports as the
  larger MIB circuit; ``circuit.extra["coarse"].to_mib()`` exports the coarse circuit, whose
  MLP nodes are whole layers as MIB's are);
* a node's ``score`` is the sum of its outgoing edges' scores over the whole graph (its node
  attribution, by the same additivity); it is in the graph when an edge of the circuit touches
  it. Nodes and edges a restricted graph dropped have score 0 and are out.

MIB's neuron level (``Graph.neurons_in_graph``, ``[n_forward, d_model]``) masks the ``d_model``
dimensions of each node's *output* (``eap.evaluate.evaluate_graph`` multiplies each node's
activation difference by it), not an MLP's hidden neurons: a named neuron writes along its row of
``W_out``, across every dimension, so it has no MIB neuron-level form, and ``level="neuron"`` is
refused.

**Attribution graphs** (circuit-tracer's ``circuit_tracer/frontend/graph_models.py`` and
``utils/create_graph_files.py``; Neuronpedia's schema
``apps/webapp/app/api/graph/graph-schema.json``, a copy in ``tests/data/``): ``metadata``,
``qParams``, ``nodes`` and ``links``. Every node of a circuit edge is a node, labelled by role in
``feature_type`` (``"embedding"``, ``"attention head"``, ``"attention key/value head"``,
``"attention layer input"``, ``"mlp neuron"``, ``"mlp neuron-head"``, ``"mlp layer"``, ``"mlp
expert"``, ``"mlp expert neuron"``, ``"mlp layer input"``, ``"logit"``) and ``clerp`` (``"L3H2:
attention head 2 of layer 3"``); each pair of nodes joined by circuit edges is one link whose
``weight`` is the sum of their scores (the scores by input, ``q``/``k``/``v`` or ``gate``/``value``,
under ``inputs``; ``resid`` for the logits). ``layer`` is the node's sublayer in the residual
stream: attention of layer ``l`` is ``2l+1``, its MLP ``2l+2``, the embeddings ``"E"``, the logits
``2 n_layers + 1``. ``ctx_idx``: our edges cover every position, so on a graph without position
classes every node sits at the last entry of ``prompt_tokens`` (default: one entry, ``"(every
position)"``); on a graph resolved by position classes each class is one context entry
(``prompt_tokens`` defaults to the class names) and an edge's two nodes sit at its class. With
``atlas=`` (a neuron atlas site, :mod:`tl_attnonly.atlas`) each MLP node links to its atlas page
under ``vis_link``. The ``logits`` node stands for the task's metric; its ``clerp`` carries the
``(p=...)`` suffix Neuronpedia's viewer parses from a logit node, with p = 1.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery import graph as graphs
from tl_attnonly.analysis.discovery.atlas_links import AtlasLocation, atlas_page
from tl_attnonly.analysis.discovery.graph import EMBED, LOGITS, MLP_REST, HeadGraph, InputGroup

#: The levels :func:`circuit_to_mib` takes (``"neuron"`` is refused; see the module's doc).
MIB_LEVELS = ("node", "neuron")

# ---------------------------------------------------------------------------------------------
# MIB


def mib_names(cfg: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Node and edge names of MIB's graph for ``cfg``, in the order ``Graph.from_model`` makes
    them (``eap/graph.py``): ``input``, then per layer its heads and ``m{l}``, then ``logits``;
    each reader's edges from every source before it (an MLP reads its layer's heads unless
    ``parallel_attn_mlp``)."""
    n_layers, n_heads = int(cfg["n_layers"]), int(cfg["n_heads"])
    nodes, edges, stream = ["input"], [], ["input"]
    for li in range(n_layers):
        heads, mlp = [f"a{li}.h{h}" for h in range(n_heads)], f"m{li}"
        nodes += [*heads, mlp]
        if cfg["parallel_attn_mlp"]:
            for s in stream:
                edges += [f"{s}->{h}<{x}>" for h in heads for x in "qkv"] + [f"{s}->{mlp}"]
            stream = [*stream, *heads, mlp]
        else:
            edges += [f"{s}->{h}<{x}>" for s in stream for h in heads for x in "qkv"]
            stream = [*stream, *heads]
            edges += [f"{s}->{mlp}" for s in stream]
            stream = [*stream, mlp]
    nodes.append("logits")
    edges += [f"{s}->logits" for s in stream]
    return nodes, edges


def _mib_sources(graph: HeadGraph) -> dict[str, list[str]]:
    """Per source group key, the MIB node of each of its nodes."""
    out = {}
    for g in graph.sources:
        if g.kind == EMBED:
            out[g.key] = ["input"] * len(g.labels)
        elif g.kind == "attn":
            out[g.key] = [f"a{g.layer}.h{h}" for h in g.index]
        else:  # neurons, neuron-heads, the MLP remainder
            out[g.key] = [f"m{g.layer}"] * len(g.labels)
    return out


def _mib_readers(
    graph: HeadGraph, dst: InputGroup, alive: set[str]
) -> list[tuple[str, float, bool, list[int]]]:
    """The MIB readers of ``dst``'s readers: ``(MIB reader, share of each score, in the graph
    when kept, columns of dst it stands for)``."""
    every = list(range(len(dst.labels)))
    if dst.kind == LOGITS:
        return [("logits", 1.0, True, every)]
    if dst.kind in ("neuron", MLP_REST, graphs.EXPERTS):
        return [(f"m{dst.layer}", 1.0, True, every)]
    if dst.kind == graphs.LATENT_ATTN:  # every input of every head, the score split evenly
        share = 1.0 / (3 * graph.n_heads)
        return [
            (f"a{dst.layer}.h{h}<{x}>", share, f"a{dst.layer}.h{h}" in alive, every)
            for h in range(graph.n_heads)
            for x in "qkv"
        ]
    if dst.input == "q" or not graph.gqa:
        return [
            (f"a{dst.layer}.h{h}<{dst.input}>", 1.0, True, [v]) for v, h in enumerate(dst.index)
        ]
    group = graph.n_heads // graph.n_kv  # a key/value head serves `group` query heads
    return [
        (f"a{dst.layer}.h{h}<{dst.input}>", 1.0 / group, f"a{dst.layer}.h{h}" in alive, [v])
        for v, j in enumerate(dst.index)
        for h in range(j * group, (j + 1) * group)
    ]


def circuit_to_mib(
    circuit: Any,
    path: str | Path | None = None,
    *,
    level: str = "node",
    model: Any = None,
    d_model: int | None = None,
) -> dict[str, Any]:
    """The circuit in MIB's circuit format (the module's doc gives the mapping).

    Args:
        circuit: A :class:`~.circuit.Circuit`.
        path: Write the JSON there too (a file; its directory must exist).
        level: ``"node"``: heads and whole MLP layers, as MIB's graph has them. ``"neuron"`` is
            refused: MIB's neurons are dimensions of each node's output, not MLP neurons.
        model: The model it was found on (gives ``d_model``), or
        d_model: ``d_model`` itself (MIB's ``cfg`` needs it).

    Returns:
        ``{"cfg", "nodes", "edges"}``, every node and edge of MIB's graph for the model, in
        ``Graph.from_model``'s order (as ``Graph.to_json`` writes them).

    Raises:
        ValueError: For ``level="neuron"``, another level, or no ``d_model``.
    """
    if level == "neuron":
        raise ValueError(
            "MIB's neuron level masks the d_model dimensions of each node's output "
            "(eap.graph.Graph.neurons_in_graph [n_forward, d_model], applied per dimension by "
            "eap.evaluate.evaluate_graph), not an MLP's hidden neurons: a named neuron (L0N5) "
            "writes along its row of W_out, across every dimension, so it has no MIB "
            "neuron-level form. Export level='node' (MIB's m{l} is layer l's whole MLP: named "
            "neurons and remainder together)."
        )
    if level not in MIB_LEVELS:
        raise ValueError(f"level must be one of {MIB_LEVELS}, got {level!r}.")
    if d_model is None:
        if model is None:
            raise ValueError(
                "MIB's cfg needs d_model: pass model= (the model the circuit was found on) "
                "or d_model=."
            )
        d_model = int(analysis_model(model).cfg.d_model)
    graph: HeadGraph = circuit.scores.graph
    cfg = {
        "n_layers": graph.n_layers,
        "n_heads": graph.n_heads,
        "parallel_attn_mlp": bool(graph.parallel),
        "d_model": int(d_model),
    }
    node_names, edge_names = mib_names(cfg)
    sources = _mib_sources(graph)
    alive = {  # query heads with an edge out of them in the circuit
        name
        for (src, _), kept in circuit.mask.items()
        if graph.source_by_key[src].kind == "attn"
        for name, out in zip(sources[src], kept.any(dim=1).tolist(), strict=True)
        if out
    }
    score = dict.fromkeys(edge_names, 0.0)
    kept = dict.fromkeys(edge_names, False)
    for src, dst in graph.blocks():
        block = circuit.scores.scores[(src.key, dst.key)].detach().double().cpu()
        mask = circuit.mask[(src.key, dst.key)].detach().bool().cpu()
        rows = sources[src.key]
        readers = _mib_readers(graph, dst, alive)
        # sum over our sources of one MIB node first (a layer's neurons: one row)
        names = list(dict.fromkeys(rows))
        if len(names) < len(rows):
            which = torch.tensor([names.index(r) for r in rows])
            block = torch.zeros(len(names), block.shape[1], dtype=block.dtype).index_add_(
                0, which, block
            )
            kept_in = torch.zeros(len(names), mask.shape[1], dtype=torch.float64)
            mask = kept_in.index_add_(0, which, mask.double()) > 0
        for name, col_scores, col_kept in zip(names, block.tolist(), mask.tolist(), strict=True):
            for reader, share, can_keep, cols in readers:
                edge = f"{name}->{reader}"
                if edge not in score:
                    raise AssertionError(f"{edge} is not an edge of MIB's graph for {cfg}")
                score[edge] += share * sum(col_scores[v] for v in cols)
                kept[edge] = kept[edge] or (can_keep and any(col_kept[v] for v in cols))
    node_score = dict.fromkeys(node_names, 0.0)
    touched = {"logits"}
    for edge in edge_names:
        parent, child = edge.split("->")
        node_score[parent] += score[edge]
        if kept[edge]:
            touched |= {parent, child.split("<")[0]}
    nodes = {
        n: {"in_graph": n in touched} | ({} if n == "logits" else {"score": node_score[n]})
        for n in node_names
    }
    out = {
        "cfg": cfg,
        "nodes": nodes,
        "edges": {e: {"score": score[e], "in_graph": kept[e]} for e in edge_names},
    }
    if path is not None:
        Path(path).write_text(json.dumps(out), encoding="utf-8")
    return out


# ---------------------------------------------------------------------------------------------
# circuit-tracer / Neuronpedia attribution graphs

_SLUG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
#: The file circuit-tracer's local server lists its graphs in (``frontend/utils.py``).
GRAPH_METADATA_NAME = "graph-metadata.json"


def _node_roles(graph: HeadGraph) -> dict[str, dict[str, Any]]:
    """Per node label: ``layer`` (sublayer row), ``feature`` (unique in its row), role, clerp."""
    roles: dict[str, dict[str, Any]] = {
        EMBED: dict(layer="E", feature=0, feature_type="embedding",
                    clerp="embed: token and position embeddings"),
        LOGITS: dict(layer=str(2 * graph.n_layers + 1), feature=0, feature_type="logit"),
    }  # fmt: skip
    group = graph.n_heads // graph.n_kv
    for g in graph.sources:
        if g.kind == "attn":
            for label, h in zip(g.labels, g.index, strict=True):
                roles[label] = dict(
                    layer=str(2 * g.layer + 1), feature=h, feature_type="attention head",
                    clerp=f"{label}: attention head {h} of layer {g.layer}",
                )  # fmt: skip
        elif g.kind == "neuron":
            role = "mlp neuron" if graph.neuron_level else "mlp neuron-head"
            for label, i in zip(g.labels, g.index, strict=True):
                neuron, k = divmod(i, graph.n_heads_per_neuron)
                what = (
                    f"MLP neuron {i}" if graph.neuron_level else f"head {k} of MLP neuron {neuron}"
                )
                roles[label] = dict(
                    layer=str(2 * g.layer + 2), feature=i, feature_type=role,
                    clerp=f"{label}: {what} of layer {g.layer}",
                )  # fmt: skip
        elif g.kind == graphs.EXPERT:
            for label, e in zip(g.labels, g.index, strict=True):
                roles[label] = dict(
                    layer=str(2 * g.layer + 2), feature=e, feature_type="mlp expert",
                    clerp=f"{label}: component {e} of layer {g.layer}'s mixture of experts "
                    "(its weighted output)",
                )  # fmt: skip
        elif g.kind == graphs.EXPERT_NEURON:  # after the experts and their input in the row
            parts = graph.expert_part_labels[g.layer]
            widths = dict(zip(graph.shape.expert_layers, graph.shape.expert_widths, strict=True))
            for label in g.labels:
                owner, j = label[: label.rindex("N")], int(label[label.rindex("N") + 1 :])
                roles[label] = dict(
                    layer=str(2 * g.layer + 2), feature_type="mlp expert neuron",
                    feature=len(parts) + 1 + parts.index(owner) * max(widths[g.layer]) + j,
                    clerp=f"{label}: neuron {j} of {owner}, an expert of layer {g.layer}'s "
                    "mixture of experts (its weighted contribution)",
                )  # fmt: skip
        elif g.kind == graphs.EXPERTS:
            roles[g.labels[0]] = dict(
                layer=str(2 * g.layer + 2), feature=0, feature_type="mlp layer",
                clerp=f"{g.labels[0]}: MLP layer {g.layer} (a mixture of experts, whole)",
            )  # fmt: skip
        elif g.kind == MLP_REST:
            what = "neurons" if graph.neuron_level else "neuron-heads"
            named = len(g.index) < g.size
            part = f"its {len(g.index)} {what} not named" if named else f"all {g.size} {what}"
            roles[g.labels[0]] = dict(
                layer=str(2 * g.layer + 2), feature=g.size, feature_type="mlp layer",
                clerp=f"{g.labels[0]}: MLP layer {g.layer} ({part})",
            )  # fmt: skip
    if graph.gqa:
        for d in graph.inputs:
            if d.kind == "attn" and d.input != "q":
                for label, j in zip(d.labels, d.index, strict=True):
                    served = ", ".join(f"L{d.layer}H{h}" for h in range(j * group, (j + 1) * group))
                    roles[label] = dict(
                        layer=str(2 * d.layer + 1), feature=graph.n_heads + j,
                        feature_type="attention key/value head",
                        clerp=f"{label}: key/value head {j} of layer {d.layer} (serves {served})",
                    )  # fmt: skip
    for d in graph.inputs:
        if d.kind == graphs.EXPERTS and d.layer in graph.split_experts and d.labels:
            roles[d.labels[0]] = dict(
                layer=str(2 * d.layer + 2), feature=len(graph.expert_part_labels[d.layer]),
                feature_type="mlp layer input",
                clerp=f"{d.labels[0]}: the normalised input layer {d.layer}'s router and experts "
                "read",
            )  # fmt: skip
        if d.kind == graphs.LATENT_ATTN and d.labels:
            roles[d.labels[0]] = dict(
                layer=str(2 * d.layer + 1), feature=graph.n_heads + graph.n_kv,
                feature_type="attention layer input",
                clerp=f"{d.labels[0]}: the normalised input every head of layer {d.layer} reads "
                "(multi-head latent attention)",
            )  # fmt: skip
    return roles


def _version() -> str:
    try:
        return version("tl-attnonly")
    except PackageNotFoundError:
        return "unknown"


def circuit_to_graph_json(
    circuit: Any,
    path: str | Path | None = None,
    *,
    slug: str = "tl-attnonly-circuit",
    scan: str = "tl-attnonly",
    prompt_tokens: Sequence[str] | None = None,
    prompt: str | None = None,
    logit_label: str = "metric",
    atlas: AtlasLocation | None = None,
) -> dict[str, Any]:
    """The circuit as a circuit-tracer / Neuronpedia attribution graph (module's doc: the
    mapping and how ``ctx_idx`` is set).

    Args:
        circuit: A :class:`~.circuit.Circuit`.
        path: A directory to write ``{slug}.json`` into, with ``graph-metadata.json`` listing it
            (updated, as circuit-tracer's ``add_graph_metadata`` does): what circuit-tracer's
            local server (``circuit_tracer.frontend.local_server.serve(path)``) serves.
        slug: The graph's name (letters, digits, ``_``, ``.``, ``-``).
        scan: Neuronpedia's model id (``metadata.scan``).
        prompt_tokens: The context's entries. Without position classes: the prompt's tokens
            (every node sits at the last); with them: one name per class (default: the class
            names).
        prompt: ``metadata.prompt`` (default: the tokens joined).
        logit_label: What the ``logits`` node's ``clerp`` names (the metric).
        atlas: Where a neuron atlas of the model is (:mod:`tl_attnonly.atlas`'s site: a URL or
            a path relative to the graph's viewer as a string, or a folder as a ``Path``, which
            becomes its ``file://`` URI): each neuron (and neuron-head) node links to its page
            (``{atlas}/neuron.html#L{l}N{i}``) and each MLP layer node to its layer's
            (``{atlas}/layer_{l}.html``), under ``vis_link`` (the field Neuronpedia's viewer
            opens; :func:`~.atlas_links.atlas_page`).

    Returns:
        ``{"metadata", "qParams", "nodes", "links"}``.

    Raises:
        ValueError: For a malformed slug, or ``prompt_tokens`` that do not fit the classes.
    """
    if not _SLUG.match(slug):
        raise ValueError(
            f"slug {slug!r} must be letters, digits, '_', '.' and '-' (it names the file "
            f"{slug}.json), starting with a letter or digit."
        )
    graph: HeadGraph = circuit.scores.graph
    classes = graph.positions
    if classes is None:
        tokens = list(prompt_tokens) if prompt_tokens is not None else ["(every position)"]
        if not tokens:
            raise ValueError("prompt_tokens is empty: give the prompt's tokens, or None.")
    else:
        tokens = list(prompt_tokens) if prompt_tokens is not None else list(classes)
        if len(tokens) != len(classes):
            raise ValueError(
                f"This circuit's graph is resolved by {len(classes)} position classes "
                f"{list(classes)}: give one prompt_tokens entry per class (or None for their "
                f"names), not {len(tokens)}."
            )

    class_ctx = {name: c for c, name in enumerate(classes or ())}

    def ctx(position: str | None) -> int:
        return len(tokens) - 1 if position is None else class_ctx[position]

    roles = _node_roles(graph)
    frame = circuit.scores.frame(circuit.mask)
    positions = frame["position"] if classes is not None else [None] * len(frame)
    links: dict[tuple[str, str, int], dict[str, float]] = {}
    for src, dst, inp, pos, s in zip(
        frame.source, frame.target, frame.input, positions, frame.score, strict=True
    ):
        by_input = links.setdefault((src, dst, ctx(pos)), {})
        key = inp or "resid"
        by_input[key] = by_input.get(key, 0.0) + float(s)
    used = {(src, c) for src, _, c in links} | {(dst, c) for _, dst, c in links}
    if not any(label == LOGITS for label, _ in used):
        used.add((LOGITS, len(tokens) - 1))
    if not any(label == EMBED for label, _ in used):
        used.add((EMBED, len(tokens) - 1))

    def node_id(label: str, c: int) -> str:
        return f"{label}_{c}"

    def sort_key(item: tuple[str, int]) -> tuple:
        role = roles[item[0]]
        row = -1 if role["layer"] == "E" else int(role["layer"])
        return (item[1], row, role["feature"], item[0])

    nodes = []
    for label, c in sorted(used, key=sort_key):
        role = roles[label]
        is_logit = label == LOGITS
        nodes.append({
            "node_id": node_id(label, c),
            "feature": role["feature"],
            "layer": role["layer"],
            "ctx_idx": c,
            "feature_type": role["feature_type"],
            "token_prob": 1.0 if is_logit else 0.0,
            "is_target_logit": is_logit,
            "run_idx": 0,
            "reverse_ctx_idx": 0,
            "jsNodeId": node_id(label, c),
            "clerp": f'Output "{logit_label}" (p=1.000)' if is_logit else role["clerp"],
            "influence": None,
            "activation": None,
        })  # fmt: skip
        page = None if atlas is None else atlas_page(label, atlas)
        if page is not None:
            nodes[-1]["vis_link"] = page
    link_list = [
        {
            "source": node_id(src, c),
            "target": node_id(dst, c),
            "weight": sum(by_input.values()),
            "inputs": by_input,
        }
        for (src, dst, c), by_input in links.items()
    ]
    metadata = {
        "slug": slug,
        "scan": scan,
        "transcoder_list": [],
        "prompt_tokens": tokens,
        "prompt": prompt if prompt is not None else "".join(tokens),
        "info": {
            "description": (
                f"Circuit of {len(frame)} edges (faithfulness {circuit.faithfulness:.4g}); "
                "nodes are attention heads, MLP neurons or layers, the embeddings and the "
                "logits (the task's metric); link weights are edge attribution scores."
            ),
            "generator": {"name": "tl-attnonly", "version": _version()},
        },
        "generation_settings": {
            "method": circuit.scores.method,
            "faithfulness": float(circuit.faithfulness),
            "metric_clean": float(circuit.metric_clean),
            "metric_corrupted": float(circuit.metric_corrupted),
            "metric_circuit": float(circuit.metric_circuit),
            "position_classes": list(classes) if classes is not None else None,
        },
    }
    out = {
        "metadata": metadata,
        "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "",
                    "sg_pos": ""},
        "nodes": nodes,
        "links": link_list,
    }  # fmt: skip
    if path is not None:
        _write_graph_files(out, Path(path))
    return out


def _write_graph_files(graph_json: dict[str, Any], directory: Path) -> None:
    """``{slug}.json`` and the ``graph-metadata.json`` entry circuit-tracer's server lists."""
    directory.mkdir(parents=True, exist_ok=True)
    meta = graph_json["metadata"]
    (directory / f"{meta['slug']}.json").write_text(json.dumps(graph_json), encoding="utf-8")
    index_file = directory / GRAPH_METADATA_NAME
    index = json.loads(index_file.read_text(encoding="utf-8")) if index_file.exists() else {}
    graphs = [g for g in index.get("graphs", []) if g.get("slug") != meta["slug"]]
    entry = {k: meta[k] for k in ("slug", "scan", "transcoder_list", "prompt_tokens", "prompt")}
    index_file.write_text(json.dumps({"graphs": [*graphs, entry]}, indent=2), encoding="utf-8")


__all__ = [
    "GRAPH_METADATA_NAME",
    "MIB_LEVELS",
    "circuit_to_graph_json",
    "circuit_to_mib",
    "mib_names",
]
