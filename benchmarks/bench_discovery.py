"""Circuit discovery on CPU: the default coarse-to-fine ``discover_circuit``, stage by stage.

Default: the bundled model (tiny-stdlib-silu: 2 layers, d_model 128, 4 heads, d_mlp 512, SiLU,
fp32) on the bracket task of ``scripts/circuit_bracket.py`` (clean ``"    return{a}({b}"``,
corrupted ``"    return{a}[{b}"``; metric: mean ``logit(")") - logit("]")``), and
``discover_circuit(model, clean, corrupted, metric)`` with its defaults (``DiscoveryOptions()``:
coarse graph of attention heads and whole MLP layers, EAP-IG with 5 steps ranked by signed effect,
sweep of exact runs to faithfulness 0.8, up to 30 pruning runs, MIB's curve, MLP nodes kept whole
(no neuron named: ``neurons_per_mlp=0``, so no gate/value split of neurons). Printed, each line
with the configuration it was measured under: the time of each stage (``circuit.extra["seconds"]``:
edge scores, sweep, pruning, MIB curve, neurons where named, node patching, gate/value), the
total, the peak resident memory above the loaded model (Linux ``VmHWM`` after resetting it), and
the circuit found (edges, faithfulness, ceiling, node-patching baseline, sweep and pruning runs).

``--smollm2`` measures the same call on SmolLM2-135M-Instruct IOI too (``make_ioi_dataset``,
``--ioi-prompts`` prompts, ABC corruption, seed 1, ``data.additive_metric()``; the [smollm2]
extra). It is slow on a CPU: see ``docs/open_questions.md``.

``--families`` measures the same call on two random models of SmolLM2-135M's size instead, a
Llama-like one and a Gemma-2-like one (norms after each sublayer, soft caps, GeGLU with K = 4
heads per neuron), converted bridges, on a random task (``benchmarks/random_families.py``), and
prints the Gemma-2-like total over the Llama-like (with ``--repeats``, medians of runs that
alternate between the two).

``--gpt2-small`` runs the earlier measurement instead: a GPT-2-small-shaped model (12 layers,
d_model 768, 12 heads, d_mlp 3072, LayerNorm, GELU, random weights) with a 1000-token vocabulary,
converted (K = 4 heads per neuron, neuron-level graph). Its full head graph has 1.26e9 edges:
``edge_attribution_scores`` refuses it before any work (``MemoryError``, 4.7 GiB of fp32 scores
against the default 1 GiB budget). The two stages of ``discover_circuit(..., n_nodes=N,
top_n=T)`` (``graph="neurons"``), timed apart: ``top_nodes`` ranks all 37,008 nodes by node
attribution; ``discover_circuit(..., nodes=...)`` scores the edges among the top ``N``, prunes to
``T`` edges, runs the circuit exactly and splits the gate and value of 4 neurons. Printed: the
time of each stage, the peak resident memory above the loaded model, and PASS/FAIL against
``--budget-s`` and ``--budget-mib``. ``--mlp-rest`` adds each layer's other neurons as one node
``L{l}MLP``. With ``--stream N``, ``top_edges`` also streams the top ``N`` of all 1.26e9 edges
(timed apart) and their circuit runs exactly on the restricted graph of their nodes.

``--kind`` picks the model kind: ``hooked`` (an ``AttnOnlyTransformer``, TransformerLens 3.x, the
default there), ``bridge`` (a converted ``TransformerBridge`` of the same weights, the default on
4.x) or ``both`` (TransformerLens 3.x: both kinds in one run, the bridge after the
``HookedTransformer``, then a line comparing them: the circuits' sizes and faithfulness, and the
bridge's total time over the ``HookedTransformer``'s).

``--neurons-per-mlp N|auto`` sets ``discover_circuit``'s ``neurons_per_mlp`` (the config line
says so); with ``auto`` the neuron stage's table (``circuit.extra["neuron_stage"]``: per MLP
node the named count, whether the remainder is kept, the faithfulness, the runs) and its totals
are printed too.

``--device cuda`` runs the same calls with the model and tokens on a GPU (the config lines name
it, e.g. ``cuda (NVIDIA H200)``; the total line adds the peak of the GPU's allocated memory above
the loaded model); ``--threads`` still sets the CPU threads.

``--repeats N`` (N > 1) makes the times robust to the machine's load: every kind measured is
loaded, run once untimed (warm-up), then run ``N`` times, the kinds alternating round by round in
ABBA order, and each line prints medians (the total line also the range of the runs and the
process's CPU time). With ``--kind both`` the comparison line prints the ratio of the median
totals, the range of the ratios within a round, and the ratio of the median CPU times, which with
one thread hardly depends on what else runs on the machine.

Run: ``python benchmarks/bench_discovery.py [--threads 2] [--examples 112] [--batch-size B]
[--smollm2 [--ioi-prompts 16]] [--kind hooked|bridge|both] [--neurons-per-mlp N|auto]
[--repeats N] [--device cuda] [--progress]``;
``python benchmarks/bench_discovery.py --gpt2-small [--threads 2] [--n-nodes 400] [--top-n 200]
[--stream 1000] [--mlp-rest]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
import warnings
from pathlib import Path

import torch

import tl_attnonly
from tl_attnonly._compat import HAS_HOOKED_TRANSFORMER
from tl_attnonly.analysis import (
    HeadGraph,
    circuit_metric,
    discover_circuit,
    edge_attribution_scores,
    logit_diff_metric,
    mask_size,
    top_edges,
    top_nodes,
)

warnings.filterwarnings("ignore", message="HookedTransformer is deprecated")

#: ``--kind`` -> the kinds measured, in order.
KINDS = {"hooked": ("hooked",), "bridge": ("bridge",), "both": ("hooked", "bridge")}


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (0 where there is none)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


ROOT = Path(__file__).resolve().parents[1]


def bracket_task(model, n_examples: int | None):
    """The bracket task of ``scripts/circuit_bracket.py`` (its own function, loaded from there)."""
    spec = importlib.util.spec_from_file_location(
        "circuit_bracket", ROOT / "scripts" / "circuit_bracket.py"
    )
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.bracket_task(model, n_examples)


def _run(
    model, clean, corrupted, metric, batch_size: int | None, progress: bool = False, **options
):
    """One ``discover_circuit`` (defaults but ``options``); its total time, the process's CPU
    time over it, its peak memory above the loaded model and its warnings in ``circuit.extra``
    (``total_seconds``, ``cpu_seconds``, ``peak_bytes``, ``n_warnings``; on CUDA also
    ``peak_cuda_bytes``: the peak of the device's allocated memory above the loaded model)."""
    cuda = clean.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(clean.device)
        torch.cuda.reset_peak_memory_stats(clean.device)
        cuda_base = torch.cuda.memory_allocated(clean.device)
    _reset_peak()
    base = _status("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        circuit = discover_circuit(
            model, clean, corrupted, metric, batch_size=batch_size, progress=progress, **options
        )
    if cuda:
        torch.cuda.synchronize(clean.device)
        circuit.extra["peak_cuda_bytes"] = torch.cuda.max_memory_allocated(clean.device) - cuda_base
    circuit.extra["total_seconds"] = time.perf_counter() - t0
    circuit.extra["cpu_seconds"] = time.process_time() - c0
    # (the kernel's RSS counters lag by up to a few pages: a run that allocates nothing can read
    # a peak a little below the base)
    circuit.extra["peak_bytes"] = max(0, _status("VmHWM") - base)
    circuit.extra["n_warnings"] = len(caught)
    return circuit


def _report(config: str, runs: list):
    """Print the runs of one model (each stage's median time, the median total and CPU time, the
    largest peak memory, the circuit and whether every run found it) and return the last run's
    circuit, its ``extra["total_seconds"]`` and ``extra["cpu_seconds"]`` the medians and
    ``extra["totals"]`` every run's total."""
    circuit = runs[-1]
    for stage in circuit.extra["seconds"]:
        value = statistics.median(run.extra["seconds"][stage] for run in runs)
        print(f"[{config}] {stage}: {value:.1f} s")
    stages = statistics.median(sum(run.extra["seconds"].values()) for run in runs)
    totals = [run.extra["total_seconds"] for run in runs]
    total = statistics.median(totals)
    cpu = statistics.median(run.extra["cpu_seconds"] for run in runs)
    peak = max(run.extra["peak_bytes"] for run in runs)
    spread = f", runs {min(totals):.2f}-{max(totals):.2f} s" if len(runs) > 1 else ""
    cuda = ""
    if "peak_cuda_bytes" in circuit.extra:
        cuda_peak = max(run.extra["peak_cuda_bytes"] for run in runs)
        cuda = f", GPU memory {cuda_peak / 2**20:.0f} MiB"
    print(
        f"[{config}] total: {total:.1f} s (stages {stages:.1f} s){spread}, CPU {cpu:.1f} s; "
        f"peak memory above the loaded model {peak / 2**20:.0f} MiB{cuda}"
    )
    coarse = circuit.extra.get("coarse", circuit)
    curve = circuit.curve
    same = {(mask_size(run.mask), run.faithfulness) for run in runs}
    print(
        f"[{config}] circuit: coarse {mask_size(coarse.mask):,} of {coarse.graph.n_edges():,} "
        f"edges, faithfulness {circuit.faithfulness:.3f} (ceiling {circuit.ceiling:.3f}, node "
        f"patching {circuit.node_patching:.3f}); {len(curve) if curve is not None else 0} exact "
        f"sweep runs, {len(circuit.extra.get('pruning', ()))} pruning runs; "
        + ("" if circuit is coarse else f"with named neurons {mask_size(circuit.mask):,} edges; ")
        + f"{circuit.extra['n_warnings']} warning(s)"
        + ("" if len(runs) == 1 else "; the same in every run" if len(same) == 1 else
           "; DIFFERENT across runs")
    )  # fmt: skip
    circuit.extra["total_seconds"] = total
    circuit.extra["totals"] = totals
    circuit.extra["cpu_seconds"] = cpu
    table = circuit.extra.get("neuron_stage")
    if table is not None:  # neurons_per_mlp="auto": per MLP node, then the totals
        print(f"[{config}] neuron stage:\n{table.to_string(index=False)}")
        print(
            f"[{config}] neuron stage: {int(table.named.sum()):,} named neurons, "
            f"{int(table.remainder.sum())} remainder(s) kept, "
            f"{circuit.extra['neuron_stage_runs']} runs"
        )
    return circuit


def measure_kinds(
    kinds: tuple[str, ...], load, repeats: int, batch_size, progress: bool, **options
) -> dict:
    """The default ``discover_circuit`` on each kind; ``load(kind, note)`` gives ``(model, clean,
    corrupted, metric, config)``, ``note`` the words the config adds for repeats.

    One run (``repeats`` 1): each kind loaded, run and dropped in turn. More: all kinds loaded,
    one untimed warm-up run each, then ``repeats`` rounds, each running every kind once,
    alternating the order (hooked, bridge, bridge, hooked, ...) so that a change of the
    machine's load over the rounds falls on both kinds alike; medians per kind."""
    if repeats == 1:
        found = {}
        for kind in kinds:
            model, clean, corrupted, metric, config = load(kind, "")
            found[kind] = _report(
                config, [_run(model, clean, corrupted, metric, batch_size, progress, **options)]
            )
            del model
        return found
    note = (
        f", median of {repeats} runs"
        + (" interleaved with the other kind" if len(kinds) > 1 else "")
        + " after a warm-up run"
    )
    tasks = {kind: load(kind, note) for kind in kinds}
    for kind in kinds:
        _run(*tasks[kind][:4], batch_size, progress, **options)
    runs: dict[str, list] = {kind: [] for kind in kinds}
    for round_ in range(repeats):
        for kind in kinds if round_ % 2 == 0 else kinds[::-1]:
            runs[kind].append(_run(*tasks[kind][:4], batch_size, progress, **options))
    return {kind: _report(tasks[kind][4], runs[kind]) for kind in kinds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--batch-size", type=int, default=None,
        help="examples per pass (default: all at once; --gpt2-small: 4)",
    )  # fmt: skip
    parser.add_argument("--examples", type=int, default=112, help="bracket prompts (max 112)")
    parser.add_argument(
        "--smollm2", action="store_true", help="also SmolLM2-135M IOI (the [smollm2] extra; slow)"
    )
    parser.add_argument("--ioi-prompts", type=int, default=16, help="with --smollm2")
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="runs per kind: with more than 1, a warm-up run each, then the kinds alternate "
        "round by round and medians are printed (the ratio robust to the machine's load)",
    )  # fmt: skip
    parser.add_argument(
        "--neurons-per-mlp", default=None, metavar="N|auto",
        help="discover_circuit's neurons_per_mlp (default: its default, 0); 'auto' prints the "
        "neuron stage's table",
    )  # fmt: skip
    parser.add_argument(
        "--progress", action="store_true", help="progress bars (stderr) during discover_circuit"
    )
    parser.add_argument(
        "--kind", choices=sorted(KINDS), default=None,
        help="hooked (AttnOnlyTransformer, TL 3 default), bridge (TL 4 default) or both (TL 3)",
    )  # fmt: skip
    parser.add_argument(
        "--device", default="cpu",
        help="where the model and tokens live (e.g. cuda; the config line names the GPU); "
        "--threads still sets the CPU threads",
    )  # fmt: skip
    parser.add_argument(
        "--gpt2-small", action="store_true",
        help="the earlier two-stage neuron-level measurement on a GPT-2-small-shaped model",
    )  # fmt: skip
    parser.add_argument(
        "--families", action="store_true",
        help="random Llama-like and Gemma-2-like models of SmolLM2's size instead (bridges)",
    )  # fmt: skip
    fam = parser.add_argument_group("--families")
    fam.add_argument("--family-vocab", type=int, default=49152)
    fam.add_argument("--family-prompts", type=int, default=16)
    fam.add_argument("--family-pos", type=int, default=16)
    group = parser.add_argument_group("--gpt2-small")
    group.add_argument("--layers", type=int, default=12)
    group.add_argument("--d-mlp", type=int, default=3072)
    group.add_argument("--vocab", type=int, default=1000)
    group.add_argument("--act", default="gelu")
    group.add_argument("--prompts", type=int, default=8)
    group.add_argument("--pos", type=int, default=16)
    group.add_argument("--n-nodes", type=int, default=400)
    group.add_argument("--top-n", type=int, default=200)
    group.add_argument("--budget-s", type=float, default=600.0)
    group.add_argument("--budget-mib", type=float, default=2048.0)
    group.add_argument(
        "--mlp-rest", action="store_true",
        help="keep each layer's other neurons as one node L{l}MLP (discover_circuit mlp_rest)",
    )  # fmt: skip
    group.add_argument(
        "--stream", type=int, default=0, metavar="N",
        help="also stream the top N edges of the full graph (top_edges), timed apart",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here (use --device cpu)")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: only cpu and cuda are measured")
    if args.gpt2_small and device.type != "cpu":
        parser.error("--gpt2-small runs on the CPU only (leave --device out)")
    where = "" if device.type == "cpu" else f", {_device_name(device)}"
    if args.gpt2_small:
        if args.batch_size is None:
            args.batch_size = 4
        two_stage(args)
        return
    if args.families:
        families(args, where)
        return
    kinds = KINDS[args.kind or ("hooked" if HAS_HOOKED_TRANSFORMER else "bridge")]
    if "hooked" in kinds and not HAS_HOOKED_TRANSFORMER:
        parser.error("--kind hooked/both needs TransformerLens 3.x (HookedTransformer)")
    batch = "all" if args.batch_size is None else args.batch_size
    options = {}
    if args.neurons_per_mlp is not None:
        npm = args.neurons_per_mlp
        options["neurons_per_mlp"] = npm if npm == "auto" else int(npm)
    settings = "defaults" if not options else f"defaults but neurons_per_mlp={args.neurons_per_mlp}"

    def bundled(kind: str, note: str):
        model = tl_attnonly.convert(_bundled(kind, device))
        clean, corrupted, metric = bracket_task(model, args.examples)
        config = (
            f"bundled tiny-stdlib-silu fp32{_suffix(kind, kinds)}{where}, bracket task "
            f"{clean.shape[0]} prompts x {clean.shape[1]} tokens, batch {batch}, {settings}, "
            f"{torch.get_num_threads()} threads{note}"
        )
        return model, clean, corrupted, metric, config

    found = measure_kinds(kinds, bundled, args.repeats, args.batch_size, args.progress, **options)
    _compare(found, "bundled tiny-stdlib-silu fp32, bracket task", args.repeats)
    if args.smollm2:
        found = measure_kinds(
            kinds,
            lambda kind, note: _smollm2(kind, kinds, args, batch, note, settings, device, where),
            args.repeats, args.batch_size, args.progress, **options,
        )  # fmt: skip
        _compare(found, f"SmolLM2-135M-Instruct fp32, IOI {args.ioi_prompts} prompts", args.repeats)


def families(args: argparse.Namespace, where: str) -> None:
    """``--families``: the default call on a random Llama-like and a Gemma-2-like model."""
    import random_families

    batch = "all" if args.batch_size is None else args.batch_size
    vocab, prompts, pos = args.family_vocab, args.family_prompts, args.family_pos

    def load(family: str, note: str):
        model = random_families.build(family, vocab)
        clean, corrupted, metric = random_families.task(vocab, prompts, pos)
        config = (
            f"random {family}-like, SmolLM2-135M's sizes, vocab {vocab}, fp32, converted "
            f"TransformerBridge{where}, random task {prompts} prompts x {pos} tokens, batch "
            f"{batch}, defaults, {torch.get_num_threads()} threads{note}"
        )
        return model, clean, corrupted, metric, config

    found = measure_kinds(("llama", "gemma2"), load, args.repeats, args.batch_size, args.progress)
    llama, gemma = found["llama"], found["gemma2"]
    print(
        f"[random SmolLM2-sized models, vocab {vocab}, {torch.get_num_threads()} threads] "
        f"gemma2-like over llama-like: time "
        f"{gemma.extra['total_seconds'] / llama.extra['total_seconds']:.2f}x, CPU time "
        f"{gemma.extra['cpu_seconds'] / llama.extra['cpu_seconds']:.2f}x"
    )


def _suffix(kind: str, kinds: tuple[str, ...]) -> str:
    """The kind in a config line (only the bridge is named when one kind is measured)."""
    if len(kinds) == 1 and kind == "hooked":
        return ""
    return ", AttnOnlyTransformer" if kind == "hooked" else ", converted TransformerBridge"


def _device_name(device: torch.device) -> str:
    """The device in a config line: ``cuda (NVIDIA H200)``; the CPU is not named."""
    if device.type != "cuda":
        return str(device)
    return f"{device} ({torch.cuda.get_device_name(device)})"


def _bundled(kind: str, device: torch.device):
    from tl_attnonly.bundled import load_bundled_bridge, load_bundled_model

    load = load_bundled_model if kind == "hooked" else load_bundled_bridge
    return load(device=device)


def _smollm2(
    kind: str,
    kinds: tuple[str, ...],
    args: argparse.Namespace,
    batch,
    note: str,
    settings: str,
    device: torch.device,
    where: str,
):
    from tl_attnonly.analysis import make_ioi_dataset
    from tl_attnonly.smollm2 import load_smollm2, load_smollm2_bridge

    load = load_smollm2 if kind == "hooked" else load_smollm2_bridge
    original = load(device=device)
    data = make_ioi_dataset(original, args.ioi_prompts, corruption="abc", seed=1)
    model = tl_attnonly.convert(original)
    del original
    config = (
        f"SmolLM2-135M-Instruct fp32{_suffix(kind, kinds)}{where}, IOI {len(data)} prompts x "
        f"{data.tokens.shape[1]} tokens (abc, seed 1), batch {batch}, {settings}, "
        f"{torch.get_num_threads()} threads{note}"
    )
    return model, data.tokens, data.corrupted_tokens, data.additive_metric(), config


def _compare(found: dict, config: str, repeats: int = 1) -> None:
    """One line comparing the two kinds' circuits and times (``--kind both``): the bridge's
    median CPU time and median total (wall-clock) time over the ``HookedTransformer``'s, and with
    repeats the range of the wall-clock ratios of the runs made in the same round. With one
    thread the CPU time hardly depends on what else runs on the machine."""
    if set(found) != {"hooked", "bridge"}:
        return
    hooked, bridge = found["hooked"], found["bridge"]
    ratio = bridge.extra["total_seconds"] / hooked.extra["total_seconds"]
    cpu = bridge.extra["cpu_seconds"] / hooked.extra["cpu_seconds"]
    rounds = ""
    if repeats > 1:
        paired = [b / h for b, h in zip(bridge.extra["totals"], hooked.extra["totals"])]
        rounds = (
            f"; medians of {repeats} interleaved runs, ratio per round "
            f"{min(paired):.2f}-{max(paired):.2f}"
        )
    print(
        f"[{config}, bridge vs AttnOnlyTransformer, {torch.get_num_threads()} threads] circuit "
        f"edges {mask_size(bridge.mask):,} vs {mask_size(hooked.mask):,}, faithfulness "
        f"{bridge.faithfulness:.3f} vs {hooked.faithfulness:.3f} (difference "
        f"{bridge.faithfulness - hooked.faithfulness:+.3f}){rounds}; CPU time {cpu:.2f}x; "
        f"time {ratio:.2f}x"
    )


def two_stage(args: argparse.Namespace) -> None:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    """The ``--gpt2-small`` measurement (module docstring)."""
    cfg = HookedTransformerConfig(
        n_layers=args.layers, d_model=768, n_heads=12, d_head=64, d_mlp=args.d_mlp,
        d_vocab=args.vocab, n_ctx=max(64, args.pos), act_fn=args.act, normalization_type="LN",
        seed=0, device="cpu",
    )  # fmt: skip
    model = tl_attnonly.convert(HookedTransformer(cfg).eval(), share_weights=True)
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, args.vocab, (args.prompts, args.pos), generator=g)
    corrupted = clean.clone()
    corrupted[:, args.pos // 2 :] = torch.randint(
        0, args.vocab, (args.prompts, args.pos - args.pos // 2), generator=g
    )
    correct, wrong = torch.randint(0, args.vocab, (2, args.prompts), generator=g)
    metric = logit_diff_metric(correct, wrong)
    n_edges = HeadGraph(model).n_edges()
    print(
        f"config: {args.layers} layers, d_model 768, 12 heads, d_mlp {args.d_mlp}, act "
        f"{args.act} (K={model.n_heads_per_neuron}), vocab {args.vocab}, fp32, "
        f"{args.prompts} prompts x {args.pos} tokens, batch {args.batch_size}, "
        f"{torch.get_num_threads()} threads"
    )
    tag = (
        f"[GPT-2-small-shaped {args.layers}L d_mlp {args.d_mlp} {args.act}, "
        f"{args.prompts}x{args.pos}, batch {args.batch_size}, N={args.n_nodes} T={args.top_n}"
        f"{' mlp_rest' if args.mlp_rest else ''}, {torch.get_num_threads()} threads]"
    )
    print(f"{tag} full graph: {n_edges:,} edges (neuron level)")
    try:
        edge_attribution_scores(model, clean, corrupted, metric, progress=False)
        print(f"{tag} full graph: scored (unexpected)")
    except MemoryError as err:
        print(f"{tag} full graph: refused before any work: {str(err)[:90]}...")

    _reset_peak()
    base = _status("VmRSS")
    times = {}
    t0 = time.perf_counter()
    nodes, _ = top_nodes(
        model, clean, corrupted, metric, args.n_nodes, batch_size=args.batch_size, progress=False
    )
    times["node attribution"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    circuit = discover_circuit(
        model, clean, corrupted, metric, nodes=nodes, top_n=args.top_n, mlp_rest=args.mlp_rest,
        batch_size=args.batch_size, max_gate_value_neurons=4, progress=True,
    )  # fmt: skip
    times["edges + prune + circuit run + gate/value (4 neurons)"] = time.perf_counter() - t0
    peak = _status("VmHWM") - base
    t0 = time.perf_counter()
    full = circuit_metric(
        model, circuit.graph.full_mask(True), clean, corrupted, metric,
        nodes=circuit.graph.node_labels(), batch_size=args.batch_size,
    )  # fmt: skip
    times["one exact circuit run (all edges among the kept nodes)"] = time.perf_counter() - t0
    print(
        f"{tag} restricted graph: {len(circuit.graph.node_labels())} nodes, "
        f"{circuit.graph.n_edges():,} edges; circuit: "
        f"{mask_size(circuit.mask)} edges, faithfulness {circuit.faithfulness:.3f} (all kept "
        f"nodes' edges: {(full - circuit.metric_corrupted) / (circuit.metric_clean - circuit.metric_corrupted):.3f})"  # noqa: E501
    )
    for name, seconds in times.items():
        print(f"{tag} {name}: {seconds:.1f} s")
    total = sum(v for k, v in times.items() if not k.startswith("one exact"))
    ok = total <= args.budget_s and peak <= args.budget_mib * 2**20
    print(
        f"{tag} two-stage total {total:.1f} s (budget {args.budget_s:.0f} s), peak memory "
        f"above the loaded model {peak / 2**20:.0f} MiB (budget {args.budget_mib:.0f} MiB): "
        f"{'PASS' if ok else 'FAIL'}"
    )
    if args.stream:
        _reset_peak()
        base = _status("VmRSS")
        t0 = time.perf_counter()
        top = top_edges(
            model, args.stream, clean, corrupted, metric, batch_size=args.batch_size, progress=True
        )
        seconds, peak_stream = time.perf_counter() - t0, _status("VmHWM") - base
        nodes, mask = top.restricted_mask(model)
        m = circuit_metric(model, mask, clean, corrupted, metric, nodes=nodes)
        print(
            f"{tag} streamed top {args.stream} of {top.n_scored:,} edges (top_edges): "
            f"{seconds:.1f} s, peak memory above the loaded model {peak_stream / 2**20:.0f} MiB; "
            f"their circuit ({len(nodes)} nodes): faithfulness "
            f"{(m - top.metric_corrupted) / (top.metric_clean - top.metric_corrupted):.3f}"
        )
    if os.environ.get("BENCH_STRICT") and not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
