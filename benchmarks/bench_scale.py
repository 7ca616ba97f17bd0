"""How time and peak memory grow with sequence length N and d_mlp: original vs converted.

GPT-2-small blocks (d_model 768, 12 heads, LayerNorm, random weights) with a 1000-token
vocabulary, so that the blocks, not the unembedding, dominate; 4 layers by default. For each N in
``--n`` (batch ``--batch``) and each d_mlp in ``--d-mlp`` (at N = ``--n-for-d-mlp``), original and
converted are measured in the same process:

- forward time (median of ``--repeats`` interleaved runs, ``torch.inference_mode``);
- ``run_with_cache`` time (every hook; the converted model derives neuron-head entries on access);
- peak memory above the loaded models during one forward / one ``run_with_cache`` (Linux
  ``VmHWM`` after resetting it, with glibc's mmap threshold fixed so freed tensors leave RSS);
- bytes the cache holds (each storage once; for the converted model what it holds before any
  neuron-head entry is read);
- the literal form's forward where it fits (``--literal-n``; refused sizes are reported as such).

Slopes are least-squares fits of log(cost) against log(N) (or log(d_mlp)).

Run: ``python benchmarks/bench_scale.py [--threads 2] [--repeats 3] [--act gelu_new silu]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

from tl_attnonly import convert

warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")
VOCAB = 1000


def blocks_config(act_fn: str, d_mlp: int, n_layers: int, n_ctx: int) -> HookedTransformerConfig:
    return HookedTransformerConfig(
        n_layers=n_layers,
        d_model=768,
        n_heads=12,
        d_head=64,
        d_mlp=d_mlp,
        d_vocab=VOCAB,
        n_ctx=n_ctx,
        act_fn=act_fn,
        normalization_type="LN",
        seed=0,
        device="cpu",
    )


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def peak_extra_bytes(fn) -> int:
    """Peak resident memory above the current one while ``fn()`` runs and its result lives
    (after one warm-up call, so one-off allocations are not counted)."""
    fn()
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return -1
    base = _status("VmRSS")
    result = fn()
    peak = _status("VmHWM")
    del result
    return peak - base


def median_times(fns, repeats: int) -> list[float]:
    for fn in fns:
        fn()  # warm up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def cache_bytes(cache) -> int:
    if hasattr(cache, "stored_nbytes"):
        return cache.stored_nbytes()
    return sum(
        {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in cache.values()
        }.values()
    )


def measure(original, converted, tokens, repeats: int, peaks: bool) -> dict[str, float]:
    """Times (``peaks=False``) or peak memory (``peaks=True``: run in a child process whose glibc
    mmap threshold is fixed, so that freed tensors leave RSS; that slows allocation, so the
    times are taken in the parent)."""
    row: dict[str, float] = {}
    with torch.inference_mode():
        if peaks:
            row["peak_fwd_o"] = peak_extra_bytes(lambda: original(tokens))
            row["peak_fwd_c"] = peak_extra_bytes(lambda: converted(tokens))
            row["peak_rwc_o"] = peak_extra_bytes(lambda: original.run_with_cache(tokens))
            row["peak_rwc_c"] = peak_extra_bytes(lambda: converted.run_with_cache(tokens))
            return row
        row["fwd_o"], row["fwd_c"] = median_times(
            [lambda: original(tokens), lambda: converted(tokens)], repeats
        )
        row["rwc_o"], row["rwc_c"] = median_times(
            [lambda: original.run_with_cache(tokens), lambda: converted.run_with_cache(tokens)],
            repeats,
        )
        row["cache_o"] = cache_bytes(original.run_with_cache(tokens)[1])
        row["cache_c"] = cache_bytes(converted.run_with_cache(tokens)[1])
    return row


def peaks_in_child(argv: list[str]) -> list[dict[str, float]]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(
        [sys.executable, __file__, *argv, "--peaks-only"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def slope(xs, ys) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-12)) for y in ys]
    mx, my = statistics.mean(lx), statistics.mean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def print_table(label: str, xs, rows) -> None:
    mib = 2**20
    print()
    print(
        f"| {label} | fwd orig (s) | fwd conv (s) | ratio | rwc orig (s) | rwc conv (s) | ratio "
        "| peak fwd orig/conv (MiB) | peak rwc orig/conv (MiB) | cache orig/conv (MiB) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for x, r in zip(xs, rows):
        print(
            f"| {x} | {r['fwd_o']:.3f} | {r['fwd_c']:.3f} | {r['fwd_c'] / r['fwd_o']:.2f} "
            f"| {r['rwc_o']:.3f} | {r['rwc_c']:.3f} | {r['rwc_c'] / r['rwc_o']:.2f} "
            f"| {r['peak_fwd_o'] / mib:.0f} / {r['peak_fwd_c'] / mib:.0f} "
            f"| {r['peak_rwc_o'] / mib:.0f} / {r['peak_rwc_c'] / mib:.0f} "
            f"| {r['cache_o'] / mib:.1f} / {r['cache_c'] / mib:.1f} |"
        )
    if len(xs) > 1:
        fits = {k: slope(xs, [r[k] for r in rows]) for k in rows[0]}
        print(
            f"| slope (log-log) | {fits['fwd_o']:.2f} | {fits['fwd_c']:.2f} | "
            f"| {fits['rwc_o']:.2f} | {fits['rwc_c']:.2f} | "
            f"| {fits['peak_fwd_o']:.2f} / {fits['peak_fwd_c']:.2f} "
            f"| {fits['peak_rwc_o']:.2f} / {fits['peak_rwc_c']:.2f} "
            f"| {fits['cache_o']:.2f} / {fits['cache_c']:.2f} |"
        )
    print()


def literal_forward(act_fn: str, n: int, repeats: int) -> str:
    """The literal form's forward on a small model (2 layers, d_model 128, d_mlp 512): its
    weights grow as (d_mlp K + N)^2, so GPT-2-small blocks do not fit."""
    cfg = HookedTransformerConfig(
        n_layers=2,
        d_model=128,
        n_heads=4,
        d_head=32,
        d_mlp=512,
        d_vocab=VOCAB,
        n_ctx=n,
        act_fn=act_fn,
        normalization_type="LN",
        seed=0,
        device="cpu",
    )
    original = HookedTransformer(cfg).eval()
    tokens = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n))
    try:
        literal = convert(original, form="literal")
    except (MemoryError, ValueError, NotImplementedError) as err:
        return f"refused: {str(err).splitlines()[0][:90]}"
    with torch.inference_mode():
        try:
            (t_o, t_l) = median_times([lambda: original(tokens), lambda: literal(tokens)], repeats)
            peak = peak_extra_bytes(lambda: literal(tokens))
        except (MemoryError, RuntimeError) as err:
            return f"failed: {str(err).splitlines()[0][:90]}"
    return f"{t_l:.3f} s ({t_l / t_o:.1f}x original), peak {peak / 2**20:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--act", nargs="*", default=["gelu_new", "silu"])
    parser.add_argument("--n", nargs="*", type=int, default=[128, 256, 512, 1024])
    parser.add_argument("--d-mlp", nargs="*", type=int, default=[768, 1536, 3072, 6144])
    parser.add_argument("--n-for-d-mlp", type=int, default=256)
    parser.add_argument("--literal-n", nargs="*", type=int, default=[16, 32, 64])
    parser.add_argument("--peaks-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.peaks_only:
        for *_, row in cells(args, peaks=True):
            print(json.dumps(row), flush=True)
        return
    peak_rows = iter(peaks_in_child([a for a in sys.argv[1:] if a != "--peaks-only"]))
    print(
        f"torch {torch.__version__}, CPU, {args.threads} threads, fp32, {args.layers} layers, "
        f"d_model 768, 12 heads, vocab {VOCAB}, batch {args.batch}, median of {args.repeats}"
    )
    groups: dict[tuple[str, str], list[tuple[int, dict[str, float]]]] = {}
    for act_fn, axis, x, row in cells(args, peaks=False):
        row.update(next(peak_rows))
        groups.setdefault((act_fn, axis), []).append((x, row))
    for (act_fn, axis), items in groups.items():
        fixed = "d_mlp 3072" if axis == "N" else f"N = {args.n_for_d_mlp}"
        print(f"\n### {act_fn}, {fixed}, against {axis}\n")
        print_table(axis, [x for x, _ in items], [row for _, row in items])
        if axis == "N":
            for n in args.literal_n:
                result = literal_forward(act_fn, n, args.repeats)
                print(f"- literal form, 2 layers, d_model 128, d_mlp 512, batch 1, N={n}: {result}")


def cells(args, peaks: bool):
    """``(act_fn, axis, x, row)`` for every measured configuration, in a fixed order."""
    for act_fn in args.act:
        torch.manual_seed(0)
        original = HookedTransformer(blocks_config(act_fn, 3072, args.layers, 1024)).eval()
        converted = convert(original)
        for n in args.n:
            generator = torch.Generator().manual_seed(n)
            tokens = torch.randint(0, VOCAB, (args.batch, n), generator=generator)
            yield act_fn, "N", n, measure(original, converted, tokens, args.repeats, peaks)
        del original, converted
        gc.collect()
        for d_mlp in args.d_mlp:
            torch.manual_seed(0)
            original = HookedTransformer(blocks_config(act_fn, d_mlp, args.layers, 1024)).eval()
            converted = convert(original)
            tokens = torch.randint(0, VOCAB, (args.batch, args.n_for_d_mlp))
            yield act_fn, "d_mlp", d_mlp, measure(original, converted, tokens, args.repeats, peaks)
            del original, converted
            gc.collect()


if __name__ == "__main__":
    main()
