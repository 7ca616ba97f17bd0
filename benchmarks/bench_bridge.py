"""Forward time and conversion memory of a converted TransformerBridge against the unconverted one.

Random Hugging Face models with GPT-2-small-sized blocks (defaults: d_model 768, d_mlp 3072,
12 heads, 2 layers) and a small vocabulary (1000, so that the unembedding does not hide the
blocks' cost):

* ``silu``: ``GPT2LMHeadModel`` with ``activation_function="silu"`` (plain MLP);
* ``swiglu``: ``LlamaForCausalLM`` (gated MLP) of the same widths.

Each is wrapped in bridges (``build_bridge_from_module``) around copies of one model; all but
one are converted with ``tl_attnonly.convert`` (in place, sharing their weights). For each input
shape ``batch x pos`` the script prints, one line per (config, shape, converted path), the median
forward time of the unconverted and the converted bridge, measured in one process with the calls
interleaved (so drifts hit both equally), and their ratio. Converted paths:

* ``default (fused)``: default options;
* ``heads (fused=False)``: ``ConversionOptions(fused=False)``, every neuron-head evaluated through
  the hook points ``hook_q, hook_v, hook_attn_scores, hook_pattern, hook_z`` (no hook attached);
* ``heads, hooked``: the same with a no-op hook on every neuron-head hook point (``q, k, v,
  attn_scores, pattern, z``) of every layer, so that every quantity gets its own memory, as under
  ``run_with_cache``.

Conversion peak memory is measured in a fresh child process per model (see
``benchmarks/bench_forward.py``: a long-lived process reuses freed heap pages) on its own config
(:data:`MEMORY_LAYERS` layers, :data:`MEMORY_D_MLP`): (model bytes + resident peak added while
converting) / model bytes.

Run: ``python benchmarks/bench_bridge.py [--threads 2] [--repeats 9] [--layers 2]
[--shapes 1x128 4x128 1x512] [--models silu swiglu] [--no-memory]``
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import transformers

MODELS = ("silu", "swiglu")
#: The neuron-head hook points the ``heads, hooked`` path puts a no-op hook on.
NEURON_HEAD_HOOKS = ("q", "k", "v", "attn_scores", "pattern", "z")
#: The conversion-memory child's config (its figures in docs/bridge_zoo.md and the target test).
MEMORY_LAYERS = 4
MEMORY_D_MLP = {"silu": 3072, "swiglu": 2048}


@dataclass(frozen=True)
class Config:
    """One benchmark model: random weights, fp32, eager attention."""

    kind: str
    d_model: int = 768
    d_mlp: int = 3072
    n_layers: int = 2
    n_heads: int = 12
    vocab: int = 1000

    def describe(self) -> str:
        """The config, printed beside every figure."""
        mlp = "plain SiLU (GPT-2)" if self.kind == "silu" else "SwiGLU (Llama)"
        return (
            f"{mlp}, d_model {self.d_model}, d_mlp {self.d_mlp}, {self.n_layers} layers, "
            f"{self.n_heads} heads, vocab {self.vocab}, fp32"
        )


def memory_config(kind: str) -> Config:
    """The config the conversion-memory child measures."""
    return Config(kind, d_mlp=MEMORY_D_MLP[kind], n_layers=MEMORY_LAYERS)


def build_hf(config: Config) -> tuple[Any, Any, str]:
    """(hf_model, hf_config, architecture) of one benchmark model, random, eval mode."""
    torch.manual_seed(0)
    hf_config: Any
    model: Any
    if config.kind == "silu":
        hf_config = transformers.GPT2Config(
            n_embd=config.d_model,
            n_layer=config.n_layers,
            n_head=config.n_heads,
            n_inner=config.d_mlp,
            activation_function="silu",
            vocab_size=config.vocab,
            n_positions=1024,
            bos_token_id=0,
            eos_token_id=0,
        )
        architecture = "GPT2LMHeadModel"
        model = transformers.GPT2LMHeadModel(hf_config)
    else:
        hf_config = transformers.LlamaConfig(
            hidden_size=config.d_model,
            intermediate_size=config.d_mlp,
            num_hidden_layers=config.n_layers,
            num_attention_heads=config.n_heads,
            num_key_value_heads=config.n_heads,
            vocab_size=config.vocab,
            max_position_embeddings=1024,
            bos_token_id=0,
            eos_token_id=0,
        )
        architecture = "LlamaForCausalLM"
        model = transformers.LlamaForCausalLM(hf_config)
    hf_config._attn_implementation = "eager"
    return model.eval(), hf_config, architecture


def bridge_of(model: Any, config: Any, architecture: str) -> Any:
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    return build_bridge_from_module(model, architecture, hf_config=config)


def convert(bridge: Any, **options: Any) -> Any:
    from tl_attnonly import ConversionOptions
    from tl_attnonly import convert as tl_convert

    return tl_convert(bridge, ConversionOptions(**options))


def interleaved_times(
    fn_a: Callable[[], Any], fn_b: Callable[[], Any], repeats: int
) -> tuple[list[float], list[float]]:
    """Seconds of ``repeats`` calls each of ``fn_a`` and ``fn_b``, called alternately (after
    one warm-up each), so that drifts in the machine's load hit both alike."""
    fn_a(), fn_b()
    a: list[float] = []
    b: list[float] = []
    for _ in range(repeats):
        for fn, times in ((fn_a, a), (fn_b, b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return a, b


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _memory_only(kind: str) -> None:
    """Child process: one JSON line with the conversion's peak-memory ratio for ``kind``:
    ``(model + peak resident growth while converting) / model``, after a 1-layer model of the
    same kind was converted and the bridge has run once (fixed costs: imports, library buffers)."""
    config = memory_config(kind)
    # Fixed costs, not the model's: the modules convert() imports on first use (which depend on
    # the environment) and one-time library buffers. Converting a 1-layer model of the same kind
    # first pays them; its memory is given back (large blocks are mmapped, see the parent).
    warm_up = convert(bridge_of(*build_hf(replace(config, n_layers=1))))
    with torch.no_grad():
        warm_up(torch.zeros(1, 4, dtype=torch.long))
    del warm_up

    model, hf_config, architecture = build_hf(config)
    bridge = bridge_of(model, hf_config, architecture)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.no_grad():  # the first forward's one-time library buffers, likewise
        bridge(torch.zeros(1, 4, dtype=torch.long))
    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset the peak (VmHWM) to the current resident size
    base = _status_bytes("VmRSS")
    convert(bridge)
    peak = _status_bytes("VmHWM")
    print(json.dumps({"ratio": (model_bytes + peak - base) / model_bytes, "bytes": model_bytes}))


def conversion_memory_in_child(kind: str) -> dict[str, float]:
    """Run :func:`_memory_only` in a fresh process (``MALLOC_MMAP_THRESHOLD_`` fixed)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    child = subprocess.run(
        [sys.executable, __file__, "--memory-only", kind],
        env=env,
        capture_output=True,
        text=True,
    )
    if child.returncode != 0:
        raise RuntimeError(f"The conversion-memory child failed:\n{child.stderr[-3000:]}")
    return json.loads(child.stdout.splitlines()[-1])


def _no_op(tensor: torch.Tensor, hook: Any) -> None:
    return None


@contextmanager
def no_op_hooks(bridge: Any, names: list[str]) -> Iterator[None]:
    """A no-op forward hook on each of ``names`` while inside (added once, outside the timed
    calls: adding hooks per call costs milliseconds on TransformerLens 3.9's bridge)."""
    points = [bridge.hook_dict[name] for name in names]
    for point in points:
        point.add_hook(_no_op)
    try:
        yield
    finally:
        for point in points:
            point.remove_hooks("fwd")


def bench(config: Config, shapes: list[tuple[int, int]], repeats: int) -> list[str]:
    """Markdown rows: config, shape, path, unconverted and converted ms (medians), ratio."""
    model, hf_config, architecture = build_hf(config)
    # Bridging replaces the HF model's submodules with bridge components: one pristine copy each.
    fused, heads = (
        convert(bridge_of(copy.deepcopy(model), hf_config, architecture), **options)
        for options in ({}, {"fused": False})
    )
    original = bridge_of(model, hf_config, architecture)
    every_head_hook = [
        f"blocks.{layer}.mlp.hook_{name}"
        for layer in range(config.n_layers)
        for name in NEURON_HEAD_HOOKS
    ]
    paths: tuple[tuple[str, Any, list[str]], ...] = (
        ("default (fused)", fused, []),
        ("heads (fused=False)", heads, []),
        ("heads, hooked", heads, every_head_hook),
    )
    rows = []
    for batch, pos in shapes:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, config.vocab, (batch, pos), generator=generator)
        for path, converted, hook_names in paths:
            with torch.no_grad(), no_op_hooks(converted, hook_names):
                error = (converted(tokens) - original(tokens)).abs().max().item()
                assert error < 1e-3, f"{path}: converted logits differ by {error}"
                a, b = interleaved_times(
                    partial(original, tokens), partial(converted, tokens), repeats
                )
            t_orig, t_conv = statistics.median(a), statistics.median(b)
            rows.append(
                f"| {config.describe()} | {batch}x{pos} | {path} | {t_orig * 1e3:.1f} "
                f"| {t_conv * 1e3:.1f} | {t_conv / t_orig:.3f} |"
            )
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[str]:
    """Print the tables; returns the timing rows."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", nargs="+", default=["1x128", "4x128", "1x512"])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--layers", type=int, default=Config.n_layers)
    parser.add_argument("--d-model", type=int, default=Config.d_model)
    parser.add_argument("--d-mlp", type=int, default=Config.d_mlp)
    parser.add_argument("--heads", type=int, default=Config.n_heads)
    parser.add_argument("--vocab", type=int, default=Config.vocab)
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the conversion-memory children"
    )
    parser.add_argument("--memory-only", choices=MODELS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    if args.memory_only:
        _memory_only(args.memory_only)
        return []
    shapes = [(int(b), int(p)) for b, p in (s.split("x") for s in args.shapes)]
    from importlib.metadata import version

    print(
        f"TransformerLens {version('transformer-lens')}, transformers {transformers.__version__}, "
        f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats} "
        "interleaved repeats\n"
    )
    print("| config | batch x pos | converted path | unconverted ms | converted ms | ratio |")
    print("|---|---|---|---|---|---|")
    rows = []
    for kind in args.models:
        config = Config(kind, args.d_model, args.d_mlp, args.layers, args.heads, args.vocab)
        rows += bench(config, shapes, args.repeats)
    if not args.no_memory:
        print("\n| config | conversion peak memory / model bytes | model MB |")
        print("|---|---|---|")
        for kind in args.models:
            memory = conversion_memory_in_child(kind)
            print(
                f"| {memory_config(kind).describe()} | {memory['ratio']:.3f} "
                f"| {memory['bytes'] / 2**20:.0f} |"
            )
    return rows


if __name__ == "__main__":
    main()
