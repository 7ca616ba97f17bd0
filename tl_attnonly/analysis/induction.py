"""Induction (copying) prompts: a random token sequence repeated, and a corrupted twin.

An induction head (Olsson et al. 2022, *In-context Learning and Induction Heads*) completes
``[A][B] ... [A] -> [B]``: at a token seen before it attends to the token that followed it then
and copies it. On a sequence of random tokens repeated once, ``x_1 ... x_L x_1 ... x_L``, a model
with induction heads predicts the second half: at position ``L + j`` (token ``x_j``) the next token
``x_{j+1}`` is known only from the first half.

:func:`make_induction_dataset` draws such rows from a token pool (by default every distinct token
of the package's bundled text, ``data/sentences.txt`` and ``data/prompts.txt``, in the model's
tokenizer: so it works offline on any tokenizer), with corrupted twins of the same shape:

* ``"first"`` (default): the first half replaced by other tokens, ``y_1 ... y_L x_1 ... x_L``.
  The second half, and so every query position of the metric, is the clean one; only the copy to
  read from is gone.
* ``"second"``: the second half replaced, ``x_1 ... x_L y_1 ... y_L`` (nothing repeats; the
  queries themselves differ).

The metric (:meth:`InductionDataset.metric`) is the mean logit of the clean next token ``x_{j+1}``
over the second half's positions ``L + 1 .. 2L - 1`` (prefix not counted) and over rows;
:meth:`InductionDataset.additive_metric` writes it as a sum divided by the dataset size, for
:func:`~tl_attnonly.analysis.discover_circuit` in batches. The first token of the second half is
not scored: nothing says a repeat starts there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tl_attnonly.protocol import ModelLike

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from jaxtyping import Float, Int

from tl_attnonly._types import tokens_on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.corpora import load_prompts

if TYPE_CHECKING:
    pass

#: Corruptions of :func:`make_induction_dataset`.
INDUCTION_CORRUPTIONS = ("first", "second")


@dataclass(frozen=True)
class InductionDataset:
    """Repeated random tokens, corrupted twins, and where the metric reads the logits.

    Every row is ``prefix + first half + second half`` (``prefix_len`` tokens, then ``half_len``
    and ``half_len``); the clean second half repeats the first.

    Attributes:
        tokens: ``[batch, pos]`` clean rows, ``pos = prefix_len + 2 * half_len``.
        corrupted_tokens: ``[batch, pos]`` corrupted twins.
        prefix_len: Tokens before the first half (e.g. 1 for a BOS token).
        half_len: Length of each half.
        corruption: ``"first"``, ``"second"`` or ``""`` (built by :meth:`from_tokens`).
    """

    tokens: Int[torch.Tensor, "batch pos"]
    corrupted_tokens: Int[torch.Tensor, "batch pos"]
    prefix_len: int
    half_len: int
    corruption: str = field(default="")

    def __post_init__(self) -> None:
        if self.tokens.ndim != 2 or self.corrupted_tokens.shape != self.tokens.shape:
            raise ValueError(
                f"tokens {tuple(self.tokens.shape)} and corrupted_tokens "
                f"{tuple(self.corrupted_tokens.shape)} must be [batch, pos] of one shape."
            )
        if self.half_len < 2 or self.prefix_len < 0:
            raise ValueError(
                f"half_len must be >= 2 and prefix_len >= 0, got {self.half_len}, "
                f"{self.prefix_len}."
            )
        if self.tokens.shape[1] != self.prefix_len + 2 * self.half_len:
            raise ValueError(
                f"tokens have {self.tokens.shape[1]} positions; expected prefix_len + 2 * half_len"
                f" = {self.prefix_len + 2 * self.half_len}."
            )
        first = self.tokens[:, self.prefix_len : self.prefix_len + self.half_len]
        if not torch.equal(first, self.tokens[:, self.prefix_len + self.half_len :]):
            raise ValueError("The clean rows' second half must repeat their first half.")

    @classmethod
    def from_tokens(
        cls,
        tokens: Int[torch.Tensor, "batch pos"],
        corrupted_tokens: Int[torch.Tensor, "batch pos"],
        prefix_len: int = 0,
    ) -> InductionDataset:
        """A dataset from token ids (e.g. for a model without a tokenizer).

        Args:
            tokens: ``[batch, pos]`` rows of ``prefix_len`` tokens then a half repeated once.
            corrupted_tokens: ``[batch, pos]``, the same shape.
            prefix_len: Tokens before the first half.

        Raises:
            ValueError: If ``pos - prefix_len`` is odd or the second half does not repeat.
        """
        rest = tokens.shape[-1] - prefix_len
        if rest % 2:
            raise ValueError(
                f"{tokens.shape[-1]} positions minus prefix_len={prefix_len} is odd: each row "
                "must be the prefix, then a half, then the same half again."
            )
        return cls(tokens, corrupted_tokens, prefix_len, rest // 2)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def query_positions(self) -> Int[torch.Tensor, " n_scored"]:
        """Positions whose next-token logits are scored: ``prefix_len + half_len + j`` for
        ``j = 0 .. half_len - 2`` (each predicts the first half's token ``j + 1``)."""
        start = self.prefix_len + self.half_len
        return torch.arange(start, start + self.half_len - 1)

    @property
    def targets(self) -> Int[torch.Tensor, "batch n_scored"]:
        """The clean next token at each scored position: ``tokens[:, query_positions + 1]``."""
        return self.tokens[:, self.query_positions + 1]

    def select(self, index: slice | Sequence[int] | torch.Tensor) -> InductionDataset:
        """The rows ``index`` (a slice, a list of rows or a tensor of them), as a dataset."""
        rows = torch.arange(len(self))[index]
        return InductionDataset(
            self.tokens[rows],
            self.corrupted_tokens[rows],
            self.prefix_len,
            self.half_len,
            self.corruption,
        )

    def correct_logits(
        self, logits: Float[torch.Tensor, "batch pos d_vocab"]
    ) -> Float[torch.Tensor, "batch n_scored"]:
        """The logit of the clean next token at every scored position: ``[batch, n_scored]``."""
        if logits.shape[:2] != self.tokens.shape:
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match the dataset's tokens "
                f"{tuple(self.tokens.shape)}: run the model on dataset.tokens (or a select())."
            )
        positions = self.query_positions.to(logits.device)
        return logits[:, positions].gather(-1, self.targets.to(logits.device)[..., None])[..., 0]

    def accuracy(self, logits: Float[torch.Tensor, "batch pos d_vocab"]) -> float:
        """The fraction of scored positions whose most likely next token is the clean one."""
        positions = self.query_positions.to(logits.device)
        top = logits[:, positions].argmax(-1)
        return (top == self.targets.to(logits.device)).float().mean().item()

    def metric(self, logits: Float[torch.Tensor, "batch pos d_vocab"], *_: object) -> torch.Tensor:
        """Mean logit of the clean next token over scored positions and rows: a scalar.

        Extra arguments (a node-circuit metric's inputs) are ignored.
        """
        return self.correct_logits(logits).mean()

    def additive_metric(
        self,
    ) -> Callable[
        [Float[torch.Tensor, "batch pos d_vocab"], Int[torch.Tensor, " batch"]], torch.Tensor
    ]:
        """:meth:`metric` as a batch-additive ``metric(logits, indices)``.

        For circuit discovery in batches (:func:`~tl_attnonly.analysis.discover_circuit`,
        ``batch_size=``): ``logits`` are those of the rows ``indices`` of this dataset; each row
        contributes its mean over the scored positions divided by ``len(self)``, so the sum over
        batches is the dataset mean.
        """
        n = len(self)

        def metric(logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
            return self.select(indices.cpu()).correct_logits(logits).mean(-1).sum() / n

        return metric


def induction_token_pool(model: ModelLike, texts: Sequence[str] | None = None) -> list[int]:
    """Every distinct non-special token id of ``texts`` in ``model``'s tokenizer, sorted.

    Args:
        model: A ``HookedTransformer`` with a tokenizer.
        texts: The corpus; default the package's bundled prompts
            (:func:`tl_attnonly.fidelity_lm.load_prompts`: 300 lines of prose, dialogue, code
            and numbers).

    Raises:
        ValueError: If the model has no tokenizer.
    """
    model = analysis_model(model, neuron_heads=False)
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            "This model has no tokenizer; pass pool=[token ids] to make_induction_dataset, or "
            "build the dataset with InductionDataset.from_tokens(tokens, corrupted_tokens)."
        )
    special = set(tokenizer.all_special_ids)
    ids: set[int] = set()
    for text in load_prompts() if texts is None else texts:
        ids.update(tokenizer(text, add_special_tokens=False)["input_ids"])
    return sorted(ids - special)


def make_induction_dataset(
    model: ModelLike,
    n_prompts: int,
    half_len: int = 10,
    *,
    corruption: str = "first",
    prepend_bos: bool | None = None,
    pool: Sequence[int] | None = None,
    seed: int = 0,
) -> InductionDataset:
    """Rows of ``half_len`` random distinct pool tokens repeated once, and corrupted twins.

    Args:
        model: A ``HookedTransformer`` (its tokenizer gives the default pool and the BOS token).
        n_prompts: Number of rows.
        half_len: Tokens in each half (at least 2).
        corruption: ``"first"`` (the first half replaced: the scored positions are unchanged,
            the copy is gone) or ``"second"`` (the second half replaced).
        prepend_bos: Put the tokenizer's BOS token first (default: the model's own
            ``cfg.default_prepend_bos``).
        pool: Token ids to draw from; default :func:`induction_token_pool` (the bundled text).
        seed: Seed of the draws.

    Returns:
        The :class:`InductionDataset`; the replacement tokens of a corrupted half are drawn from
        the pool apart from the row's clean tokens, so a corrupted row repeats nothing.

    Raises:
        ValueError: For an unknown corruption, ``half_len < 2``, ``n_prompts < 1``, a pool of
            fewer than ``2 * half_len`` distinct tokens, or a BOS with no BOS token.
    """
    model = analysis_model(model, neuron_heads=False)
    if corruption not in INDUCTION_CORRUPTIONS:
        raise ValueError(f"corruption={corruption!r}; expected one of {INDUCTION_CORRUPTIONS}.")
    if half_len < 2:
        raise ValueError(f"half_len must be at least 2 (one scored position), got {half_len}.")
    if n_prompts < 1:
        raise ValueError(f"n_prompts must be at least 1, got {n_prompts}.")
    ids = sorted(set(induction_token_pool(model) if pool is None else pool))
    if len(ids) < 2 * half_len:
        raise ValueError(
            f"The pool has {len(ids)} distinct tokens; a row and its corruption need "
            f"2 * half_len = {2 * half_len}. Pass a larger pool= or a smaller half_len."
        )
    if any(not 0 <= i < model.cfg.d_vocab for i in (ids[0], ids[-1])):
        raise ValueError(f"Pool token ids must lie in [0, d_vocab={model.cfg.d_vocab}).")
    bos = model.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
    prefix: list[int] = []
    if bos:
        tokenizer = getattr(model, "tokenizer", None)
        if tokenizer is None or tokenizer.bos_token_id is None:
            raise ValueError("prepend_bos=True needs a tokenizer with a BOS token.")
        prefix = [int(tokenizer.bos_token_id)]
    rng = random.Random(seed)
    clean, corrupted = [], []
    for _ in range(n_prompts):
        drawn = rng.sample(ids, 2 * half_len)
        x, y = drawn[:half_len], drawn[half_len:]
        clean.append(prefix + x + x)
        corrupted.append(prefix + (y + x if corruption == "first" else x + y))
    # on the model's device, as model.to_tokens puts them
    return InductionDataset(
        *tokens_on_model_device(
            model, torch.tensor(clean, dtype=torch.long), torch.tensor(corrupted, dtype=torch.long)
        ),
        len(prefix),
        half_len,
        corruption,
    )


__all__ = [
    "INDUCTION_CORRUPTIONS",
    "InductionDataset",
    "induction_token_pool",
    "make_induction_dataset",
]
