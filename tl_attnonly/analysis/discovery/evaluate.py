"""The exact faithfulness of a found circuit on other prompts (:func:`evaluate_circuit`).

A circuit found by :func:`~tl_attnonly.analysis.discover_circuit` was chosen on its search
prompts, so its faithfulness there is fitted to them. :func:`evaluate_circuit` measures the same
edges on prompts the search never saw (a held-out split): the clean and corrupted metrics are
recomputed on those prompts and the circuit's mask is run once, exactly
(:func:`~.runs.circuit_metrics`), over the circuit's own graph (its nodes, its position classes).
On the search prompts themselves (and the search's ``batch_size``) it gives
``circuit.faithfulness`` back, up to float rounding where the search took the circuit's figure
from a run that reused another run's inputs (:func:`~.runs.circuit_metrics`) or from its run on
the coarse graph (the neuron stage's figure: this run, on the graph with the neurons named, sums
each layer's named neurons and remainder apart).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from jaxtyping import Int

from tl_attnonly._types import tokens_on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.circuit import Circuit, faithfulness
from tl_attnonly.analysis.discovery.positions import PositionClasses
from tl_attnonly.analysis.discovery.run_metrics import circuit_metrics
from tl_attnonly.analysis.discovery.sites import DiscoveryMetric, batch_indices, call_metric

if TYPE_CHECKING:
    from tl_attnonly.protocol import ModelLike


@dataclass(frozen=True)
class CircuitEvaluation:
    """A circuit measured on prompts (:func:`evaluate_circuit`).

    Attributes:
        faithfulness: ``(circuit - corrupted) / (clean - corrupted)`` on these prompts.
        metric_clean, metric_corrupted, metric_circuit: The metric of the clean run, the
            corrupted run and the circuit's exact run on these prompts.
        n_prompts: Number of prompts.
    """

    faithfulness: float
    metric_clean: float
    metric_corrupted: float
    metric_circuit: float
    n_prompts: int


def _metric_of_runs(
    model, tokens: torch.Tensor, metric: DiscoveryMetric, batches: list[torch.Tensor]
) -> float:
    """The metric of the model's plain run on ``tokens``, summed over ``batches``."""
    total = 0.0
    with torch.no_grad():
        for idx in batches:
            total += call_metric(metric, model(tokens[idx]), idx).item()
    return total


def _check_positions(circuit: Circuit, positions: PositionClasses | None) -> None:
    """Refuse position classes that do not match the circuit's graph."""
    names = circuit.graph.positions
    if names is None and positions is not None:
        raise ValueError(
            "positions=... was given, but this circuit's edges are not resolved by position "
            "(it was found without positions=); leave positions out."
        )
    if names is not None and positions is None:
        raise ValueError(
            f"This circuit's edges are resolved by the position classes {names}: give "
            "positions=... for the new prompts (e.g. data.position_classes() of their dataset, "
            "with the same class names)."
        )
    if names is not None and positions is not None and tuple(positions.names) != names:
        raise ValueError(
            f"positions= has the classes {tuple(positions.names)}, but this circuit's edges are "
            f"resolved by {names}: build the new prompts' classes with the same names, in the "
            "same order."
        )


def evaluate_circuit(
    model: ModelLike,
    circuit: Circuit,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    metric: DiscoveryMetric,
    *,
    positions: PositionClasses | None = None,
    batch_size: int | None = None,
) -> CircuitEvaluation:
    """The exact faithfulness of ``circuit`` (its mask, over its graph) on these prompts.

    Args:
        model: The model the circuit was found in.
        circuit: A :class:`~.circuit.Circuit` (:func:`~tl_attnonly.analysis.discover_circuit`).
        clean_tokens, corrupted_tokens: ``[n_examples, pos]``, same shape: the prompts to
            measure on (e.g. fresh prompts the search never saw).
        metric: As in :func:`~tl_attnonly.analysis.discover_circuit`, for these prompts (e.g.
            their dataset's ``additive_metric()``); additive over examples when there are several
            batches (a per-batch mean is refused, as in
            :func:`~tl_attnonly.analysis.circuit_metrics`).
        positions: The new prompts' position classes, required when the circuit's edges are
            resolved by position (``discover_circuit(..., positions=...)``), with the same class
            names in the same order; refused otherwise.
        batch_size: Examples per pass (default: all at once).

    Returns:
        A :class:`CircuitEvaluation`: faithfulness and the clean, corrupted and circuit metrics.
        On the search's own prompts (and the same ``batch_size``) its faithfulness is
        ``circuit.faithfulness`` (up to float rounding: see the module docstring).

    Raises:
        ValueError: For ``positions`` that do not match the circuit (missing, extra, or other
            names), token pairs of different shapes, or a metric that is not additive over
            several batches.
    """
    model = analysis_model(model)
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    _check_positions(circuit, positions)
    graph = circuit.graph
    batches = batch_indices(clean_tokens.shape[0], batch_size)
    (m_circuit,) = circuit_metrics(
        model, [circuit.mask], clean_tokens, corrupted_tokens, metric,
        neuron_level=graph.neuron_level, nodes=graph.node_labels() if graph.restricted else None,
        batch_size=batch_size, positions=positions,
    )  # fmt: skip
    m_clean = _metric_of_runs(model, clean_tokens, metric, batches)
    m_corrupted = _metric_of_runs(model, corrupted_tokens, metric, batches)
    return CircuitEvaluation(
        faithfulness(m_circuit, m_clean, m_corrupted),
        m_clean,
        m_corrupted,
        m_circuit,
        int(clean_tokens.shape[0]),
    )


__all__ = ["CircuitEvaluation", "evaluate_circuit"]
