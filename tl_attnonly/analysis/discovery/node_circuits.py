"""Node-level circuits over attention heads and neuron-heads, for decoders and encoders alike.

The edge graph (:mod:`.edge_scores`) needs a residual stream that is a sum of node outputs (pre-norm
decoders). BERT-style encoders (MiniLM) normalise *after* each residual addition, so there the
circuit is a set of **nodes**: the embeddings, attention heads ``L{l}H{h}`` and neurons
``L{l}N{i}``. Nodes are scored by attribution patching (one forward and one backward pass per
batch on the corrupted input: ``score = (out(clean) - out(corrupted)) . d metric / d out``), and
each neuron's two inputs are scored apart (``gate``: its queries, hence pattern; ``value``).

A circuit run is exact: the clean input runs with every node outside the circuit replaced by its
output on the corrupted input (embeddings: the embedding output; attention heads: ``hook_z``;
neurons: their column of ``hook_post``). The full set gives the clean run, the empty set the
corrupted run, so ``faithfulness`` is 1 and 0 for them. The gate/value split of a neuron in the
circuit patches its corrupted queries or values alone.

Inputs are :class:`ModelInputs`: decoder tokens, or an encoder's ``input_ids`` with
``token_type_ids`` and ``attention_mask``; the metric takes the output (decoder logits, or the
encoder's final hidden states) and the inputs. :func:`pair_cosine_metric` is a sentence-embedding
metric: the cosine similarity of the mean-pooled embeddings of rows ``2i`` and ``2i + 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from tl_attnonly.adapt import analysis_model
from tl_attnonly.hooks import block_act_name, head_act_name, neuron_act_name
from tl_attnonly.mlp_protocol import expert_layer_indices, refuse_expert_layers

if TYPE_CHECKING:
    from tl_attnonly.protocol import AttnOnlyModel, ModelLike

#: A node-circuit metric: ``metric(output, inputs) -> scalar``.
NodeMetric = Callable[..., torch.Tensor]


@dataclass
class ModelInputs:
    """One batch of model inputs.

    Attributes:
        tokens: ``[batch, pos]`` token ids.
        token_type_ids, attention_mask: Encoders only (``[batch, pos]``); ``None`` for decoders.
    """

    tokens: torch.Tensor
    token_type_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None


def _is_encoder(model: AttnOnlyModel) -> bool:
    return model.is_encoder


def _forward(model: AttnOnlyModel, inputs: ModelInputs, fwd_hooks) -> torch.Tensor:
    """Decoder logits, or the encoder's final hidden states, with ``fwd_hooks`` attached."""
    if _is_encoder(model):
        with model.hooks(fwd_hooks=fwd_hooks):
            return model.encoder_output(inputs.tokens, inputs.token_type_ids, inputs.attention_mask)
    return model.run_with_hooks(inputs.tokens, fwd_hooks=fwd_hooks)


def pair_cosine_metric(mean: bool = True) -> NodeMetric:
    """Cosine similarity of the mean-pooled embeddings of rows ``(0, 1), (2, 3), ...``.

    Args:
        mean: Average over the pairs (else sum).

    Returns:
        ``metric(hidden [batch, pos, d_model], inputs) -> scalar``.
    """

    def metric(hidden: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
        if hidden.shape[0] % 2:
            raise ValueError("pair_cosine_metric needs an even batch: rows (2i, 2i + 1) are pairs.")
        mask = inputs.attention_mask
        if mask is None:
            mask = torch.ones(hidden.shape[:2], device=hidden.device)
        m = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        cos = F.cosine_similarity(pooled[0::2], pooled[1::2], dim=-1)
        return cos.mean() if mean else cos.sum()

    return metric


def _node_hooks(model: AttnOnlyModel, experts: bool = False) -> list[tuple[str, str, int]]:
    """``(node group, hook name, layer)``: where each group's output is patched. A mixture of
    experts is refused, or with ``experts`` taken whole (group ``"experts"``, ``hook_mlp_out``)."""
    mlps = [block.mlp for block in model.blocks]
    whole = set(expert_layer_indices(mlps)) if experts else set()
    if not experts:
        refuse_expert_layers(mlps, None, "Node-level circuits")
    out = []
    if _is_encoder(model):
        out.append(("embed", "hook_full_embed", -1))
    else:
        out += [("embed", name, -1) for name in model.embed_hooks]
    for li in range(model.cfg.n_layers):
        out.append(("attn", head_act_name("z", li, "attn"), li))
        if li in whole:
            out.append(("experts", block_act_name("mlp_out", li), li))
        else:
            out.append(("neuron", neuron_act_name("post", li), li))
    return out


def node_labels(model: ModelLike) -> list[str]:
    """Every node: ``"embed"``, then per layer its attention heads and its neurons."""
    model = analysis_model(model)
    labels = ["embed"]
    for li in range(model.cfg.n_layers):
        labels += [f"L{li}H{h}" for h in range(model.cfg.n_heads)]
        labels += [f"L{li}N{i}" for i in range(cast(int, model.cfg.d_mlp))]
    return labels


@dataclass
class NodeScores:
    """Attribution scores of every node and of every neuron's gate and value inputs.

    Attributes:
        scores: ``label -> score`` (estimated change of the metric when the node's clean output
            enters the corrupted run).
        gate, value: ``[n_layers, d_mlp]`` the same for a neuron's queries alone / values alone.
        metric_clean, metric_corrupted: The two runs' metric.
    """

    scores: pd.Series
    gate: torch.Tensor
    value: torch.Tensor
    metric_clean: float
    metric_corrupted: float


def node_attribution_scores(
    model: ModelLike, clean: ModelInputs, corrupted: ModelInputs, metric: NodeMetric
) -> NodeScores:
    """Attribution patching of every node and neuron input (one backward pass). A mixture of
    experts' layer is one node ``L{l}MLP`` (its output ``hook_mlp_out``; its ``gate``/``value``
    rows stay 0): it has no neurons of its own."""
    model = analysis_model(model)
    if clean.tokens.shape != corrupted.tokens.shape:
        raise ValueError("clean and corrupted inputs must have the same shape.")
    L, K = model.cfg.n_layers, model.n_heads_per_neuron
    hooks = _node_hooks(model, experts=True)
    dense = [li for g, _, li in hooks if g == "neuron"]
    names = {name for _, name, _ in hooks} | {
        neuron_act_name(k, li) for li in dense for k in ("q", "v")
    }
    caches = []
    values = []
    for inputs in (clean, corrupted):
        acts: dict[str, torch.Tensor] = {}

        def keep(act, hook, acts=acts):
            acts[hook.name] = act.detach()
            return act

        with torch.no_grad():
            out = _forward(model, inputs, [(n, keep) for n in names])
            values.append(metric(out, inputs).item())
        caches.append(acts)
    clean_acts, corr_acts = caches
    grads: dict[str, torch.Tensor] = {}
    live: dict[str, torch.Tensor] = {}

    def grab(act, hook):
        if not act.requires_grad:
            act = act.detach().requires_grad_(True)
        live[hook.name] = act
        return act

    with torch.enable_grad():
        out = _forward(model, corrupted, [(n, grab) for n in names])
        value = metric(out, corrupted)
        keys = list(live)
        for key, grad in zip(
            keys,
            torch.autograd.grad(value, [live[k] for k in keys], allow_unused=True),
            strict=True,
        ):
            grads[key] = torch.zeros_like(live[key]) if grad is None else grad.detach()

    def attr(name: str) -> torch.Tensor:
        return (clean_acts[name] - corr_acts[name]) * grads[name]

    scores = {"embed": float(sum(attr(n).sum() for g, n, _ in hooks if g == "embed"))}
    gate = torch.zeros(L, cast(int, model.cfg.d_mlp), dtype=torch.float64)
    val = torch.zeros_like(gate)
    for li in range(L):
        per_head = attr(head_act_name("z", li, "attn")).sum((0, 1, 3))
        for h, s in enumerate(per_head.tolist()):
            scores[f"L{li}H{h}"] = s
        if li not in dense:  # a mixture of experts: the whole layer
            scores[f"L{li}MLP"] = float(attr(block_act_name("mlp_out", li)).sum())
            continue
        per_neuron = attr(neuron_act_name("post", li)).sum((0, 1))
        for i, s in enumerate(per_neuron.tolist()):
            scores[f"L{li}N{i}"] = s
        gate[li] = attr(neuron_act_name("q", li)).sum((0, 1, 3)).unflatten(0, (-1, K)).sum(-1)
        val[li] = attr(neuron_act_name("v", li)).sum((0, 1, 3)).unflatten(0, (-1, K)).sum(-1)
    return NodeScores(pd.Series(scores), gate, val, values[0], values[1])


def node_circuit_metrics(
    model: ModelLike,
    circuits: Sequence[set[str]],
    clean: ModelInputs,
    corrupted: ModelInputs,
    metric: NodeMetric,
    *,
    corrupt_inputs: Sequence[dict[str, str]] | None = None,
    progress: bool = False,
) -> list[float]:
    """The metric of each node circuit, exactly (see the module docstring).

    Args:
        circuits: Sets of node labels (:func:`node_labels`).
        corrupt_inputs: Per circuit, ``{neuron label: "gate" | "value"}``: that input of that
            neuron additionally receives its corrupted value (for gate/value splits).
    """
    model = analysis_model(model)
    K = model.n_heads_per_neuron
    hooks = _node_hooks(model)
    names = {name for _, name, _ in hooks} | {
        neuron_act_name(k, li) for li in range(model.cfg.n_layers) for k in ("q", "v")
    }
    corr: dict[str, torch.Tensor] = {}

    def keep(act, hook):
        corr[hook.name] = act.detach()
        return act

    with torch.no_grad():
        _forward(model, corrupted, [(n, keep) for n in names])
    out = []
    extra = corrupt_inputs or [{}] * len(circuits)
    for circuit, inputs_off in tqdm(
        list(zip(circuits, extra, strict=True)), desc="node circuits", disable=not progress
    ):
        fwd = []
        for group, name, li in hooks:
            if group == "embed":
                if "embed" not in circuit:
                    fwd.append((name, lambda act, hook: corr[hook.name]))
                continue
            n = model.cfg.n_heads if group == "attn" else cast(int, model.cfg.d_mlp)
            prefix = f"L{li}{'H' if group == 'attn' else 'N'}"
            off = [i for i in range(n) if f"{prefix}{i}" not in circuit]
            if off:
                fwd.append((name, _patcher(corr, off)))
        for label, which in inputs_off.items():
            li, i = int(label[1:].split("N")[0]), int(label.split("N")[1])
            kind = "q" if which == "gate" else "v"
            fwd.append((neuron_act_name(kind, li), _patcher(corr, list(range(i * K, i * K + K)))))
        with torch.no_grad():
            out.append(metric(_forward(model, clean, fwd), clean).item())
    return out


def _patcher(corr: dict[str, torch.Tensor], index: list[int]):
    idx = torch.tensor(index)

    def hook(act, hook):
        act = act.clone()
        act[:, :, idx] = corr[hook.name][:, :, idx]
        return act

    return hook


@dataclass
class NodeCircuit:
    """A node circuit: its nodes, scores, exact metric and per-neuron gate/value split."""

    nodes: set[str]
    scores: NodeScores
    metric_circuit: float
    faithfulness: float
    gate_value: pd.DataFrame

    def __repr__(self) -> str:
        return (
            f"NodeCircuit({len(self.nodes)} nodes, faithfulness={self.faithfulness:.4g}, clean="
            f"{self.scores.metric_clean:.4g}, corrupted={self.scores.metric_corrupted:.4g})"
        )


def discover_node_circuit(
    model: ModelLike,
    clean: ModelInputs,
    corrupted: ModelInputs,
    metric: NodeMetric,
    *,
    top_n: int,
    max_gate_value_neurons: int = 8,
    progress: bool = False,
) -> NodeCircuit:
    """Keep the ``top_n`` nodes by |attribution|, run the circuit exactly, split its neurons.

    Returns:
        A :class:`NodeCircuit`; ``gate_value`` has columns ``node, gate, value, both,
        interaction`` with ``both = m(C) - m(C, neuron's q and v corrupted)``, ``gate = m(C, v
        corrupted) - m(C, q and v corrupted)``, ``value = m(C, q corrupted) - m(C, q and v
        corrupted)`` and ``interaction = both - gate - value``.
    """
    model = analysis_model(model)
    _node_hooks(model)  # refuses a mixture of experts before any work
    scores = node_attribution_scores(model, clean, corrupted, metric)
    ranked = scores.scores.abs().sort_values(ascending=False, kind="stable")
    nodes = set(ranked.index[:top_n])
    neurons = [n for n in ranked.index[:top_n] if "N" in n][:max_gate_value_neurons]
    circuits: list[set[str]] = [nodes]
    offs: list[dict[str, str]] = [{}]
    for n in neurons:  # q and v free but v corrupted; q corrupted; the neuron off
        circuits += [nodes, nodes, nodes - {n}]
        offs += [{n: "value"}, {n: "gate"}, {}]
    values = node_circuit_metrics(
        model, circuits, clean, corrupted, metric, corrupt_inputs=offs, progress=progress
    )
    m_c = values[0]
    rows = []
    for j, n in enumerate(neurons):
        gate_only, value_only, none = values[1 + 3 * j : 4 + 3 * j]
        gate, value, both = gate_only - none, value_only - none, m_c - none
        rows.append(
            dict(node=n, gate=gate, value=value, both=both, interaction=both - gate - value)
        )
    denom = scores.metric_clean - scores.metric_corrupted
    faith = (m_c - scores.metric_corrupted) / denom if denom else float("nan")
    return NodeCircuit(
        nodes, scores, m_c, faith,
        pd.DataFrame(rows, columns=["node", "gate", "value", "both", "interaction"]),
    )  # fmt: skip


__all__ = [
    "ModelInputs",
    "NodeCircuit",
    "NodeScores",
    "discover_node_circuit",
    "node_attribution_scores",
    "node_circuit_metrics",
    "node_labels",
    "pair_cosine_metric",
]
