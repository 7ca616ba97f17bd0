"""Forward time and conversion memory of a converted TransformerBridge against the unconverted one.

Two random Hugging Face models with GPT-2-small-sized blocks (d_model 768, 12 heads, 4 layers) and
a small vocabulary (1000, so that the unembedding does not hide the blocks' cost):

* ``silu``: ``GPT2LMHeadModel`` with ``activation_function="silu"`` (plain MLP, d_mlp 3072);
* ``swiglu``: ``LlamaForCausalLM`` (gated MLP, d_mlp 2048).

Each is wrapped in two bridges (``build_bridge_from_module``) around two copies of the model; one
is converted with ``tl_attnonly.convert`` (in place, sharing its weights). For each input shape
``batch x pos`` the script prints the median forward time of the unconverted and the converted
bridge, measured in one run with the calls interleaved (so drifts hit both equally), and their
ratio, for the default options (fused path) and the head path (``ConversionOptions(fused=False)``:
every neuron-head evaluated). Conversion peak memory is measured in a fresh child process per
model (see ``benchmarks/bench_forward.py``: a long-lived process reuses freed heap pages):
(model bytes + resident peak added while converting) / model bytes.

Run: ``python benchmarks/bench_bridge.py [--repeats 7] [--threads 1] [--shapes 1x128 4x128 1x512]``
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
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import transformers

D_MODEL, N_HEADS, N_LAYERS, VOCAB = 768, 12, 4, 1000
D_MLP = {"silu": 3072, "swiglu": 2048}
MODELS = tuple(D_MLP)


def describe(kind: str) -> str:
    """The config, printed beside every figure."""
    mlp = "plain SiLU (GPT-2)" if kind == "silu" else "SwiGLU (Llama)"
    return (
        f"{mlp}, d_model {D_MODEL}, d_mlp {D_MLP[kind]}, {N_LAYERS} layers, {N_HEADS} heads, "
        f"vocab {VOCAB}, fp32"
    )


def build_hf(kind: str, n_layers: int = N_LAYERS) -> tuple[Any, Any, str]:
    """(hf_model, hf_config, architecture) of one benchmark model, random, eval mode."""
    torch.manual_seed(0)
    if kind == "silu":
        config = transformers.GPT2Config(
            n_embd=D_MODEL,
            n_layer=n_layers,
            n_head=N_HEADS,
            n_inner=D_MLP[kind],
            activation_function="silu",
            vocab_size=VOCAB,
            n_positions=1024,
            bos_token_id=0,
            eos_token_id=0,
        )
        architecture = "GPT2LMHeadModel"
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            hidden_size=D_MODEL,
            intermediate_size=D_MLP[kind],
            num_hidden_layers=n_layers,
            num_attention_heads=N_HEADS,
            num_key_value_heads=N_HEADS,
            vocab_size=VOCAB,
            max_position_embeddings=1024,
            bos_token_id=0,
            eos_token_id=0,
        )
        architecture = "LlamaForCausalLM"
        model = transformers.LlamaForCausalLM(config)
    config._attn_implementation = "eager"
    return model.eval(), config, architecture


def bridge_of(model: Any, config: Any, architecture: str) -> Any:
    from transformer_lens.model_bridge.sources import build_bridge_from_module

    return build_bridge_from_module(model, architecture, hf_config=config)


def convert(bridge: Any, **options: Any) -> Any:
    from tl_attnonly import ConversionOptions
    from tl_attnonly import convert as tl_convert

    return tl_convert(bridge, ConversionOptions(**options))


def interleaved_medians(
    fn_a: Callable[[], Any], fn_b: Callable[[], Any], repeats: int
) -> tuple[float, float]:
    """Median seconds of ``fn_a`` and ``fn_b``, called alternately (after one warm-up each)."""
    fn_a(), fn_b()
    a, b = [], []
    for _ in range(repeats):
        for fn, times in ((fn_a, a), (fn_b, b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


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
    # Fixed costs, not the model's: the modules convert() imports on first use (which depend on
    # the environment) and one-time library buffers. Converting a 1-layer model of the same kind
    # first pays them; its memory is given back (large blocks are mmapped, see the parent).
    warm_up = convert(bridge_of(*build_hf(kind, n_layers=1)))
    with torch.no_grad():
        warm_up(torch.zeros(1, 4, dtype=torch.long))
    del warm_up

    model, config, architecture = build_hf(kind)
    bridge = bridge_of(model, config, architecture)
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


def bench(kind: str, shapes: list[tuple[int, int]], repeats: int) -> list[str]:
    """Markdown rows: shape, path, unconverted ms, converted ms, ratio."""
    model, config, architecture = build_hf(kind)
    # Bridging replaces the HF model's submodules with bridge components: one pristine copy each.
    copies = [copy.deepcopy(model) for _ in range(2)]
    original = bridge_of(model, config, architecture)
    rows = []
    paths = (("default (fused)", {}), ("heads (fused=False)", {"fused": False}))
    for (path, options), hf_copy in zip(paths, copies):
        converted = convert(bridge_of(hf_copy, config, architecture), **options)
        for batch, pos in shapes:
            generator = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, VOCAB, (batch, pos), generator=generator)
            with torch.no_grad():
                assert (converted(tokens) - original(tokens)).abs().max().item() < 1e-3
                t_orig, t_conv = interleaved_medians(
                    partial(original, tokens), partial(converted, tokens), repeats
                )
            rows.append(
                f"| {describe(kind)} | {batch}x{pos} | {path} | {t_orig * 1e3:.1f} "
                f"| {t_conv * 1e3:.1f} | {t_conv / t_orig:.3f} |"
            )
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", nargs="+", default=["1x128", "4x128", "1x512"])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--memory-only", choices=MODELS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    if args.memory_only:
        _memory_only(args.memory_only)
        return
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes]
    from importlib.metadata import version

    print(
        f"TransformerLens {version('transformer-lens')}, transformers {transformers.__version__}, "
        f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats} "
        "interleaved repeats\n"
    )
    print("| config | batch x pos | converted path | unconverted ms | converted ms | ratio |")
    print("|---|---|---|---|---|---|")
    for kind in args.models:
        bench(kind, shapes, args.repeats)  # type: ignore[arg-type]
    print("\n| config | conversion peak memory / model bytes | model MB |")
    print("|---|---|---|")
    for kind in args.models:
        memory = conversion_memory_in_child(kind)
        print(f"| {describe(kind)} | {memory['ratio']:.3f} | {memory['bytes'] / 2**20:.0f} |")


if __name__ == "__main__":
    main()
