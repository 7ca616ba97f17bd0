"""What every dataset of clean prompts with corrupted twins shares (:class:`PromptPairs`).

A task dataset (:class:`~tl_attnonly.analysis.IOIDataset`,
:class:`~tl_attnonly.analysis.sva.SVADataset`) is a frozen dataclass whose
tensor fields have one row per example and whose tuple fields (texts, labels) one entry per
example or none; it names its positions (:meth:`PromptPairs.positions`) and defines its per-row
:meth:`PromptPairs.logit_diff`. From those this base gives row selection, position classes for a
circuit resolved by position, and the scalar and batch-additive metrics.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from jaxtyping import Float, Int

from tl_attnonly.analysis.discovery.positions import PositionClasses

#: ``metric(logits, indices)``: a batch's share of the dataset mean.
AdditiveMetric = Callable[
    [Float[torch.Tensor, "batch pos d_vocab"], Int[torch.Tensor, " batch"]], torch.Tensor
]


def padding_id(tokenizer: Any) -> int:
    """The token id that right-pads a dataset's rows: the tokenizer's pad token, else its
    end-of-sequence token, else 0."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return 0 if pad is None else int(pad)


class _ReadsEndPos:
    """:meth:`PromptPairs.metric` as a method whose bound form declares the logits it reads
    (a ``logit_positions`` attribute: the rows' ``end_pos``), so that patching and exact runs
    from a block unembed only those (:mod:`~tl_attnonly.analysis.metric_reads`)."""

    def __init__(self, func: Callable[..., torch.Tensor]):
        self.func = func
        self.__doc__ = func.__doc__

    def __get__(self, obj: Any, owner: type | None = None) -> Callable[..., torch.Tensor]:
        if obj is None:
            return self.func
        bound = functools.partial(self.func, obj)
        bound.logit_positions = lambda indices: obj.end_pos[indices.cpu()]  # type: ignore[attr-defined]
        return bound


class PromptPairs:
    """Base of the task datasets (a frozen dataclass with ``tokens [batch, pos]``)."""

    tokens: Int[torch.Tensor, "batch pos"]

    corrupted_tokens: Int[torch.Tensor, "batch pos"]

    #: Each row's last prompt position, whose logits :meth:`logit_diff` reads.
    end_pos: Int[torch.Tensor, " batch"]

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def _check_rows(self, per_row: Sequence[str]) -> None:
        """Refuse tokens and corrupted tokens that are not ``[batch, pos]`` of one shape, or a
        field of ``per_row`` that is not ``[batch]``."""
        if self.tokens.ndim != 2 or self.corrupted_tokens.shape != self.tokens.shape:
            raise ValueError(
                f"tokens {tuple(self.tokens.shape)} and corrupted_tokens "
                f"{tuple(self.corrupted_tokens.shape)} must be [batch, pos] of one shape."
            )
        n = self.tokens.shape[0]
        for name in per_row:
            value = getattr(self, name)
            if value.shape != (n,):
                raise ValueError(
                    f"{name} must have shape [batch] = ({n},), got {tuple(value.shape)}."
                )

    def positions(self, name: str) -> Int[torch.Tensor, " batch"]:
        """``[batch]`` positions of the role ``name``."""
        raise NotImplementedError

    def logit_diff(self, logits: Float[torch.Tensor, "batch pos d_vocab"]) -> torch.Tensor:
        """The task's per-row logit difference, ``[batch]``."""
        raise NotImplementedError

    def select(self, index: slice | Sequence[int] | torch.Tensor) -> Any:
        """The rows ``index`` (a slice, a list of rows or a tensor of them), as a dataset."""
        rows = torch.arange(len(self))[index]
        picked: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                picked[f.name] = value[rows]
            elif value:
                picked[f.name] = tuple(value[i] for i in rows.tolist())
        return dataclasses.replace(self, **picked)  # type: ignore[type-var]

    def position_classes(self, names: Sequence[str]) -> PositionClasses:
        """Each token position's role, for a circuit resolved by position
        (``discover_circuit(..., positions=data.position_classes())``): one class per name in
        ``names`` (as :meth:`positions` takes them), every other position ``"other"``."""
        return PositionClasses.from_positions(
            (self.tokens.shape[0], self.tokens.shape[1]),
            {name: self.positions(name) for name in names},
        )

    def _at_end(
        self, logits: Float[torch.Tensor, "batch pos d_vocab"], end: Int[torch.Tensor, " batch"]
    ) -> Float[torch.Tensor, "batch d_vocab"]:
        """Each row's logits at its position ``end``, after checking the logits fit the tokens."""
        if logits.shape[:2] != self.tokens.shape:
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match the dataset's tokens "
                f"{tuple(self.tokens.shape)}: run the model on dataset.tokens (or a select())."
            )
        return logits[torch.arange(logits.shape[0], device=logits.device), end.to(logits.device)]

    @_ReadsEndPos
    def metric(self, logits: Float[torch.Tensor, "batch pos d_vocab"], *_: object) -> torch.Tensor:
        """Mean :meth:`logit_diff`: a scalar (a patching or circuit metric; extra arguments, a
        node-circuit metric's inputs, are ignored). It declares the one position per row it
        reads (``data.metric.logit_positions``: ``end_pos``), so that patching runs from a block
        unembed only those."""
        return self.logit_diff(logits).mean()

    def additive_metric(self) -> AdditiveMetric:
        """The mean :meth:`logit_diff` as a batch-additive ``metric(logits, indices)`` (for
        ``discover_circuit(..., batch_size=...)``): the rows' summed difference over the dataset
        size, so the batches add up to the dataset mean. Its ``logit_positions`` attribute
        declares the position it reads per row (``end_pos``), so that exact runs from a block
        unembed only those (:func:`~tl_attnonly.analysis.discovery.sites.logit_positions`)."""
        size = len(self)

        def metric(logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
            return self.select(indices.cpu()).logit_diff(logits).sum() / size

        # the logits it reads (exact runs compute only these: logit_positions)
        metric.logit_positions = lambda indices: self.end_pos[indices.cpu()]  # type: ignore[attr-defined]
        return metric


__all__ = ["AdditiveMetric", "PromptPairs", "padding_id"]
