"""Exact activation patching of neuron-heads: one head per forward pass vs batched, one run.

A GPT-2-small-shaped model with few layers (d_model 768, 12 heads, d_mlp 3072, LayerNorm, random
weights, a small vocabulary so that the blocks dominate), converted. The same random subset of
``--heads`` neuron-heads (drawn from every layer) is patched (clean ``z`` into the corrupted run,
all positions) three ways, measured in the same process:

- ``one per forward``: ``get_act_patch_neuron_heads(..., patches_per_pass=1)``, i.e.
  TransformerLens's ``generic_activation_patch``: a full hooked forward pass per head;
- ``hooked, batched``: ``run_patches`` (``patches_per_pass`` copies of the batch per pass, each
  with its own ``hook_z`` edit; passes start at the patched layer);
- ``batched (output deltas)``: ``get_act_patch_outputs(level="head")``: the corrupted residual
  stream after the patched layer plus each head's rank-1 change, run through the later layers.

The corrupted input differs from the clean one at one position (``--corrupt-pos``, default the
middle): positions before it are the same in every patched run, and the batched method runs only
the positions from there on (a frozen key-value cache of the prefix), so the speed-up grows with
it. The script checks that the three agree (max |difference| printed) and prints wall-clock and
process CPU times and their ratios. Wall-clock timings on a shared machine are noisy (one forward
per head suffers most from contention); with ``--threads 1`` the CPU-time ratio is steadier.

Run: ``python benchmarks/bench_patching.py [--layers 2] [--batch 2] [--pos 16] [--heads 128]
[--act silu] [--threads 2]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")  # TransformerLens's per-sweep bars, before tqdm loads

import argparse  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
from transformer_lens import HookedTransformer, HookedTransformerConfig  # noqa: E402

from tl_attnonly import convert  # noqa: E402
from tl_attnonly.analysis import (  # noqa: E402
    get_act_patch_neuron_heads,
    get_act_patch_outputs,
    run_patches,
)
from tl_attnonly.hooks import HeadRef, head_names_filter, neuron_act_name  # noqa: E402

warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-mlp", type=int, default=3072)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--pos", type=int, default=16)
    parser.add_argument("--heads", type=int, default=128, help="random neuron-heads patched")
    parser.add_argument("--act", default="silu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--patches-per-pass", type=int, default=64)
    parser.add_argument(
        "--corrupt-pos", type=int, default=None, help="the corrupted position (default: pos // 2)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    cfg = HookedTransformerConfig(
        n_layers=args.layers,
        d_model=768,
        n_heads=12,
        d_head=64,
        d_mlp=args.d_mlp,
        d_vocab=args.vocab,
        n_ctx=max(args.pos, 16),
        act_fn=args.act,
        normalization_type="LN",
        seed=0,
        device="cpu",
    )
    model = convert(HookedTransformer(cfg).eval())
    clean = torch.randint(0, args.vocab, (args.batch, args.pos))
    corrupted = clean.clone()
    where = args.pos // 2 if args.corrupt_pos is None else args.corrupt_pos
    corrupted[:, where] = (clean[:, where] + 1) % args.vocab
    target = torch.arange(5)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, target].mean()

    n = model.n_neuron_heads
    picks = torch.randperm(args.layers * n)[: args.heads].sort().values.tolist()
    refs = [HeadRef("neuron", i // n, i % n) for i in picks]
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(clean, names_filter=head_names_filter("z"))

    def one_per_forward() -> torch.Tensor:
        out = []
        for ref in refs:
            value = get_act_patch_neuron_heads(
                model, corrupted, clean_cache, metric, "z", layers=[ref.layer],
                heads=[ref.head], patches_per_pass=1, level="head",
            )  # fmt: skip
            out.append(float(value.item()))
        return torch.tensor(out, dtype=torch.float64)

    def hooked_batched() -> torch.Tensor:
        def patch(head: int):
            def fn(z: torch.Tensor, clean_z: torch.Tensor) -> None:
                z[:, :, head] = clean_z[:, :, head]

            return fn

        patches = [[(neuron_act_name("z", ref.layer), patch(ref.head))] for ref in refs]
        return run_patches(
            model, corrupted, clean_cache, metric, patches,
            patches_per_pass=args.patches_per_pass, progress=False,
        )  # fmt: skip

    def deltas() -> torch.Tensor:
        return get_act_patch_outputs(
            model, corrupted, clean_cache, metric, refs, level="head",
            patches_per_pass=args.patches_per_pass, progress=False,
        )[0]  # fmt: skip

    results, times, cpu = {}, {}, {}
    with torch.inference_mode():
        deltas()  # warm-up
        for name, fn in [
            ("one per forward", one_per_forward),
            ("hooked, batched", hooked_batched),
            ("batched (output deltas)", deltas),
        ]:
            start, start_cpu = time.perf_counter(), time.process_time()
            results[name] = fn()
            times[name] = time.perf_counter() - start
            cpu[name] = time.process_time() - start_cpu

    print(
        f"config: {args.layers} layers, d_model 768, 12 heads, d_mlp {args.d_mlp}, vocab "
        f"{args.vocab}, act {args.act} (K = {model.n_heads_per_neuron}), batch {args.batch}, "
        f"pos {args.pos}, corrupted position {where}, {len(refs)} random neuron-heads of all "
        f"layers, patches_per_pass "
        f"{args.patches_per_pass}, fp32, CPU, {args.threads} threads, torch "
        f"{torch.__version__}; one run"
    )
    base = results["one per forward"]
    print(
        "| method | time (s) | ms per head | speed-up | CPU time (s) | speed-up in CPU time | "
        "max |Δ| vs one per forward |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, seconds in times.items():
        diff = (results[name].double() - base).abs().max().item()
        print(
            f"| {name} | {seconds:.2f} | {1000 * seconds / len(refs):.2f} | "
            f"{times['one per forward'] / seconds:.1f}x | {cpu[name]:.2f} | "
            f"{cpu['one per forward'] / cpu[name]:.1f}x | {diff:.1e} |"
        )


if __name__ == "__main__":
    main()
