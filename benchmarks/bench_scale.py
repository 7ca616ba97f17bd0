"""How time and peak memory grow with sequence length N and d_mlp: original vs converted.

GPT-2-small-width blocks (d_model 768, 12 heads of 64, LayerNorm, random weights, float32) with a
small vocabulary (1000 tokens), so that the blocks, not the unembedding, dominate. For every
model config (``--configs``: SiLU, GELU with K = 4 heads per neuron, gated GeGLU with K = 4),
every d_mlp (``--d-mlp``) and every N (``--n``), the original and the converted model are
measured in the same process:

- forward and ``run_with_cache`` time: medians of ``--repeats`` interleaved runs under
  ``torch.inference_mode`` (``run_with_cache`` caches every hook; the converted model derives
  neuron-head entries when read);
- peak memory above the loaded models during one forward / one ``run_with_cache`` (Linux:
  ``VmHWM`` after resetting it, in a child process whose glibc mmap threshold is fixed so that
  freed tensors leave the resident set; "n/a" elsewhere);
- the literal form (``form="literal"``, ``max_len=N``) where its weights fit the budget
  ``--literal-budget-gib``: its forward time and peak, else the memory it would need;
- the slope of each cost: the least-squares exponent of log(cost) against log(N) (per d_mlp) and
  against log(d_mlp) (per N).

It prints Markdown tables (and, with ``--json PATH``, every measurement as JSON). It needs only
torch, transformer_lens and tl_attnonly.

Run: ``python benchmarks/bench_scale.py`` (the README's table; minutes);
``python benchmarks/bench_scale.py --quick`` (a small smoke run, seconds).
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
from typing import Any

import torch
from transformer_lens import HookedTransformer, HookedTransformerConfig

from tl_attnonly import convert

warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")

#: name -> (act_fn, gated MLP). GELU-family activations use the default K = 4 heads per neuron.
CONFIGS: dict[str, tuple[str, bool]] = {
    "silu": ("silu", False),
    "gelu_new K=4": ("gelu_new", False),
    "GeGLU K=4": ("gelu_pytorch_tanh", True),
}
MIB = 2**20


def blocks_config(
    act_fn: str, gated: bool, d_model: int, d_mlp: int, n_layers: int, n_ctx: int, vocab: int
) -> HookedTransformerConfig:
    return HookedTransformerConfig(
        n_layers=n_layers,
        d_model=d_model,
        n_heads=max(1, d_model // 64),
        d_head=min(64, d_model),
        d_mlp=d_mlp,
        d_vocab=vocab,
        n_ctx=n_ctx,
        act_fn=act_fn,
        gated_mlp=gated,
        normalization_type="LN",
        seed=0,
        device="cpu",
    )


# ---------------------------------------------------------------------------- measuring
def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def peak_extra_bytes(fn) -> int:
    """Peak resident memory above the current one while ``fn()`` runs and its result lives
    (after one warm-up call, so one-off allocations are not counted); -1 off Linux."""
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


def literal_cell(original, tokens, budget_bytes: int, repeats: int, peaks: bool) -> dict[str, Any]:
    """The literal form at this N: time and peak of its forward, or what it would need."""
    from tl_attnonly.literal.layout import LiteralBudgetError

    n = tokens.shape[1]
    layout = "split" if original.cfg.gated_mlp else "neuron"  # gated MLPs need "split"
    try:
        literal = convert(
            original, form="literal", max_len=n, budget_bytes=budget_bytes, layout=layout
        )
    except LiteralBudgetError as err:
        needs = str(err).split("needs about ")[-1].split(" GiB")[0]
        return {"literal": f"over budget (needs {needs} GiB)"}
    with torch.inference_mode():
        if peaks:
            return {"peak_literal": peak_extra_bytes(lambda: literal(tokens))}
        t_o, t_l = median_times([lambda: original(tokens), lambda: literal(tokens)], repeats)
    return {"literal_s": t_l, "literal_ratio": t_l / t_o}


def measure(original, converted, tokens, args, peaks: bool) -> dict[str, Any]:
    """Times (``peaks=False``) or peak memory (``peaks=True``, in the child process: its fixed
    mmap threshold slows allocation, so times are taken in the parent)."""
    row: dict[str, Any] = {}
    with torch.inference_mode():
        if peaks:
            row["peak_fwd_o"] = peak_extra_bytes(lambda: original(tokens))
            row["peak_fwd_c"] = peak_extra_bytes(lambda: converted(tokens))
            row["peak_rwc_o"] = peak_extra_bytes(lambda: original.run_with_cache(tokens))
            row["peak_rwc_c"] = peak_extra_bytes(lambda: converted.run_with_cache(tokens))
        else:
            row["fwd_o"], row["fwd_c"] = median_times(
                [lambda: original(tokens), lambda: converted(tokens)], args.repeats
            )
            row["rwc_o"], row["rwc_c"] = median_times(
                [lambda: original.run_with_cache(tokens), lambda: converted.run_with_cache(tokens)],
                args.repeats,
            )
    if args.literal_budget_gib > 0:
        budget = int(args.literal_budget_gib * 2**30)
        row.update(literal_cell(original, tokens, budget, args.repeats, peaks))
    return row


def cells(args, peaks: bool):
    """``(config, d_mlp, n, row)`` for every measured cell, in a fixed order."""
    for name in args.configs:
        act_fn, gated = CONFIGS[name]
        for d_mlp in args.d_mlp:
            cfg = blocks_config(
                act_fn, gated, args.d_model, d_mlp, args.layers, max(args.n), args.vocab
            )
            torch.manual_seed(0)
            original = HookedTransformer(cfg).eval()
            converted = convert(original)
            for n in args.n:
                generator = torch.Generator().manual_seed(n)
                tokens = torch.randint(0, args.vocab, (args.batch, n), generator=generator)
                yield name, d_mlp, n, measure(original, converted, tokens, args, peaks)
            del original, converted
            gc.collect()


def peaks_in_child(argv: list[str]) -> list[dict[str, Any]]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    child = subprocess.run(
        [sys.executable, __file__, *argv, "--peaks-only"], env=env, capture_output=True, text=True
    )
    if child.returncode != 0:
        raise RuntimeError(f"The peak-memory child process failed:\n{child.stderr[-3000:]}")
    return [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]


# ---------------------------------------------------------------------------- reporting
def slope(xs, ys) -> float:
    """Least-squares exponent of ``ys ~ xs^slope`` (NaN with fewer than two usable points)."""
    pairs = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if y > 0]
    if len(pairs) < 2:
        return float("nan")
    mx = statistics.mean(p[0] for p in pairs)
    my = statistics.mean(p[1] for p in pairs)
    var = sum((a - mx) ** 2 for a, _ in pairs)
    return sum((a - mx) * (b - my) for a, b in pairs) / var if var else float("nan")


def _mib(value: float) -> str:
    return "n/a" if value < 0 else f"{value / MIB:.0f}"


def _ratio(converted: float, original: float) -> str:
    """``converted / original``; "n/a" where the original's cost is not a positive number
    (a peak too small to see, or not measured)."""
    return f"{converted / original:.2f}" if original > 0 and converted >= 0 else "n/a"


def _literal(row: dict[str, Any]) -> str:
    if "literal" in row:
        return row["literal"]
    if "literal_s" in row:
        peak = row.get("peak_literal", -1)
        return f"{row['literal_s']:.3f} s ({row['literal_ratio']:.1f}x), {_mib(peak)} MiB"
    return "not run"


def print_tables(rows: list[dict[str, Any]], args) -> None:
    literal_col = args.literal_budget_gib > 0
    for name in args.configs:
        mine = [r for r in rows if r["config"] == name]
        print(f"\n### {name}\n")
        head = (
            "| d_mlp | N | fwd orig (s) | fwd conv (s) | ratio | rwc orig (s) | rwc conv (s) "
            "| ratio | peak fwd orig / conv (MiB) | ratio | peak rwc orig / conv (MiB) | ratio |"
        )
        print(head + (" literal form |" if literal_col else ""))
        print("|---:" * 12 + "|" + ("---|" if literal_col else ""))
        for r in mine:
            line = (
                f"| {r['d_mlp']} | {r['n']} | {r['fwd_o']:.4f} | {r['fwd_c']:.4f} "
                f"| {_ratio(r['fwd_c'], r['fwd_o'])} | {r['rwc_o']:.4f} | {r['rwc_c']:.4f} "
                f"| {_ratio(r['rwc_c'], r['rwc_o'])} | {_mib(r['peak_fwd_o'])} / "
                f"{_mib(r['peak_fwd_c'])} | {_ratio(r['peak_fwd_c'], r['peak_fwd_o'])} "
                f"| {_mib(r['peak_rwc_o'])} / {_mib(r['peak_rwc_c'])} "
                f"| {_ratio(r['peak_rwc_c'], r['peak_rwc_o'])} |"
            )
            print(line + (f" {_literal(r)} |" if literal_col else ""))
        print_slopes(mine, args)


QUANTITIES = (
    ("forward time", "fwd"),
    ("run_with_cache time", "rwc"),
    ("peak forward", "peak_fwd"),
    ("peak run_with_cache", "peak_rwc"),
)


def print_slopes(rows: list[dict[str, Any]], args) -> None:
    """Log-log exponents of each cost, orig / conv: against N per d_mlp, against d_mlp per N
    (and the literal form's time / peak where it ran at two sizes or more)."""
    cols: list[tuple[str, list[dict[str, Any]], str]] = []
    if len(args.n) > 1:
        for d_mlp in args.d_mlp:
            cols.append((f"vs N, d_mlp {d_mlp}", [r for r in rows if r["d_mlp"] == d_mlp], "n"))
    if len(args.d_mlp) > 1:
        for n in sorted({args.n[0], args.n[-1]}):
            cols.append((f"vs d_mlp, N {n}", [r for r in rows if r["n"] == n], "d_mlp"))
    if not cols:
        return
    print("\nSlopes (log-log exponent, orig / conv):\n")
    print("| cost | " + " | ".join(c[0] for c in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for label, key in QUANTITIES:
        cells_ = []
        for _, sel, axis in cols:
            xs = [r[axis] for r in sel]
            s_o = slope(xs, [r[f"{key}_o"] for r in sel])
            s_c = slope(xs, [r[f"{key}_c"] for r in sel])
            cells_.append(f"{s_o:.2f} / {s_c:.2f}")
        print(f"| {label} | " + " | ".join(cells_) + " |")
    literal_cells = []
    for _, sel, axis in cols:  # where the literal form fitted the budget: its time / its peak
        ran = [r for r in sel if "literal_s" in r]
        xs = [r[axis] for r in ran]
        s_t = slope(xs, [r["literal_s"] for r in ran])
        s_p = slope(xs, [r.get("peak_literal", -1) for r in ran])
        literal_cells.append(f"{s_t:.2f} / {s_p:.2f}" if len(ran) > 1 else "n/a")
    if any(cell != "n/a" for cell in literal_cells):
        print("| literal form: time / peak forward | " + " | ".join(literal_cells) + " |")


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--n", nargs="*", type=int, default=[128, 256, 512, 1024])
    parser.add_argument("--d-mlp", nargs="*", type=int, default=[1024, 3072])
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--literal-budget-gib",
        type=float,
        default=4.0,
        help="memory budget of the literal form's weights (0: skip the literal form)",
    )
    parser.add_argument("--quick", action="store_true", help="a small smoke run (seconds)")
    parser.add_argument("--json", metavar="PATH", help="also write every measurement as JSON")
    parser.add_argument("--peaks-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.d_mlp, args.d_model = [16, 32], [32, 64], 64
        args.layers, args.repeats, args.vocab, args.threads = 1, 1, 100, 1
        args.literal_budget_gib = min(args.literal_budget_gib, 0.25) or 0.0
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    gc.freeze()  # the imported modules' objects: later collections need not walk them
    torch.set_num_threads(args.threads)
    if args.peaks_only:
        for name, d_mlp, n, row in cells(args, peaks=True):
            print(json.dumps({"config": name, "d_mlp": d_mlp, "n": n, **row}), flush=True)
        return
    peak_rows = {
        (r["config"], r["d_mlp"], r["n"]): r
        for r in peaks_in_child([a for a in argv if a != "--peaks-only"])
    }
    setup = (
        f"torch {torch.__version__}, CPU, {args.threads} threads, float32, {args.layers} layers, "
        f"d_model {args.d_model}, {max(1, args.d_model // 64)} heads, vocab {args.vocab}, "
        f"batch {args.batch}, median of {args.repeats} interleaved runs; literal form budget "
        f"{args.literal_budget_gib:g} GiB"
    )
    print(setup)
    rows = []
    for name, d_mlp, n, row in cells(args, peaks=False):
        peaks = peak_rows[(name, d_mlp, n)]
        rows.append({"config": name, "d_mlp": d_mlp, "n": n, **row, **peaks})
    print_tables(rows, args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"setup": setup, "argv": argv, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
