"""How the default ``discover_circuit`` call's time and peak memory grow with model size and with
the number of prompts (issue 47, item 5).

Random Llama-like models (``benchmarks/random_families.py``: ``LlamaForCausalLM``, Hugging Face's
initialisation, seed 0, fp32, bridged offline and converted) of three public models' sizes
(``--scales``: ``135M`` SmolLM2-135M's, ``0.5B`` Qwen2.5-0.5B's, ``1B`` Llama-3.2-1B's, each with
its own vocabulary), the random task of ``random_families.task`` (``--prompts`` prompts of
``--pos`` tokens, corrupted at two positions, the logit difference of two random tokens at the
last position), and ``discover_circuit`` with its defaults, once per model and prompt count.
``--prompt-counts`` adds runs of the first scale with other prompt counts.

Printed: one line per run with its config, the total time, the process's CPU time, the peak
resident memory above the loaded model (Linux ``VmHWM`` after resetting it), each stage's time
and the circuit's size; then a Markdown table of all runs. Random weights: the circuits mean
nothing, and their sizes (which the exact runs' cost follows) differ between models.

Run: ``python benchmarks/bench_discovery_scaling.py [--scales 135M 0.5B 1B]
[--prompt-counts 64 256] [--prompts 16] [--pos 16] [--threads 2] [--device cuda]``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import random_families  # noqa: E402
from bench_discovery import _device_name, _run  # noqa: E402

from tl_attnonly.analysis import mask_size  # noqa: E402


def _params(model) -> int:
    """The parameters of the unconverted model the bridge wraps (tied embeddings once)."""
    original = getattr(model, "original_model", model)
    return sum(p.numel() for p in original.parameters())


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scales", nargs="+", default=["135M", "0.5B", "1B"],
                        choices=list(random_families.SCALES))  # fmt: skip
    parser.add_argument("--prompt-counts", nargs="*", type=int, default=[], metavar="N")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--pos", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    where = "CPU" if device.type == "cpu" else _device_name(device)
    tl_version = importlib.metadata.version("transformer-lens")
    print(f"config: random Llama-like models, fp32, converted TransformerBridge (TransformerLens "
          f"{tl_version}), random task x {args.pos} tokens, discover_circuit defaults, {where}, "
          f"{args.threads} threads, {platform.machine()}; one run each")  # fmt: skip
    jobs = [(scale, args.prompts) for scale in args.scales]
    jobs += [(args.scales[0], n) for n in args.prompt_counts]
    rows = []
    for scale, prompts in jobs:
        sizes, vocab = random_families.SCALES[scale]
        model = random_families.build("llama", vocab, sizes)
        if device.type != "cpu":
            model = model.to(device)
        clean, corrupted, metric = random_families.task(vocab, prompts, args.pos)
        circuit = _run(model, clean.to(device), corrupted.to(device), metric, None)
        extra = circuit.extra
        coarse = extra.get("coarse", circuit)
        row = {
            "model": scale, "parameters": _params(model), "prompts": prompts,
            "total_s": extra["total_seconds"], "cpu_s": extra["cpu_seconds"],
            "peak_mib": extra["peak_bytes"] / 2**20, "stages": dict(extra["seconds"]),
            "coarse_edges": mask_size(coarse.mask), "graph_edges": coarse.graph.n_edges(),
        }  # fmt: skip
        if "peak_cuda_bytes" in extra:
            row["peak_cuda_mib"] = extra["peak_cuda_bytes"] / 2**20
        stages = ", ".join(f"{k} {v:.1f} s" for k, v in row["stages"].items())
        print(f"[{scale} ({row['parameters'] / 1e6:,.1f}M parameters), {prompts} prompts] total "
              f"{row['total_s']:.1f} s, CPU {row['cpu_s']:.1f} s, peak memory above the model "
              f"{row['peak_mib']:,.0f} MiB; {stages}; coarse circuit {row['coarse_edges']:,} of "
              f"{row['graph_edges']:,} edges")  # fmt: skip
        rows.append(row)
        del model
    print("\n| model | parameters | prompts | total | CPU time | peak memory | coarse circuit |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['parameters'] / 1e6:,.1f}M | {row['prompts']} | "
              f"{row['total_s']:.1f} s | {row['cpu_s']:.1f} s | {row['peak_mib']:,.0f} MiB | "
              f"{row['coarse_edges']:,} edges |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
