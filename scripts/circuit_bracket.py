"""The bracket-matching circuit of the bundled model, over attention heads and neuron-heads.

Task: after ``"    return{a}({b}"`` the bundled model predicts ``")"``; after
``"    return{a}[{b}"`` it predicts ``"]"``. Metric: mean logit difference
``logit(")") - logit("]")`` at the last position; clean = round bracket, corrupted = square
bracket (same lengths).

Prints (figures quoted in docs/open_questions.md):

1. the metric on clean and corrupted inputs;
2. faithfulness of EAP circuits of several sizes (exact circuit runs), for EAP and EAP-IG;
3. the total |EAP score| on gate edges and on value edges into neuron-heads;
4. the gate/value split of the top neurons' incoming circuit edges (exact);
5. the path-patching gate/value split of ``L0H0 -> every layer-0 neuron``;
6. what plain neuron tools give: attribution patching of ``hook_post`` (one number per neuron)
   and how many of its top neurons the circuit contains;
7. :func:`~tl_attnonly.analysis.discover_circuit` with its defaults (coarse graph, EAP-IG ranked
   by signed effect, sweep to faithfulness 0.8, pruning, named neurons) and its evidence
   (``Circuit.report()``).

Usage::

    python scripts/circuit_bracket.py [--examples 112] [--threads 2] [--discover-only]
"""

from __future__ import annotations

import argparse
import time

import torch

import tl_attnonly
from tl_attnonly.analysis import (
    circuit_gate_value_split,
    circuit_metrics,
    discover_circuit,
    edge_attribution_scores,
    faithfulness,
    logit_diff_metric,
    mask_size,
    path_gate_value_split,
    prune,
)
from tl_attnonly.bundled import load_bundled_model

CALLEES = [" x", " self", " data", " key", " name", " args", " result", " path", " line", " value",
           " i", " n", " obj", " f"]  # fmt: skip
ARGS = ["x", "self", "data", "key", "name", "args", "result", "path"]


def bracket_task(model, n_examples: int | None = None):
    """Clean/corrupted tokens and the metric of the bracket task (all prompts one length)."""
    clean = [f"    return{a}({b}" for a in CALLEES for b in ARGS]
    corrupted = [f"    return{a}[{b}" for a in CALLEES for b in ARGS]
    if n_examples is not None:
        step = max(1, len(clean) // n_examples)
        clean, corrupted = clean[::step][:n_examples], corrupted[::step][:n_examples]
    clean_tokens, corrupted_tokens = model.to_tokens(clean), model.to_tokens(corrupted)
    if clean_tokens.shape != corrupted_tokens.shape:
        raise RuntimeError("The tokenizer split the prompts unevenly; pick other names.")
    n = clean_tokens.shape[0]
    round_, square = model.to_single_token(")"), model.to_single_token("]")
    metric = logit_diff_metric(torch.full((n,), round_), torch.full((n,), square))
    return clean_tokens, corrupted_tokens, metric


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=112)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="*", default=[25, 50, 100, 200, 400, 800])
    parser.add_argument(
        "--discover-only", action="store_true", help="only step 7 (discover_circuit defaults)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model = tl_attnonly.convert(load_bundled_model())
    clean, corrupted, metric = bracket_task(model, args.examples)
    n, pos = clean.shape
    print(f"bundled model (tiny-stdlib-silu, fp32), {n} prompts of {pos} tokens")
    if args.discover_only:
        _discover(model, clean, corrupted, metric)
        print(f"\ntotal time {time.perf_counter() - start:.0f} s ({args.threads} threads)")
        return

    scores = {}
    for method in ("eap", "eap-ig"):
        scores[method] = edge_attribution_scores(
            model, clean, corrupted, metric, method=method, ig_steps=5, batch_size=64,
            progress=False,
        )  # fmt: skip
    es = scores["eap"]
    print(f"metric: clean {es.metric_clean:.3f}, corrupted {es.metric_corrupted:.3f}")
    print(f"graph: {es.graph.n_edges():,} edges")

    print("\nfaithfulness of the top-n circuits (exact circuit runs)")
    print("| top n | edges after dropping dangling | EAP | EAP-IG |")
    print("|---|---|---|---|")
    masks = {m: [prune(scores[m], top_n=n) for n in args.sizes] for m in scores}
    values = {
        m: circuit_metrics(model, masks[m], clean, corrupted, metric, batch_size=64) for m in scores
    }
    for i, n in enumerate(args.sizes):
        f = {m: faithfulness(values[m][i], es.metric_clean, es.metric_corrupted) for m in scores}
        print(f"| {n} | {mask_size(masks['eap'][i])} | {f['eap']:.3f} | {f['eap-ig']:.3f} |")

    frame = es.frame()
    into = frame[frame.target_kind == "neuron"]
    gate_total = into[into.input == "gate"].score.abs().sum()
    value_total = into[into.input == "value"].score.abs().sum()
    print(
        f"\nsum of |EAP score| into neuron-heads: gate edges {gate_total:.3f}, value edges "
        f"{value_total:.3f}"
    )

    pick = args.sizes[len(args.sizes) // 2]
    mask = prune(es, top_n=pick)
    kept = es.frame(mask)
    print(f"\ncircuit top_n={pick}: {len(kept)} edges; nodes by kind:")
    nodes = sorted(set(kept.source) | set(kept.target))
    attn = [n for n in nodes if "H" in n]
    neurons = [n for n in nodes if "N" in n]
    print(f"  attention heads ({len(attn)}): {', '.join(attn)}")
    print(f"  neurons: {len(neurons)} (layer 0: {sum(n.startswith('L0') for n in neurons)}, "
          f"layer 1: {sum(n.startswith('L1') for n in neurons)})")  # fmt: skip
    ranked = (
        kept[kept.target_kind == "neuron"].groupby("target").score.apply(lambda s: s.abs().sum())
    ).sort_values(ascending=False)
    split = circuit_gate_value_split(
        model, mask, clean, corrupted, metric, neurons=list(ranked.index[:6]), batch_size=64,
        progress=False,
    )  # fmt: skip
    print("\ngate/value split of the top neurons' incoming circuit edges (metric units)")
    print(split.to_string(index=False, float_format=lambda v: f"{v:.4f}"))

    l0_neurons = [f"L0N{i}" for i in range(model.cfg.d_mlp)]
    pp = path_gate_value_split(model, clean, corrupted, ["L0H0"], l0_neurons, _plain(metric))
    print(
        "\npath patching L0H0 -> all layer-0 neurons (clean L0H0 into the corrupted run): "
        f"gate {pp['gate']:.3f}, value {pp['value']:.3f}, both {pp['both']:.3f}, "
        f"interaction {pp['interaction']:.3f}"
    )

    # plain neuron tools: attribution patching of each neuron's output (hook_post)
    from tl_attnonly.analysis.discovery.node_circuits import ModelInputs, node_attribution_scores

    node = node_attribution_scores(
        model, ModelInputs(clean), ModelInputs(corrupted), lambda lg, _: _plain(metric)(lg)
    )
    neuron_scores = node.scores[[lab for lab in node.scores.index if "N" in lab]]
    top_plain = list(neuron_scores.abs().sort_values(ascending=False).index[:20])
    inside = sum(n in neurons for n in top_plain)
    print(
        f"\nplain neuron attribution (hook_post): {inside} of its top 20 neurons are in the "
        f"circuit; its top 5: {', '.join(top_plain[:5])}"
    )
    _discover(model, clean, corrupted, metric)
    print(f"\ntotal time {time.perf_counter() - start:.0f} s ({args.threads} threads)")


def _discover(model, clean, corrupted, metric) -> None:
    """Step 7: ``discover_circuit`` with its defaults, and its evidence."""
    t = time.perf_counter()
    circuit = discover_circuit(model, clean, corrupted, metric, batch_size=64, progress=False)
    print(f"\n## discover_circuit with its defaults ({time.perf_counter() - t:.0f} s)")
    print(circuit.report())


def _plain(metric):
    """The batch-indexed metric as a plain ``metric(logits)`` over the whole dataset."""

    def plain(logits: torch.Tensor) -> torch.Tensor:
        return metric(logits, torch.arange(logits.shape[0]))

    return plain


if __name__ == "__main__":
    main()
