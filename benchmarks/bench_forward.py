"""Speed and memory of the structured form against the original model, measured in one run.

Builds a GPT-2-small-shaped model (12 layers, d_model 768, 12 heads, d_mlp 3072, d_vocab 50257)
with random weights, in a SiLU and a gelu_new variant, converts it, and prints ratios
converted / original for:

- forward (N = 128 tokens, batch 1 and 4), fused path and head path (a hook on every pattern);
- ``run_with_cache`` (every hook) time, and the memory the cache holds;
- conversion time (absolute, and relative to one forward pass);
- conversion peak memory / model size, copying and with ``share_weights=True`` (Linux; each
  measured in a fresh child process, see :func:`conversion_memory_in_child`).

Run: ``python benchmarks/bench_forward.py [--repeats 7] [--threads 2]``; blocks only (the
unembedding diluting nothing): ``--layers 4 --vocab 1000 --shapes 1x128 2x256 8x128 1x1024``;
gated MLPs (GeGLU at K = 4): ``--gated --act gelu_pytorch_tanh``; the fused path's compiled kernel
(``ConversionOptions(compiled=True)``, torch.compile; compiling happens in the warm-up calls):
``--compiled``.
Timings are medians over interleaved repeats; the ratios are what the README's performance
table reports.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from functools import partial

import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

from tl_attnonly import ConversionOptions, convert

warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")


def gpt2_small_config(
    act_fn: str, n_layers: int = 12, d_vocab: int = 50257, gated: bool = False
) -> HookedTransformerConfig:
    return HookedTransformerConfig(
        gated_mlp=gated,
        n_layers=n_layers,
        d_model=768,
        n_heads=12,
        d_head=64,
        d_mlp=3072,
        d_vocab=d_vocab,
        n_ctx=1024,
        act_fn=act_fn,
        normalization_type="LN",
        seed=0,
        device="cpu",
    )


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def compare(fn_a, fn_b, repeats: int) -> tuple[float, float]:
    """Median seconds of fn_a and fn_b, interleaved so drifts hit both equally."""
    fn_a(), fn_b()  # warm up
    a, b = [], []
    for _ in range(repeats):
        a += timed(fn_a, 1)
        b += timed(fn_b, 1)
    return statistics.median(a), statistics.median(b)


def cache_bytes(cache) -> int:
    if hasattr(cache, "stored_nbytes"):  # a derived cache: what it holds, deriving nothing
        return cache.stored_nbytes()
    seen, total = set(), 0
    for tensor in cache.values():
        key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def conversion_memory_ratio(original, share_weights: bool) -> float:
    """(model bytes + peak resident memory added while converting) / model bytes (Linux)."""
    model_bytes = sum(p.numel() * p.element_size() for p in original.parameters())
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset the peak (VmHWM) to the current resident size
    except OSError:
        return float("nan")
    base = _status_bytes("VmRSS")
    converted = convert(original, share_weights=share_weights)
    peak = _status_bytes("VmHWM")
    del converted
    return (model_bytes + peak - base) / model_bytes


#: The conversion-memory rows: copying, and sharing the original's tensors.
MEMORY_ROWS = ("copy", "share_weights=True")


def conversion_memory_in_child(
    act_fn: str, n_layers: int, d_vocab: int, gated: bool
) -> dict[str, float]:
    """:func:`conversion_memory_ratio` copying and sharing, each measured in a fresh process.

    In one long-lived process the figure is wrong: glibc raises its mmap threshold after large
    tensors are freed, so a later conversion reuses freed heap pages and the resident peak hardly
    grows (a second model measured 1.00x copying). A child with the threshold fixed
    (``MALLOC_MMAP_THRESHOLD_``) measures each model from a clean heap.
    """
    argv = ["--act", act_fn, "--layers", str(n_layers), "--vocab", str(d_vocab)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    child = subprocess.run(
        [sys.executable, __file__, *argv, *(["--gated"] if gated else []), "--memory-only"],
        env=env,
        capture_output=True,
        text=True,
    )
    if child.returncode != 0:
        raise RuntimeError(f"The conversion-memory child process failed:\n{child.stderr[-3000:]}")
    return json.loads(child.stdout.splitlines()[-1])


def _memory_only(act_fn: str, n_layers: int, d_vocab: int, gated: bool) -> None:
    """The child's side of :func:`conversion_memory_in_child`: one JSON line."""
    torch.manual_seed(0)
    original = HookedTransformer(gpt2_small_config(act_fn, n_layers, d_vocab, gated)).eval()
    ratios = {how: conversion_memory_ratio(original, how != "copy") for how in MEMORY_ROWS}
    print(json.dumps(ratios))


def bench(
    act_fn: str,
    repeats: int,
    n_layers: int,
    d_vocab: int,
    shapes: list[tuple[int, int]],
    gated: bool = False,
    compiled: bool = False,
) -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    original = HookedTransformer(gpt2_small_config(act_fn, n_layers, d_vocab, gated)).eval()
    memory = conversion_memory_in_child(act_fn, n_layers, d_vocab, gated)
    memory_rows = [
        (f"conversion peak memory / model size ({how})", 1.0, memory[how]) for how in MEMORY_ROWS
    ]
    t0 = time.perf_counter()
    converted = convert(original, conversion=ConversionOptions(compiled=compiled))
    conversion_s = time.perf_counter() - t0
    rows = []
    forward_1 = float("nan")
    with torch.inference_mode():
        for i, (batch, n) in enumerate(shapes):
            tokens = torch.randint(0, d_vocab, (batch, n))
            a, b = compare(partial(original, tokens), partial(converted, tokens), repeats)
            rows.append((f"forward, batch {batch}, N={n}", a, b))
            if i == 0:
                forward_1 = a
            hooks = [(lambda name: name.endswith("mlp.hook_pattern"), lambda x, hook: x)]
            a2, b2 = compare(
                partial(original, tokens),
                partial(converted.run_with_hooks, tokens, fwd_hooks=hooks),
                repeats,
            )
            rows.append((f"forward (head path), batch {batch}, N={n}", a2, b2))
        batch, n = shapes[0]
        tokens = torch.randint(0, d_vocab, (batch, n))
        a, b = compare(
            lambda: original.run_with_cache(tokens),
            lambda: converted.run_with_cache(tokens),
            repeats,
        )
        rows.append((f"run_with_cache, batch {batch}, N={n}", a, b))
        _, cache_a = original.run_with_cache(tokens)
        _, cache_b = converted.run_with_cache(tokens)
        mib_a, mib_b = cache_bytes(cache_a) / 2**20, cache_bytes(cache_b) / 2**20
        rows.append((f"cache memory (MiB), batch {batch}, N={n}", mib_a, mib_b))
    rows.append(("conversion (s) vs one forward", forward_1, conversion_s))
    return rows + memory_rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--act", nargs="*", default=["silu", "gelu_new"])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument(
        "--shapes", nargs="*", default=["1x128", "4x128"], help="batch x N, e.g. 2x256"
    )
    parser.add_argument(
        "--gated", action="store_true", help="gated MLPs (TL's GatedMLP: SwiGLU, GeGLU, ...)"
    )
    parser.add_argument(
        "--compiled", action="store_true", help="the fused path's torch.compile kernel"
    )
    parser.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_only:
        _memory_only(args.act[0], args.layers, args.vocab, args.gated)
        return
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes]
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} threads, {args.repeats} repeats, fp32, CPU, "
        f"{args.layers} layers, d_model 768, d_mlp 3072{' gated' if args.gated else ''}, "
        f"vocab {args.vocab}{', compiled kernel' if args.compiled else ''}"
    )
    print("| activation | measurement | original | converted | ratio |")
    print("|---|---|---|---|---|")
    for act_fn in args.act:
        for name, a, b in bench(
            act_fn, args.repeats, args.layers, args.vocab, shapes, args.gated, args.compiled
        ):  # one model pair alive at a time
            unit = "" if "MiB" in name or "(s)" in name or "size" in name else " s"
            print(f"| {act_fn} | {name} | {a:.4g}{unit} | {b:.4g}{unit} | {b / a:.2f} |")
        gc.collect()


if __name__ == "__main__":
    main()
