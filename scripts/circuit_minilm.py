"""Node circuits and neuron-head summaries on the real all-MiniLM-L6-v2 (needs the [minilm] extra).

MiniLM is a BERT-style encoder (LayerNorm after each residual addition), so circuits are sets of
nodes (:mod:`tl_attnonly.analysis.discovery.node_circuits`). Metric: the cosine similarity of the
mean-pooled embeddings of two paraphrases; the corrupted input swaps one word of the first
sentence (same token count), which lowers the similarity.

Prints the metric on clean and corrupted pairs, the top nodes by attribution, the faithfulness of
node circuits of several sizes, the gate/value split of the circuit's top neurons, and the
summaries' most token-selective neuron-heads over the bundled sentences.

Usage::

    python scripts/circuit_minilm.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from importlib.resources import files

import torch

from tl_attnonly.analysis.discovery.node_circuits import (
    ModelInputs,
    discover_node_circuit,
    node_attribution_scores,
    node_circuit_metrics,
    pair_cosine_metric,
)
from tl_attnonly.analysis.summaries import summarize_neuron_heads
from tl_attnonly.hooked.encoder import convert_encoder
from tl_attnonly.minilm import load_minilm

#: (sentence, paraphrase, sentence with one word swapped).
PAIRS = [
    ("The cat sat on the mat.", "A cat was sitting on a rug.", "The car sat on the mat."),
    (
        "He plays the guitar every evening.",
        "Every night he plays music on his guitar.",
        "He plays the market every evening.",
    ),
    (
        "The river flooded the small town.",
        "Floods hit the village by the river.",
        "The river flooded the small market.",
    ),
    (
        "She is baking bread in the kitchen.",
        "Bread is being baked by her at home.",
        "She is baking code in the kitchen.",
    ),
]


def pair_inputs(tokenizer) -> tuple[ModelInputs, ModelInputs]:
    """Rows (sentence, paraphrase) per pair; the corrupted rows swap the first sentence."""
    clean_rows, corrupted_rows = [], []
    for a, b, swapped in PAIRS:
        ea, eb, es = (tokenizer(x, return_tensors="pt")["input_ids"][0] for x in (a, b, swapped))
        if len(ea) != len(es):
            raise RuntimeError(f"{swapped!r} tokenises to a different length than {a!r}.")
        clean_rows += [ea, eb]
        corrupted_rows += [es, eb]
    width = max(len(r) for r in clean_rows)

    def pad(rows):
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros_like(tokens)
        for i, row in enumerate(rows):
            tokens[i, : len(row)], mask[i, : len(row)] = row, 1
        return ModelInputs(tokens, torch.zeros_like(tokens), mask)

    return pad(clean_rows), pad(corrupted_rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="*", default=[10, 30, 100, 300, 1000])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    hooked, tokenizer = load_minilm()
    model = convert_encoder(hooked)
    clean, corrupted = pair_inputs(tokenizer)
    metric = pair_cosine_metric()
    print(
        f"all-MiniLM-L6-v2 converted (K = {model.n_heads_per_neuron} heads per GELU neuron), "
        f"{len(PAIRS)} sentence pairs, metric: mean cosine similarity of the pooled embeddings"
    )
    scores = node_attribution_scores(model, clean, corrupted, metric)
    print(f"metric: clean {scores.metric_clean:.4f}, corrupted {scores.metric_corrupted:.4f}")
    ranked = scores.scores.abs().sort_values(ascending=False, kind="stable")
    print("top 10 nodes by |attribution|:", ", ".join(ranked.index[:10]))
    circuits = [set(ranked.index[:n]) for n in args.sizes]
    values = node_circuit_metrics(model, circuits, clean, corrupted, metric)
    denom = scores.metric_clean - scores.metric_corrupted
    print("| nodes kept | attention heads | neurons | faithfulness |")
    print("|---|---|---|---|")
    for n, circuit, value in zip(args.sizes, circuits, values, strict=True):
        heads = sum("H" in x for x in circuit)
        neurons = sum("N" in x for x in circuit)
        print(f"| {n} | {heads} | {neurons} | {(value - scores.metric_corrupted) / denom:.3f} |")
    circuit = discover_node_circuit(
        model, clean, corrupted, metric, top_n=args.sizes[2], max_gate_value_neurons=5
    )
    print(f"\ngate/value split of the top neurons of the {args.sizes[2]}-node circuit")
    print(circuit.gate_value.to_string(index=False, float_format=lambda v: f"{v:.5f}"))
    sentences = [
        s for s in files("tl_attnonly").joinpath("data/sentences.txt").read_text().splitlines() if s
    ]
    summary = summarize_neuron_heads(model, sentences, k=5, token_stats=False, progress=False)
    fire = summary.firing_fraction()
    print(
        f"\nsummaries over {summary.n_rows} bundled sentences ({summary.n_positions} tokens): "
        f"median firing fraction of a neuron-head, per layer: "
        + ", ".join(f"{float(fire[li].median()):.3f}" for li in range(model.cfg.n_layers))
    )
    print(f"total time {time.perf_counter() - start:.0f} s ({args.threads} threads)")


if __name__ == "__main__":
    main()
