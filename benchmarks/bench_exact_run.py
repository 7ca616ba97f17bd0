"""One exact circuit run against one plain forward pass of the same batch (issue 47, item 1).

On the coarse graph (every attention head with its ``q``/``k``/``v`` apart, every MLP layer one
node: ``discover_circuit``'s default), circuits of the ``--sizes`` largest edges by plain EAP
score (``prune(top_n=...)``; ``all``: every edge), each run ``--runs`` times in one
``circuit_metrics`` call with a shared :class:`~tl_attnonly.analysis.discovery.CorruptedRuns`
(as the sweep's and the pruning's calls do, so the corrupted run is made once, before the
timing). Printed, medians of ``--repeats`` interleaved measurements: the plain forward pass of
the clean batch (``model(tokens)``, logits), the time per exact run, and their ratio (the goal:
at most 1.5 on 2 CPU threads for SmolLM2's coarse graph).

Models: ``bundled`` (the bracket task of ``scripts/circuit_bracket.py``, 112 prompts) and
``smollm2`` (SmolLM2-135M-Instruct, IOI: ``make_ioi_dataset``, ``--prompts`` prompts, ABC
corruption, seed 1; the ``[smollm2]`` extra), a ``HookedTransformer`` converted on TL 3.x, a
converted ``TransformerBridge`` on 4.x (``--bridge``: the bridge on 3.x too).

Run: ``python benchmarks/bench_exact_run.py [--model bundled|smollm2] [--sizes 100 1000 all]
[--runs 4] [--repeats 3] [--prompts 16] [--threads 2] [--bridge]``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import tl_attnonly
from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER
from tl_attnonly.analysis import edge_attribution_scores, prune
from tl_attnonly.analysis.discovery.pruning import mask_size
from tl_attnonly.analysis.discovery.run_metrics import circuit_metrics
from tl_attnonly.analysis.discovery.search import coarse_nodes
from tl_attnonly.analysis.task import CorruptedRuns

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))


def task(name: str, prompts: int, bridge: bool):
    """The converted model, clean and corrupted tokens, the metric and a description."""
    if name == "smollm2":
        from tl_attnonly.analysis import make_ioi_dataset
        from tl_attnonly.smollm2 import load_smollm2, load_smollm2_bridge

        loaded = load_smollm2_bridge() if bridge else load_smollm2()
        data = make_ioi_dataset(loaded, prompts, corruption="abc", seed=1)
        desc = f"SmolLM2-135M-Instruct IOI, {prompts} prompts x {data.tokens.shape[1]} tokens, ABC"
        return tl_attnonly.convert(loaded), data.tokens, data.corrupted_tokens, \
            data.additive_metric(), desc  # fmt: skip
    from circuit_bracket import bracket_task

    from tl_attnonly.bundled import load_bundled_bridge, load_bundled_model

    loaded = load_bundled_bridge() if bridge else load_bundled_model()
    clean, corrupted, metric = bracket_task(loaded)
    desc = f"bundled model, bracket task, {clean.shape[0]} prompts x {clean.shape[1]} tokens"
    return tl_attnonly.convert(loaded), clean, corrupted, metric, desc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["bundled", "smollm2"], default="bundled")
    parser.add_argument("--sizes", nargs="+", default=["100", "1000", "all"])
    parser.add_argument("--runs", type=int, default=4, help="exact runs per timed call")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16, help="smollm2: IOI prompts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bridge", action="store_true", help="TransformerBridge (4.x: always)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    bridge = args.bridge or not HAS_HOOKED_TRANSFORMER
    model, clean, corrupted, metric, desc = task(args.model, args.prompts, bridge)
    nodes = coarse_nodes(model)
    scores = edge_attribution_scores(model, clean, corrupted, metric, method="eap", nodes=nodes,
                                     progress=False)  # fmt: skip
    n_edges = scores.graph.n_edges()
    kind = "TransformerBridge" if bridge else "HookedTransformer"
    tl_version = importlib.metadata.version("transformer-lens")
    print(f"config: {desc}; coarse graph, {n_edges:,} edges; {kind} (TransformerLens "
          f"{tl_version}), fp32, {args.threads} threads, {platform.machine()}; "
          f"{args.runs} runs per call, medians of {args.repeats}")  # fmt: skip
    masks = {}
    for size in args.sizes:
        top = n_edges if size == "all" else min(int(size), n_edges)
        masks[size] = prune(scores, top_n=top, absolute=True)
    runs = CorruptedRuns()
    with torch.no_grad():  # warm-up; the first call also makes the corrupted runs
        model(clean)
        circuit_metrics(model, [masks[args.sizes[0]]], clean, corrupted, metric, nodes=nodes,
                        corrupted_runs=runs)  # fmt: skip
    forward: list[float] = []
    per_run: dict[str, list[float]] = {size: [] for size in args.sizes}
    for _ in range(args.repeats):
        with torch.no_grad():
            start = time.perf_counter()
            model(clean)
            forward.append(time.perf_counter() - start)
        for size, mask in masks.items():
            start = time.perf_counter()
            circuit_metrics(model, [mask] * args.runs, clean, corrupted, metric, nodes=nodes,
                            corrupted_runs=runs)  # fmt: skip
            per_run[size].append((time.perf_counter() - start) / args.runs)
    fwd = statistics.median(forward)
    print(f"forward pass: {1000 * fwd:.1f} ms")
    for size, mask in masks.items():
        run = statistics.median(per_run[size])
        print(f"circuit of top {size} edges ({mask_size(mask):,} kept): {1000 * run:.1f} ms per "
              f"exact run, {run / fwd:.2f}x the forward pass")  # fmt: skip


if __name__ == "__main__":
    main()
