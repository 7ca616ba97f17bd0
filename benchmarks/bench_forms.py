"""Forward time of the original, structured and literal forms of the bundled model, one run.

The paper's open question (1): how much slower is an attention-only model? Three forms of the
bundled model (2 layers, d_model 128, 4 heads, d_mlp 512, d_vocab 3072, SiLU, fp32):

- original: TransformerLens's ``HookedTransformer``;
- structured: ``tl_attnonly.convert(model)`` (fused path, and head path: a hook on every pattern);
- literal: ``tl_attnonly.convert(model, form="literal")`` (plain softmax attention everywhere,
  omega masks in the weights, residual width D' = D + 1 + max_len).

Prints medians of interleaved repeats (``torch.inference_mode``) and ratios to the original,
measured in the same run, for a few sequence lengths.

Run: ``python benchmarks/bench_forms.py [--repeats 5] [--threads 2] [--lengths 16 64 128]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tl_attnonly
from tl_attnonly.bundled import load_bundled_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="*", default=[16, 64, 128])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    original = load_bundled_model()
    structured = tl_attnonly.convert(original)
    literal = tl_attnonly.convert(original, form="literal")
    g = torch.Generator().manual_seed(0)
    print(
        f"bundled model (tiny-stdlib-silu, fp32), batch {args.batch}, {args.threads} threads, "
        f"medians of {args.repeats} interleaved repeats"
    )
    print("| tokens | original | structured | structured (head path) | literal | structured / "
          "original | head path / original | literal / original |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")

    def every_pattern(pattern, hook):
        return pattern

    head_hooks = [(f"blocks.{li}.mlp.hook_pattern", every_pattern) for li in range(2)]
    for n in args.lengths:
        tokens = torch.randint(0, original.cfg.d_vocab, (args.batch, n), generator=g)
        runs = {
            "original": lambda t=tokens: original(t),
            "structured": lambda t=tokens: structured(t),
            "head": lambda t=tokens: structured.run_with_hooks(t, fwd_hooks=head_hooks),
            "literal": lambda t=tokens: literal(t),
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        with torch.inference_mode():
            for fn in runs.values():
                fn()  # warm up
            for _ in range(args.repeats):
                for name, fn in runs.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"| {n} | {med['original'] * 1e3:.1f} ms | {med['structured'] * 1e3:.1f} ms | "
            f"{med['head'] * 1e3:.1f} ms | {med['literal'] * 1e3:.1f} ms | "
            f"{med['structured'] / med['original']:.2f} | {med['head'] / med['original']:.2f} | "
            f"{med['literal'] / med['original']:.1f} |"
        )


if __name__ == "__main__":
    main()
