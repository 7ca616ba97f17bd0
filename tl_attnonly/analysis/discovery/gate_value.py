"""A circuit's neurons' gate and value edges apart (:func:`circuit_gate_value_split`).

Exact runs (:func:`~.run_metrics.circuit_metrics`) of the circuit, and of the circuit without each
neuron's gate edges, value edges, or both: the effect of each side alone and their interaction.
The split of paths by path patching instead:
:func:`~tl_attnonly.analysis.patching.paths.path_gate_value_split`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import pandas as pd
import torch
from jaxtyping import Int

from tl_attnonly._types import tokens_on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.graph import HeadGraph
from tl_attnonly.analysis.discovery.positions import PositionClasses
from tl_attnonly.analysis.discovery.run_metrics import circuit_metrics
from tl_attnonly.analysis.discovery.run_reuse import CorruptedRuns
from tl_attnonly.analysis.discovery.sites import DiscoveryMetric, Mask
from tl_attnonly.mlp_protocol import refuse_expert_layers

if TYPE_CHECKING:
    from tl_attnonly.protocol import ModelLike


def circuit_gate_value_split(
    model: ModelLike,
    mask: Mask,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    metric: DiscoveryMetric,
    *,
    neurons: Sequence[str] | None = None,
    neuron_level: bool = True,
    nodes: Collection[str] | None = None,
    batch_size: int | None = None,
    progress: bool = True,
    positions: PositionClasses | None = None,
    corrupted_runs: CorruptedRuns | None = None,
) -> pd.DataFrame:
    """For each neuron of the circuit: the effect of its gate edges alone, value edges alone, both.

    With ``C`` the circuit and ``C - X`` the circuit without the edges into input(s) ``X`` of the
    neuron (exact circuit runs, :func:`~tl_attnonly.analysis.circuit_metric`):

    - ``gate = m(C - value) - m(C - gate - value)``: its pattern receives the circuit, its value
      does not;
    - ``value = m(C - gate) - m(C - gate - value)``;
    - ``both = m(C) - m(C - gate - value)``;
    - ``interaction = both - gate - value`` (so ``both = gate + value + interaction`` exactly; the
      interaction is zero when the metric is linear in the neuron's pattern and value jointly,
      which a product ``pattern * value`` is not).

    A neuron with no circuit edge into its gate (value) has no gate (value) effect to measure:
    that column and ``interaction`` are NaN, with a warning (not 0, which would read as a
    measured zero); ``n_gate_edges`` / ``n_value_edges`` say how many edges each side has.

    For a gated neuron (``act_K(g) * u``) the gate is ``g`` (the pattern and the ``g`` factor of
    the value: *whether and how strongly it fires*) and the value is ``u`` (*what it scales*): for
    a last-layer neuron read linearly, ``gate = F(g_clean, u_corr) - F(g_corr, u_corr)`` with
    ``F(g, u) = act_K(g) u``.

    Args:
        neurons: Labels of neurons (or neuron-heads) to split; default every neuron with an
            incoming circuit edge.
        Others: As in :func:`~tl_attnonly.analysis.circuit_metric` (``nodes``: the mask's
            restricted graph; ``positions``: its position classes, whose gate (value) edges at
            every position count as the neuron's gate (value)).
        corrupted_runs: A :class:`CorruptedRuns` shared with other calls (:func:`circuit_metrics`).

    Returns:
        DataFrame with columns ``node, gate, value, both, interaction, n_gate_edges,
        n_value_edges`` (metric units).
    """
    model = analysis_model(model)
    if neurons is not None:  # an expert layer has no neurons of its own (the default: none)
        named = [int(label[1:].split("N")[0]) for label in neurons]
        refuse_expert_layers([b.mlp for b in model.blocks], named, "circuit_gate_value_split")
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    graph = HeadGraph(
        model, neuron_level=neuron_level, nodes=nodes,
        positions=None if positions is None else positions.names,
    )  # fmt: skip
    targets: dict[str, dict[str, list[tuple[tuple[str, str], int]]]] = {}
    for src, dst in graph.blocks():
        if dst.kind != "neuron":
            continue
        m = mask[(src.key, dst.key)]
        for v in m.any(0).nonzero().flatten().tolist():
            entry = targets.setdefault(dst.labels[v], {"gate": [], "value": []})
            entry[dst.input].append(((src.key, dst.key), v))
    labels = list(targets) if neurons is None else list(neurons)

    def without(entry, *inputs: str) -> Mask:
        out = {k: m.clone() for k, m in mask.items()}
        for inp in inputs:
            for key, v in entry[inp]:
                out[key][:, v] = False
        return out

    masks = [mask]
    entries = []
    for label in labels:
        entry = targets.get(label, {"gate": [], "value": []})
        entries.append(entry)
        masks += [without(entry, "gate"), without(entry, "value"), without(entry, "gate", "value")]
    values = circuit_metrics(
        model, masks, clean_tokens, corrupted_tokens, metric, neuron_level=neuron_level,
        nodes=nodes, batch_size=batch_size, progress=progress, positions=positions,
        corrupted_runs=corrupted_runs,
    )  # fmt: skip
    m_full = values[0]
    rows = []
    for i, (label, entry) in enumerate(zip(labels, entries, strict=True)):
        no_gate, no_value, none = values[1 + 3 * i : 4 + 3 * i]
        gate, value, both = no_value - none, no_gate - none, m_full - none
        # no edge of a kind: removing "its" edges changes nothing, which measures nothing
        for kind in ("gate", "value"):
            if not entry[kind]:
                warnings.warn(
                    f"{label}: {kind} not measured: no {kind} edge kept in the circuit (NaN in "
                    f"the {kind} and interaction columns; 0 would read as a measured zero).",
                    stacklevel=2,
                )
        gate = gate if entry["gate"] else math.nan
        value = value if entry["value"] else math.nan
        rows.append(
            dict(
                node=label,
                gate=gate,
                value=value,
                both=both,
                interaction=both - gate - value,
                n_gate_edges=_n_edges(mask, entry["gate"]),
                n_value_edges=_n_edges(mask, entry["value"]),
            )
        )
    return pd.DataFrame(
        rows,
        columns=["node", "gate", "value", "both", "interaction", "n_gate_edges", "n_value_edges"],
    )


def _n_edges(mask: Mask, columns: list[tuple[tuple[str, str], int]]) -> int:
    """How many circuit edges reach the input columns ``(block key, column)`` (one entry per
    source group: a group of several kept sources counts each)."""
    return sum(int(mask[key][:, v].sum()) for key, v in columns)


__all__ = ["circuit_gate_value_split"]
