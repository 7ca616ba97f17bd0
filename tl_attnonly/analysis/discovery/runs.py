"""Exact circuit runs over the head graph: what a run is, and one circuit's :func:`circuit_metric`.

A circuit is a set of edges of :class:`~tl_attnonly.analysis.discovery.HeadGraph`. Its run is exact:
the model runs on the clean input, and every input of every node receives the corrupted residual
stream plus the current run's change of the sources joined to it by circuit edges,

    ``input_v = resid(corrupted) + sum_{u -> v in circuit} (out_u(current) - out_u(corrupted))``

(each node's normalisation applied to its own input). So the full graph gives the clean run, the
empty graph the corrupted run, and ``faithfulness = (m(circuit) - m(corrupted)) / (m(clean) -
m(corrupted))`` is 1 and 0 for them.

A gated neuron's two inputs are its gate ``g = x W_gate`` (``hook_pre``) and linear branch
``u = x W_in`` (``hook_pre_linear``), rebuilt each from its own residual input; its heads then
compute ``sigmoid(b_k g + d_k) (f_k g + e_k - g_k) u`` as in the model.

On a restricted graph (``nodes=``) a circuit is the circuit of the full graph whose edges touching
a dropped node are absent: a dropped node's inputs are corrupted, so its output is too.

The runs are made by the modules below; their public names are importable from here too
(:class:`Circuit` and :func:`faithfulness`: :mod:`.circuit`).

=====================  ========================================================================
:mod:`.exact_run`      one circuit's run: the hooks that rebuild each input from its edges
:mod:`.run_metrics`    :func:`circuit_metrics`: several circuits' runs, batch by batch
:mod:`.run_reuse`      what runs share: :class:`CorruptedRuns`, :class:`KeptRun`, first runs
:mod:`.gate_value`     :func:`circuit_gate_value_split`: a neuron's gate and value edges apart
=====================  ========================================================================

The split of paths by path patching, :func:`path_gate_value_split`, is in
:mod:`tl_attnonly.analysis.patching.paths`. ``discover_circuit`` (score, prune, check in one call,
and the two-stage recipe for large models): :mod:`.search`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import torch
from jaxtyping import Int

from tl_attnonly.adapt import analysis_model

# Circuit and faithfulness live in .circuit, the others in the modules of the module docstring;
# they stay importable from here too
from tl_attnonly.analysis.discovery.circuit import Circuit, faithfulness
from tl_attnonly.analysis.discovery.gate_value import circuit_gate_value_split
from tl_attnonly.analysis.discovery.positions import PositionClasses
from tl_attnonly.analysis.discovery.run_metrics import circuit_metrics
from tl_attnonly.analysis.discovery.run_reuse import CorruptedRuns, KeptRun
from tl_attnonly.analysis.discovery.sites import BLOCK_BUDGET, DiscoveryMetric, Mask
from tl_attnonly.analysis.patching.paths import path_gate_value_split  # path patching

if TYPE_CHECKING:
    from tl_attnonly.protocol import ModelLike


def circuit_metric(
    model: ModelLike,
    mask: Mask,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    metric: DiscoveryMetric,
    *,
    neuron_level: bool = True,
    nodes: Collection[str] | None = None,
    batch_size: int | None = None,
    block_bytes: int = BLOCK_BUDGET,
    progress: bool = False,
    positions: PositionClasses | None = None,
) -> float:
    """The metric of the circuit ``mask``, exactly (see the module docstring).

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` or a ``TransformerBridge``
            converted with :func:`tl_attnonly.convert` (in place).
        mask: ``(source group, input group) -> bool [n_sources, n_inputs]``
            (:func:`~tl_attnonly.analysis.prune`, ``HeadGraph.full_mask``).
        clean_tokens, corrupted_tokens: ``[n_examples, pos]``.
        metric: As in :func:`~tl_attnonly.analysis.edge_attribution_scores`.
        neuron_level: The graph's granularity (must match the mask).
        nodes: The restricted graph's nodes (:class:`HeadGraph`), if the mask is over one.
        batch_size: Examples per pass.
        block_bytes: Budget for the residual inputs rebuilt at once (chunked to fit).
        progress: Progress bar over batches.
        positions: The mask's position classes (:mod:`.positions`), if it is over a graph
            resolved by position: each class's positions are rebuilt from its own edges.

    Returns:
        The metric summed over batches.
    """
    model = analysis_model(model)
    return circuit_metrics(
        model, [mask], clean_tokens, corrupted_tokens, metric, neuron_level=neuron_level,
        nodes=nodes, batch_size=batch_size, block_bytes=block_bytes, progress=progress,
        positions=positions,
    )[0]  # fmt: skip


__all__ = [
    "Circuit",
    "CorruptedRuns",
    "KeptRun",
    "circuit_gate_value_split",
    "circuit_metric",
    "circuit_metrics",
    "faithfulness",
    "path_gate_value_split",
]
