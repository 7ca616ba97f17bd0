"""Position classes: a graph whose inputs are resolved by token position.

Each token position of each example belongs to one named class (for IOI: ``io``, ``s1``,
``s1_plus1``, ``s2``, ``end`` and ``other``). A :class:`~.graph.HeadGraph` built with the class
names has one input group per reader input *and class* (key ``"attn.23.v@io"``): the edge
``L0MLP -> L23KV1:v@io`` is the change of ``L0MLP``'s output reaching the values of ``L23KV1`` at
the IO positions only. Sources are not split: a source's change at a position reaches readers at
that position only (the residual stream is per position), so splitting the readers splits every
path. With one class per position the circuit run is the same as without classes; the full graph
is still the clean run and the empty graph the corrupted one, exactly.

Edge scores (:func:`~.edge_scores.edge_attribution_scores`) sum each reader's gradient over the
positions of its class only; exact circuit runs (:func:`~.runs.circuit_metrics`) rebuild each
class's positions from its own edges.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Int

#: The class of every position not named (``PositionClasses.from_positions``).
OTHER = "other"


@dataclass(frozen=True)
class PositionClasses:
    """Which class each token position of each example belongs to.

    Attributes:
        names: The classes' names (unique, no ``"@"``).
        ids: ``[n_examples, pos]``: the index into ``names`` of each position's class.

    Raises:
        ValueError: For repeated or malformed names, or ids that are not class indices.
    """

    names: tuple[str, ...]
    ids: Int[torch.Tensor, "batch pos"]

    def __post_init__(self) -> None:
        names = tuple(self.names)
        object.__setattr__(self, "names", names)
        if not names or len(set(names)) != len(names) or any("@" in n or not n for n in names):
            raise ValueError(
                f"Position class names must be unique, non-empty and free of '@'; got {names}."
            )
        if self.ids.ndim != 2 or self.ids.dtype.is_floating_point or self.ids.dtype == torch.bool:
            raise ValueError(
                f"ids must be an integer tensor [n_examples, pos], got {self.ids.dtype} "
                f"{tuple(self.ids.shape)}."
            )
        if self.ids.numel() and (int(self.ids.min()) < 0 or int(self.ids.max()) >= len(names)):
            raise ValueError(
                f"ids must be class indices in [0, {len(names)}) (names {names}); got values in "
                f"[{int(self.ids.min())}, {int(self.ids.max())}]."
            )

    @classmethod
    def from_positions(
        cls,
        shape: tuple[int, int],
        positions: Mapping[str, Int[torch.Tensor, " batch"] | Sequence[int]],
        other: str = OTHER,
    ) -> PositionClasses:
        """Classes from one position per example for each named class, the rest in ``other``.

        Args:
            shape: ``(n_examples, pos)`` of the tokens.
            positions: ``name -> [n_examples]`` positions (e.g. ``{"io": io_pos, "end": end_pos}``);
                later names win where two share a position.
            other: Name of the class of every other position.

        Returns:
            :class:`PositionClasses` with names ``(*positions, other)``.
        """
        n, pos = shape
        names = (*positions, other)
        ids = torch.full((n, pos), len(names) - 1, dtype=torch.long)
        rows = torch.arange(n)
        for c, where in enumerate(positions.values()):
            where = torch.as_tensor(where, dtype=torch.long).cpu()
            if where.shape != (n,):
                raise ValueError(
                    f"positions[{names[c]!r}] must hold one position per example, [{n}], got "
                    f"{tuple(where.shape)}."
                )
            if ((where < 0) | (where >= pos)).any():
                raise ValueError(f"positions[{names[c]!r}] must lie in [0, {pos}).")
            ids[rows, where] = c
        return cls(names, ids)

    def check_tokens(self, tokens: torch.Tensor) -> None:
        """Refuse tokens of another shape than ``ids``."""
        if tuple(tokens.shape) != tuple(self.ids.shape):
            raise ValueError(
                f"The position classes are for tokens of shape {tuple(self.ids.shape)}; the tokens "
                f"have shape {tuple(tokens.shape)}. Build them from the same dataset "
                "(PositionClasses.from_positions, IOIDataset.position_classes())."
            )

    def mask(
        self, name: str, idx: torch.Tensor | None = None, device=None
    ) -> Bool[torch.Tensor, "batch pos"]:
        """``[batch, pos]``: the positions of class ``name`` (of examples ``idx``)."""
        ids = self.ids if idx is None else self.ids[idx.cpu()]
        return (ids == self.names.index(name)).to(device)


def resolve_name(key: str) -> tuple[str, str | None]:
    """``"attn.23.v@io"`` -> ``("attn.23.v", "io")``; a key without class -> ``(key, None)``."""
    base, _, position = key.partition("@")
    return base, position or None


__all__ = ["OTHER", "PositionClasses", "resolve_name"]
