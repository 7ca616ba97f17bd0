"""Building an atlas: stream a corpus through a converted model, keep every neuron's state.

:func:`collect_atlas` runs the corpus (rows ``first_row ..``) in batches through the model's own
``run_with_cache`` (the neuron-head hooks ``hook_pre``, ``hook_post`` and, gated,
``hook_pre_linear``: no head hook, so each layer runs its fused path; the self weight, the
pattern's first column, is computed from ``hook_pre``), and merges each batch into an
:class:`AtlasState`
(:mod:`tl_attnonly.atlas.state`). The state stays on the model's device; the loop reads no scalar
back per token. :func:`build_atlas` adds the checkpoints (written atomically, every
``checkpoint_every`` batches; a run that finds one resumes after its last row, so nothing is
counted twice) and writes the site (:mod:`tl_attnonly.atlas.site`).
"""

from __future__ import annotations

import itertools
import json
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Int
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from tl_attnonly._types import replace_options
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.summaries.collect import (
    SummaryOptions,
    cached_batches,
    stdlib_corpus,
    token_rows,
)
from tl_attnonly.atlas.state import (
    AtlasOptions,
    flatten_state,
    merge_layer_states,
    new_layer_state,
    unflatten_state,
)
from tl_attnonly.atlas.update import BatchActs, update_layer
from tl_attnonly.hooks import neuron_act_name
from tl_attnonly.protocol import AttnOnlyModel, ModelLike

#: The file of a finished atlas's state (mergeable), and of a run's checkpoint.
STATE_FILE, CHECKPOINT_FILE = "state.safetensors", ".checkpoint.safetensors"


@dataclass
class AtlasState:
    """Every neuron's statistics over the rows seen (mergeable: :meth:`merge`).

    Attributes:
        layers: Per layer, the state of :func:`~tl_attnonly.atlas.state.new_layer_state`.
        options: What is kept.
        manifest: The model's name and shape (an atlas is of one model).
        n_rows: Rows seen (``first_row`` included: the next row to read).
        n_tokens: Tokens seen (a 0-d tensor on the model's device).
    """

    layers: list[dict[str, Any]]
    options: AtlasOptions
    manifest: dict[str, Any]
    n_rows: int = 0
    n_tokens: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))

    def merge(self, other: AtlasState) -> AtlasState:
        """The state of this state's rows and ``other``'s (disjoint rows; exact)."""
        if other.manifest != self.manifest or other.options != self.options:
            raise ValueError("Only states of the same model and options merge.")
        layers = [merge_layer_states(a, b) for a, b in zip(self.layers, other.layers)]
        n_tokens = self.n_tokens + other.n_tokens.to(self.n_tokens.device)
        rows = max(self.n_rows, other.n_rows)
        return AtlasState(layers, self.options, self.manifest, rows, n_tokens)

    def save(self, path: str | Path) -> None:
        """Write the state to ``path`` (safetensors) atomically: a temporary file, renamed."""
        path = Path(path)
        tensors = flatten_state(self.layers)
        tensors["n_tokens"] = self.n_tokens.reshape(())
        meta = {"options": self.options.to_dict(), "manifest": self.manifest, "n_rows": self.n_rows}
        tmp = path.with_name(path.name + ".tmp")
        save_file({k: v.cpu() for k, v in tensors.items()}, str(tmp), {"atlas": json.dumps(meta)})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path, device: Any = "cpu") -> AtlasState:
        """Read a state :meth:`save` wrote."""
        from safetensors import safe_open

        with safe_open(str(path), "pt") as handle:
            meta = json.loads(handle.metadata()["atlas"])
        tensors = load_file(str(path), device=str(device))
        n_tokens = tensors.pop("n_tokens")
        manifest = meta["manifest"]
        layers = unflatten_state(tensors, manifest["n_layers"])
        options = AtlasOptions.from_dict(meta["options"])
        return cls(layers, options, manifest, meta["n_rows"], n_tokens)


def model_manifest(model: AttnOnlyModel, name: str | None = None) -> dict[str, Any]:
    """The name and shape of ``model`` that an atlas records (and checks on reuse)."""
    cfg = model.cfg
    name = name or getattr(getattr(model.model, "cfg", None), "model_name", None) or "model"
    return {
        "model_name": str(name),
        "n_layers": cfg.n_layers,
        "d_mlp": cfg.d_mlp,
        "d_model": cfg.d_model,
        "d_vocab": cfg.d_vocab,
        "n_heads_per_neuron": model.n_heads_per_neuron,
        "gated": [bool(block.mlp.gated) for block in model.blocks],
    }


def atlas_options(options: AtlasOptions | None, overrides: dict[str, Any]) -> AtlasOptions:
    """``options`` (default :class:`AtlasOptions`) with ``overrides`` replaced."""
    return replace_options(
        options or AtlasOptions(),
        overrides,
        "Unknown atlas option(s) {unknown}; the options are {names} "
        "(tl_attnonly.atlas.AtlasOptions).",
    )


def _layer_acts(
    model: AttnOnlyModel, cache: Any, li: int, base: dict[str, torch.Tensor]
) -> BatchActs:
    """Layer ``li``'s activations in ``cache`` (the self weight: each neuron's first head's,
    from ``pre`` by ``mlp.self_weight``; over the whole batch, so that its bits do not depend on
    which positions a pass keeps: a vector kernel rounds a tensor's tail elements otherwise)."""
    mlp = model.blocks[li].mlp
    pre = cache[neuron_act_name("pre", li)]
    return BatchActs(
        tokens=base["tokens"],
        valid=base["valid"],
        gidx=base["gidx"],
        act=cache[neuron_act_name("post", li)],
        pre=pre,
        self_weight=mlp.self_weight(pre),
        linear=cache[neuron_act_name("pre_linear", li)] if mlp.gated else None,
        b_in=mlp.b_in.detach() if mlp.gated else None,
    )


def collect_atlas(
    model: ModelLike,
    corpus: Iterable[str | torch.Tensor] | None = None,
    *,
    options: AtlasOptions | None = None,
    state: AtlasState | None = None,
    first_row: int = 0,
    batch_size: int = 16,
    max_rows: int | None = None,
    progress: bool = False,
    on_batch: Callable[[AtlasState, int], None] | None = None,
    model_name: str | None = None,
    shard: tuple[int, int] = (0, 1),
    **overrides: Any,
) -> AtlasState:
    """Stream rows ``first_row ..`` of ``corpus`` through ``model`` into an :class:`AtlasState`.

    Args:
        model: A converted model (:func:`~tl_attnonly.adapt.analysis_model` takes it).
        corpus: Strings and/or int token tensors; default
            :func:`~tl_attnonly.analysis.summaries.stdlib_corpus`.
        options: :class:`AtlasOptions` (each also accepted by keyword).
        state: A state to continue (its ``n_rows`` is then the first row read).
        first_row: The first row to read (rows before it are tokenised and skipped).
        batch_size: Rows per forward pass (a resumed run gives the same state bit for bit with
            the same batch size; another changes activations by rounding at most).
        max_rows: Stop before this row.
        progress: A progress bar in tokens (with tokens/s).
        on_batch: Called as ``on_batch(state, batches_done)`` after every batch.
        model_name: The name the manifest records.
        shard: ``(rank, world)``: read only batches ``rank, rank + world, rank + 2 * world, ...``
            of the corpus's batches of ``batch_size`` rows (every rank tokenises the whole
            corpus). The shards' states merge to the state of one pass, bit for bit
            (:mod:`tl_attnonly.atlas.distributed`).

    Returns:
        The state over the rows read (``n_rows``: one past the last row read).
    """
    adapted = analysis_model(model)
    opts = atlas_options(options if state is None else state.options, overrides)
    cfg, device = adapted.cfg, adapted.cfg.device
    assert cfg.d_mlp is not None  # a converted model has MLPs
    max_len = opts.max_len or cfg.n_ctx
    if state is None:
        manifest = model_manifest(adapted, model_name)
        layers = [new_layer_state(cfg.d_mlp, opts, g, device) for g in manifest["gated"]]
        state = AtlasState(layers, opts, manifest, first_row, torch.zeros((), dtype=torch.long))
    state.n_tokens = state.n_tokens.to(device)
    stop = None if max_rows is None else max(max_rows, state.n_rows)
    rows = token_rows(adapted, stdlib_corpus() if corpus is None else corpus, max_len)
    starts: deque[int] = deque()  # the global index of each row handed on, in order
    mine = _shard_rows(rows, state.n_rows, stop, batch_size, shard, starts)
    names = {neuron_act_name(kind, li) for li in range(cfg.n_layers)
             for kind in ("pre", "post")}  # fmt: skip
    names |= {neuron_act_name("pre_linear", li) for li, g in enumerate(state.manifest["gated"])
              if g}  # fmt: skip
    passes = SummaryOptions(max_len=max_len, batch_size=batch_size, progress=False)
    bar = tqdm(desc="atlas", unit="tok", unit_scale=True, disable=not progress)
    for batches, (tokens, lengths, valid, cache) in enumerate(
        cached_batches(adapted, mine, names, passes), start=1
    ):
        first = starts.popleft()
        for _ in range(tokens.shape[0] - 1):
            starts.popleft()
        base = _batch_base(tokens, valid, first, max_len, device)
        for li in range(cfg.n_layers):
            acts = _layer_acts(adapted, cache, li, base)
            state.layers[li] = update_layer(state.layers[li], acts, li * cfg.d_mlp, opts)
        state.n_tokens += base["valid"].sum()
        state.n_rows = first + tokens.shape[0]
        bar.update(int(lengths.sum()))
        if on_batch is not None:
            on_batch(state, batches)
    bar.close()
    return state


def _shard_rows(
    rows: Iterator[torch.Tensor],
    first: int,
    stop: int | None,
    batch_size: int,
    shard: tuple[int, int],
    starts: deque[int],
) -> Iterator[torch.Tensor]:
    """Rows ``first .. stop`` of ``rows`` in batches ``rank (mod world)`` of ``batch_size`` rows,
    each row's global index appended to ``starts``."""
    rank, world = shard
    if not 0 <= rank < world:
        raise ValueError(f"shard=(rank, world) needs 0 <= rank < world, got {shard}.")
    for index, row in enumerate(itertools.islice(rows, stop)):
        if index >= first and (index // batch_size) % world == rank:
            starts.append(index)
            yield row


def _batch_base(
    tokens: Int[torch.Tensor, "batch pos"],
    valid: torch.Tensor,
    first_row: int,
    max_len: int,
    device: Any,
) -> dict[str, torch.Tensor]:
    """The batch's tokens, valid mask and global token indices ``row * max_len + pos``."""
    row = torch.arange(first_row, first_row + tokens.shape[0])
    gidx = row[:, None] * max_len + torch.arange(tokens.shape[1])[None, :]
    return {"tokens": tokens.to(device), "valid": valid.to(device), "gidx": gidx.to(device)}


#: Per layer: the largest logit effects ``[d_mlp, n]``, their tokens, the smallest, theirs.
LogitEffect = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def logit_effect(model: ModelLike, n: int = 10) -> LogitEffect:
    """Per layer, each neuron's direct logit effect ``W_out[i] @ W_U``: the ``n`` largest values
    and their tokens, then the ``n`` smallest and theirs (a gated neuron's, per unit of its
    activation ``act(g) * u``: per unit of the linear branch ``u`` where ``act(g) = 1``)."""
    adapted = analysis_model(model)
    out = []
    with torch.no_grad():
        for block in adapted.blocks:
            effect = block.mlp.W_out.float() @ adapted.W_U.float()  # [d_mlp, d_vocab]
            top, bottom = effect.topk(n, dim=1), effect.topk(n, dim=1, largest=False)
            out.append((top.values, top.indices, bottom.values, bottom.indices))
    return out


__all__ = [
    "CHECKPOINT_FILE",
    "LogitEffect",
    "STATE_FILE",
    "AtlasState",
    "atlas_options",
    "collect_atlas",
    "logit_effect",
    "model_manifest",
]
