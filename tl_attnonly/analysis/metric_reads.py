"""What a metric reads of the logits: calling a metric with or without its batch's indices,
and the positions whose logits it declares it reads (``logit_positions``), so that runs from a
block unembed only those positions.

A metric declares the one position per row it reads with a ``logit_positions(indices)``
attribute giving ``[batch]`` positions (negative ones from the end), ``indices`` being the
rows' indices into the dataset (a patching metric, called with a whole batch's logits, gets
``arange(batch)``). :func:`~tl_attnonly.analysis.discovery.sites.logit_diff_metric`, the task
datasets' ``metric`` and ``additive_metric()`` declare theirs. The declaration is checked
(:func:`check_logit_positions`) before it is used.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from jaxtyping import Float, Int

#: A metric: ``metric(logits)`` or ``metric(logits, indices)`` -> a scalar tensor.
DiscoveryMetric = Callable[..., torch.Tensor]


def call_metric(
    metric: DiscoveryMetric, logits: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    try:
        n_args = len(
            [
                p
                for p in inspect.signature(metric).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
        )
    except (TypeError, ValueError):
        n_args = 1
    out = metric(logits, indices) if n_args >= 2 else metric(logits)
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        raise ValueError("The metric must return a scalar tensor (sum or mean over the batch).")
    return out.reshape(())


def logit_positions(
    metric: DiscoveryMetric, indices: Int[torch.Tensor, " batch"], n_pos: int
) -> Int[torch.Tensor, " batch"] | None:
    """The one position per row whose logits ``metric`` reads, where it declares them (a
    ``logit_positions(indices)`` attribute giving ``[batch]`` positions, negative ones from the
    end: :func:`logit_diff_metric` and the task datasets' ``additive_metric()`` do); ``None``
    for any other metric (every position's logits are computed for it).

    Exact runs from a block compute only these positions' logits (the unembedding of the other
    positions is skipped; their logits are NaN, so a metric that reads more than it declares
    gives NaN, which :func:`check_logit_positions` refuses)."""
    reads = getattr(metric, "logit_positions", None)
    if reads is None:
        return None
    return torch.as_tensor(reads(indices), dtype=torch.long).cpu() % n_pos


def check_logit_positions(
    metric: DiscoveryMetric,
    logits: Float[torch.Tensor, "batch pos d_vocab"],
    indices: Int[torch.Tensor, " batch"],
    positions: Int[torch.Tensor, " batch"],
) -> None:
    """Refuse a metric whose value on ``logits`` changes when only its declared
    ``positions`` (:func:`logit_positions`) are kept (the others NaN).

    Raises:
        ValueError: If it reads logits at other positions than it declares.
    """
    rows = torch.arange(logits.shape[0], device=logits.device)
    at = positions.to(logits.device)
    kept = torch.full_like(logits, float("nan"))
    kept[rows, at] = logits[rows, at]
    if not torch.equal(call_metric(metric, kept, indices), call_metric(metric, logits, indices)):
        raise ValueError(
            "The metric reads logits at other positions than its logit_positions attribute "
            "declares (its value changes when only those are kept): correct logit_positions, "
            "or remove it (every position's logits are then computed)."
        )


def checked_logit_positions(
    metric: DiscoveryMetric, logits: Float[torch.Tensor, "batch pos d_vocab"]
) -> Int[torch.Tensor, " batch"] | None:
    """The positions ``metric`` declares it reads for a batch of ``logits`` (rows
    ``arange(batch)``), checked on those logits; ``None`` where it declares none.

    Raises:
        ValueError: If it reads logits at other positions than it declares.
    """
    indices = torch.arange(logits.shape[0])
    positions = logit_positions(metric, indices, logits.shape[1])
    if positions is not None:
        check_logit_positions(metric, logits, indices, positions)
    return positions


__all__ = [
    "DiscoveryMetric",
    "call_metric",
    "check_logit_positions",
    "checked_logit_positions",
    "logit_positions",
]
