"""Every neuron-head of some layers patched, with and without the metric's declared positions
(issue 47, item 4: a patching sweep at forward cost).

``get_act_patch_neuron_heads(model, corrupted, clean_cache, metric, "z", layers=[l])`` (the
batched default: each patch a rank-1 change of the residual stream after its layer, run from
there, many patches per pass) for each of ``--layers``, twice in one process on one model:

- ``every position``: a metric that declares nothing (``lambda logits: data.metric(logits)``),
  so every pass unembeds every position;
- ``declared``: the task dataset's own ``data.metric``, which declares the one position per row
  it reads (``logit_positions``: ``end_pos``), so every pass unembeds that one only.

Printed: the config, the time of each layer's sweep both ways (wall clock, one run each, the two
interleaved per layer), their ratio, and the largest difference of the two sweeps' values.

``--whole``: instead, one call over every layer with the declared metric (as a user would patch
every neuron-head of the model), its time, and three random patches of it against one patch per
full forward pass (``patches_per_pass=1``: TransformerLens's ``generic_activation_patch``).

Models: ``bundled`` (the bundled 2-layer model; an IOI-shaped pair of random tokens) and
``smollm2`` (SmolLM2-135M-Instruct; ``make_ioi_dataset``, ``--prompts`` prompts, ABC corruption,
seed 1; the ``[smollm2]`` extra), a ``HookedTransformer`` converted on TL 3.x, a converted
``TransformerBridge`` on 4.x (``--bridge``: the bridge on 3.x too).

Run: ``python benchmarks/bench_patch_sweep.py [--model bundled|smollm2] [--layers 29 15 1]
[--prompts 1] [--threads 2] [--bridge] [--whole]``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import time

import torch

import tl_attnonly
from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER
from tl_attnonly.analysis import get_act_patch_neuron_heads
from tl_attnonly.analysis.ioi.prompts import IOIDataset
from tl_attnonly.hooks import head_names_filter


def task(name: str, prompts: int, bridge: bool):
    """The converted model, the IOI-shaped dataset and a description."""
    if name == "smollm2":
        from tl_attnonly.analysis import make_ioi_dataset
        from tl_attnonly.smollm2 import load_smollm2, load_smollm2_bridge

        loaded = load_smollm2_bridge() if bridge else load_smollm2()
        data = make_ioi_dataset(loaded, prompts, corruption="abc", seed=1)
        desc = f"SmolLM2-135M-Instruct IOI, {prompts} prompt(s) x {data.tokens.shape[1]} tokens"
        return tl_attnonly.convert(loaded), data, desc + ", ABC"
    from tl_attnonly.bundled import load_bundled_bridge, load_bundled_model

    loaded = load_bundled_bridge() if bridge else load_bundled_model()
    g = torch.Generator().manual_seed(0)
    n, pos = max(prompts, 2), 14
    tokens = torch.randint(10, 3000, (n, pos), generator=g)
    tokens[:, 7] = tokens[:, 4]  # S2 repeats S1
    corrupted = tokens.clone()
    corrupted[:, 7] = (tokens[:, 7] + 7) % 3000
    at = torch.full((n,), 1)
    data = IOIDataset.from_tokens(tokens, corrupted, at, at + 3, at + 6)
    return tl_attnonly.convert(loaded), data, f"bundled model, {n} random IOI-shaped pairs x {pos}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["bundled", "smollm2"], default="bundled")
    parser.add_argument("--layers", nargs="+", type=int, default=None, help="default: all")
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bridge", action="store_true", help="TransformerBridge (4.x: always)")
    parser.add_argument("--whole", action="store_true", help="one call over every layer")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    bridge = args.bridge or not HAS_HOOKED_TRANSFORMER
    model, data, desc = task(args.model, args.prompts, bridge)
    layers = list(range(model.cfg.n_layers)) if args.layers is None else args.layers
    kind = "TransformerBridge" if bridge else "HookedTransformer"
    tl_version = importlib.metadata.version("transformer-lens")
    print(f"config: {desc}; every neuron-head's z of layers {layers}; {kind} (TransformerLens "
          f"{tl_version}), fp32, {args.threads} threads, {platform.machine()}; "
          "one run each")  # fmt: skip
    with torch.no_grad():
        _, cache = model.run_with_cache(data.tokens, names_filter=head_names_filter("z"))
    metrics = {"every position": lambda logits: data.metric(logits), "declared": data.metric}

    def sweep(metric, layer: int) -> torch.Tensor:
        return get_act_patch_neuron_heads(
            model, data.corrupted_tokens, cache, metric, "z", layers=[layer], progress=False
        )

    if args.whole:
        whole(model, data, cache)
        return
    sweep(data.metric, layers[0])  # warm-up (once-per-model checks)
    totals = dict.fromkeys(metrics, 0.0)
    for layer in layers:
        times, values = {}, {}
        for name, metric in metrics.items():
            start = time.perf_counter()
            values[name] = sweep(metric, layer)
            times[name] = time.perf_counter() - start
            totals[name] += times[name]
        diff = (values["declared"] - values["every position"]).abs().max().item()
        print(f"layer {layer}: {values['declared'].numel():,} patches; every position "
              f"{times['every position']:.2f} s, declared {times['declared']:.2f} s "
              f"({times['declared'] / times['every position']:.2f}x); max |difference| "
              f"{diff:.2e}")  # fmt: skip
    ratio = totals["declared"] / totals["every position"]
    print(f"total: every position {totals['every position']:.1f} s, declared "
          f"{totals['declared']:.1f} s ({ratio:.2f}x)")  # fmt: skip


def whole(model, data, cache) -> None:
    """``--whole``: every neuron-head of every layer in one call, and three random patches of
    it against one patch per full forward pass."""
    start = time.perf_counter()
    values = get_act_patch_neuron_heads(
        model, data.corrupted_tokens, cache, data.metric, "z", progress=True
    )
    seconds = time.perf_counter() - start
    print(f"every neuron-head: {values.numel():,} patches in {seconds:.1f} s "
          f"({seconds / 60:.1f} min), declared metric")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    picks = torch.randint(0, values.numel(), (3,), generator=gen).tolist()
    n = values.shape[1]
    diffs = []
    for i in picks:
        one = get_act_patch_neuron_heads(
            model, data.corrupted_tokens, cache, data.metric, "z", layers=[i // n],
            heads=[i % n], patches_per_pass=1, progress=False,
        )  # fmt: skip
        diffs.append(abs(one.item() - values[i // n, i % n].item()))
    print(f"three random patches against one patch per forward pass: max |difference| "
          f"{max(diffs):.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
