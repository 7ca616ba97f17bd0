"""Activation patching over neuron-heads (and attention heads), one patch or many per pass.

Built on :func:`transformer_lens.patching.generic_activation_patch` and its patch setters: the
index frames are custom (any subset of layers, neuron-heads or neurons, and positions), and the
hook names are the neuron-heads' ``blocks.{l}.mlp.hook_{z,v,q,pattern,attn_scores,result}``. As
in TransformerLens, the corrupted run receives the clean activation (``clean_cache``) and the
result is ``patching_metric(patched_logits)`` for every patch. A patch is one neuron-head
(``level="head"``) or the ``K`` heads of one neuron together (``level="neuron"``, the default
where ``K > 1``: patching a neuron's ``z`` is patching its ``hook_post``).

Batched mode (``patches_per_pass`` other than 1, the default): ``c`` patches share a pass as ``c``
copies of the corrupted batch, each copy with its own patch. The rows of a batch never interact
in a TransformerLens model, so this is exact (no linearity assumption; results equal one-at-a-time
patching up to floating-point summation order) and costs ``c`` times the activation memory,
bounded by ``max_bytes``. In a decoder a pass starts at the first patched layer from the
corrupted run's residual stream, and ``z`` patches run as output deltas from the layer after
(:mod:`~tl_attnonly.analysis.patching.outputs`); ``benchmarks/bench_patching.py`` times both
against one patch per forward pass. For a *linear* approximation of every head at the cost of
one backward pass, see :func:`tl_attnonly.analysis.attribution_patch`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Literal

import pandas as pd
import torch
from jaxtyping import Float, Int
from tqdm.auto import tqdm
from transformer_lens import ActivationCache
from transformer_lens.patching import (
    generic_activation_patch,
    layer_head_pattern_patch_setter,
    layer_head_pos_pattern_patch_setter,
    layer_head_vector_patch_setter,
    layer_pos_head_vector_patch_setter,
)

from tl_attnonly._types import FwdHooks, Metric, check_tokens, on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.patching.dense_layers import (
    dense_neuron_layers,
    expert_layers,
    head_refs,
    refuse_expert_refs,
)
from tl_attnonly.analysis.patching.expert_sweeps import patch_neuron_heads_with_experts
from tl_attnonly.analysis.patching.options import (
    PatchingOptions,
    patch_level,
    resolve_patching_options,
)
from tl_attnonly.analysis.patching.outputs import PatchUnit, get_act_patch_outputs
from tl_attnonly.analysis.patching.resume import (
    PATCH_BUDGET,
    LayerRuns,
    can_resume,
    metric_of_copies,
    patches_per_pass_for,
    run_copies,
)
from tl_attnonly.hooks import (
    HeadRef,
    head_labels,
    neuron_act_name,
    neuron_head_label,
    neuron_hook_kind,
    parse_head_label,
)
from tl_attnonly.protocol import AttnOnlyModel, ModelLike

#: Neuron-head activations that can be patched, and their layout.
VECTOR_KINDS = ("z", "v", "q", "result")  # [batch, pos, head, ...]
PATTERN_KINDS = ("pattern", "attn_scores")  # [batch, head, query_pos, 2]


class _NeuronHeadNames:
    """The model as :func:`generic_activation_patch` sees it: ``attn`` hook names sent to ``mlp``.

    ``generic_activation_patch`` names activations with ``get_act_name(name, layer)``, which sends
    ``z``, ``pattern``, ... to ``blocks.{l}.attn``; neuron-heads live at ``blocks.{l}.mlp``.
    """

    def __init__(self, model: ModelLike):
        model = analysis_model(model)
        self.model = model
        self.cfg = model.cfg

    def run_with_hooks(self, *args, fwd_hooks=(), **kwargs):
        hooks: FwdHooks = [(_to_mlp(name), hook) for name, hook in fwd_hooks]
        return self.model.run_with_hooks(*args, fwd_hooks=hooks, **kwargs)


class _NeuronHeadCacheView:
    def __init__(self, cache: ActivationCache):
        self.cache = cache

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.cache[_to_mlp(name)]


def _to_mlp(name: str) -> str:
    return name.replace(".attn.hook_", ".mlp.hook_")


def _cloning(setter: Callable) -> Callable:
    """Patch a copy: the neuron-heads' q, v and pre may share storage, never edit in place."""

    def patch(corrupted_activation, index, clean_activation):
        return setter(corrupted_activation.clone(), index, clean_activation)

    return patch


def neuron_head_patch_index(
    model: ModelLike,
    activation_name: str = "z",
    *,
    per_position: bool = False,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    positions: Sequence[int] | None = None,
    n_pos: int | None = None,
    level: Literal["neuron", "head"] | None = None,
) -> pd.DataFrame:
    """The index frame of a neuron-head patching sweep (one row per patch).

    Columns follow TransformerLens's patch setters: ``layer, pos, head`` for vector activations
    patched per position, ``layer, head`` for all positions at once, ``layer, head, dest_pos``
    for patterns patched per query position. At ``level="neuron"`` the ``head`` column is
    ``neuron`` (neuron ``i`` stands for its heads ``i*K .. i*K+K-1``).

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` or a ``TransformerBridge``
            converted with :func:`tl_attnonly.convert` (in place).
        activation_name: One of ``z, v, q, result, pattern, attn_scores``.
        per_position: One patch per (layer, head, position) instead of per (layer, head).
        layers, heads, positions: Subsets to sweep; default all (positions need ``n_pos``).
            At ``level="neuron"``, ``heads`` are neuron indices in ``[0, d_mlp)``.
        n_pos: Number of positions (for ``positions=None``).
        level: ``"head"``: one row per neuron-head; ``"neuron"``: one per neuron; ``None``
            (default): ``"neuron"`` where ``K > 1``, ``"head"`` where ``K = 1``.
    """
    model = analysis_model(model)
    level = patch_level(level, model.n_heads_per_neuron)
    kind = neuron_hook_kind(activation_name)
    if kind not in VECTOR_KINDS + PATTERN_KINDS:
        raise ValueError(
            f"Cannot patch neuron-head {activation_name!r}: choose one of "
            f"{VECTOR_KINDS + PATTERN_KINDS} (keys are constant; patch hook_pre/hook_post with "
            "TransformerLens's own functions)."
        )
    layers = dense_neuron_layers(model, layers, "Patching dense neuron-heads")
    unit = "neuron" if level == "neuron" else "head"
    n_units = model.n_neuron_heads // model.n_heads_per_neuron if unit == "neuron" else None
    heads = list(range(n_units or model.n_neuron_heads)) if heads is None else list(map(int, heads))
    if n_units is not None and any(not 0 <= n < n_units for n in heads):
        raise IndexError(
            f"At level='neuron', heads= are neuron indices in [0, {n_units}), got "
            f"{[n for n in heads if not 0 <= n < n_units][:5]}; pass level='head' for neuron-heads."
        )
    columns: dict[str, list[int]] = {"layer": layers, unit: heads}
    if per_position:
        if positions is None:
            if n_pos is None:
                raise ValueError("per_position=True needs positions=[...] or n_pos.")
            positions = range(n_pos)
        positions = [int(p) for p in positions]
        if kind in VECTOR_KINDS:
            columns = {"layer": layers, "pos": positions, unit: heads}
        else:
            columns = {"layer": layers, unit: heads, "dest_pos": positions}
    index = pd.MultiIndex.from_product(list(columns.values()), names=list(columns))
    return index.to_frame(index=False)


def _setter(kind: str, per_position: bool) -> Callable:
    if kind in VECTOR_KINDS:
        return (
            layer_pos_head_vector_patch_setter if per_position else layer_head_vector_patch_setter
        )
    return layer_head_pos_pattern_patch_setter if per_position else layer_head_pattern_patch_setter


def _neuron_setter(setter: Callable, column: int, K: int) -> Callable:
    """``setter`` with the neuron at ``index[column]`` replaced by its ``K`` heads (a slice)."""

    def patch(corrupted_activation, index, clean_activation):
        index = list(index)
        neuron = int(index[column])
        index[column] = slice(neuron * K, neuron * K + K)
        return setter(corrupted_activation, index, clean_activation)

    return patch


def get_act_patch_neuron_heads(
    model: ModelLike,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: ActivationCache,
    patching_metric: Metric,
    activation_name: str = "z",
    *,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    return_index_df: bool = False,
    options: PatchingOptions | None = None,
    **overrides: Any,
):
    """Activation patching of neuron-heads: each one's (or each neuron's) clean activation into
    the corrupted run.

    On a model with ``K > 1`` heads per neuron (the GELU family, default ``K = 4``) one patch is
    by default a whole neuron, all its ``K`` heads together (``level="neuron"``): patching one
    head of a neuron patches a part of it only (``level="head"``, the per-head sweep).

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` or a ``TransformerBridge``
            converted with :func:`tl_attnonly.convert` (in place).
        corrupted_tokens: ``[batch, pos]``.
        clean_cache: Cache of the clean run holding ``blocks.{l}.mlp.hook_{activation_name}``
            for the swept layers (e.g. ``names_filter=neuron_names_filter("z")``).
        patching_metric: Logits ``[batch, pos, d_vocab]`` -> scalar.
        activation_name: ``z`` (the head's output; a neuron's ``hook_post`` is the sum of its
            ``K`` heads' ``z``, plus a constant in gated layers, so at ``level="neuron"`` a ``z``
            patch is a patch of the neuron's ``post``), ``v`` (value), ``q`` (query), ``pattern``
            (its two-key pattern), ``attn_scores``, or ``result`` (after
            ``model.set_use_neuron_result(True)``). At ``level="neuron"`` each is patched for all
            ``K`` heads of the neuron at once.
        per_position: Patch one position (query position for patterns) at a time.
        layers, heads, positions: Which to sweep; default all. ``heads`` are neuron-head indices
            (``neuron * K + k``, in ``[0, n_neuron_heads)``) at ``level="head"`` and neuron
            indices (in ``[0, d_mlp)``; neuron ``i`` is heads ``i*K .. i*K+K-1``) at
            ``level="neuron"``. A mixture-of-experts layer's neuron-heads are its experts'
            laid end to end (routed experts in index order, then the shared ones), each patched
            as :func:`~tl_attnonly.analysis.experts.get_act_patch_expert_neuron_heads` does: at
            the tokens routed to the expert in both runs, one pass per head, ``z`` only and not
            per position (:mod:`~tl_attnonly.analysis.patching.expert_sweeps`); the clean cache
            then needs the experts' ``hook_z`` and the routers' indices
            (``neuron_names_filter("z")`` keeps them).
        level: ``"neuron"``: one patch per neuron, its ``K`` heads together; ``"head"``: one per
            neuron-head. Default (``None``): ``"neuron"`` where ``K > 1``, ``"head"`` where
            ``K = 1`` (the same patches; ``"head"`` keeps the index frame's ``head`` column).
            Anything else is refused (``ValueError``) before any work.
        patches_per_pass: Patches per pass (batched mode, see the module docstring); default:
            as many as ``max_bytes`` allows. ``1`` runs TransformerLens's
            :func:`generic_activation_patch` itself (one full forward pass per patch). Batched
            ``z`` patches of a decoder run as output deltas from the patched layer on
            (:func:`~tl_attnonly.analysis.get_act_patch_outputs`); other activations as hooked
            passes that start at the patched layer (:func:`run_patches`).
        max_bytes: Memory budget of a batched pass's copies of the batch.
        return_index_df: Also return the index frame (one row per patch).
        progress: Show a progress bar in batched mode (``generic_activation_patch`` always does).
        options: A :class:`~tl_attnonly.analysis.PatchingOptions` (``per_position``, ``positions``,
            ``patches_per_pass``, ``max_bytes``, ``progress``, ``level``); each is also accepted
            by keyword, replacing the one in ``options``.

    Returns:
        The metric after each patch as a float64 tensor (with ``patches_per_pass=1`` its values
        pass through :func:`generic_activation_patch`'s float32 result tensor, so they are
        rounded to float32 first), shaped ``[n_layers, n_heads]``,
        ``[n_layers, pos, n_heads]`` (vectors per position) or ``[n_layers, n_heads, dest_pos]``
        (patterns per position), with the sizes of the subsets given, where ``n_heads`` counts
        neuron-heads (``n_neuron_heads``) at ``level="head"`` and neurons (``d_mlp``) at
        ``level="neuron"``; and the index frame if ``return_index_df`` (its ``head`` column is
        ``neuron`` at ``level="neuron"``). With mixture-of-experts layers in the sweep: ``[n_layers,
        n_heads]``, ``n_heads`` the widest layer's (NaN past a narrower layer's heads), and an
        index frame of one row per cell: ``layer, head, expert, label`` (``L1E3N17``).
    """
    opts = resolve_patching_options(
        "get_act_patch_neuron_heads",
        options,
        overrides,
        supported=(
            "per_position", "positions", "patches_per_pass", "max_bytes", "progress", "level"
        ),
    )  # fmt: skip
    per_position = opts.per_position
    positions = opts.positions
    patches_per_pass = opts.patches_per_pass
    max_bytes = opts.max_bytes
    progress = opts.progress
    model = analysis_model(model)
    K = model.n_heads_per_neuron
    level = patch_level(opts.level, K)
    corrupted_tokens = on_model_device(model, corrupted_tokens)
    check_tokens(corrupted_tokens)
    chosen = list(range(model.cfg.n_layers)) if layers is None else [int(li) for li in layers]
    if expert_layers(model) & set(chosen):  # experts' neuron-heads end to end (expert_sweeps)

        def dense_sweep(dense: list[int], cols: list[int]) -> torch.Tensor:
            return get_act_patch_neuron_heads(
                model, corrupted_tokens, clean_cache, patching_metric, activation_name,
                layers=dense, heads=cols, options=opts,
            )  # fmt: skip

        out, frame = patch_neuron_heads_with_experts(
            model, corrupted_tokens, clean_cache, patching_metric, activation_name, chosen,
            heads, opts, dense_sweep,
        )  # fmt: skip
        return (out, frame) if return_index_df else out
    index_df = neuron_head_patch_index(
        model,
        activation_name,
        per_position=per_position,
        layers=layers,
        heads=heads,
        positions=positions,
        n_pos=corrupted_tokens.shape[-1],
        level=level,
    )
    kind = neuron_hook_kind(activation_name)
    if kind == "result" and not model.neuron_heads[0].use_neuron_result:
        raise ValueError(
            "Patching neuron-head results needs model.set_use_neuron_result(True) (and a clean "
            "cache made with it); patching 'z' has the same effect and is cheaper."
        )
    missing = [
        name
        for name in {neuron_act_name(kind, int(layer)) for layer in index_df["layer"]}
        if name not in clean_cache.cache_dict
    ]
    if missing:
        raise KeyError(
            f"The clean cache lacks {sorted(missing)}. Cache them with names_filter="
            f"tl_attnonly.hooks.neuron_names_filter({kind!r})."
        )
    setter = _setter(kind, per_position)
    if level == "neuron":  # the unit column: the last but one for patterns per position
        setter = _neuron_setter(setter, list(index_df.columns).index("neuron"), K)
    if patches_per_pass == 1:
        flat = generic_activation_patch(  # type: ignore[call-overload]  # duck-typed model, cache
            _NeuronHeadNames(model),
            corrupted_tokens,
            _NeuronHeadCacheView(clean_cache),
            patching_metric,
            patch_setter=_cloning(setter),
            activation_name=kind,
            index_df=index_df,
        ).to(torch.float64)
    elif kind == "z" and can_resume(model):
        flat = _z_by_output_deltas(
            model, corrupted_tokens, clean_cache, patching_metric, index_df, per_position,
            patches_per_pass, max_bytes, progress, level,
        )  # fmt: skip
    else:
        patches = [
            [(neuron_act_name(kind, int(row[0])), _bind(setter, list(map(int, row))))]
            for row in index_df.itertuples(index=False)
        ]
        flat = run_patches(
            model, corrupted_tokens, clean_cache, patching_metric, patches,
            patches_per_pass=patches_per_pass, max_bytes=max_bytes, progress=progress,
        )  # fmt: skip
    shape = [index_df[c].nunique() for c in index_df.columns]
    out = flat.reshape(shape)
    return (out, index_df) if return_index_df else out


def _z_by_output_deltas(
    model: AttnOnlyModel,
    corrupted_tokens: torch.Tensor,
    clean_cache: ActivationCache,
    patching_metric: Metric,
    index_df: pd.DataFrame,
    per_position: bool,
    patches_per_pass: int | None,
    max_bytes: int,
    progress: bool,
    level: str = "head",
) -> torch.Tensor:
    """``z`` patches of the index frame's rows, flat in its order, by output deltas."""
    layers = list(dict.fromkeys(int(x) for x in index_df["layer"]))
    K = model.n_heads_per_neuron
    by_neuron = level == "neuron"  # a neuron's K heads are one unit
    ids = list(dict.fromkeys(int(x) for x in index_df["neuron" if by_neuron else "head"]))
    units = [
        PatchUnit(f"L{li}N{i}", "neuron", li, tuple(range(i * K, i * K + K)))
        if by_neuron
        else PatchUnit(neuron_head_label(li, i, K), "neuron", li, (i,))
        for li in layers
        for i in ids
    ]
    positions = list(dict.fromkeys(int(x) for x in index_df["pos"])) if per_position else None
    out, _ = get_act_patch_outputs(
        model, corrupted_tokens, clean_cache, patching_metric, units, per_position=per_position,
        positions=positions, patches_per_pass=patches_per_pass, max_bytes=max_bytes,
        progress=progress,
    )  # fmt: skip
    if per_position:  # [layer * head, pos] -> rows (layer, pos, head)
        out = out.reshape(len(layers), len(ids), -1).transpose(1, 2)
    return out.flatten()


def _bind(setter: Callable, index: list[int]) -> Callable:
    return lambda corrupted, clean: setter(corrupted, index, clean)


PatchFn = Callable[[torch.Tensor, torch.Tensor], object]


def run_patches(
    model: ModelLike,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: ActivationCache,
    patching_metric: Metric,
    patches: Sequence[Sequence[tuple[str, PatchFn]]],
    *,
    patches_per_pass: int | None = 16,
    max_bytes: int = PATCH_BUDGET,
    progress: bool = True,
) -> Float[torch.Tensor, "n_patches"]:  # noqa: F821
    """Run many patches, ``patches_per_pass`` per forward pass (batched mode).

    The building block of the sweeps here and in :mod:`~tl_attnonly.analysis.patching.paths`.
    Each patch is a list of ``(hook_name, fn)``; ``fn(corrupted, clean)`` edits, in place, the
    ``[batch, ...]`` slice of the activation that belongs to its copy of the batch, given the
    clean activation ``clean_cache[hook_name]`` (TransformerLens's patch setters, with the index
    bound, are such functions). A patch may touch several hooks and heads (group patching).

    In a decoder, a pass whose patches all edit hooks of blocks ``>= l`` starts at block ``l``
    from the corrupted run's residual stream (``forward(resid, start_at_layer=l)``, cached once):
    the blocks before it are the same in every patched run and are not recomputed.

    Args:
        model, corrupted_tokens, clean_cache, patching_metric: As in
            :func:`get_act_patch_neuron_heads`.
        patches: One list of ``(hook_name, fn)`` per patch.
        patches_per_pass: Patches per pass; ``None`` chooses it from ``max_bytes``.
        max_bytes: Memory budget of one pass's batch copies (an estimate; see
            :func:`~tl_attnonly.analysis.patching.resume.bytes_per_copy`).
        progress: Show a progress bar.

    Returns:
        ``patching_metric`` of each patched run, ``[n_patches]`` (float64).

    Raises:
        MemoryError: If ``patches_per_pass`` copies (or one) exceed ``max_bytes``.
    """
    model = analysis_model(model)
    corrupted_tokens = on_model_device(model, corrupted_tokens)
    check_tokens(corrupted_tokens)
    batch, pos = corrupted_tokens.shape
    step = patches_per_pass_for(model, batch, pos, patches_per_pass, max_bytes)
    out = torch.zeros(len(patches), dtype=torch.float64)
    runs = (
        LayerRuns(model, corrupted_tokens, metric=patching_metric)
        if can_resume(model) and patches
        else None
    )
    for start in tqdm(range(0, len(patches), step), desc="patching", disable=not progress):
        chunk = patches[start : start + step]
        by_hook: dict[str, list[tuple[int, PatchFn]]] = defaultdict(list)
        for copy, patch in enumerate(chunk):
            for name, fn in patch:
                by_hook[name].append((copy, fn))

        fwd_hooks: FwdHooks = [
            (name, _patch_hook(edits, clean_cache, batch)) for name, edits in by_hook.items()
        ]
        logits = run_copies(model, runs, corrupted_tokens, len(chunk), fwd_hooks)
        values = metric_of_copies(patching_metric, logits, batch)
        out[start : start + len(chunk)] = torch.tensor(values, dtype=torch.float64)
    return out


def _patch_hook(edits: list[tuple[int, PatchFn]], clean_cache, batch: int) -> Callable:
    def hook(activation: torch.Tensor, hook) -> torch.Tensor:
        activation = activation.clone()  # never edit in place (see _cloning)
        clean = clean_cache[hook.name]
        for copy, fn in edits:
            fn(activation[copy * batch : (copy + 1) * batch], clean)
        return activation

    return hook


def get_act_patch_all_heads(
    model: ModelLike,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    clean_cache: ActivationCache,
    patching_metric: Metric,
    *,
    heads: Sequence[HeadRef | str] | None = None,
    patches_per_pass: int | None = None,
    max_bytes: int = PATCH_BUDGET,
    progress: bool = True,
) -> tuple[Float[torch.Tensor, "n_heads"], list[str]]:  # noqa: F821
    """Patch the clean ``z`` of each head (attention heads and neuron-heads), all positions.

    The head-level sweep that :func:`~tl_attnonly.analysis.attribution_patch` approximates; same
    order and labels.

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` or a ``TransformerBridge``
            converted with :func:`tl_attnonly.convert` (in place).
        corrupted_tokens: ``[batch, pos]``.
        clean_cache: Clean cache with the ``z`` of every head swept
            (``names_filter=head_names_filter("z")``).
        patching_metric: Logits -> scalar.
        heads: Heads to sweep (:class:`HeadRef` or labels); default every head, attention heads
            first (:func:`tl_attnonly.hooks.all_head_refs`).
        patches_per_pass: Patches per pass (exact batched mode); default: from ``max_bytes``.
        max_bytes: Memory budget of a pass's copies of the batch.
        progress: Show a progress bar.

    Returns:
        ``(metric after each patch [n_heads], labels)``. For every head of a neuron together
        (``K > 1``), use :func:`~tl_attnonly.analysis.get_act_patch_outputs` (``level="neuron"``).
    """
    model = analysis_model(model)
    corrupted_tokens = on_model_device(model, corrupted_tokens)
    K = model.n_heads_per_neuron
    refs = head_refs(model) if heads is None else [parse_head_label(h, K) for h in heads]
    refuse_expert_refs(model, refs, "get_act_patch_all_heads (dense neuron-heads)")
    if can_resume(model):  # decoders: passes start at the patched layer (output deltas)
        return get_act_patch_outputs(
            model, corrupted_tokens, clean_cache, patching_metric, refs, level="head",
            patches_per_pass=patches_per_pass, max_bytes=max_bytes, progress=progress,
        )  # fmt: skip
    patches = []
    for ref in refs:
        patches.append(
            [(ref.act_name("z"), _bind(layer_head_vector_patch_setter, [ref.layer, ref.head]))]
        )
    scores = run_patches(
        model, corrupted_tokens, clean_cache, patching_metric, patches,
        patches_per_pass=patches_per_pass, max_bytes=max_bytes, progress=progress,
    )  # fmt: skip
    return scores, head_labels(refs, K)


__all__ = [
    "PATTERN_KINDS",
    "VECTOR_KINDS",
    "PatchFn",
    "get_act_patch_all_heads",
    "get_act_patch_neuron_heads",
    "neuron_head_patch_index",
    "run_patches",
]
