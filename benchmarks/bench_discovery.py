"""Circuit discovery at GPT-2-small size on CPU: the two-stage recipe within a memory budget.

A GPT-2-small-shaped model (12 layers, d_model 768, 12 heads, d_mlp 3072, LayerNorm, GELU, random
weights) with a 1000-token vocabulary, converted (K = 4 heads per neuron, neuron-level graph).
Its full head graph has 1.26e9 edges: ``edge_attribution_scores`` refuses it before any work
(``MemoryError``, 4.7 GiB of fp32 scores against the default 1 GiB budget). The two stages of
``discover_circuit(..., n_nodes=N, top_n=T)``, timed apart: ``top_nodes`` ranks all 37,008 nodes by
node attribution; ``discover_circuit(..., nodes=...)`` scores the edges among the top ``N``,
prunes to ``T`` edges, runs the circuit exactly and splits the gate and value of 4 neurons.
Printed: the time of each stage, the peak resident memory above the loaded model (Linux
``VmHWM`` after resetting it), and PASS/FAIL against ``--budget-s`` and ``--budget-mib``.
``--mlp-rest`` adds each layer's other neurons as one node ``L{l}MLP``. With
``--stream N``, ``top_edges`` also streams the top ``N`` of all 1.26e9 edges (timed apart) and
their circuit runs exactly on the restricted graph of their nodes.

Run: ``python benchmarks/bench_discovery.py [--threads 2] [--n-nodes 400] [--top-n 200]
[--stream 1000]``.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

from tl_attnonly import convert
from tl_attnonly.analysis import (
    HeadGraph,
    circuit_metric,
    discover_circuit,
    edge_attribution_scores,
    logit_diff_metric,
    mask_size,
    top_edges,
    top_nodes,
)

warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (0 where there is none)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-mlp", type=int, default=3072)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--act", default="gelu")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--pos", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--n-nodes", type=int, default=400)
    parser.add_argument("--top-n", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=600.0)
    parser.add_argument("--budget-mib", type=float, default=2048.0)
    parser.add_argument(
        "--mlp-rest", action="store_true",
        help="keep each layer's other neurons as one node L{l}MLP (discover_circuit mlp_rest)",
    )  # fmt: skip
    parser.add_argument(
        "--stream", type=int, default=0, metavar="N",
        help="also stream the top N edges of the full graph (top_edges), timed apart",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = HookedTransformerConfig(
        n_layers=args.layers, d_model=768, n_heads=12, d_head=64, d_mlp=args.d_mlp,
        d_vocab=args.vocab, n_ctx=max(64, args.pos), act_fn=args.act, normalization_type="LN",
        seed=0, device="cpu",
    )  # fmt: skip
    model = convert(HookedTransformer(cfg).eval(), share_weights=True)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, args.vocab, (args.prompts, args.pos), generator=g)
    corrupted = clean.clone()
    corrupted[:, args.pos // 2 :] = torch.randint(
        0, args.vocab, (args.prompts, args.pos - args.pos // 2), generator=g
    )
    correct, wrong = torch.randint(0, args.vocab, (2, args.prompts), generator=g)
    metric = logit_diff_metric(correct, wrong)
    n_edges = HeadGraph(model).n_edges()
    print(
        f"config: {args.layers} layers, d_model 768, 12 heads, d_mlp {args.d_mlp}, act "
        f"{args.act} (K={model.n_heads_per_neuron}), vocab {args.vocab}, fp32, "
        f"{args.prompts} prompts x {args.pos} tokens, batch {args.batch_size}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"full graph: {n_edges:,} edges (neuron level)")
    try:
        edge_attribution_scores(model, clean, corrupted, metric, progress=False)
        print("full graph: scored (unexpected)")
    except MemoryError as err:
        print(f"full graph: refused before any work: {str(err)[:90]}...")

    _reset_peak()
    base = _status("VmRSS")
    times = {}
    t0 = time.perf_counter()
    nodes, _ = top_nodes(
        model, clean, corrupted, metric, args.n_nodes, batch_size=args.batch_size, progress=False
    )
    times["node attribution"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    circuit = discover_circuit(
        model, clean, corrupted, metric, nodes=nodes, top_n=args.top_n, mlp_rest=args.mlp_rest,
        batch_size=args.batch_size, max_gate_value_neurons=4, progress=True,
    )  # fmt: skip
    times["edges + prune + circuit run + gate/value (4 neurons)"] = time.perf_counter() - t0
    peak = _status("VmHWM") - base
    t0 = time.perf_counter()
    full = circuit_metric(
        model, circuit.graph.full_mask(True), clean, corrupted, metric,
        nodes=circuit.graph.node_labels(), batch_size=args.batch_size,
    )  # fmt: skip
    times["one exact circuit run (all edges among the kept nodes)"] = time.perf_counter() - t0
    print(
        f"restricted graph: {len(circuit.graph.node_labels())} nodes, "
        f"{circuit.graph.n_edges():,} edges; circuit: "
        f"{mask_size(circuit.mask)} edges, faithfulness {circuit.faithfulness:.3f} (all kept "
        f"nodes' edges: {(full - circuit.metric_corrupted) / (circuit.metric_clean - circuit.metric_corrupted):.3f})"  # noqa: E501
    )
    for name, seconds in times.items():
        print(f"  {name}: {seconds:.1f} s")
    total = sum(v for k, v in times.items() if not k.startswith("one exact"))
    ok = total <= args.budget_s and peak <= args.budget_mib * 2**20
    print(
        f"two-stage total {total:.1f} s (budget {args.budget_s:.0f} s), peak memory above the "
        f"loaded model {peak / 2**20:.0f} MiB (budget {args.budget_mib:.0f} MiB): "
        f"{'PASS' if ok else 'FAIL'}"
    )
    if args.stream:
        _reset_peak()
        base = _status("VmRSS")
        t0 = time.perf_counter()
        top = top_edges(
            model, args.stream, clean, corrupted, metric, batch_size=args.batch_size, progress=True
        )
        seconds, peak_stream = time.perf_counter() - t0, _status("VmHWM") - base
        nodes, mask = top.restricted_mask(model)
        m = circuit_metric(model, mask, clean, corrupted, metric, nodes=nodes)
        print(
            f"streamed top {args.stream} of {top.n_scored:,} edges (top_edges): {seconds:.1f} s, "
            f"peak memory above the loaded model {peak_stream / 2**20:.0f} MiB; their circuit "
            f"({len(nodes)} nodes): faithfulness "
            f"{(m - top.metric_corrupted) / (top.metric_clean - top.metric_corrupted):.3f}"
        )
    if os.environ.get("BENCH_STRICT") and not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
