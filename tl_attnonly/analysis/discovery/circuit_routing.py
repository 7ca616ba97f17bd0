"""Which experts a circuit's exact run routed each token to (:func:`circuit_experts_used`).

An expert layer is one node of the graph (:data:`~.graph.EXPERTS`): its input in a circuit's run
is rebuilt from its edges, and the layer's router reads that input. So a circuit's run can route
a token to other experts than the clean run (every edge into the layer kept) or the corrupted run
(none kept) did. This runs the circuit once per batch, as :func:`~.run_metrics.circuit_metrics`
does, and reads the routing hook of every expert layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Int

from tl_attnonly.analysis.discovery.exact_run import BatchRun, circuit_run, corrupted_names
from tl_attnonly.analysis.discovery.positions import PositionClasses
from tl_attnonly.analysis.discovery.run_plan import RunCall
from tl_attnonly.analysis.discovery.sites import BLOCK_BUDGET, check_discoverable
from tl_attnonly.analysis.task import DiscoveryTask

if TYPE_CHECKING:
    from tl_attnonly.protocol import ModelLike


def _no_metric(logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return logits.new_zeros(())


def circuit_experts_used(
    model: ModelLike,
    circuit: Any,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    *,
    positions: PositionClasses | None = None,
    batch_size: int | None = None,
) -> dict[int, Int[torch.Tensor, "batch pos top_k"]]:
    """The experts each token was routed to in ``circuit``'s exact run, per expert layer.

    Args:
        model: The converted model the circuit was found on (a bridge with mixtures of experts).
        circuit: A :class:`~.circuit.Circuit` (its ``graph`` and ``mask`` are read).
        clean_tokens, corrupted_tokens: The prompts of the run, ``[batch, pos]``.
        positions: The circuit's position classes, if its graph is resolved by position.
        batch_size: Examples per pass.

    Returns:
        ``{layer: [batch, pos, top_k]}``: the router's top-k expert indices of every token in the
        circuit's run (as :func:`tl_attnonly.analysis.experts.experts_used` gives a cached run's);
        empty for a model without expert layers.
    """
    from tl_attnonly.analysis.experts.routing import routing_hook_name

    task = DiscoveryTask.make(
        model, clean_tokens, corrupted_tokens, _no_metric, positions=positions,
        batch_size=batch_size,
    )  # fmt: skip
    model = task.model
    check_discoverable(model, circuit.graph.neuron_level)
    task.check_tokens()
    graph = circuit.graph
    names = {routing_hook_name(layer, model): layer for layer in sorted(graph.expert_layers)}
    found: dict[int, list[torch.Tensor]] = {layer: [] for layer in names.values()}
    seen: dict[int, torch.Tensor] = {}

    def record(act: torch.Tensor, hook: Any) -> torch.Tensor:
        seen[names[hook.name]] = act
        return act

    call = RunCall(model, graph, BLOCK_BUDGET)
    corrupted = corrupted_names(model, graph)
    for idx in task.batches():
        with torch.no_grad():
            corr = task.corrupted_runs.activations(model, task.corrupted, idx, corrupted)
            where = task.position_masks(idx)
            seen.clear()
            observe = [(name, record) for name in names]
            circuit_run(call, BatchRun(task.clean[idx], corr, where, observe=observe), circuit.mask)
        n, pos = len(idx), task.clean.shape[1]
        for layer in found:
            found[layer].append(seen[layer].reshape(n, pos, -1))
    return {layer: torch.cat(parts) for layer, parts in found.items()}


__all__ = ["circuit_experts_used"]
