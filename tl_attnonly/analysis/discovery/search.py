"""Find a circuit in one call: score edges, prune, check exactly, split gate from value.

:func:`discover_circuit` scores the edges of the head graph (:mod:`.edge_scores`), keeps the best
(:func:`~tl_attnonly.analysis.prune`), runs the circuit exactly (:mod:`.runs`) and splits
the incoming edges of its main neurons into gate and value (:mod:`.runs`).

**Large models: two stages.** At neuron level the full graph of a GPT-2-small-sized model has
~1.3e9 edges (SmolLM2-135M: ~2.1e9), more than any score tensor should hold. With ``n_nodes=N``,
:func:`top_nodes` first ranks every attention head and neuron by node attribution patching
(:func:`~.node_circuits.node_attribution_scores`: one forward and backward
pass per batch) and keeps the ``N`` with the largest ``|score|``; edges are then scored, pruned and
run only among them (a restricted :class:`~.graph.HeadGraph`). The circuit run
stays exact: every node left out reads the corrupted run, as does every edge outside the circuit.
The node ranking is first-order, so a node can be missed; compare ``n_nodes`` values, and the
faithfulness, before trusting a circuit.
"""

from __future__ import annotations

from collections.abc import Collection

import pandas as pd
import torch
from jaxtyping import Int
from tqdm.auto import tqdm

from tl_attnonly.analysis.discovery.edge_scores import edge_attribution_scores, prune
from tl_attnonly.analysis.discovery.graph import EMBED, mlp_rest_label
from tl_attnonly.analysis.discovery.runs import (
    Circuit,
    circuit_gate_value_split,
    circuit_metric,
    faithfulness,
)
from tl_attnonly.analysis.discovery.sites import (
    DiscoveryMetric,
    _batches,
    _call_metric,
    check_discoverable,
)


def top_nodes(
    model,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    metric: DiscoveryMetric,
    n_nodes: int,
    *,
    neuron_level: bool = True,
    batch_size: int | None = None,
    progress: bool = True,
) -> tuple[list[str], pd.Series]:
    """The ``n_nodes`` attention heads and neurons with the largest node attribution ``|score|``.

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer`.
        clean_tokens, corrupted_tokens: ``[n_examples, pos]``, same shape.
        metric: As in :func:`~tl_attnonly.analysis.edge_attribution_scores` (additive over
            batches).
        n_nodes: How many nodes to keep (attention heads and neurons together).
        neuron_level: Return neurons ``L{l}N{i}`` (default), or all their neuron-heads
            ``L{l}N{i}.{k}`` (for a head-level graph).
        batch_size: Examples per forward/backward pass; default all at once.
        progress: Progress bar over batches.

    Returns:
        ``(labels, scores)``: the kept nodes' labels, best first, and every node's score
        (``pd.Series`` indexed by label; ``"embed"`` included, never kept: the graph always has
        it).
    """
    from tl_attnonly.analysis.discovery.node_circuits import ModelInputs, node_attribution_scores

    check_discoverable(model, neuron_level)
    if n_nodes < 1:
        raise ValueError(f"n_nodes must be >= 1, got {n_nodes}.")
    total: pd.Series | None = None
    batches = _batches(clean_tokens.shape[0], batch_size)
    for idx in tqdm(batches, desc="node attribution", disable=not progress):

        def node_metric(out, inputs, idx=idx):
            return _call_metric(metric, out, idx)

        scores = node_attribution_scores(
            model, ModelInputs(clean_tokens[idx]), ModelInputs(corrupted_tokens[idx]), node_metric
        ).scores
        total = scores if total is None else total + scores
    if total is None:
        raise ValueError("No examples: clean_tokens has 0 rows.")
    ranked = total.drop(EMBED).abs().sort_values(ascending=False, kind="stable")
    labels = list(ranked.index[:n_nodes])
    K = model.n_heads_per_neuron
    if not neuron_level and K > 1:
        labels = [f"{lab}.{k}" if "N" in lab else lab for lab in labels for k in range(K)]
        labels = list(dict.fromkeys(labels))
    return labels, total


def discover_circuit(
    model,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    metric: DiscoveryMetric,
    *,
    top_n: int | None = None,
    threshold: float | None = None,
    method: str = "eap",
    ig_steps: int = 5,
    neuron_level: bool = True,
    nodes: Collection[str] | None = None,
    n_nodes: int | None = None,
    mlp_rest: bool = False,
    batch_size: int | None = None,
    gate_value: bool = True,
    max_gate_value_neurons: int = 8,
    progress: bool = True,
) -> Circuit:
    """Score the edges, prune to a circuit, and check it exactly (two stages with ``n_nodes``).

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer`.
        clean_tokens, corrupted_tokens: ``[n_examples, pos]``, same shape.
        metric: ``metric(logits)`` or ``metric(logits, indices)`` -> scalar, additive over batches
            (:mod:`tl_attnonly.analysis.discovery.edge_scores`).
        top_n, threshold: How to prune (exactly one): :func:`~tl_attnonly.analysis.prune`.
        method, ig_steps, neuron_level, batch_size: As in
            :func:`~tl_attnonly.analysis.edge_attribution_scores`.
        nodes: Restrict the graph to these attention heads and neurons (the embeddings and logits
            are always in it).
        n_nodes: Two stages: keep the ``n_nodes`` nodes of :func:`top_nodes` (node attribution),
            then discover edges among them. Exclusive with ``nodes``.
        mlp_rest: With ``nodes`` or ``n_nodes``: keep each layer's other neurons as one node
            ``L{l}MLP`` (:class:`~.graph.HeadGraph`), so that what they carry
            together can be in the circuit instead of being frozen to the corrupted run.
        gate_value: Also split the incoming edges of the circuit's neurons into gate and value
            (:func:`~tl_attnonly.analysis.circuit_gate_value_split`; 3 circuit runs per neuron).
        max_gate_value_neurons: Split at most this many neurons (the ones with the largest summed
            |score| of incoming edges).
        progress: Progress bars.

    Returns:
        A :class:`~tl_attnonly.analysis.Circuit`; with ``n_nodes``, ``circuit.extra["nodes"]`` and
        ``circuit.extra["node_scores"]`` hold the kept nodes and every node's score.
    """
    if top_n is None and threshold is None:
        raise ValueError("Give top_n=... (edges to keep) or threshold=... (minimum |score|).")
    if mlp_rest and nodes is None and n_nodes is None:
        raise ValueError(
            "mlp_rest=True keeps the neurons left out of a restricted graph; give nodes=[...] or "
            "n_nodes=N too (the full graph leaves none out)."
        )
    if nodes is not None and n_nodes is not None:
        raise ValueError(
            "Give nodes=[...] (your own) or n_nodes=N (picked by attribution), not both."
        )
    extra: dict = {}
    if n_nodes is not None:
        nodes, node_scores = top_nodes(
            model, clean_tokens, corrupted_tokens, metric, n_nodes, neuron_level=neuron_level,
            batch_size=batch_size, progress=progress,
        )  # fmt: skip
        extra = {"nodes": nodes, "node_scores": node_scores}
    if mlp_rest and nodes is not None:
        nodes = [*nodes, *(mlp_rest_label(li) for li in range(model.cfg.n_layers))]
    scores = edge_attribution_scores(
        model, clean_tokens, corrupted_tokens, metric, method=method, ig_steps=ig_steps,
        neuron_level=neuron_level, nodes=nodes, batch_size=batch_size, progress=progress,
    )  # fmt: skip
    mask = prune(scores, top_n=top_n, threshold=threshold)
    m_circ = circuit_metric(
        model, mask, clean_tokens, corrupted_tokens, metric, neuron_level=neuron_level,
        nodes=nodes, batch_size=batch_size,
    )  # fmt: skip
    circuit = Circuit(
        scores, mask, scores.metric_clean, scores.metric_corrupted, m_circ,
        faithfulness(m_circ, scores.metric_clean, scores.metric_corrupted), extra=extra,
    )  # fmt: skip
    if gate_value:
        frame = circuit.edges()
        into = frame[frame.target_kind == "neuron"]
        ranked = (
            into.groupby("target").score.apply(lambda s: s.abs().sum()).sort_values(ascending=False)
        )
        circuit.gate_value = circuit_gate_value_split(
            model, mask, clean_tokens, corrupted_tokens, metric,
            neurons=list(ranked.index[:max_gate_value_neurons]), neuron_level=neuron_level,
            nodes=nodes, batch_size=batch_size, progress=progress,
        )  # fmt: skip
    return circuit


__all__ = [
    "discover_circuit",
    "top_nodes",
]
