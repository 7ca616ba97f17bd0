"""The wall time of each stage of a search (:class:`StageTimer`).

:func:`~.search.discover_circuit` reports, in ``circuit.extra["seconds"]``, how long each of its
stages took (edge scores, sweep, pruning, neurons, ...). A stage is timed by running it inside
``with timer("stage"):``; the stages that did not run are absent.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StageTimer:
    """Wall time per stage: ``with timer("sweep"): ...`` records the block's seconds under
    ``"sweep"`` in :attr:`seconds` (a stage that raises is not recorded).

    Attributes:
        seconds: Stage name -> seconds, in the order the stages ran.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[stage] = time.perf_counter() - start

    def total(self) -> float:
        """Seconds of every stage timed so far."""
        return sum(self.seconds.values())


__all__ = ["StageTimer"]
