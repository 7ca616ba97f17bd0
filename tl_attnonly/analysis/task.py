"""One analysis task as one value: the model, clean and corrupted tokens and metric, checked once.

Circuit discovery (:mod:`tl_attnonly.analysis.discovery`) and patching run the same model on the
same clean and corrupted tokens with the same metric (and position classes, batch size) in every
one of their steps. A :class:`DiscoveryTask` holds them together, made by
:meth:`DiscoveryTask.make` at a public entry point: the model adapted
(:func:`~tl_attnonly.adapt.analysis_model`) and the tokens moved to its device there, once; the
internal functions take the task instead of the same four to ten arguments, and do not check or
move them again.

The task also owns what its runs share: the corrupted run of each batch (:class:`CorruptedRuns`),
made once for every exact circuit run of the task.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Int

from tl_attnonly._types import check_token_pair, tokens_on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.graph import HeadGraph
from tl_attnonly.analysis.discovery.sites import (
    BLOCK_BUDGET,
    DiscoveryMetric,
    batch_indices,
    check_additive,
)

if TYPE_CHECKING:
    from tl_attnonly.analysis.discovery.positions import PositionClasses
    from tl_attnonly.protocol import AttnOnlyModel, ModelLike


class CorruptedRuns:
    """The corrupted run's activations per batch, kept across the exact-run calls of one search
    (:func:`~.search.discover_circuit`'s sweep, pruning, neuron stage and gate/value split), so
    that each batch's corrupted run is made once instead of once per call.

    Bound to the first model and corrupted tokens it serves (others are refused). Activations
    are kept up to ``budget`` bytes in all; a batch beyond it is run again at each call.

    Args:
        budget: Most bytes of activations kept.
    """

    def __init__(self, budget: int = 4 * BLOCK_BUDGET):
        self.budget = budget
        self.kept_bytes = 0
        self._bound: tuple[Any, torch.Tensor] | None = None
        self._store: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
        self._asked: dict[tuple[int, ...], set[str]] = {}
        #: The model's weights as exact runs read them (per layer and input), gathered by the
        #: first run that needs them (:class:`~.discovery.run_plan.RunCall`'s ``weights``).
        self.weights: dict = {}

    def activations(
        self,
        model: AttnOnlyModel,
        corrupted_tokens: Int[torch.Tensor, "batch pos"],
        idx: torch.Tensor,
        names: Collection[str],
    ) -> dict[str, torch.Tensor]:
        """The corrupted run's activations at ``names`` for the batch ``idx`` (rows of
        ``corrupted_tokens``)."""
        if self._bound is None:
            self._bound = (model.model, corrupted_tokens)
        elif self._bound[0] is not model.model or self._bound[1] is not corrupted_tokens:
            raise ValueError(
                "This CorruptedRuns holds another model's or other tokens' corrupted runs: use "
                "one per model and token pair."
            )
        key = tuple(idx.tolist())
        have = self._store.get(key, {})
        asked = self._asked.get(key, set())
        missing = set(names) - asked
        if missing:
            _, cache = model.run_with_cache(
                corrupted_tokens[idx], names_filter=lambda n: n in missing
            )
            fresh = dict(cache.cache_dict)
            size = sum(t.numel() * t.element_size() for t in fresh.values())
            if self.kept_bytes + size > self.budget:
                return {**have, **fresh}
            self.kept_bytes += size
            have = self._store[key] = {**have, **fresh}
            self._asked[key] = asked | missing
        return have


def _no_kept_runs() -> CorruptedRuns:
    """A task's corrupted runs where its caller shares none: nothing kept (each call's own)."""
    return CorruptedRuns(budget=0)


@dataclass(frozen=True)
class DiscoveryTask:
    """The model, clean and corrupted tokens, metric, position classes and batch size that every
    step of one discovery or patching call shares (module docstring). Make it with
    :meth:`make`, which adapts the model and moves the tokens to its device.

    Attributes:
        model: The adapted model (:func:`~tl_attnonly.adapt.analysis_model`).
        clean: ``[n_examples, pos]`` on the model's device.
        corrupted: ``[n_examples, pos]`` on the model's device.
        metric: ``metric(logits)`` or ``metric(logits, indices)`` -> scalar.
        positions: The position classes the graph is resolved by, if any.
        batch_size: Examples per pass (None: all at once).
        corrupted_runs: Each batch's corrupted run, kept for the task's exact runs
            (:class:`CorruptedRuns`; by default nothing is kept).
    """

    model: AttnOnlyModel
    clean: Int[torch.Tensor, "batch pos"]
    corrupted: Int[torch.Tensor, "batch pos"]
    metric: DiscoveryMetric
    positions: PositionClasses | None = None
    batch_size: int | None = None
    corrupted_runs: CorruptedRuns = field(default_factory=_no_kept_runs, compare=False)

    @classmethod
    def make(
        cls,
        model: ModelLike,
        clean: Int[torch.Tensor, "batch pos"],
        corrupted: Int[torch.Tensor, "batch pos"],
        metric: DiscoveryMetric,
        *,
        positions: PositionClasses | None = None,
        batch_size: int | None = None,
        corrupted_runs: CorruptedRuns | None = None,
    ) -> DiscoveryTask:
        """The task of a public call: ``model`` adapted, the tokens on its device (once).

        Args:
            model: An :class:`~tl_attnonly.AttnOnlyTransformer` or a converted bridge.
            clean, corrupted: ``[n_examples, pos]``.
            metric: The call's metric.
            positions: Position classes, if the call resolves its graph by position.
            batch_size: Examples per pass.
            corrupted_runs: A :class:`CorruptedRuns` shared with other calls (default: a new
                one keeping nothing).
        """
        model = analysis_model(model)
        clean, corrupted = tokens_on_model_device(model, clean, corrupted)
        runs = _no_kept_runs() if corrupted_runs is None else corrupted_runs
        return cls(model, clean, corrupted, metric, positions, batch_size, runs)

    def replace(self, **changes: Any) -> DiscoveryTask:
        """A copy with the given fields replaced (its corrupted runs shared unless replaced)."""
        return dataclasses.replace(self, **changes)

    @property
    def n_examples(self) -> int:
        """How many examples (rows of the tokens)."""
        return self.clean.shape[0]

    def batches(self) -> list[torch.Tensor]:
        """The rows of each batch (:attr:`batch_size` examples per pass)."""
        return batch_indices(self.n_examples, self.batch_size)

    def position_masks(self, idx: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Position class -> ``[batch, pos]`` bool of the batch ``idx`` (on the tokens' device),
        or None where the task has no position classes."""
        if self.positions is None:
            return None
        return {p: self.positions.mask(p, idx, self.clean.device) for p in self.positions.names}

    def check_tokens(self) -> None:
        """Refuse clean and corrupted tokens of other shapes, or position classes of other
        tokens than these."""
        check_token_pair(self.clean, self.corrupted)
        if self.positions is not None:
            self.positions.check_tokens(self.clean)

    def check_additive(self) -> None:
        """Refuse a metric that is not additive over examples where the task has several
        batches (:func:`~.discovery.sites.check_additive`)."""
        check_additive(self.model, self.clean, self.metric, self.batches())

    def graph(self, neuron_level: bool = True, nodes: Collection[str] | None = None) -> HeadGraph:
        """The head graph of the task's model (``nodes``: restricted), resolved by the task's
        position classes if it has them."""
        return HeadGraph(
            self.model, neuron_level=neuron_level, nodes=nodes,
            positions=None if self.positions is None else self.positions.names,
        )  # fmt: skip

    def binding(self) -> tuple[Any, ...]:
        """What a reused run was computed with: the model, tokens, metric and position classes
        (:data:`BOUND_BY_IDENTITY` entries, compared by identity: :func:`same_binding`)."""
        return (self.model.model, self.clean, self.corrupted, self.metric, self.positions)


#: How many leading entries of a :meth:`DiscoveryTask.binding` are objects compared by identity
#: (model, clean tokens, corrupted tokens, metric, position classes).
BOUND_BY_IDENTITY = 5


def same_binding(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two bindings (:meth:`DiscoveryTask.binding`, each maybe with more entries
    compared by equality) are the same: the same objects, then equal extras."""
    n = BOUND_BY_IDENTITY
    return all(x is y for x, y in zip(a[:n], b[:n], strict=True)) and a[n:] == b[n:]


__all__ = ["CorruptedRuns", "DiscoveryTask", "same_binding"]
