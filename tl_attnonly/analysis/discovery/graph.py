"""The unified head graph: embeddings, attention heads, neuron-heads and the logits.

Every component that writes to the residual stream is a *source* node: the embeddings (token plus
position), every attention head ``L{l}H{h}`` and every neuron ``L{l}N{i}`` (or, at head level,
every neuron-head ``L{l}N{i}.{k}``). Every component that reads the residual stream has one or
more *inputs*: an attention head's ``q``, ``k`` and ``v``; a neuron-head's ``gate`` (its query,
hence its pattern: whether it fires) and ``value`` (how much it writes); the ``logits``. An edge
joins a source to an input of a later component (through the residual stream, directly).

Gated MLPs (SwiGLU, GeGLU, ReGLU; ``docs/gated_mlps.md``) read the residual twice, through
``W_gate`` and through ``W_in``, so there the two inputs are those two reads: ``gate`` is
``g = x W_gate[:, i]`` (``hook_pre``: the query, hence the pattern, and the factor
``f_k g + e_k - g_k`` of the value) and ``value`` is ``u = x W_in[:, i]`` (``hook_pre_linear``:
the linear branch the product is multiplied by). The neuron writes ``act_K(g) * u``.

Nodes are grouped by layer and kind; edge scores and circuit masks are stored per
``(source group, input group)`` block, ``[n_sources, n_inputs]``.

**Restricted graphs.** ``HeadGraph(model, nodes=[...])`` keeps only the given attention heads and
neurons (the embeddings and the logits are always kept): its edges are those of the full graph
between kept nodes, and each group remembers which of the full group's nodes it holds
(``index``), so scores over a restricted graph are the corresponding entries of the full graph's
scores, and a circuit over it is a circuit of the full graph (every edge touching a dropped node
absent). At neuron level a GPT-2-small-sized model has ~1.3e9 edges; a few thousand kept nodes
have a few million. :func:`~tl_attnonly.analysis.discover_circuit` with ``n_nodes=`` picks them by
node attribution first; :func:`~tl_attnonly.analysis.top_edges` streams the full graph's top-n
edges instead.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, cast

import pandas as pd
import torch

from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.expert_nodes import expert_neuron_nodes
from tl_attnonly.hooks import attn_head_label, neuron_head_label

if TYPE_CHECKING:
    from tl_attnonly.protocol import ModelLike

#: Inputs of each kind of reader.
ATTN_INPUTS = ("q", "k", "v")
NEURON_INPUTS = ("gate", "value")
LOGITS = "logits"
EMBED = "embed"
#: Kind of the node ``L{l}MLP``: layer ``l``'s neurons left out of a restricted graph, together.
MLP_REST = "mlp"
#: Kind of the node ``L{l}MLP`` of a mixture-of-experts layer: the whole layer, one source (its
#: output, ``hook_mlp_out``) and one input (what its norm reads: the router and every expert read
#: the normalised input, ``blocks.{l}.mlp.hook_in``). Routing is recomputed from each run's input.
EXPERTS = "experts"
#: Kind of the source nodes ``L{l}E{e}`` (routed experts) and ``L{l}S`` (shared) of a
#: mixture-of-experts layer named by its experts (:mod:`.expert_nodes`); the layer keeps its one
#: input ``L{l}MLP`` (:data:`EXPERTS`).
EXPERT = "expert"
#: Kind of the source nodes ``L{l}E{e}N{j}`` / ``L{l}SN{j}``: an expert's neurons named beside
#: its node (then its remainder; :mod:`.expert_nodes`), reading the layer's input too.
EXPERT_NEURON = "expert_neuron"
#: Kind of the input ``L{l}ATTN`` of a multi-head latent attention layer (DeepSeek-V2/V3): one
#: reader, the layer's normalised input (``blocks.{l}.attn.hook_in``), which every head reads. Its
#: queries, keys and values are decompressed from latents the heads share (the key/value latent
#: normalised across them), so no head reads an input of its own; the heads stay source nodes.
LATENT_ATTN = "latent_attn"


def mlp_rest_label(layer: int) -> str:
    """``"L{layer}MLP"``: the node of a layer's neurons left out of a restricted graph."""
    return f"L{layer}MLP"


def latent_attn_label(layer: int) -> str:
    """``"L{layer}ATTN"``: the input every head of a multi-head latent attention layer reads."""
    return f"L{layer}ATTN"


class _Labels(tuple):
    """One layer's neuron (or neuron-head) labels, in order, with ``position``: label -> its index
    (a graph of few kept nodes looks them up instead of testing every label)."""

    position: dict[str, int]


@functools.lru_cache(maxsize=8)
def _neuron_labels(n_layers: int, d_mlp: int, K: int) -> tuple[_Labels, ...]:
    """Per layer, its neurons' labels ``L{l}N{i}`` (``K == 0``) or its neuron-heads' (``K``
    per neuron), made once per model shape."""
    out = []
    for li in range(n_layers):
        labels = _Labels(
            [f"L{li}N{i}" for i in range(d_mlp)]
            if K == 0
            else [neuron_head_label(li, h, K) for h in range(d_mlp * K)]
        )
        labels.position = {label: j for j, label in enumerate(labels)}
        out.append(labels)
    return tuple(out)


@functools.lru_cache(maxsize=8)
def _known_labels(n_layers: int, n_heads: int, d_mlp: int, K: int) -> frozenset[str]:
    """Every node label of a graph of this shape (:func:`_neuron_labels`): attention heads,
    neurons (or neuron-heads) and MLP remainders."""
    known = {attn_head_label(li, h) for li in range(n_layers) for h in range(n_heads)}
    known.update(label for layer in _neuron_labels(n_layers, d_mlp, K) for label in layer)
    known.update(mlp_rest_label(li) for li in range(n_layers))
    return frozenset(known)


@dataclass(frozen=True)
class SourceGroup:
    """Source nodes of one kind in one layer.

    Attributes:
        key: ``"embed"``, ``"attn.{l}"`` or ``"neuron.{l}"``.
        kind: ``"embed"``, ``"attn"`` or ``"neuron"``.
        layer: Layer index (-1 for the embeddings).
        labels: Node labels (``"embed"``, ``"L0H1"``, ``"L0N5"`` or ``"L0N5.1"``).
        order: Position in the residual stream (the group is read by inputs of larger order).
        index: Positions of ``labels`` in the full group (all of it unless restricted); for an
            MLP remainder (kind ``"mlp"``, one node) the positions of the neurons it holds.
        size: Number of nodes in the full group.
    """

    key: str
    kind: str
    layer: int
    labels: tuple[str, ...]
    order: int
    index: tuple[int, ...]
    size: int


@dataclass(frozen=True)
class InputGroup:
    """Inputs of one kind of reader in one layer.

    Attributes:
        key: ``"attn.{l}.q"``, ``"neuron.{l}.gate"``, ``"logits"``, ...
        kind: ``"attn"``, ``"neuron"``, ``"logits"``, :data:`EXPERTS`, :data:`MLP_REST` or
            :data:`LATENT_ATTN` (key ``"attn.{l}.in"``).
        layer: Layer index (``n_layers`` for the logits).
        input: ``"q"``, ``"k"``, ``"v"``, ``"gate"``, ``"value"``, ``"qkv"`` (a latent attention
            layer's one input) or ``""`` (logits, an expert layer).
        labels: The reading nodes' labels (for ``k``/``v`` of grouped-query attention, the key/value
            heads ``L{l}KV{j}``; a latent attention layer's input ``L{l}ATTN``).
        order: Reads every source group of smaller order.
        index: Positions of ``labels`` in the full group (all of it unless restricted); for an
            MLP remainder (kind ``"mlp"``, one reader) the positions of the neurons it holds.
        size: Number of readers in the full group.
        position: The position class this group reads at (key suffix ``"@{position}"``;
            :mod:`.positions`), or None: every position.
    """

    key: str
    kind: str
    layer: int
    input: str
    labels: tuple[str, ...]
    order: int
    index: tuple[int, ...]
    size: int
    position: str | None = None


@dataclass(frozen=True)
class GraphShape:
    """What a :class:`HeadGraph` reads of its model (TransformerLens's config names): enough to
    build the graph again without the model (a saved circuit: :mod:`.circuit_io`)."""

    n_layers: int
    n_heads: int
    n_key_value_heads: int | None
    d_mlp: int
    n_heads_per_neuron: int
    gated_mlp: bool
    parallel_attn_mlp: bool
    #: The mixture-of-experts layers (each one node ``L{l}MLP`` of kind :data:`EXPERTS`).
    expert_layers: tuple[int, ...] = ()
    #: The multi-head latent attention layers (each read through one input ``L{l}ATTN`` of kind
    #: :data:`LATENT_ATTN`).
    latent_attn_layers: tuple[int, ...] = ()
    #: Per expert layer (in ``expert_layers``' order), its components' label suffixes (``E0``,
    #: ..., ``S``): the nodes it has when named by its experts (:data:`EXPERT`).
    expert_parts: tuple[tuple[str, ...], ...] = ()
    #: Per expert layer, its components' neurons (:data:`EXPERT_NEURON` nodes it can name).
    expert_widths: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:  # a saved shape's JSON lists
        for name in ("expert_layers", "latent_attn_layers"):
            object.__setattr__(self, name, tuple(int(li) for li in getattr(self, name)))
        parts = tuple(tuple(str(p) for p in layer) for layer in self.expert_parts)
        object.__setattr__(self, "expert_parts", parts)
        widths = tuple(tuple(int(n) for n in layer) for layer in self.expert_widths)
        object.__setattr__(self, "expert_widths", widths)

    @classmethod
    def of(cls, model: ModelLike) -> GraphShape:
        """The shape of ``model`` (either model kind, through :func:`analysis_model`)."""
        from tl_attnonly.analysis.discovery.attention_support import latent_attention_layers
        from tl_attnonly.analysis.discovery.expert_nodes import expert_parts, expert_widths
        from tl_attnonly.analysis.patching.dense_layers import expert_layers

        model = analysis_model(model)
        cfg, experts = model.cfg, sorted(expert_layers(model))
        return cls(
            n_layers=int(cfg.n_layers), n_heads=int(cfg.n_heads),
            n_key_value_heads=cfg.n_key_value_heads, d_mlp=int(cast(int, cfg.d_mlp)),
            n_heads_per_neuron=int(model.n_heads_per_neuron), gated_mlp=bool(cfg.gated_mlp),
            parallel_attn_mlp=bool(cfg.parallel_attn_mlp),
            expert_layers=tuple(experts), latent_attn_layers=tuple(latent_attention_layers(model)),
            expert_parts=expert_parts(model, experts), expert_widths=expert_widths(model, experts),
        )  # fmt: skip


class HeadGraph:
    """Sources, inputs and edges of the attention-only view of ``model``.

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer`, a converted bridge, or the
            :class:`GraphShape` of one.
        neuron_level: One node per MLP neuron (its ``K`` heads summed; default). With False, one
            node per neuron-head (only differs when ``K > 1``; plain MLPs only).
        nodes: Restrict the graph to these attention heads (``"L0H1"``) and neurons (``"L0N5"``;
            at head level neuron-heads ``"L0N5.1"``); the embeddings and the logits are always
            kept. ``"L{l}MLP"`` keeps layer ``l``'s other neurons as one node (their summed output
            is its output; its gate and value inputs are theirs, all receiving the same edges).
            A mixture of experts' experts ``"L{l}E{e}"``, ``"L{l}S"`` and their neurons
            ``"L{l}E{e}N{j}"``, ``"L{l}SN{j}"`` (:mod:`.expert_nodes`). Default: every node.
        positions: Names of position classes (:class:`~.positions.PositionClasses`): every
            input group is split into one group per class (key ``"attn.23.v@io"``), so edges
            are resolved by position. Default: none (one group per input, every position).

    Attributes:
        gated: Whether the MLPs are gated (inputs ``gate = g``, ``value = u``; see above).
        restricted: Whether ``nodes`` dropped any node (or named an expert layer's experts:
            the graph is not the full graph, ``nodes=None``).

    Raises:
        ValueError: If ``nodes`` names a node the model does not have.
    """

    def __init__(
        self,
        model: ModelLike | GraphShape,
        neuron_level: bool = True,
        nodes: Collection[str] | None = None,
        positions: Sequence[str] | None = None,
    ):
        cfg = model if isinstance(model, GraphShape) else GraphShape.of(model)
        self.shape = cfg
        self.positions = None if positions is None else tuple(positions)
        self.n_heads = cfg.n_heads
        self.n_layers = cfg.n_layers
        self.n_heads_per_neuron = cfg.n_heads_per_neuron
        self.neuron_level = neuron_level or cfg.n_heads_per_neuron == 1
        self.expert_layers = frozenset(cfg.expert_layers)
        self.latent_attn_layers = frozenset(cfg.latent_attn_layers)
        #: Expert layer -> its components' labels (``L{l}E{e}``, ``L{l}S``).
        self.expert_part_labels = {
            li: tuple(f"L{li}{suffix}" for suffix in parts)
            for li, parts in zip(cfg.expert_layers, cfg.expert_parts, strict=False)
        }
        self.gated = cfg.gated_mlp  # what the blocks' MLPs say (MLPLayer.gated)
        self.parallel = cfg.parallel_attn_mlp
        n_kv = cfg.n_key_value_heads or cfg.n_heads
        self.n_kv = n_kv
        self.gqa = n_kv != cfg.n_heads
        K = self.n_heads_per_neuron
        d_mlp = cfg.d_mlp
        k_labels = 0 if self.neuron_level else K  # neurons, or K neuron-heads each
        neuron_labels = _neuron_labels(cfg.n_layers, d_mlp, k_labels)
        keep = None if nodes is None else set(nodes)
        #: Expert layer -> its expert neurons named here (``L{l}E{e}N{j}``, ``L{l}SN{j}``).
        widths = dict(zip(cfg.expert_layers, cfg.expert_widths, strict=False))
        self.expert_neurons = expert_neuron_nodes(keep, self.expert_part_labels, widths)
        #: The expert layers named by their experts here (their components are the nodes).
        self.split_experts: frozenset[int] = frozenset(
            li
            for li, parts in self.expert_part_labels.items()
            if keep is not None and (not keep.isdisjoint(parts) or li in self.expert_neurons)
        )
        if keep is not None:
            known = _known_labels(cfg.n_layers, cfg.n_heads, d_mlp, k_labels)
            parts = {p for labels in self.expert_part_labels.values() for p in labels}
            parts.update(n for named in self.expert_neurons.values() for n in named)
            unknown = sorted(keep - known - parts - {EMBED, LOGITS})
            if unknown:
                raise ValueError(
                    f"nodes names {len(unknown)} node(s) this graph does not have, e.g. "
                    f"{unknown[:3]}: give attention heads 'L{{l}}H{{h}}', "
                    + ("neurons 'L{l}N{i}'" if self.neuron_level else "neuron-heads 'L{l}N{i}.{k}'")
                    + f" (neuron_level={self.neuron_level}), MLP remainders 'L{{l}}MLP' and a "
                    "mixture of experts' experts 'L{l}E{e}', 'L{l}S' and their neurons "
                    "'L{l}E{e}N{j}', 'L{l}SN{j}'."
                )

        def pick(labels, kept_by=None):
            """(labels, index, size) of the kept nodes; ``kept_by(j)``: whether node j is kept."""
            if keep is None:
                idx = tuple(range(len(labels)))
            elif kept_by is not None:
                idx = tuple(j for j in range(len(labels)) if kept_by(j))
            elif isinstance(labels, _Labels):  # a layer's neurons: look up the few kept
                idx = tuple(sorted(labels.position[n] for n in keep if n in labels.position))
            else:
                idx = tuple(j for j, label in enumerate(labels) if label in keep)
            return tuple(labels[j] for j in idx), idx, len(labels)

        # order: embed 0; attn of layer l at 3l+1 (reads < 3l+1); mlp at 3l+2 (reads < 3l+2,
        # or < 3l+1 when attention and MLP run in parallel); logits last.
        self.sources: list[SourceGroup] = [SourceGroup(EMBED, EMBED, -1, (EMBED,), 0, (0,), 1)]
        self.inputs: list[InputGroup] = []
        group = cfg.n_heads // n_kv
        for li in range(cfg.n_layers):
            heads = tuple(attn_head_label(li, h) for h in range(cfg.n_heads))
            kv = tuple(f"L{li}KV{j}" for j in range(n_kv)) if self.gqa else heads
            if li in self.latent_attn_layers:  # one reader: kept with any of the layer's heads
                reader = pick(
                    (latent_attn_label(li),),
                    lambda j, heads=heads: keep is None or any(h in keep for h in heads),
                )
                self.inputs.append(
                    InputGroup(f"attn.{li}.in", LATENT_ATTN, li, "qkv", reader[0], 3 * li + 1,
                               *reader[1:])
                )  # fmt: skip
            for inp in ATTN_INPUTS if li not in self.latent_attn_layers else ():
                if inp == "q" or not self.gqa:
                    picked = pick(heads)
                else:  # a key/value head is kept with any of the query heads it serves
                    picked = pick(
                        kv,
                        lambda j, li=li: (
                            keep is not None
                            and any(
                                attn_head_label(li, h) in keep
                                for h in range(j * group, (j + 1) * group)
                            )
                        ),
                    )
                self.inputs.append(
                    InputGroup(
                        f"attn.{li}.{inp}", "attn", li, inp, picked[0], 3 * li + 1, *picked[1:]
                    )
                )
            kept_heads, index, size = pick(heads)
            self.sources.append(
                SourceGroup(f"attn.{li}", "attn", li, kept_heads, 3 * li + 1, index, size)
            )
            mlp_order = 3 * li + 1 if self.parallel else 3 * li + 2
            if li in self.expert_layers:  # the whole layer: one node, one input
                label = (mlp_rest_label(li),)
                whole = pick(label) if li not in self.split_experts else (label, (0,), 1)
                self.inputs.append(
                    InputGroup(f"experts.{li}", EXPERTS, li, "", whole[0], mlp_order, *whole[1:])
                )
                if li in self.split_experts:  # its experts: one node each, the layer's input
                    part = pick(self.expert_part_labels[li])
                    self.sources.append(
                        SourceGroup(f"expert.{li}", EXPERT, li, part[0], 3 * li + 2, *part[1:])
                    )
                    named = self.expert_neurons.get(li, ())
                    if named:  # its named neurons (the experts' nodes are their remainders)
                        self.sources.append(SourceGroup(
                            f"{EXPERT_NEURON}.{li}", EXPERT_NEURON, li, named, 3 * li + 2,
                            tuple(range(len(named))), len(named),
                        ))  # fmt: skip
                    continue
                self.sources.append(
                    SourceGroup(f"experts.{li}", EXPERTS, li, whole[0], 3 * li + 2, *whole[1:])
                )
                continue
            neurons = pick(neuron_labels[li])
            for inp in NEURON_INPUTS:
                self.inputs.append(
                    InputGroup(
                        f"neuron.{li}.{inp}", "neuron", li, inp, neurons[0], mlp_order, *neurons[1:]
                    )
                )
            self.sources.append(
                SourceGroup(f"neuron.{li}", "neuron", li, neurons[0], 3 * li + 2, *neurons[1:])
            )
            if keep is not None and mlp_rest_label(li) in keep:
                rest = tuple(sorted(set(range(neurons[2])).difference(neurons[1])))
            else:
                rest = ()
            if rest:
                label = (mlp_rest_label(li),)
                for inp in NEURON_INPUTS:
                    self.inputs.append(
                        InputGroup(
                            f"mlp.{li}.{inp}", MLP_REST, li, inp, label, mlp_order, rest, neurons[2]
                        )
                    )
                self.sources.append(
                    SourceGroup(f"mlp.{li}", MLP_REST, li, label, 3 * li + 2, rest, neurons[2])
                )
        self.inputs.append(
            InputGroup(LOGITS, LOGITS, cfg.n_layers, "", (LOGITS,), 3 * cfg.n_layers + 3, (0,), 1)
        )
        if self.positions is not None:
            self.inputs = [
                replace(g, key=f"{g.key}@{p}", position=p)
                for g in self.inputs
                for p in self.positions
            ]
        # (a layer named by its experts differs from the full graph's whole layer too)
        self.restricted = (
            any(len(g.labels) < g.size for g in self.sources)
            or any(len(g.labels) < g.size for g in self.inputs)
            or bool(self.split_experts)
        )
        self.source_by_key = {g.key: g for g in self.sources}
        self.input_by_key = {g.key: g for g in self.inputs}

    def blocks(self) -> Iterator[tuple[SourceGroup, InputGroup]]:
        """Every (source group, input group) pair joined by edges (both non-empty)."""
        for dst in self.inputs:
            if not dst.labels:
                continue
            for src in self.sources:
                if src.order < dst.order and src.labels:
                    yield src, dst

    def reading_nodes(self, dst: InputGroup, v: int) -> list[str]:
        """Labels of the source nodes that read input ``v`` of ``dst`` (their outputs depend on
        it): none for the logits, every head a grouped key/value head serves, every head of a
        latent attention layer, every expert (and named expert neuron) of a layer named by its
        experts, else the reader itself."""
        if dst.kind == LOGITS:
            return []
        if dst.kind == LATENT_ATTN:  # every head of the layer reads it
            return [attn_head_label(dst.layer, h) for h in range(self.n_heads)]
        if dst.kind == EXPERTS and dst.layer in self.split_experts:  # every expert of the layer
            return [*self.expert_part_labels[dst.layer], *self.expert_neurons.get(dst.layer, ())]
        if dst.kind == "attn" and dst.input in "kv" and self.gqa:
            group = self.n_heads // self.n_kv
            j = dst.index[v]
            return [attn_head_label(dst.layer, h) for h in range(j * group, (j + 1) * group)]
        return [dst.labels[v]]

    def members(self, label: str) -> list[str]:
        """The neurons (or neuron-heads) of an MLP remainder ``"L{l}MLP"``."""
        group = self.source_by_key[f"mlp.{label[1:-3]}"]
        K = self.n_heads_per_neuron
        return [
            f"L{group.layer}N{j}" if self.neuron_level else neuron_head_label(group.layer, j, K)
            for j in group.index
        ]

    def node_labels(self) -> list[str]:
        """Labels of the graph's attention heads and neurons (restricted: the kept ones)."""
        return [label for g in self.sources if g.kind != EMBED for label in g.labels]

    def block_keys(self) -> list[tuple[str, str]]:
        return [(s.key, d.key) for s, d in self.blocks()]

    def n_edges(self) -> int:
        return sum(len(s.labels) * len(d.labels) for s, d in self.blocks())

    def full_mask(self, value: bool = True, device=None) -> dict[tuple[str, str], torch.Tensor]:
        """Masks of every block, all ``value`` (True: the full graph; False: the empty graph)."""
        return {
            (s.key, d.key): torch.full((len(s.labels), len(d.labels)), value, device=device)
            for s, d in self.blocks()
        }


def edge_label(src: str, dst: str, inp: str, position: str | None = None) -> str:
    """``"L0H1->L1N3:gate"``, ``"L1N3->logits"``; resolved by position ``"L0H1->L1N3:gate@io"``."""
    return f"{src}->{dst}" + (f":{inp}" if inp else "") + (f"@{position}" if position else "")


def edges_frame(
    graph: HeadGraph,
    scores: dict[tuple[str, str], torch.Tensor],
    mask: dict[tuple[str, str], torch.Tensor] | None = None,
) -> pd.DataFrame:
    """One row per edge (or per edge in ``mask``): source, target, input, score, sorted by |score|.

    Columns: ``edge, source, target, input, source_kind, target_kind, score`` (and ``position``
    after ``input`` for a graph resolved by position).
    """
    columns = ["source", "target", "input", "source_kind", "target_kind", "score"]
    if graph.positions is not None:
        columns.insert(3, "position")
    rows: dict[str, list] = {k: [] for k in columns}
    for src, dst in graph.blocks():
        block = scores[(src.key, dst.key)]
        keep = (
            mask[(src.key, dst.key)]
            if mask is not None
            else torch.ones_like(block, dtype=torch.bool)
        )
        idx = keep.nonzero().tolist()
        for u, v in idx:
            rows["source"].append(src.labels[u])
            rows["target"].append(dst.labels[v])
            rows["input"].append(dst.input)
            if graph.positions is not None:
                rows["position"].append(dst.position)
            rows["source_kind"].append(src.kind)
            rows["target_kind"].append(dst.kind)
            rows["score"].append(float(block[u, v]))
    frame = pd.DataFrame(rows)
    frame.insert(
        0,
        "edge",
        [
            edge_label(s, t, i, p)
            for s, t, i, p in zip(
                frame.source,
                frame.target,
                frame.input,
                frame["position"] if graph.positions is not None else [None] * len(frame),
                strict=True,
            )
        ],
    )
    order = frame.score.abs().sort_values(ascending=False, kind="stable").index
    return frame.loc[order].reset_index(drop=True)


__all__ = [
    "ATTN_INPUTS",
    "EMBED",
    "EXPERT",
    "EXPERT_NEURON",
    "LATENT_ATTN",
    "LOGITS",
    "MLP_REST",
    "NEURON_INPUTS",
    "GraphShape",
    "HeadGraph",
    "InputGroup",
    "SourceGroup",
    "edge_label",
    "edges_frame",
    "latent_attn_label",
    "mlp_rest_label",
]
