"""Path patching many pairs: one receiver from each sender, each receiver from fixed senders,
and the sender x receiver grid, batched (many patches per pass).

Each sweep runs :func:`~tl_attnonly.analysis.patching.paths.path_patch`'s two passes per batch of
patches; see :mod:`tl_attnonly.analysis.patching.paths` for what is patched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from jaxtyping import Float, Int
from tqdm.auto import tqdm
from transformer_lens import ActivationCache

from tl_attnonly._types import FwdHooks, Metric, tokens_on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.patching.dense_layers import head_refs, refuse_path_patching_experts
from tl_attnonly.analysis.patching.options import PatchingOptions, resolve_patching_options
from tl_attnonly.analysis.patching.paths import (
    LOGITS,
    Receiver,
    path_patch_runs,
    prepare_path_patch,
    receiver_hooks,
    receiver_label,
    record_receiver_inputs,
)
from tl_attnonly.analysis.patching.resume import (
    LayerRuns,
    can_resume,
    metric_of_copies,
    patches_per_pass_for,
    run_copies,
)
from tl_attnonly.hooks import (
    HeadRef,
    block_act_name,
    head_labels,
    parse_head_label,
)
from tl_attnonly.protocol import ModelLike


def path_patch_sweep(
    model: ModelLike,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    receivers: str | Iterable[str | HeadRef | tuple | Receiver],
    patching_metric: Metric,
    *,
    senders: Sequence[str | HeadRef] | None = None,
    clean_cache: ActivationCache | None = None,
    corrupted_cache: ActivationCache | None = None,
    options: PatchingOptions | None = None,
    **overrides: Any,
) -> tuple[Float[torch.Tensor, "n_senders"], list[str]]:  # noqa: F821
    """Path patching from each sender alone to ``receivers`` (the IOI paper's per-head plots).

    ``patches_per_pass`` senders share each pair of forward passes (one batch copy each; exact).
    For one sender set and many receivers, see :func:`path_patch_receiver_sweep`.

    Args:
        senders: Heads to sweep; default every head (attention heads first, then neuron-heads).
        patches_per_pass: Senders per pair of passes; ``None``: as many as ``max_bytes`` allows.
        max_bytes: Memory budget of a pass's copies of the batch (``MemoryError`` beyond it).
        Others: As in :func:`path_patch`.
        options: A :class:`~tl_attnonly.analysis.PatchingOptions` (``patches_per_pass``,
            ``max_bytes``, ``progress``); each is also accepted by keyword, replacing the one in
            ``options`` (default here: ``PatchingOptions(patches_per_pass=16)``).

    Returns:
        ``(metric for each sender [n_senders], sender labels)``, float64 on the CPU like
        :func:`path_patch_receiver_sweep`.
    """
    model = analysis_model(model)
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    opts = resolve_patching_options(
        "path_patch_sweep",
        options,
        overrides,
        supported=("patches_per_pass", "max_bytes", "progress"),
        default=PatchingOptions(patches_per_pass=16),
    )
    patches_per_pass = opts.patches_per_pass
    max_bytes = opts.max_bytes
    progress = opts.progress
    K = model.n_heads_per_neuron
    refs = head_refs(model) if senders is None else [parse_head_label(s, K) for s in senders]
    refuse_path_patching_experts(model, "path_patch_sweep")
    parsed, clean_cache, corrupted_cache = prepare_path_patch(
        model, clean_tokens, corrupted_tokens, receivers, clean_cache, corrupted_cache
    )
    out = torch.zeros(len(refs), dtype=torch.float64)
    batch, n_pos = corrupted_tokens.shape
    step = patches_per_pass_for(model, batch, n_pos, patches_per_pass, max_bytes)
    for start in tqdm(range(0, len(refs), step), desc="path patching", disable=not progress):
        chunk = refs[start : start + step]
        values = path_patch_runs(
            model, corrupted_tokens, clean_cache, corrupted_cache, [[r] for r in chunk], parsed,
            patching_metric,
        )  # fmt: skip
        out[start : start + len(chunk)] = torch.tensor(values, dtype=torch.float64)
    return out, head_labels(refs, K)


def path_patch_receiver_sweep(
    model: ModelLike,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    senders: Iterable[str | HeadRef],
    patching_metric: Metric,
    *,
    receivers: Iterable[str | HeadRef | tuple | Receiver] | None = None,
    clean_cache: ActivationCache | None = None,
    corrupted_cache: ActivationCache | None = None,
    options: PatchingOptions | None = None,
    **overrides: Any,
) -> tuple[Float[torch.Tensor, "n_receivers"], list[str]]:  # noqa: F821
    """Path patching from a fixed set of ``senders`` to each receiver alone.

    Equal to ``[path_patch(model, clean, corrupted, senders, [r], metric) for r in receivers]``
    (tested), but step 1 (senders clean, every other head frozen) runs once for all receivers,
    and the step-2 runs of ``patches_per_pass`` receivers share a pass as batch copies, each
    starting at its receivers' layer from the corrupted residual stream.

    Args:
        senders: The sender set (head labels or :class:`HeadRef` s), patched together.
        receivers: Receiver specs, each its own entry (``"L1H0:q"``, ``"L1N3"``, ``"logits"``,
            ...); default every head with all its inputs, then ``"logits"``.
        patches_per_pass: Receivers per step-2 pass; default: from ``max_bytes``.
        max_bytes: Memory budget of a pass's copies of the batch (``MemoryError`` beyond it).
        progress: Show a progress bar over passes.
        Others: As in :func:`path_patch`.
        options: A :class:`~tl_attnonly.analysis.PatchingOptions` (``patches_per_pass``,
            ``max_bytes``, ``progress``); each is also accepted by keyword, replacing the one in
            ``options``.

    Returns:
        ``(metric for each receiver [n_receivers], receiver labels)``, float64; labels as
        :func:`receiver_label` (``"L1H0:qkv"``, ``"logits"``).
    """
    model = analysis_model(model)
    refuse_path_patching_experts(model, "path_patch_receiver_sweep")
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    opts = resolve_patching_options(
        "path_patch_receiver_sweep",
        options,
        overrides,
        supported=("patches_per_pass", "max_bytes", "progress"),
    )
    patches_per_pass = opts.patches_per_pass
    max_bytes = opts.max_bytes
    progress = opts.progress
    specs: list = list(head_refs(model)) + [LOGITS] if receivers is None else list(receivers)
    sweep = _ReceiverSweep(
        model,
        clean_tokens,
        corrupted_tokens,
        specs,
        clean_cache,
        corrupted_cache,
        patches_per_pass,
        max_bytes,
    )
    return sweep.run(list(senders), patching_metric, progress), sweep.labels


class _ReceiverSweep:
    """What every sender set's receiver sweep shares: the checked inputs and both caches, the
    receivers' hooks and labels, the step and the corrupted run that step-2 passes resume from
    (made once, also for a sender x receiver grid). Arguments as in
    :func:`path_patch_receiver_sweep`.
    """

    def __init__(
        self,
        model: ModelLike,
        clean_tokens: torch.Tensor,
        corrupted_tokens: torch.Tensor,
        receivers: Sequence[str | HeadRef | tuple | Receiver],
        clean_cache: ActivationCache | None,
        corrupted_cache: ActivationCache | None,
        patches_per_pass: int | None,
        max_bytes: int,
    ):
        model = analysis_model(model)
        parsed, self.clean_cache, self.corrupted_cache = prepare_path_patch(
            model, clean_tokens, corrupted_tokens, receivers, clean_cache, corrupted_cache
        )
        self.model = model
        self.K = model.n_heads_per_neuron
        self.labels = [receiver_label(r, self.K) for r in parsed]
        self.corrupted_tokens = corrupted_tokens
        batch, n_pos = corrupted_tokens.shape
        self.step = patches_per_pass_for(model, batch, n_pos, patches_per_pass, max_bytes)
        self.per_receiver = [receiver_hooks(model, [r]) for r in parsed]
        self.names = list(dict.fromkeys(name for hooks in self.per_receiver for name in hooks))
        self.runs = LayerRuns(model, corrupted_tokens) if can_resume(model) else None
        self.final = block_act_name("resid_post", model.cfg.n_layers - 1)

    def run(
        self,
        senders: Sequence[str | HeadRef],
        patching_metric: Metric,
        progress: bool,
    ) -> Float[torch.Tensor, "n_receivers"]:  # noqa: F821
        """Step 1 once for ``senders``, then step 2 for each receiver alone (float64)."""
        corrupted_tokens, corrupted_cache = self.corrupted_tokens, self.corrupted_cache
        batch = corrupted_tokens.shape[0]
        sender_refs = [parse_head_label(s, self.K) for s in senders]
        recorded = record_receiver_inputs(
            self.model,
            corrupted_tokens,
            self.clean_cache,
            corrupted_cache,
            [sender_refs],
            self.names,
        )
        final, per_receiver, step = self.final, self.per_receiver, self.step
        if self.runs is not None:
            self.runs.read_only(patching_metric)
        out = torch.zeros(len(per_receiver), dtype=torch.float64)
        for start in tqdm(
            range(0, len(per_receiver), step), desc="path patching", disable=not progress
        ):
            chunk = per_receiver[start : start + step]
            by_name: dict[str, list[tuple[int, list[int]]]] = {}
            for c, hooks_of_receiver in enumerate(chunk):
                for name, heads in hooks_of_receiver.items():
                    by_name.setdefault(name, []).append((c, heads))

            def patch(name: str, edits: list[tuple[int, list[int]]]):
                def hook(act, hook):
                    act = act.clone()  # the neuron-heads' q, v and pre may share storage
                    for c, heads in edits:
                        rows = slice(c * batch, (c + 1) * batch)
                        if name == final and not heads:  # the logits: the senders' direct effect
                            act[rows] += recorded[name] - corrupted_cache[name]
                        else:
                            act[rows, :, heads] = recorded[name][:, :, heads].to(act.dtype)
                    return act

                return hook

            hooks: FwdHooks = [(name, patch(name, edits)) for name, edits in by_name.items()]
            logits = run_copies(self.model, self.runs, corrupted_tokens, len(chunk), hooks)
            values = metric_of_copies(patching_metric, logits, batch)
            out[start : start + len(chunk)] = torch.tensor(values, dtype=torch.float64)
        return out


def path_patch_grid(
    model: ModelLike,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    senders: Sequence[str | HeadRef],
    receivers: Sequence[str | HeadRef | tuple | Receiver],
    patching_metric: Metric,
    *,
    clean_cache: ActivationCache | None = None,
    corrupted_cache: ActivationCache | None = None,
    options: PatchingOptions | None = None,
    **overrides: Any,
) -> tuple[Float[torch.Tensor, "n_senders n_receivers"], list[str], list[str]]:
    """Path patching from each sender alone to each receiver alone: a sender x receiver grid.

    Entry ``[i, j]`` equals ``path_patch(model, clean, corrupted, [senders[i]], [receivers[j]],
    metric)`` (tested); each row is one :func:`path_patch_receiver_sweep`, and the rows share
    the corrupted run that their step-2 passes resume from.

    Args:
        senders: Head labels or :class:`HeadRef` s, one row each.
        receivers: Receiver specs, one column each.
        Others: As in :func:`path_patch_receiver_sweep`.
        options: A :class:`~tl_attnonly.analysis.PatchingOptions` (``patches_per_pass``,
            ``max_bytes``, ``progress``); each is also accepted by keyword, replacing the one in
            ``options``.

    Returns:
        ``(metric [n_senders, n_receivers] (float64), sender labels, receiver labels)``.
    """
    model = analysis_model(model)
    refuse_path_patching_experts(model, "path_patch_grid")
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    opts = resolve_patching_options(
        "path_patch_grid",
        options,
        overrides,
        supported=("patches_per_pass", "max_bytes", "progress"),
    )
    patches_per_pass = opts.patches_per_pass
    max_bytes = opts.max_bytes
    progress = opts.progress
    sweep = _ReceiverSweep(
        model,
        clean_tokens,
        corrupted_tokens,
        receivers,
        clean_cache,
        corrupted_cache,
        patches_per_pass,
        max_bytes,
    )
    refs = [parse_head_label(s, sweep.K) for s in senders]
    rows = [
        sweep.run([ref], patching_metric, progress=False)
        for ref in tqdm(refs, desc="senders", disable=not progress)
    ]
    grid = torch.stack(rows) if rows else torch.zeros(0, len(sweep.labels), dtype=torch.float64)
    return grid, head_labels(refs, sweep.K), sweep.labels


__all__ = ["path_patch_grid", "path_patch_receiver_sweep", "path_patch_sweep"]
