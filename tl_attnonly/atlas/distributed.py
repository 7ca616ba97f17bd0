"""An atlas built by many processes: ``torchrun`` splits the corpus, one exact merge joins it.

Under ``torch.distributed`` (``torchrun --nproc-per-node N``; gloo on CPU, NCCL on GPU), each
rank reads every ``N``-th batch of the corpus (rank ``r``: batches ``r, r + N, ...``, the same
batches one process would run, so each batch's activations are the same bits), collects its
state, and the states are gathered to rank 0 and merged. Every part of the state merges exactly
(the selections rank by value and global token index, the counters are integers, the activation
sum is fixed point: :mod:`tl_attnonly.atlas.state`), so the atlas equals one process's bit for
bit. Rank 0 writes the site; every rank tokenises the whole corpus (cheap beside the model).

Multi-node: the same command on every node with a rendezvous, e.g.
``torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 ...``
(under SLURM, ``srun`` one ``torchrun`` per node with ``HOST`` the first node); ``--out`` must be
one directory that every node can write (its checkpoints are per rank).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tl_attnonly.atlas.build import AtlasState
from tl_attnonly.atlas.state import AtlasOptions, flatten_state, unflatten_state


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_from_env(device: str = "cpu") -> tuple[int, int]:
    """Join the process group ``torchrun`` describes in the environment (``WORLD_SIZE > 1``):
    NCCL for a CUDA ``device`` (each rank on ``cuda:LOCAL_RANK``), gloo otherwise. Does nothing
    outside ``torchrun`` or if a group exists.

    Returns:
        ``(rank, world_size)``.
    """
    dist = torch.distributed
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        cuda = str(device).startswith("cuda")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    return world()


def rank_device(device: str) -> str:
    """``cuda:LOCAL_RANK`` for a CUDA ``device`` under ``torchrun``; else ``device``."""
    if str(device).startswith("cuda") and "LOCAL_RANK" in os.environ:
        return f"cuda:{os.environ['LOCAL_RANK']}"
    return device


def _payload(state: AtlasState) -> dict[str, Any]:
    return {
        "tensors": {k: v.cpu() for k, v in flatten_state(state.layers).items()},
        "n_tokens": state.n_tokens.cpu(),
        "n_rows": state.n_rows,
        "manifest": state.manifest,
        "options": state.options.to_dict(),
    }


def gather_states(state: AtlasState) -> AtlasState | None:
    """On rank 0, the merge of every rank's state (on ``state``'s device); ``None`` elsewhere.

    Raises:
        ValueError: If the ranks' states are of other models or options.
    """
    rank, size = world()
    if size == 1:
        return state
    parts: list[Any] | None = [None] * size if rank == 0 else None
    torch.distributed.gather_object(_payload(state), parts, dst=0)
    if parts is None:
        return None
    device = state.n_tokens.device
    merged = None
    for part in parts:
        layers = unflatten_state(
            {k: v.to(device) for k, v in part["tensors"].items()}, len(state.layers)
        )
        options = AtlasOptions.from_dict(part["options"])
        one = AtlasState(layers, options, part["manifest"], part["n_rows"],
                         part["n_tokens"].to(device))  # fmt: skip
        merged = one if merged is None else merged.merge(one)
    return merged


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
    if world()[1] > 1:
        torch.distributed.barrier()


__all__ = ["barrier", "gather_states", "init_from_env", "rank_device", "world"]
