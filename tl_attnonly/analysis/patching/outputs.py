"""Exact patching of head outputs, batched: neuron-heads, whole neurons and attention heads.

Patching the output ``z`` of neuron-heads of neuron ``i`` in layer ``l`` from the clean run into
the corrupted run changes that layer's ``hook_post[..., i]`` by ``delta = sum (z_clean -
z_corrupted)`` over the patched heads, hence (the MLP's output being ``post @ W_out + b_out``,
added to the residual stream) the residual stream after layer ``l`` by exactly ``delta *
W_out[i]``. So a patched run is the corrupted residual stream after layer ``l`` plus that rank-1
change, run through the layers after ``l`` only (TransformerLens's ``start_at_layer``); layers
``0..l`` are never recomputed, and many patches share a pass as copies of the batch. For a patch
in the last layer only the final norm and the unembedding run. In a causal decoder the positions
before the first one the patch changes are the corrupted run's in every later layer, so only the
positions from there on run, against the corrupted keys and values of the prefix
(:class:`~tl_attnonly.analysis.patching.resume.LayerRuns`).

Attention heads (and neuron-heads of models that normalise the MLP output before adding it:
Gemma 2/3, OLMo 2/3) are patched through their ``hook_z`` in a pass that starts at their layer
from the corrupted residual stream. Either way the result is the metric of the patched model,
not an approximation: it equals patching one head per forward pass up to floating-point summation
order (tested to 1e-10 in float64 on plain, GELU ``K = 4`` and gated models).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from tqdm.auto import tqdm
from transformer_lens import ActivationCache

from tl_attnonly._types import Metric, check_tokens, on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.patching.dense_layers import head_refs, refuse_expert_refs
from tl_attnonly.analysis.patching.options import PatchingOptions, resolve_patching_options
from tl_attnonly.analysis.patching.resume import (
    LayerRuns,
    additive_mlp_out,
    can_resume,
    metric_of_copies,
    patches_per_pass_for,
)
from tl_attnonly.hooks import (
    HeadRef,
    head_act_name,
    neuron_act_name,
    neuron_head_refs,
    parse_head_label,
)
from tl_attnonly.protocol import AttnOnlyModel, ModelLike

Level = Literal["neuron", "head"]


@dataclass(frozen=True)
class PatchUnit:
    """What one patch replaces: heads of one kind and layer, patched together.

    Attributes:
        label: ``L{l}H{h}`` (attention head), ``L{l}N{i}`` (a neuron: all its ``K`` heads, or its
            one head when ``K = 1``) or ``L{l}N{i}.{k}`` (one neuron-head).
        kind: ``"attn"`` or ``"neuron"``.
        layer: The layer.
        heads: Head indices in that layer's head axis (``neuron * K + k`` for neuron-heads).
    """

    label: str
    kind: Literal["attn", "neuron"]
    layer: int
    heads: tuple[int, ...]


def patch_units(
    model: ModelLike,
    heads: Sequence[str | HeadRef] | None = None,
    level: Level = "neuron",
) -> list[PatchUnit]:
    """The units an output-patching sweep patches, in :func:`all_head_refs` order by default.

    Args:
        model: A converted model.
        heads: Labels (``"L1H0"``, ``"L1N3"``, ``"L1N3.2"``) or :class:`HeadRef` s; default every
            head (a mixture-of-experts layer: its attention heads; its neuron-heads refuse, see
            :mod:`~tl_attnonly.analysis.patching.dense_layers`). At ``level="neuron"`` a
            neuron-head stands for its whole neuron (a neuron listed twice, e.g. by two of its
            heads, is patched once).
        level: ``"neuron"`` (default): a neuron's ``K`` heads are one unit, labelled
            ``L{l}N{i}``; ``"head"``: every neuron-head is its own unit.

    Raises:
        ValueError: For an unknown level or a malformed label.
    """
    model = analysis_model(model)
    if level not in ("neuron", "head"):
        raise ValueError(f"level must be 'neuron' or 'head', got {level!r}.")
    K = model.n_heads_per_neuron
    refs: list[HeadRef] = []
    if heads is None:  # mixtures of experts: their attention heads only
        refs = head_refs(model)
    else:
        for spec in heads:
            if isinstance(spec, str) and K > 1 and "N" in spec and "." not in spec:
                layer_text, neuron_text = spec[1:].split("N")
                refs += neuron_head_refs(int(layer_text), int(neuron_text), K)
            else:
                refs.append(parse_head_label(spec, K))
        refuse_expert_refs(model, refs, "Patching dense neuron-heads")
    units: dict[str, PatchUnit] = {}
    group: tuple[int, ...]
    for ref in refs:
        if ref.kind == "attn":
            label, group = ref.label(K), (ref.head,)
        elif level == "neuron":
            neuron = ref.head // K
            label, group = f"L{ref.layer}N{neuron}", tuple(range(neuron * K, neuron * K + K))
        else:
            label, group = ref.label(K), (ref.head,)
        units.setdefault(label, PatchUnit(label, ref.kind, ref.layer, group))
    return list(units.values())


def get_act_patch_outputs(
    model: ModelLike,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: ActivationCache,
    patching_metric: Metric,
    heads: Sequence[str | HeadRef | PatchUnit] | None = None,
    *,
    level: Level = "neuron",
    options: PatchingOptions | None = None,
    **overrides: Any,
) -> tuple[Float[torch.Tensor, "n_units ..."], list[str]]:
    """Exact activation patching of head outputs, many patches per pass (module docstring).

    Each unit's clean ``z`` (all positions, or one position at a time) goes into the corrupted
    run; the result is ``patching_metric`` of the patched logits. ``level="neuron"`` patches a
    neuron's ``K`` heads together (the neuron's ``hook_post``); ``level="head"`` each head.

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` or a ``TransformerBridge``
            converted with :func:`tl_attnonly.convert` (in place).
        corrupted_tokens: ``[batch, pos]``, the run that is patched.
        clean_cache: Cache of the clean run holding ``hook_z`` of every layer swept, attention
            and neuron-heads (``names_filter=tl_attnonly.hooks.head_names_filter("z")``).
        patching_metric: Logits ``[batch, pos, d_vocab]`` -> scalar.
        heads: Units to patch: labels, :class:`HeadRef` s or :class:`PatchUnit` s (see
            :func:`patch_units`); default every head at ``level``.
        level: ``"neuron"`` (default) or ``"head"``.
        per_position: One patch per (unit, position) instead of all positions at once.
        positions: Positions for ``per_position``; default all.
        patches_per_pass: Patches per pass; default: as many as ``max_bytes`` allows (up to 256).
        max_bytes: Memory budget of a pass's batch copies (estimated from the shapes).
        progress: Show a progress bar over passes.
        options: A :class:`~tl_attnonly.analysis.PatchingOptions` (``per_position``, ``positions``,
            ``patches_per_pass``, ``max_bytes``, ``progress``); each is also accepted by keyword,
            replacing the one in ``options``.

    Returns:
        ``(metric after each patch, labels)``: ``[n_units]``, or ``[n_units, n_positions]`` with
        ``per_position``, float64.

    Raises:
        KeyError: If ``clean_cache`` lacks a ``hook_z`` it needs.
        IndexError: For positions outside the input.
        MemoryError: If the budget cannot hold one copy of the batch (or ``patches_per_pass``).
    """
    opts = resolve_patching_options(
        "get_act_patch_outputs",
        options,
        overrides,
        supported=("per_position", "positions", "patches_per_pass", "max_bytes", "progress"),
    )
    per_position = opts.per_position
    positions = opts.positions
    patches_per_pass = opts.patches_per_pass
    max_bytes = opts.max_bytes
    progress = opts.progress
    model = analysis_model(model)
    corrupted_tokens = on_model_device(model, corrupted_tokens)
    check_tokens(corrupted_tokens)
    if not can_resume(model):
        raise TypeError(
            f"get_act_patch_outputs resumes decoder runs at a layer; {type(model).__name__} "
            "cannot. Use get_act_patch_all_heads or run_patches (full passes) instead."
        )
    if heads is not None and _all_units(heads):
        units = [u for u in heads if isinstance(u, PatchUnit)]
    else:
        units = patch_units(model, heads, level)  # type: ignore[arg-type]
    batch, n_pos = corrupted_tokens.shape
    pos_list = list(range(n_pos)) if positions is None else [int(p) for p in positions]
    bad = [p for p in pos_list if not 0 <= p < n_pos]
    if bad:
        raise IndexError(
            f"positions must be in [0, {n_pos}) for [batch, {n_pos}] tokens, got {bad[:5]}."
        )
    step = patches_per_pass_for(model, batch, n_pos, patches_per_pass, max_bytes)
    names = sorted({head_act_name("z", u.layer, u.kind) for u in units})
    missing = [name for name in names if name not in clean_cache.cache_dict]
    if missing:
        raise KeyError(
            f"The clean cache lacks {missing[:3]}{'...' if len(missing) > 3 else ''}. Cache "
            "them with names_filter=tl_attnonly.hooks.head_names_filter('z')."
        )
    runs = LayerRuns(model, corrupted_tokens, extra_names=names, metric=patching_metric)
    additive = additive_mlp_out(model)
    # (unit index, position or None), grouped by (method, layer) so a pass shares its start.
    groups: dict[tuple[bool, int], list[tuple[int, int | None]]] = {}
    for i, unit in enumerate(units):
        by_delta = unit.kind == "neuron" and additive
        for p in pos_list if per_position else [None]:
            groups.setdefault((by_delta, unit.layer), []).append((i, p))
    out = torch.zeros(len(units), len(pos_list) if per_position else 1, dtype=torch.float64)
    column = {p: j for j, p in enumerate(pos_list)}
    passes = [
        (key, jobs[s : s + step])
        for key, jobs in sorted(groups.items())
        for s in range(0, len(jobs), step)
    ]
    for (by_delta, layer), chunk in tqdm(passes, desc="patching outputs", disable=not progress):
        chunk_units = [units[i] for i, _ in chunk]
        chunk_pos = [p for _, p in chunk]
        if by_delta:
            logits = _delta_pass(model, runs, clean_cache, layer, chunk_units, chunk_pos)
        else:
            logits = _hooked_pass(runs, clean_cache, layer, chunk_units, chunk_pos)
        values = metric_of_copies(patching_metric, logits, batch)
        for (i, p), value in zip(chunk, values, strict=True):
            out[i, 0 if p is None else column[p]] = value
    return (out if per_position else out[:, 0]), [u.label for u in units]


def _all_units(heads: Sequence[object]) -> bool:
    return len(heads) > 0 and all(isinstance(h, PatchUnit) for h in heads)


def _position_mask(
    chunk_pos: Sequence[int | None], n_pos: int, like: torch.Tensor
) -> torch.Tensor | None:
    """``[copies, 1, pos]``: 1 at each copy's patched position (``None``: all positions)."""
    if all(p is None for p in chunk_pos):
        return None
    mask = like.new_zeros(len(chunk_pos), 1, n_pos)
    for c, p in enumerate(chunk_pos):
        if p is None:
            mask[c] = 1
        else:
            mask[c, 0, p] = 1
    return mask


def _delta_pass(
    model: AttnOnlyModel,
    runs: LayerRuns,
    clean_cache: ActivationCache,
    layer: int,
    units: Sequence[PatchUnit],
    chunk_pos: Sequence[int | None],
) -> Float[torch.Tensor, "copies_batch pos d_vocab"]:
    """Neuron-head units of one layer: the corrupted stream after ``layer`` plus each unit's
    ``delta * W_out[neuron]``, run through the later layers only."""
    name = neuron_act_name("z", layer)
    K = model.n_heads_per_neuron
    dz = (clean_cache[name] - runs.cache[name])[..., 0]  # [batch, pos, n_neuron_heads]
    index = torch.tensor([h for u in units for h in u.heads], device=dz.device)
    owner = torch.tensor(
        [c for c, u in enumerate(units) for _ in u.heads], device=dz.device
    )  # which copy each head belongs to
    # [copies, batch, pos]: each unit's change of hook_post at its neuron
    delta = dz.new_zeros(len(units), *dz.shape[:2]).index_add_(
        0, owner, dz[..., index].permute(2, 0, 1)
    )
    mask = _position_mask(chunk_pos, dz.shape[1], delta)
    if mask is not None:
        delta = delta * mask
    w_out = model.blocks[layer].mlp.out_matrix  # [d_mlp, d_model]
    rows = w_out[torch.tensor([u.heads[0] // K for u in units], device=w_out.device)]
    resid = runs.resid(layer + 1)  # [batch, pos, d_model]
    patched = resid + delta.to(resid.device)[..., None] * rows[:, None, None, :]
    # Positions before the first change are the corrupted run's in every later layer.
    changed = (delta != 0).any(0).any(0).nonzero()
    first_pos = int(changed[0]) if len(changed) else resid.shape[1]
    return runs.run(patched.flatten(0, 1), layer + 1, first_pos=first_pos)


def _hooked_pass(
    runs: LayerRuns,
    clean_cache: ActivationCache,
    layer: int,
    units: Sequence[PatchUnit],
    chunk_pos: Sequence[int | None],
) -> Float[torch.Tensor, "copies_batch pos d_vocab"]:
    """Units of one layer patched through their ``hook_z`` in a pass from ``layer`` on."""
    batch = runs.batch
    by_name: dict[str, list[tuple[int, tuple[int, ...], int | None]]] = {}
    for c, (unit, p) in enumerate(zip(units, chunk_pos, strict=True)):
        by_name.setdefault(head_act_name("z", layer, unit.kind), []).append((c, unit.heads, p))

    def make_hook(name: str):
        edits = by_name[name]
        clean = clean_cache[name]

        def hook(z: torch.Tensor, hook) -> torch.Tensor:
            z = z.clone()  # never edit in place: q, v and pre may share storage
            for c, heads, p in edits:
                rows = slice(c * batch, (c + 1) * batch)
                cols = list(heads)
                if p is None:
                    z[rows, :, cols] = clean[:, :, cols].to(z.dtype)
                else:
                    z[rows, p, cols] = clean[:, p, cols].to(z.dtype)
            return z

        return hook

    resid = runs.resid(layer).repeat(len(units), 1, 1)
    return runs.run(resid, layer, [(name, make_hook(name)) for name in by_name])


__all__ = ["PatchUnit", "get_act_patch_outputs", "patch_units"]
