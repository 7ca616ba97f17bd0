"""Attribution patching: a gradient estimate of activation patching for every head at once.

Nanda (2023), "Attribution Patching": the effect of patching an activation ``a`` from the clean run
into the corrupted run is approximated to first order by

    ``metric(patched) - metric(corrupted) ~= sum (a_clean - a_corrupted) * d metric / d a``

with the gradient taken on the corrupted run. One forward and one backward pass give the estimate
for all ``n_layers * (n_heads + n_neuron_heads)`` heads, where activation patching needs one
forward pass per head. Use it to rank heads, then confirm the top ones exactly:
:func:`attribute_then_patch` does both in one call.

The estimate is exact when the metric is linear in the activation along the patch (e.g. heads of
the last layer of a model without final LayerNorm, with a metric linear in the logits); elsewhere it
is a linearisation, best for small clean/corrupted differences.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pandas as pd
import torch
from jaxtyping import Float, Int
from tqdm.auto import tqdm
from transformer_lens import ActivationCache

from tl_attnonly._types import (
    FwdHooks,
    Metric,
    check_kinds,
    check_token_pair,
    on_model_device,
    tokens_on_model_device,
)
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.levels import neuron_level
from tl_attnonly.analysis.patching.dense_layers import expert_layers, head_refs
from tl_attnonly.analysis.patching.options import PatchingOptions, resolve_patching_options
from tl_attnonly.analysis.patching.outputs import get_act_patch_outputs
from tl_attnonly.hooks import head_act_name, head_labels, head_names_filter
from tl_attnonly.protocol import AttnOnlyModel, ModelLike

#: Activations attribution patching supports, and where their head axis is.
ATTRIBUTION_KINDS = {"z": 2, "v": 2, "q": 2, "pattern": 1}


def _names(model: AttnOnlyModel, kind: str, kinds: Sequence[str]) -> list[tuple[str, str, int]]:
    """(sublayer kind, hook name, layer) for every layer and every requested kind of head."""
    out = []
    for sub in kinds:
        if sub == "attn" and kind == "v" and model.cfg.n_key_value_heads is not None:
            raise ValueError(
                "Attention-head 'v' attribution is per key/value head in grouped-query models; "
                "use activation_name='z' or kinds=('neuron',)."
            )
        experts = expert_layers(model) if sub == "neuron" else set()  # no dense neuron-heads
        for li in range(model.cfg.n_layers):
            if li not in experts:
                out.append((sub, head_act_name(kind, li, sub), li))
    return out


def attribution_patch(
    model: ModelLike,
    clean_cache: ActivationCache,
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    patching_metric: Metric,
    *,
    activation_name: str = "z",
    kinds: Sequence[str] = ("attn", "neuron"),
    metric_input: str | None = None,
    forward_kwargs: dict[str, Any] | None = None,
    options: PatchingOptions | None = None,
    **overrides: Any,
) -> tuple[torch.Tensor, list[str]]:
    """Attribution-patching estimate of patching each head's clean activation into the corrupted
    run.

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` or
            :class:`~tl_attnonly.AttnOnlyEncoder`.
        clean_cache: Cache of the clean run holding the activation for every layer and kind
            (e.g. ``names_filter=head_names_filter("z")``).
        corrupted_tokens: ``[batch, pos]`` (the run that is differentiated).
        patching_metric: The model's output (logits ``[batch, pos, d_vocab]``), or the
            activation named by ``metric_input``, -> scalar, differentiable.
        activation_name: ``"z"`` (head output), ``"v"``, ``"q"`` or ``"pattern"``.
        kinds: ``("attn", "neuron")`` (default), ``("attn",)`` or ``("neuron",)``. A
            mixture-of-experts layer has no dense neuron-heads: its attention heads only
            (expert neuron-heads: :mod:`tl_attnonly.analysis.experts`).
        per_position: Keep the position axis (query position for patterns).
        progress: Show a progress bar over layers while reducing.
        metric_input: A hook name whose activation the metric gets instead of the output, e.g.
            an encoder's final hidden states ``f"blocks.{n_layers - 1}.hook_normalized_resid_post"``
            for a metric on sentence embeddings (see :func:`pooled_cosine_metric`).
        forward_kwargs: Passed to the forward pass, e.g. an encoder's ``token_type_ids`` and
            ``one_zero_attention_mask`` (use the clean run's too).

    Example:
        A sentence-embedding metric on a converted encoder (``tokens``, ``mask``: a pair of
        sentences ``[2, pos]``; ``corrupted``: the pair with one word replaced)::

            last = f"blocks.{encoder.cfg.n_layers - 1}.hook_normalized_resid_post"
            _, clean = encoder.run_with_cache(tokens, one_zero_attention_mask=mask)
            scores, labels = attribution_patch(
                encoder, clean, corrupted, pooled_cosine_metric(mask), metric_input=last,
                forward_kwargs=dict(one_zero_attention_mask=mask),
            )
        options: A :class:`~tl_attnonly.analysis.PatchingOptions` (``per_position``, ``progress``);
            each is also accepted by keyword, replacing the one in ``options`` (default here:
            ``PatchingOptions(progress=False)``).

    Returns:
        ``(estimated change of the metric, labels)``: ``[n_heads]`` or ``[n_heads, pos]``, heads
        in :func:`tl_attnonly.hooks.all_head_refs` order (attention heads first), the same order
        as :func:`~tl_attnonly.analysis.get_act_patch_all_heads`. Estimates are of
        ``metric(patched) - metric(corrupted)``.
    """
    opts = resolve_patching_options(
        "attribution_patch",
        options,
        overrides,
        supported=("per_position", "progress"),
        default=PatchingOptions(progress=False),
    )
    per_position = opts.per_position
    progress = opts.progress
    model = analysis_model(model)
    corrupted_tokens = on_model_device(model, corrupted_tokens)
    if activation_name not in ATTRIBUTION_KINDS:
        raise ValueError(
            f"activation_name must be one of {sorted(ATTRIBUTION_KINDS)}, got {activation_name!r}."
        )
    kinds = check_kinds(kinds)
    names = _names(model, activation_name, kinds)
    missing = [name for _, name, _ in names if name not in clean_cache.cache_dict]
    if missing:
        raise KeyError(
            f"The clean cache lacks {missing[:3]}{'...' if len(missing) > 3 else ''}. Cache them "
            f"with names_filter=tl_attnonly.hooks.head_names_filter({activation_name!r})."
        )

    acts: dict[str, torch.Tensor] = {}

    def keep(act, hook):
        acts[hook.name] = act
        return act

    def grad_on(act, hook):  # if parameters are frozen, let the graph start at the embeddings
        return act if act.requires_grad else act.detach().requires_grad_(True)

    if metric_input is not None and metric_input not in model.hook_dict:
        raise KeyError(
            f"metric_input={metric_input!r} is not a hook of the model; e.g. "
            f"'blocks.{model.cfg.n_layers - 1}.hook_resid_post' (decoder) or "
            f"'blocks.{model.cfg.n_layers - 1}.hook_normalized_resid_post' (encoder output)."
        )
    # The first hook of the forward pass: the decoder's hook_embed, the encoder's embed.hook_embed.
    embed_hook = "hook_embed" if "hook_embed" in model.hook_dict else "embed.hook_embed"
    with torch.enable_grad():
        fwd_hooks: FwdHooks = [(embed_hook, grad_on)]
        fwd_hooks += [(name, keep) for _, name, _ in names]
        if metric_input is not None:
            fwd_hooks.append((metric_input, keep))
        output = model.run_with_hooks(
            corrupted_tokens, fwd_hooks=fwd_hooks, **(forward_kwargs or {})
        )
        metric = patching_metric(output if metric_input is None else acts[metric_input])
        if metric.numel() != 1:
            raise ValueError(
                f"patching_metric must return a scalar, got shape {tuple(metric.shape)}."
            )
        # Gradients w.r.t. the activations only: parameters' .grad are left untouched.
        grads = dict(
            zip(
                [name for _, name, _ in names],
                torch.autograd.grad(
                    metric, [acts[name] for _, name, _ in names], allow_unused=True
                ),
                strict=True,
            )
        )

    head_axis = ATTRIBUTION_KINDS[activation_name]
    per_kind: dict[str, list[torch.Tensor]] = {k: [] for k in kinds}
    for sub, name, _ in tqdm(names, desc="attribution", disable=not progress):
        grad = grads[name]
        if grad is None:  # the metric does not depend on this activation
            grad = torch.zeros_like(acts[name])
        delta = (clean_cache[name] - acts[name].detach()) * grad
        # -> [batch, pos, head, ...] (vectors) or [batch, head, query_pos, key] (patterns)
        if head_axis == 1:  # patterns: [batch, head, query_pos, key] -> [batch, query_pos, head]
            delta = delta.sum(-1).transpose(1, 2)
        else:  # vectors: [batch, pos, head, d] -> [batch, pos, head]
            delta = delta.sum(-1)
        reduced = delta.sum(0) if per_position else delta.sum((0, 1))
        per_kind[sub].append(reduced.detach())

    parts = []
    for sub in kinds:
        if not per_kind[sub]:  # every layer a mixture of experts: no dense neuron-heads
            continue
        stacked = torch.stack(per_kind[sub])  # [n_layers, (pos,) heads]
        if per_position:
            stacked = stacked.transpose(1, 2)  # [n_layers, heads, pos]
        parts.append(stacked.flatten(0, 1))
    scores = torch.cat(parts) if parts else torch.zeros(0, device=corrupted_tokens.device)
    return scores, head_labels(head_refs(model, kinds=kinds), model.n_heads_per_neuron)


def pooled_cosine_metric(
    attention_mask: Int[torch.Tensor, "batch pos"],
    pair: tuple[int, int] = (0, 1),
) -> Callable[[Float[torch.Tensor, "batch pos d_model"]], Float[torch.Tensor, ""]]:
    """A metric on sentence embeddings: cosine similarity of two mean-pooled rows of a batch.

    Mean pooling over the non-padding tokens is sentence-transformers' (all-MiniLM-L6-v2's)
    pooling; use it with ``metric_input`` set to the encoder's final hidden states.

    Args:
        attention_mask: ``[batch, pos]``, 1 for real tokens, 0 for padding.
        pair: The two batch rows to compare.

    Returns:
        ``hidden [batch, pos, d_model] -> cos(pool(hidden[pair[0]]), pool(hidden[pair[1]]))``.
    """

    def metric(hidden: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, ""]:
        mask = attention_mask.to(hidden.device, hidden.dtype).unsqueeze(-1)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.cosine_similarity(pooled[pair[0]], pooled[pair[1]], dim=-1)

    return metric


def rank_agreement(
    a: Float[torch.Tensor, "n"],  # noqa: F821
    b: Float[torch.Tensor, "n"],  # noqa: F821
    top: int | None = None,
) -> dict[str, float]:
    """How well two head scorings agree: Spearman correlation and sign agreement.

    Args:
        a, b: Two scorings of the same heads (e.g. attribution estimates and activation-patching
            effects ``metric(patched) - metric(corrupted)``).
        top: Restrict the sign agreement to the ``top`` heads by ``|b|``; default all.

    Returns:
        ``{"spearman": ..., "sign_agreement": ...}``.
    """
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"Expected two 1-d tensors of equal length, got {a.shape} and {b.shape}.")
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    spearman = float((ra * rb).sum() / (ra.norm() * rb.norm()))
    idx = b.abs().argsort(descending=True)[: top or len(b)]
    sign = float((a[idx].sign() == b[idx].sign()).double().mean())
    return {"spearman": spearman, "sign_agreement": sign}


@dataclass
class AttributionCheck:
    """Attribution patching of every head, then exact patching of the ``k`` strongest units.

    Attributes:
        table: One row per unit checked, strongest attribution first, with columns ``label``,
            ``attribution`` (the gradient estimate of ``metric(patched) - metric(corrupted)``),
            ``effect`` (the exact ``metric(patched) - metric(corrupted)``), ``patched_metric``,
            ``attribution_rank`` and ``effect_rank`` (1 = largest, by absolute value if
            ``absolute``) and ``error`` (``attribution - effect``).
        agreement: :func:`rank_agreement` of attribution and effect over the ``k`` units
            (``spearman``, ``sign_agreement``).
        corrupted_metric: ``metric`` of the unpatched corrupted run.
        level: ``"neuron"`` or ``"head"``.
    """

    table: pd.DataFrame
    agreement: dict[str, float]
    corrupted_metric: float
    level: str


def attribute_then_patch(
    model: ModelLike,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    patching_metric: Metric,
    k: int = 20,
    *,
    level: Literal["neuron", "head"] = "neuron",
    kinds: Sequence[str] = ("attn", "neuron"),
    absolute: bool = True,
    clean_cache: ActivationCache | None = None,
    options: PatchingOptions | None = None,
    **overrides: Any,
) -> AttributionCheck:
    """Rank every head by attribution patching, then patch the top ``k`` exactly, in one call.

    Attribution patching (:func:`attribution_patch`: one forward and one backward pass) scores
    every head's output ``z``; at ``level="neuron"`` (the default) the ``K`` heads of a neuron are
    summed (:func:`~tl_attnonly.analysis.neuron_level`; the first-order estimate of patching the
    whole neuron, since its ``hook_post`` is the sum of its heads' ``z``). The ``k`` units with the
    largest scores are then patched exactly, all positions, clean ``z`` into the corrupted run
    (:func:`~tl_attnonly.analysis.get_act_patch_outputs`, batched), and the two are compared.

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` or a ``TransformerBridge``
            converted with :func:`tl_attnonly.convert` (in place).
        clean_tokens: ``[batch, pos]``; the patched values come from this run.
        corrupted_tokens: ``[batch, pos]``, same shape; the run that is patched.
        patching_metric: Logits ``[batch, pos, d_vocab]`` -> scalar, differentiable.
        k: How many units to patch exactly.
        level: ``"neuron"`` (a neuron's ``K`` heads are one unit) or ``"head"``.
        kinds: Which heads to rank: ``("attn", "neuron")``, ``("attn",)`` or ``("neuron",)``.
        absolute: Rank by ``|attribution|`` (default) or by signed attribution (largest first).
        clean_cache: A clean cache holding every head's ``z``
            (``names_filter=head_names_filter("z")``); made here if not given.
        patches_per_pass, max_bytes: Batching of the exact patches (memory budget in bytes).
        progress: Show progress bars.
        options: A :class:`~tl_attnonly.analysis.PatchingOptions` (``patches_per_pass``,
            ``max_bytes``, ``progress``); each is also accepted by keyword, replacing the one in
            ``options``.

    Returns:
        An :class:`AttributionCheck`: the table of the ``k`` units and the rank agreement.
    """
    opts = resolve_patching_options(
        "attribute_then_patch",
        options,
        overrides,
        supported=("patches_per_pass", "max_bytes", "progress"),
    )
    patches_per_pass = opts.patches_per_pass
    max_bytes = opts.max_bytes
    progress = opts.progress
    model = analysis_model(model)
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    check_token_pair(clean_tokens, corrupted_tokens)
    if level not in ("neuron", "head"):
        raise ValueError(f"level must be 'neuron' or 'head', got {level!r}.")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}.")
    if clean_cache is None:
        with torch.no_grad():
            _, clean_cache = model.run_with_cache(clean_tokens, names_filter=head_names_filter("z"))
    scores, labels = attribution_patch(
        model, clean_cache, corrupted_tokens, patching_metric, kinds=kinds, progress=progress
    )
    if level == "neuron":
        scores, labels = neuron_level(scores, labels)
    key = scores.abs() if absolute else scores
    top = key.topk(min(k, len(labels))).indices.tolist()
    chosen = [labels[i] for i in top]
    patched, patched_labels = get_act_patch_outputs(
        model, corrupted_tokens, clean_cache, patching_metric, chosen, level=level,
        patches_per_pass=patches_per_pass, max_bytes=max_bytes, progress=progress,
    )  # fmt: skip
    if patched_labels != chosen:  # cannot happen: units keep the order and labels given
        raise RuntimeError(f"Patched units {patched_labels[:3]} differ from {chosen[:3]}.")
    with torch.no_grad():
        corrupted_metric = float(patching_metric(model(corrupted_tokens)).item())
    attribution = scores[top].detach().to("cpu", torch.float64)
    effect = patched - corrupted_metric
    by_effect = effect.abs() if absolute else effect
    table = pd.DataFrame(
        {
            "label": chosen,
            "attribution": attribution.numpy(),
            "effect": effect.numpy(),
            "patched_metric": patched.numpy(),
            "attribution_rank": range(1, len(chosen) + 1),
            "effect_rank": (by_effect.argsort(descending=True).argsort() + 1).numpy(),
            "error": (attribution - effect).numpy(),
        }
    )
    agreement = rank_agreement(attribution, effect)  # Spearman is nan for k = 1
    return AttributionCheck(table, agreement, corrupted_metric, level)


__all__ = [
    "ATTRIBUTION_KINDS",
    "AttributionCheck",
    "attribute_then_patch",
    "attribution_patch",
    "pooled_cosine_metric",
    "rank_agreement",
]
