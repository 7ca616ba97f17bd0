"""Atlas throughput against a plain forward pass over the same corpus, measured in one run.

For each model, the same rows of the standard library's source
(:func:`tl_attnonly.atlas.corpora.python_source`, ``--rows`` rows of exactly
``--max-len`` tokens, batches of ``--batch-size``) go through, interleaved ``--repeats`` times
after a warm-up:

- ``forward``: the converted model's plain forward pass (``model(tokens)``, logits);
- ``atlas``: :func:`tl_attnonly.atlas.collect_atlas` (the pass, the hooks it reads, and every
  neuron's bookkeeping), continuing the state of ``--warm-rows`` rows run before (untimed): 0
  measures a run's start, where every token enters the selections; a few hundred rows, a long
  run's steady state.

It prints tokens/s of each (medians) and the ratio atlas / forward (issue 48 asks for at least
0.7). Models: ``bundled`` (2 layers x 512 neurons, d_model 128), ``smollm2`` (the real
SmolLM2-135M-Instruct, the ``[smollm2]`` extra), ``llama-small-vocab`` (a random Llama of
SmolLM2's sizes with a 1,000-token vocabulary, so that the unembedding hides nothing).

Run: ``python benchmarks/bench_atlas.py [--models bundled smollm2 llama-small-vocab]
[--rows 32] [--max-len 128] [--batch-size 8] [--threads 2] [--repeats 3] [--device cuda]``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import tl_attnonly
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.summaries.collect import token_rows
from tl_attnonly.atlas import collect_atlas
from tl_attnonly.atlas.corpora import python_source

sys.path.insert(0, str(Path(__file__).parent))

MODELS = ("bundled", "smollm2", "llama-small-vocab")


def load(name: str, device: str) -> Any:
    """The converted model ``name`` (a bridge on TransformerLens 4.x)."""
    from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER

    if name == "bundled":
        from tl_attnonly.bundled import load_bundled_bridge, load_bundled_model

        loader = load_bundled_model if HAS_HOOKED_TRANSFORMER else load_bundled_bridge
        return tl_attnonly.convert(loader(device=device))
    if name == "smollm2":
        from tl_attnonly.smollm2 import load_smollm2, load_smollm2_bridge

        loader = load_smollm2 if HAS_HOOKED_TRANSFORMER else load_smollm2_bridge
        return tl_attnonly.convert(loader(device=device))
    from random_families import build

    model = build("llama", 1000)
    return model if device == "cpu" else model.to(device)


def corpus(model: Any, n_rows: int, max_len: int) -> list[torch.Tensor]:
    """``n_rows`` rows of exactly ``max_len`` tokens (token ids below the model's vocabulary;
    a model without a tokenizer gets the bundled model's tokens)."""
    adapted = analysis_model(model)
    reader = adapted
    if adapted.tokenizer is None:
        from tl_attnonly.bundled import load_bundled_bridge

        reader = analysis_model(tl_attnonly.convert(load_bundled_bridge()))
    rows = token_rows(reader, python_source(), max_len)
    full = (r % adapted.cfg.d_vocab for r in rows if r.shape[0] == max_len)
    out = list(itertools.islice(full, n_rows))
    if len(out) < n_rows:
        raise SystemExit(f"the corpus has only {len(out)} full rows of {max_len} tokens")
    return out


def measure(
    model: Any, rows: list[torch.Tensor], batch: int, repeats: int, warm: int
) -> dict[str, float]:
    """Median seconds of the forward passes and of the atlas over ``rows[warm:]``, the atlas
    continuing (a copy of) the state of ``rows[:warm]``."""
    device = analysis_model(model).cfg.device
    tokens = torch.stack(rows[warm:]).to(device)
    max_len = tokens.shape[1]
    warm_state = collect_atlas(model, rows[:warm], batch_size=batch, max_len=max_len)

    def forward() -> None:
        with torch.no_grad():
            for start in range(0, tokens.shape[0], batch):
                model(tokens[start : start + batch])

    def atlas() -> None:
        start = copy.deepcopy(warm_state)
        state = collect_atlas(model, rows, state=start, batch_size=batch, max_len=max_len)
        int(state.n_tokens)  # waits for the device

    runs: dict[str, list[float]] = {"forward": [], "atlas": []}
    forward(), atlas()  # warm up
    for _ in range(repeats):
        for name, fn in (("forward", forward), ("atlas", atlas)):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            runs[name].append(time.perf_counter() - t0)
    return {name: statistics.median(times) for name, times in runs.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--rows", type=int, default=32, help="rows timed")
    parser.add_argument(
        "--warm-rows", type=int, nargs="+", default=[0, 256],
        help="rows run before the timed ones, untimed (0: the state starts empty; more: the "
        "state of a long run, where fewer tokens enter its selections)",
    )  # fmt: skip
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from importlib.metadata import version as package_version

    version = package_version("transformer-lens")
    where = args.device if args.device == "cpu" else torch.cuda.get_device_name(args.device)
    print(
        f"# bench_atlas: {platform.processor() or platform.machine()}, {args.threads} threads, "
        f"{where}, torch {torch.__version__}, TransformerLens {version}, {args.rows} rows x "
        f"{args.max_len} tokens timed, batch {args.batch_size}, fp32, medians of {args.repeats}"
    )
    print("| model | state before (rows) | forward tokens/s | atlas tokens/s | atlas / forward |")
    print("|---|---|---|---|---|")
    for name in args.models:
        try:
            model = load(name, args.device)
        except ImportError as err:
            print(f"| {name} | skipped: {err} | | | |")
            continue
        rows = corpus(model, args.rows + max(args.warm_rows), args.max_len)
        n_tokens = args.rows * args.max_len
        for warm in args.warm_rows:
            timed_rows = rows[: warm + args.rows]
            times = measure(model, timed_rows, args.batch_size, args.repeats, warm)
            fwd, atl = n_tokens / times["forward"], n_tokens / times["atlas"]
            print(f"| {name} | {warm} | {fwd:,.0f} | {atl:,.0f} | {atl / fwd:.2f} |", flush=True)
        del model


if __name__ == "__main__":
    main()
