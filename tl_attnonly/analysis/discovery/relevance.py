"""Neuron relevance: attribution patching of every neuron, with plain or RelP gradients, gate and
value apart.

The estimate of patching neuron ``i`` of a layer (its ``hook_post``, the sum of its heads' ``z``)
from the clean run into the corrupted run is, as in attribution patching (Nanda 2023),

    ``R_i = sum_{batch, pos} (post_clean - post_corrupted)[..., i] * G[..., i]``

where ``G`` is the gradient of the metric at ``hook_post`` on the corrupted run
(``rule="gradient"``), averaged over ``ig_steps`` runs whose embeddings go from the corrupted to
the clean input (``ig_steps=n``: the node form of EAP-IG, Hanna et al. 2024, as
:func:`~tl_attnonly.analysis.edge_attribution_scores` interpolates them), or the RelP coefficient
(``rule="relp"``): Relevance Patching, Rezaei Jafari, Eberle, Khakzar & Nanda 2025 (arXiv
2508.21258), the attribution used on MLP neurons by Arora, Wu, Steinhardt & Schwettmann 2025
("Language Model Circuits Are Sparse in the Neuron Basis", arXiv 2601.22594). RelP replaces the
gradient by the propagation coefficients of LRP for transformers (AttnLRP, Achtibat et al. 2024);
its reference implementation (github.com/FarnoushRJ/RelP, a TransformerLens fork) applies, in the
backward pass only:

* *LN-rule*: the LayerNorm / RMSNorm scale is a constant (``x / scale.detach()``);
* *AH-rule*: attention patterns are constants (``pattern.detach()``);
* *Identity-rule* on the activation: ``act(x)`` backpropagates as ``x * (act(x) / x).detach()``;
* *Half-rule* on a gated MLP's product ``act(gate) * up``: half of the gradient to each factor
  (``p / 2 + (p / 2).detach()``).

Here every rule is a forward hook that returns a value equal to its input, with a different
backward, on hooks the model already has:

* ``*.hook_scale`` (every norm's scale) -> ``scale.detach()`` (LN-rule);
* ``blocks.{l}.attn.hook_pattern`` -> ``pattern.detach()`` (AH-rule);
* ``blocks.{l}.mlp.hook_pattern`` -> ``pattern.detach()``: a neuron-head's pattern on itself is
  ``sigmoid(pre)`` and its value ``pre``, so ``SiLU(pre) = pattern * value`` with the pattern held
  constant is the Identity-rule exactly (``SiLU(x) / x = sigmoid(x)``); with ``K`` fitted heads
  (GELU family) it is the same rule for the fitted sum (``sum_k sigmoid(q_k) f_k``);
* gated layers: ``blocks.{l}.mlp.hook_v`` (the value ``(f g + e - g_k) * up``, the gated product)
  -> ``v / 2 + (v / 2).detach()`` (Half-rule; the two halves add to ``v`` exactly).

The rules change only the backward pass through the layers after a neuron (its own ``hook_post``
gradient does not pass through its own pattern), so a neuron whose output reaches the metric
through linear maps only (the last layer of a model without final norm, a metric linear in the
logits) has the same relevance under both rules: its attribution-patching estimate, which is then
exact.

Gate and value apart (``split=True``): a neuron-head writes ``z = p v + (1 - p) b`` (``p`` its
weight on itself, ``v`` its value, ``b`` the bias token's value: ``g_k`` for plain layers, 0 for
gated ones). The change of ``z`` splits exactly into the part through the self weight and the part
through the value (the Shapley split of a product of two factors):

    ``z_clean - z_corr = (p_clean - p_corr) (v_mid - b) + p_mid (v_clean - v_corr)``

with ``x_mid = (x_clean + x_corr) / 2``, so ``R_i = gate_i + value_i`` with

    ``gate_i = sum G_i (p_clean - p_corr) (v_mid - b)``,
    ``value_i = sum G_i p_mid (v_clean - v_corr)``

summed over batch, positions and the neuron's ``K`` heads.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from jaxtyping import Float, Int

from tl_attnonly._types import tokens_on_model_device
from tl_attnonly.adapt import analysis_model
from tl_attnonly.analysis.discovery.sites import (
    DiscoveryMetric,
    batch_indices,
    call_metric,
    check_additive,
)
from tl_attnonly.hooks import neuron_act_name
from tl_attnonly.protocol import AttnOnlyModel, ModelLike

#: The backward rules :func:`neuron_relevance` supports.
RELEVANCE_RULES = ("gradient", "relp")

Hook = tuple[str, Callable[..., Any]]

#: The start of the warning a bridge's norm gives when a hook edits its scale on the native path.
NATIVE_NORM_EDIT = "A forward hook edited hook_scale"


def _constant(act: torch.Tensor, hook: Any) -> torch.Tensor:
    """The same value, treated as a constant by the backward pass (LN-, AH-, Identity-rule)."""
    return act.detach()


def _half(act: torch.Tensor, hook: Any) -> torch.Tensor:
    """The same value (``v / 2 + v / 2 == v`` exactly), half of the gradient passed back."""
    half = act / 2
    return half + half.detach()


def relp_hooks(model: ModelLike) -> list[Hook]:
    """The forward hooks that make a backward pass RelP's (module docstring): norm scales,
    attention patterns and neuron-head patterns held constant, gated values halved.

    Forward values are unchanged. Use them in ``model.run_with_hooks(..., fwd_hooks=...)``.

    Args:
        model: A converted model (:func:`~tl_attnonly.adapt.analysis_model` takes it).

    Returns:
        ``[(hook name, hook function), ...]``.
    """
    model = analysis_model(model)
    names = sorted({name for name in model.hook_dict if name.endswith("hook_scale")})
    hooks: list[Hook] = [(name, _constant) for name in names]
    for li, block in enumerate(model.blocks):
        hooks.append((f"blocks.{li}.attn.hook_pattern", _constant))
        hooks.append((neuron_act_name("pattern", li), _constant))
        if block.mlp.gated:
            hooks.append((neuron_act_name("v", li), _half))
    return [(name, fn) for name, fn in hooks if name in model.hook_dict]


def check_relevance(
    model: AttnOnlyModel, rule: str, layers: Sequence[int], ig_steps: int | None
) -> None:
    """Refuse, before any work, what :func:`neuron_relevance` cannot compute."""
    if rule not in RELEVANCE_RULES:
        raise ValueError(f"rule must be one of {RELEVANCE_RULES}, got {rule!r}.")
    if ig_steps is not None and ig_steps < 1:
        raise ValueError(f"ig_steps must be None or >= 1, got {ig_steps}.")
    if model.is_encoder:
        raise NotImplementedError(
            "neuron_relevance needs a decoder whose metric reads the logits; an encoder is not "
            "supported (use tl_attnonly.analysis.attribution_patch with metric_input=...)."
        )
    n_layers = model.cfg.n_layers
    bad = [li for li in layers if not 0 <= li < n_layers]
    if bad:
        raise IndexError(f"layers {bad} out of range for a model of {n_layers} layers.")
    for li in layers:
        mlp = model.blocks[li].mlp
        if not mlp.converted or mlp.is_mixture_of_experts:
            raise NotImplementedError(
                f"blocks.{li}.mlp is a {type(mlp).__name__}; neuron_relevance supports dense "
                "neuron-head layers (NeuronHeadMLP, GatedNeuronHeadMLP) only."
            )


def _bias_values(
    model: AttnOnlyModel, li: int, like: torch.Tensor
) -> Float[torch.Tensor, " n_neuron_heads"]:
    """The bias token's value of every neuron-head of layer ``li`` (0 for gated layers)."""
    mlp = model.blocks[li].mlp
    if mlp.gated:
        return like.new_zeros(mlp.n_neuron_heads)
    g = mlp.coefficient_tensors(like)[4]  # [K]
    return g.repeat(mlp.d_mlp)


def _gradients(
    model: AttnOnlyModel,
    tokens: Int[torch.Tensor, "batch pos"],
    idx: torch.Tensor,
    metric: DiscoveryMetric,
    post_names: list[str],
    rule_hooks: list[Hook],
    embeds: tuple[torch.Tensor, torch.Tensor] | None,
    alpha: float,
) -> dict[str, torch.Tensor]:
    """One forward and backward pass on ``tokens``: the metric's gradient at each ``hook_post``,
    with ``rule_hooks`` in place and, given ``embeds`` (corrupted, clean ``hook_embed``), the
    embeddings at ``corrupted + alpha (clean - corrupted)``."""
    acts: dict[str, torch.Tensor] = {}

    def embed(act: torch.Tensor, hook: Any) -> torch.Tensor:
        if embeds is not None:
            corr, clean = embeds
            act = corr + alpha * (clean - corr)
        return act if act.requires_grad else act.detach().requires_grad_(True)

    def keep(act: torch.Tensor, hook: Any) -> torch.Tensor:
        acts[hook.name] = act
        return act

    hooks: list[Hook] = [("hook_embed", embed), *rule_hooks]
    hooks += [(name, keep) for name in post_names]
    with torch.enable_grad(), warnings.catch_warnings():
        # A bridge norm on Hugging Face's native path recomputes its output from the hooked
        # (detached) scale and says so; the value is the same to rounding (LN-rule, by design).
        warnings.filterwarnings("ignore", message=NATIVE_NORM_EDIT)
        value = call_metric(metric, model.run_with_hooks(tokens, fwd_hooks=hooks), idx)
        grads = torch.autograd.grad(value, [acts[n] for n in post_names], allow_unused=True)
    return {
        name: (torch.zeros_like(acts[name]) if grad is None else grad).detach()
        for name, grad in zip(post_names, grads, strict=True)
    }


def neuron_relevance(
    model: ModelLike,
    clean_tokens: Int[torch.Tensor, "batch pos"],
    corrupted_tokens: Int[torch.Tensor, "batch pos"],
    metric: DiscoveryMetric,
    *,
    layers: Sequence[int] | None = None,
    rule: Literal["gradient", "relp"] = "relp",
    ig_steps: int | None = None,
    split: bool = False,
    batch_size: int | None = None,
) -> dict[int, torch.Tensor]:
    """Estimated effect of patching each neuron clean -> corrupted, by RelP or attribution patching.

    Args:
        model: An :class:`~tl_attnonly.AttnOnlyTransformer` or a converted ``TransformerBridge``.
        clean_tokens, corrupted_tokens: ``[n_examples, pos]``, same shape.
        metric: ``metric(logits)`` or ``metric(logits, indices)`` -> scalar, additive over batches
            (as for :func:`~tl_attnonly.analysis.edge_attribution_scores`, e.g.
            :func:`~tl_attnonly.analysis.logit_diff_metric`).
        layers: Which layers' neurons; default all.
        rule: ``"relp"`` (default: RelP's backward rules, module docstring) or ``"gradient"``
            (plain gradients: attribution patching).
        ig_steps: ``None`` (the gradient on the corrupted run) or ``n``: gradients averaged over
            ``n`` runs with embeddings ``corrupted + t (clean - corrupted)``, ``t = 1/n .. 1``
            (``rule="gradient", ig_steps=5``: node-level EAP-IG).
        split: Return each neuron's relevance through its self weight (gate) and through its
            value apart (module docstring; they sum to the total).
        batch_size: Examples per pass; default all at once.

    Returns:
        ``{layer: relevance}``, ``[d_mlp]`` per layer, or ``[d_mlp, 2]`` (gate, value) with
        ``split``; float64, estimates of ``metric(patched) - metric(corrupted)``.

    Raises:
        ValueError: For an unknown ``rule``, ``ig_steps < 1`` or token shapes that differ.
        NotImplementedError: For encoders and layers that are not dense neuron-head layers
            (mixtures of experts are refused by :func:`~tl_attnonly.adapt.analysis_model`).
    """
    model = analysis_model(model)
    clean_tokens, corrupted_tokens = tokens_on_model_device(model, clean_tokens, corrupted_tokens)
    if clean_tokens.shape != corrupted_tokens.shape:
        raise ValueError(
            f"clean and corrupted tokens differ in shape: {tuple(clean_tokens.shape)} vs "
            f"{tuple(corrupted_tokens.shape)}."
        )
    layers = list(range(model.cfg.n_layers)) if layers is None else list(layers)
    check_relevance(model, rule, layers, ig_steps)
    batches = batch_indices(clean_tokens.shape[0], batch_size)
    check_additive(model, clean_tokens, metric, batches)
    post = {li: neuron_act_name("post", li) for li in layers}
    cached = set(post.values())
    if split:
        cached |= {neuron_act_name(k, li) for li in layers for k in ("pattern", "v")}
    if ig_steps is not None:
        cached.add("hook_embed")
    rule_hooks = relp_hooks(model) if rule == "relp" else []
    alphas = [k / ig_steps for k in range(1, ig_steps + 1)] if ig_steps else [0.0]
    out = {li: torch.zeros(model.blocks[li].mlp.d_mlp, 2, dtype=torch.float64) for li in layers}
    for idx in batches:
        caches = []
        for tokens in (clean_tokens[idx], corrupted_tokens[idx]):
            with torch.no_grad():
                _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in cached)
            caches.append(dict(cache.cache_dict))
        clean, corr = caches
        embeds = (corr["hook_embed"], clean["hook_embed"]) if ig_steps else None
        grads: dict[str, torch.Tensor] = {}
        for alpha in alphas:
            step = _gradients(
                model, corrupted_tokens[idx], idx, metric, list(post.values()), rule_hooks,
                embeds, alpha,
            )  # fmt: skip
            for name, grad in step.items():
                grads[name] = grads[name] + grad if name in grads else grad
        for li in layers:
            G = grads[post[li]].double() / len(alphas)  # [batch, pos, d_mlp]
            if not split:
                delta = clean[post[li]].double() - corr[post[li]].double()
                out[li][:, 0] += (delta * G).sum((0, 1)).cpu()
                continue
            out[li] += _gate_value(model, li, G, clean, corr).cpu()
    return {li: r if split else r[:, 0] for li, r in out.items()}


def _gate_value(
    model: AttnOnlyModel,
    li: int,
    G: Float[torch.Tensor, "batch pos d_mlp"],
    clean: dict[str, torch.Tensor],
    corr: dict[str, torch.Tensor],
) -> Float[torch.Tensor, "d_mlp 2"]:
    """``(gate, value)`` relevance of every neuron of layer ``li`` (module docstring)."""
    K = model.n_heads_per_neuron
    pattern, value = neuron_act_name("pattern", li), neuron_act_name("v", li)
    # self weights [batch, n_neuron_heads, pos, 2] -> [batch, pos, n_neuron_heads]
    p_clean = clean[pattern][..., 0].double().transpose(1, 2)
    p_corr = corr[pattern][..., 0].double().transpose(1, 2)
    v_clean, v_corr = clean[value][..., 0].double(), corr[value][..., 0].double()  # [b, pos, h]
    bias = _bias_values(model, li, v_clean)
    gate = (p_clean - p_corr) * ((v_clean + v_corr) / 2 - bias)
    val = (p_clean + p_corr) / 2 * (v_clean - v_corr)
    Gh = G.repeat_interleave(K, dim=-1)  # every head of neuron i reads G[..., i]
    per_head = torch.stack(((gate * Gh).sum((0, 1)), (val * Gh).sum((0, 1))), dim=-1)
    return per_head.unflatten(0, (-1, K)).sum(1)  # [d_mlp, 2]


__all__ = ["RELEVANCE_RULES", "neuron_relevance", "relp_hooks"]
