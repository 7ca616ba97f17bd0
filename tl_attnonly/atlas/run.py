""":func:`build_atlas`: one whole atlas run, from a model and a corpus to a site on disk.

The run checks its output directory before any work (an atlas of another model there is refused;
so is a directory that holds anything but an atlas), collects the state
(:func:`~tl_attnonly.atlas.build.collect_atlas`) with a checkpoint every ``checkpoint_every``
batches (``{out}/.checkpoint.safetensors``, written to a temporary file and renamed; a run that
finds one of the same model and options resumes after its last row), writes the site into a
temporary sibling directory and only then moves it into place, so a failed run leaves ``out`` as
it was (but for the checkpoint).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from tl_attnonly.adapt import analysis_model
from tl_attnonly.atlas.build import (
    CHECKPOINT_FILE,
    AtlasState,
    atlas_options,
    collect_atlas,
    logit_effect,
    model_manifest,
)
from tl_attnonly.atlas.distributed import barrier, gather_states, world
from tl_attnonly.atlas.records import vocabulary
from tl_attnonly.atlas.site import MANIFEST, write_site
from tl_attnonly.atlas.state import AtlasOptions
from tl_attnonly.protocol import ModelLike


def checkpoint_name(rank: int, world_size: int) -> str:
    """The checkpoint's file name: one per rank of a distributed run."""
    if world_size == 1:
        return CHECKPOINT_FILE
    return CHECKPOINT_FILE.replace(".safetensors", f".rank{rank}-of-{world_size}.safetensors")


def _is_atlas_file(name: str) -> bool:
    """Whether a directory may hold ``name`` and still count as an atlas (or one being built)."""
    return name == MANIFEST or name.startswith(CHECKPOINT_FILE.split(".safetensors")[0])


def check_out_dir(out: Path, manifest: dict[str, Any]) -> None:
    """Refuse ``out`` if it holds another model's atlas, or files that are not an atlas's.

    Raises:
        FileExistsError: Saying what is there.
    """
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a directory.")
    names = {p.name for p in out.iterdir()}
    if not names:
        return
    if MANIFEST in names:
        there = json.loads((out / MANIFEST).read_text("utf-8"))["manifest"]
        if there != manifest:
            raise FileExistsError(
                f"{out} holds the atlas of another model ({there['model_name']}: "
                f"{there['n_layers']} layers x {there['d_mlp']} neurons); this model is "
                f"{manifest['model_name']} ({manifest['n_layers']} x {manifest['d_mlp']}). "
                "Choose another directory, or delete it."
            )
        return
    if not all(_is_atlas_file(name) for name in names):
        raise FileExistsError(
            f"{out} is not empty and holds no atlas ({', '.join(sorted(names)[:5])}, ...); "
            "choose a new or empty directory."
        )


def build_atlas(
    model: ModelLike,
    corpus: Iterable[str | torch.Tensor] | None = None,
    out_dir: str | Path = "tl_attnonly_atlas",
    *,
    options: AtlasOptions | None = None,
    checkpoint_every: int | None = None,
    batch_size: int = 16,
    max_rows: int | None = None,
    progress: bool = True,
    model_name: str | None = None,
    **overrides: Any,
) -> AtlasState:
    """Stream ``corpus`` through ``model`` and write its neuron atlas to ``out_dir``.

    Args:
        model: A converted model: an :class:`~tl_attnonly.AttnOnlyTransformer` or a
            ``TransformerBridge`` converted with :func:`tl_attnonly.convert`.
        corpus: Strings and/or int token tensors (``[pos]`` or ``[batch, pos]``); default
            :func:`~tl_attnonly.analysis.summaries.stdlib_corpus`. Iterated once (twice where a
            run resumes: the rows before the checkpoint are tokenised and skipped).
        out_dir: The site's directory (module docstring).
        options: :class:`~tl_attnonly.atlas.state.AtlasOptions`; each also by keyword
            (``k``, ``before``, ``after``, ``max_len``, ...).
        checkpoint_every: Write a checkpoint every this many batches (``None``: none).
        batch_size: Rows per forward pass (resume with the same one for a bit-identical state).
        max_rows: Read at most this many rows.
        progress: A progress bar in tokens, with tokens/s.
        model_name: The name the manifest records (default: the model config's
            ``model_name``).

    Under ``torch.distributed`` (``torchrun``; :mod:`tl_attnonly.atlas.distributed`) each rank
    reads its share of the batches and checkpoints it to its own file; rank 0 merges the states
    (exactly: the same atlas as one process) and writes the site; every rank returns when it is
    written.

    Returns:
        The :class:`~tl_attnonly.atlas.build.AtlasState` (as ``{out_dir}/state.safetensors``;
        under ``torch.distributed``, on ranks other than 0, the rank's own share).

    Raises:
        FileExistsError: If ``out_dir`` holds another model's atlas or other files (before any
            work).
    """
    adapted = analysis_model(model)
    opts = atlas_options(options, overrides)
    manifest = model_manifest(adapted, model_name)
    out = Path(out_dir)
    check_out_dir(out, manifest)
    rank, world_size = world()
    checkpoint = out / checkpoint_name(rank, world_size)
    state = None
    if checkpoint_every is not None and checkpoint.exists():
        saved = AtlasState.load(checkpoint, adapted.cfg.device)
        if saved.manifest == manifest and saved.options == opts:
            state = saved

    def save(current: AtlasState, batches: int) -> None:
        if checkpoint_every is not None and batches % checkpoint_every == 0:
            out.mkdir(parents=True, exist_ok=True)
            current.save(checkpoint)

    state = collect_atlas(adapted, corpus, options=opts, state=state, batch_size=batch_size,
                          max_rows=max_rows, progress=progress and rank == 0, on_batch=save,
                          model_name=model_name, shard=(rank, world_size))  # fmt: skip
    merged = gather_states(state)
    if merged is None:  # another rank writes the site
        barrier()
        return state
    write_atlas(adapted, merged, out)
    barrier()
    return merged


def write_atlas(model: ModelLike, state: AtlasState, out_dir: str | Path) -> None:
    """Write the site of ``state`` (of ``model``) into ``out_dir``: into a temporary sibling
    directory first, then moved into place (replacing what was there). Also re-renders an
    atlas from its saved state, e.g. after this package's site format changed::

        write_atlas(model, AtlasState.load("my_atlas/state.safetensors"), "my_atlas")

    Raises:
        ValueError: If ``state`` is of another model.
    """
    adapted = analysis_model(model)
    there = model_manifest(adapted, state.manifest["model_name"])
    if there != state.manifest:
        raise ValueError(
            f"The state is of {state.manifest['model_name']} ({state.manifest['n_layers']} "
            f"layers x {state.manifest['d_mlp']} neurons); the model is not."
        )
    out = Path(out_dir)
    vocab = vocabulary(adapted.tokenizer, adapted.cfg.d_vocab)
    tmp = out.with_name(out.name + ".tmp-atlas")
    shutil.rmtree(tmp, ignore_errors=True)
    max_len = state.options.max_len or adapted.cfg.n_ctx
    write_site(tmp, state, logit_effect(adapted), vocab, max_len)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


__all__ = ["build_atlas", "check_out_dir", "checkpoint_name", "write_atlas"]
