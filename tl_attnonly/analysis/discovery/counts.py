"""One vocabulary of counts for a circuit (:func:`circuit_counts`): attention heads, key/value
groups, latent attention inputs, MLP layers, named neurons and edges, counted the same way in
:meth:`~tl_attnonly.analysis.Circuit.report` and every circuit figure's title
(:mod:`tl_attnonly.vis.circuit`, :mod:`tl_attnonly.vis.neuron_circuit`).
"""

from __future__ import annotations

import re
from typing import Any

from tl_attnonly.analysis.discovery.expert_nodes import EXPERT_LABEL
from tl_attnonly.analysis.discovery.graph import EMBED, LOGITS
from tl_attnonly.analysis.discovery.profile_stats import NEURON_LABEL, parse_neuron_label

_HEAD = re.compile(r"^L\d+H\d+$")
#: A key/value group's label, ``L{l}KV{j}``.
KV_LABEL = re.compile(r"^L\d+KV\d+$")

#: What a key/value group node is (the report's legend and the figures' legend).
KV_GROUP_LEGEND = (
    "key/value groups L{l}KV{j}: under grouped-query attention one key/value head gives its k and "
    "v to several query heads, so the k and v inputs are nodes of their own (not heads)"
)
#: A latent attention layer's input's label, ``L{l}ATTN``.
LATENT_LABEL = re.compile(r"^L\d+ATTN$")
#: What a latent attention input node is (the report's legend).
LATENT_ATTN_LEGEND = (
    "latent attention inputs L{l}ATTN: under multi-head latent attention (DeepSeek-V2/V3) every "
    "head's q, k and v come from latents the heads share, so the layer's normalised input is one "
    "node that all its heads read (the heads themselves write their own outputs)"
)


def reader_kind(label: str) -> str | None:
    """The figures' kind of a node that is neither a head nor a neuron: ``"kv"`` for a key/value
    group ``L{l}KV{j}`` and ``"latent"`` for a latent attention input ``L{l}ATTN`` (attention
    readers that are not heads), ``"expert"`` for a mixture of experts' expert ``L{l}E{e}`` /
    ``L{l}S``, else None."""
    if KV_LABEL.match(label):
        return "kv"
    if LATENT_LABEL.match(label):
        return "latent"
    return "expert" if EXPERT_LABEL.match(label) else None


def kind_layer(label: str) -> tuple[str, int]:
    """``(kind, layer)`` of a node label: ``("attn", l)`` for ``L{l}H{h}`` / ``L{l}KV{j}`` /
    ``L{l}ATTN``, ``("neuron", l)`` for ``L{l}N{i}`` / ``L{l}MLP`` / a mixture of experts'
    experts ``L{l}E{e}``, ``L{l}S`` and their neurons ``L{l}E{e}N{j}``, ``L{l}SN{j}``,
    ``(label, -1)`` for the embeddings and logits."""
    if label in (EMBED, LOGITS):
        return label, -1
    match = re.match(r"^L(\d+)(H|KV|N|MLP|ATTN|E\d+(N\d+)?$|S\d*(N\d+)?$)", label)
    if match is None:
        raise ValueError(f"Not a node label: {label!r}.")
    mlp = match.group(2) in ("N", "MLP") or match.group(2)[0] in "ES"
    return ("neuron" if mlp else "attn"), int(match.group(1))


#: :meth:`~tl_attnonly.analysis.Circuit.report`'s line for a circuit whose MLP nodes are whole
#: layers (the default ``neurons_per_mlp=0``): how to resolve them into neurons.
WHOLE_MLP_NOTE = (
    "MLP nodes: each L{l}MLP is its whole layer; no neuron is named (neurons_per_mlp=0, the "
    "default). To resolve them into neurons: discover_circuit(..., neurons_per_mlp='auto') names "
    "as few per node as keep the target by exact runs (slower; whole_mlps=(0,) keeps MLP0 whole, "
    "as the IOI literature treats it), neurons_per_mlp=N the N best by node attribution. The "
    "report then states how much the named neurons carry."
)


def named_neurons(circuit: Any) -> list[str]:
    """The neurons named as nodes of ``circuit``: the neuron stage's (``circuit.extra["named"]``,
    lowest layer first, each layer in its ranking order), then any other neuron with a circuit
    edge (a neuron-level graph's), by layer and index."""
    named = circuit.extra.get("named") or {}
    out = [label for layer in sorted(named) for label in named[layer]]
    seen = set(out)
    others = [n for n in circuit.nodes() if NEURON_LABEL.match(n) and n not in seen]
    return out + sorted(others, key=parse_neuron_label)


def circuit_counts(circuit: Any) -> dict[str, int]:
    """The circuit figures' counts, from :meth:`~tl_attnonly.analysis.Circuit.edges`.

    ``attention_heads``: query heads ``L{l}H{h}`` with an edge (as :meth:`Circuit.report` counts
    them); ``kv_groups``: key/value groups ``L{l}KV{j}`` of grouped-query attention with an edge
    (the k and v inputs shared by several query heads; not heads); ``latent_attn_inputs``:
    latent attention layers' inputs ``L{l}ATTN`` with an edge (not heads); ``experts``: a
    mixture of experts' experts ``L{l}E{e}``, ``L{l}S`` with an edge; ``mlp_layers``:
    layers with an MLP node (a named neuron or the remainder ``L{l}MLP``) with an edge, or a
    named neuron;
    ``named_neurons``: the neurons named as nodes
    (:func:`~tl_attnonly.analysis.discovery.profiles.named_neurons`, with or without an edge);
    ``edges``: the circuit's edges; ``coarse_edges``: the coarse circuit's (before neurons were
    named; ``edges`` when there is none).
    """
    frame = circuit.edges()
    nodes = set(frame.source) | set(frame.target)
    coarse = (getattr(circuit, "extra", None) or {}).get("coarse")
    named = named_neurons(circuit)
    mlp = {kind_layer(n)[1] for n in nodes - {EMBED, LOGITS} if kind_layer(n)[0] == "neuron"}
    return dict(
        attention_heads=sum(bool(_HEAD.match(n)) for n in nodes),
        kv_groups=sum(bool(KV_LABEL.match(n)) for n in nodes),
        latent_attn_inputs=sum(bool(LATENT_LABEL.match(n)) for n in nodes),
        experts=sum(bool(EXPERT_LABEL.match(n)) for n in nodes),
        mlp_layers=len(mlp | {kind_layer(n)[1] for n in named}),
        named_neurons=len(named),
        edges=len(frame),
        coarse_edges=len(frame) if coarse is None or coarse is circuit else len(coarse.edges()),
    )


def counts_text(counts: dict[str, int]) -> str:
    """:func:`circuit_counts` in words (the figures' titles)."""
    parts = [f"{counts['attention_heads']} attention heads"]
    if counts["kv_groups"]:
        parts.append(f"{counts['kv_groups']} key/value groups")
    if counts["latent_attn_inputs"]:
        parts.append(f"{counts['latent_attn_inputs']} latent attention inputs")
    parts.append(f"{counts['mlp_layers']} MLP layers")
    if counts["experts"]:
        parts.append(f"{counts['experts']} experts")
    if counts["named_neurons"]:
        parts.append(f"{counts['named_neurons']} named neurons")
    edges = f"{counts['edges']} edges"
    if counts["coarse_edges"] != counts["edges"]:
        edges += f" ({counts['coarse_edges']} before naming neurons)"
    return ", ".join([*parts, edges])


__all__ = [
    "KV_GROUP_LEGEND",
    "EXPERT_LABEL",
    "KV_LABEL",
    "LATENT_ATTN_LEGEND",
    "LATENT_LABEL",
    "WHOLE_MLP_NOTE",
    "circuit_counts",
    "counts_text",
    "kind_layer",
    "named_neurons",
    "reader_kind",
]
