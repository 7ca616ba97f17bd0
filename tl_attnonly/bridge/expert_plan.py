"""Planning a bridge's mixture-of-experts conversion: where a MoE block's experts are, whether
they are laid out as supported, and whether the neuron-head experts built compute what they
replace (nothing is changed here; :mod:`tl_attnonly.bridge.experts` mounts them).

:func:`plan_experts` finds a block's experts (:class:`ExpertsPlan`) and refuses an unsupported
layout before any work (:func:`check_experts_layout`); :func:`expert_coefficients` and
:func:`build_experts` make the neuron-head experts
(:class:`~tl_attnonly.bridge.expert_modules.BridgeNeuronHeadExperts`), and :func:`check_experts`
compares them with the Hugging Face experts on a random input.

Supported experts modules: grouped weights, concatenated ``[gate; up]`` or interleaved (gate,
up, gate, ...) along the ``2 * d_mlp`` axis, stored ``[E, 2 * d_mlp, d_model]`` or transposed
``[E, d_model, 2 * d_mlp]``, with or without biases (``gate_up_proj_bias [E, 2 * d_mlp]``,
``down_proj_bias [E, d_model]``), computing the standard gating ``act(gate) * up``; each expert's
projections are Hugging Face's own arithmetic, so the layout only changes which views the
neuron-heads read. A clamped SwiGLU (GPT-OSS's ``_apply_gate``: ``(clamp(u, -L, L) + 1) * g'
sigmoid(alpha g')``, ``g' = min(g, L)``, recognised by its values:
:func:`~tl_attnonly.components.clamped_gating.find_clamped_gating`) converts only with
``ConversionOptions(clamp="check")``: to neuron-heads of the unclamped activation (one exact head
per neuron, query ``alpha g``, value ``g (u + 1)``), equal to the original wherever the clamp is
inactive; every forward pass counts where it would have acted, records it on the experts
(``clamp_count``, ``clamp_max_change``) and emits a
:class:`~tl_attnonly.components.clamped_gating.ClampActiveWarning` naming the layer, so a
result is never silently wrong. Anything else is refused before any work, naming what differs
(:func:`check_experts_layout`): per-expert module lists, experts without gate rows or with a
post-expert norm, another custom gating, a clamped one without the option.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn as nn

from tl_attnonly._compat import child_module
from tl_attnonly.activations import NeuronHeadCoefficients
from tl_attnonly.bridge.expert_modules import (
    GROUPED_BIASES,
    GROUPED_PARAMETERS,
    LAYOUT_FLAGS,
    SUPPORTED_LAYOUT,
    BridgeNeuronHeadExperts,
)
from tl_attnonly.components.clamped_gating import (
    ClampActiveWarning,
    ClampedSwiGLU,
    find_clamped_gating,
)
from tl_attnonly.components.expert_facts import routed_slots
from tl_attnonly.options import ConversionOptions

#: What each unsupported layout flag means, for the refusal.
_LAYOUT_MEANING = {
    "has_gate": "its experts are not gated (no gate rows in gate_up_proj)",
    "has_post_expert_norm": "it normalises each expert's output",
}

_SUPPORTED = (
    "Supported: grouped experts (one module with gate_up_proj [E, 2 * d_mlp, d_model] and "
    "down_proj [E, d_model, d_mlp], or both transposed, gate and up rows concatenated or "
    "interleaved, with or without biases) computing down(act(gate x) * up x) per expert, e.g. "
    "Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite-MoE, PhiMoE, DeepSeek-V3 in transformers 5; "
    "a clamped SwiGLU (GPT-OSS) with ConversionOptions(clamp='check')."
)


def is_bridge_component(module: object) -> bool:
    """Whether ``module`` is a TransformerLens bridge component (it wraps a module)."""
    return isinstance(getattr(module, "original_component", None), nn.Module)


@dataclass
class ExpertsPlan:
    """Where a MoE block's experts are and what replaces them.

    Attributes:
        name: The experts' hook prefix, ``blocks.{l}.mlp.experts``.
        layer: The block index (seeds the self-check).
        slot: What holds the experts: the Hugging Face block (attribute ``experts``), or the
            bridge component that wraps them (Qwen2-MoE's ``blocks.{l}.mlp.experts``).
        hf_experts: The Hugging Face grouped experts module.
        act_fn: TransformerLens name of its activation (set by the caller).
        clamp: Its clamped SwiGLU (``None``: the standard gating ``act(gate) * up``).
    """

    name: str
    layer: int
    slot: nn.Module
    hf_experts: nn.Module
    act_fn: str = ""
    clamp: ClampedSwiGLU | None = None


def _unwrapped(module: nn.Module) -> nn.Module:
    """The module a bridge component wraps (and, once converted, the Hugging Face experts that
    :class:`BridgeNeuronHeadExperts` replaced)."""
    inner = module.original_component if is_bridge_component(module) else module
    if isinstance(inner, BridgeNeuronHeadExperts):
        return cast(nn.Module, inner.__dict__["hf_experts"])
    return cast(nn.Module, inner)


def plan_experts(name: str, layer: int, hf_block: nn.Module, clamp: str = "refuse") -> ExpertsPlan:
    """Find a Hugging Face MoE block's experts and check their layout (nothing is changed).

    Args:
        name: The block's name, ``blocks.{l}.mlp``.
        layer: The block index.
        hf_block: The Hugging Face MoE block (the ``MoEBridge``'s wrapped module).
        clamp: ``ConversionOptions.clamp``: ``"check"`` converts a clamped SwiGLU.

    Raises:
        NotImplementedError: For a block without an ``experts`` module, or experts laid out
            otherwise than :func:`check_experts_layout` supports (named).
    """
    slot_module = child_module(hf_block, "experts")
    if slot_module is None:
        children = ", ".join(key for key, _ in hf_block.named_children()) or "none"
        raise NotImplementedError(
            f"{name} ({type(hf_block).__name__}) has no 'experts' submodule (its children: "
            f"{children}); cannot tell which modules are the "
            f"experts. {_SUPPORTED}"
        )
    slot = slot_module if is_bridge_component(slot_module) else hf_block
    hf_experts = _unwrapped(slot_module)
    gating = check_experts_layout(f"{name}.experts", hf_experts, clamp)
    return ExpertsPlan(f"{name}.experts", layer, slot, hf_experts, clamp=gating)


def check_experts_layout(
    name: str, hf_experts: nn.Module, clamp: str = "refuse"
) -> ClampedSwiGLU | None:
    """Refuse an experts module that is not supported, naming what differs.

    Args:
        name: Its name, ``blocks.{l}.mlp.experts``, for the error.
        hf_experts: The Hugging Face experts module.
        clamp: ``ConversionOptions.clamp``: ``"check"`` accepts a clamped SwiGLU.

    Returns:
        The clamped SwiGLU the experts compute (``None``: the standard gating).

    Raises:
        NotImplementedError: Per-expert modules, missing or misshapen grouped weights, a custom
            gating other than a clamped SwiGLU, a clamped SwiGLU without ``clamp="check"``, or
            a layout flag other than :data:`SUPPORTED_LAYOUT`.
    """
    what = f"{name} ({type(hf_experts).__name__})"
    if isinstance(hf_experts, nn.ModuleList):
        kinds = sorted({type(m).__name__ for m in hf_experts})
        raise NotImplementedError(
            f"{what} holds one module per expert ({', '.join(kinds)}), not grouped weights: "
            f"per-expert modules are not supported on a bridge. {_SUPPORTED}"
        )
    shapes = {n: tuple(p.shape) for n, p in hf_experts.named_parameters(recurse=False)}
    if any(len(shapes.get(n, ())) != 3 for n in GROUPED_PARAMETERS):
        raise NotImplementedError(
            f"{what} has no 3-D gate_up_proj and down_proj (its parameters: {shapes or 'none'}). "
            f"{_SUPPORTED}"
        )
    for flag in (*SUPPORTED_LAYOUT, *LAYOUT_FLAGS):
        value = getattr(hf_experts, flag, None)
        if value is None:
            import transformers

            raise NotImplementedError(
                f"{what} does not declare its layout ({flag}): not a transformers grouped "
                "experts module, or one from a transformers without the layout flags (this is "
                f"transformers {transformers.__version__}; 5.17 lacks has_post_expert_norm, 5.24 "
                f"declares them all: pip install -U transformers). {_SUPPORTED}"
            )
        if flag in SUPPORTED_LAYOUT and bool(value) != SUPPORTED_LAYOUT[flag]:
            raise NotImplementedError(
                f"{what}: {_LAYOUT_MEANING[flag]} ({flag}={value}). {_SUPPORTED}"
            )
    _check_grouped_shapes(what, hf_experts, shapes)
    gating = getattr(type(hf_experts), "_apply_gate", None)
    if gating is None or getattr(gating, "__name__", "") == "_default_apply_gate":
        return None
    clamped = find_clamped_gating(what, hf_experts)  # raises for another clamped activation
    if clamped is None:
        raise NotImplementedError(
            f"{what}: its gated activation ({type(hf_experts).__name__}._apply_gate) is not the "
            f"standard act(gate) * up. {_SUPPORTED}"
        )
    if clamp != "check":
        raise NotImplementedError(
            f"{what}: its gated activation ({type(hf_experts).__name__}._apply_gate) is a "
            f"clamped SwiGLU, {clamped.describe()}: it clamps the gate (at most "
            f"{clamped.limit:g}) and the linear branch (within ±{clamped.limit:g}) before the "
            "product, and neuron-heads have no clamp. Pass ConversionOptions(clamp='check') to "
            "convert it to the unclamped activation, exact wherever the clamp is inactive, "
            f"with a ClampActiveWarning on every forward pass where it is not. {_SUPPORTED}"
        )
    return clamped


def _check_grouped_shapes(what: str, hf_experts: nn.Module, shapes: dict[str, tuple]) -> None:
    """Refuse grouped weights (and biases) whose shapes do not fit the declared layout."""
    transposed = bool(hf_experts.is_transposed)
    (n, *gate_up), (n_out, *down) = shapes["gate_up_proj"], shapes["down_proj"]
    (d, two_m), (m, d_out) = (gate_up, down) if transposed else (gate_up[::-1], down[::-1])
    expected = {"gate_up_proj_bias": (n, two_m), "down_proj_bias": (n, d)}
    biases_fit = not hf_experts.has_bias or all(shapes.get(k) == v for k, v in expected.items())
    if (n, two_m, d) != (n_out, 2 * m, d_out) or not biases_fit:
        layout = (
            "[E, d_model, 2 * d_mlp] and [E, d_mlp, d_model]"
            if transposed
            else "[E, 2 * d_mlp, d_model] and [E, d_model, d_mlp]"
        )
        raise NotImplementedError(
            f"{what}: gate_up_proj {shapes['gate_up_proj']} and down_proj {shapes['down_proj']} "
            f"(biases: {[shapes.get(k) for k in GROUPED_BIASES]}) are not {layout} "
            f"(is_transposed={transposed}, has_bias={bool(hf_experts.has_bias)}). {_SUPPORTED}"
        )


def expert_coefficients(plan: ExpertsPlan, options: ConversionOptions) -> NeuronHeadCoefficients:
    """The per-head coefficients of ``plan``'s experts: those of ``options`` for their
    activation, or a clamped SwiGLU's one exact head per neuron (sets ``plan.act_fn``).

    Raises:
        ValueError: Options that do not fit the activation (several heads per neuron for a
            clamped SwiGLU's exact head).
    """
    if plan.clamp is None:
        return options.coefficients(plan.act_fn)
    if options.n_heads_per_neuron not in (None, 1):
        raise ValueError(
            f"{plan.name}: the clamped SwiGLU's unclamped activation g * sigmoid("
            f"{plan.clamp.alpha:g} g) is exact with 1 head per neuron; valid n_heads_per_neuron: "
            f"None or 1, got {options.n_heads_per_neuron!r}."
        )
    coefficients = plan.clamp.coefficients()
    plan.act_fn = coefficients.activation
    return coefficients


def build_experts(
    plan: ExpertsPlan, coefficients: NeuronHeadCoefficients, *, fused: bool, compiled: bool
) -> BridgeNeuronHeadExperts:
    """The neuron-head experts of ``plan`` (nothing is mounted yet)."""
    experts = BridgeNeuronHeadExperts(
        plan.hf_experts, plan.act_fn, coefficients, clamp=plan.clamp, name=plan.name
    )
    experts.fused = fused
    experts.compiled = compiled
    return experts


def _eager_forward(hf_experts: nn.Module) -> Any:
    """The experts class's own eager forward (transformers' ``use_experts_implementation`` keeps
    it as ``forward.__wrapped__``; the grouped kernels compute the same up to rounding and have
    no float64), else the module itself."""
    wrapped = getattr(type(hf_experts).forward, "__wrapped__", None)
    if wrapped is None:
        return hf_experts
    return lambda *args: wrapped(hf_experts, *args)


def check_experts(plan: ExpertsPlan, experts: BridgeNeuronHeadExperts) -> None:
    """Refuse experts whose Hugging Face forward is not ``sum_e w_e down_e(act(gate_e x) * up_e
    x)``: both run on a small random input routed to every expert, and must agree within the
    neuron-heads' error bound plus rounding (a structural difference is far outside it). For a
    clamped SwiGLU the bound adds, where the clamp acts on that input, the exact change of the
    activation through ``|W_out|``; the check's own forward pass is neither warned nor recorded.

    Raises:
        NotImplementedError: Naming the experts, the difference and the bound.
    """
    down = experts.down_proj
    if down.is_meta:
        return  # no values to compare
    dtype, device = down.dtype, down.device
    n_experts = experts.num_experts
    d_model = experts.expert_list()[0].cfg.d_model
    top_k = min(2, n_experts)
    n_tokens = 2 * n_experts
    generator = torch.Generator().manual_seed(plan.layer)
    x = torch.randn(n_tokens, d_model, generator=generator, dtype=torch.float64)
    x = x.to(device=device, dtype=dtype)
    token = torch.arange(n_tokens, device=device)
    index = torch.stack([(token + k) % n_experts for k in range(top_k)], dim=-1)
    weights = torch.rand(n_tokens, top_k, generator=generator, dtype=torch.float64)
    weights = weights.to(device=device, dtype=dtype)
    fused, training = experts.fused, experts.training
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", ClampActiveWarning)
        reference = _eager_forward(plan.hf_experts)(x, index, weights)
        experts.fused = True
        experts.eval()
        ours = experts(x, index, weights)
        experts.fused = fused
        experts.train(training)
        experts.reset_clamp_record()
        # |act_K - act| <= max_err per neuron, times |u|, through W_out, times the weight; plus
        # a clamped SwiGLU's change where its clamp acts
        scale = torch.zeros(n_tokens, d_model, dtype=torch.float64, device=device)
        clamped = torch.zeros_like(scale)
        for e, expert in enumerate(experts.expert_list()):
            slot, rows = routed_slots(index, e)
            gate_up = expert._project(x[rows], "gate_up").to(torch.float64)
            gate, u = (expert._gate_up_part(gate_up, part) for part in (0, 1))
            w = weights[rows, slot, None].abs().to(torch.float64)
            out_matrix = expert._out_matrix.abs().to(torch.float64)
            if experts.clamp is not None:
                change = experts.clamp.unclamped(gate, u) - experts.clamp.clamped(gate, u)
                clamped.index_add_(0, rows, w * (change.abs() @ out_matrix))
                u = u + experts.clamp.linear_offset
            scale.index_add_(0, rows, w * (u.abs() @ out_matrix))
        eps = torch.finfo(dtype).eps
        max_err = experts.coefficients.max_abs_error()
        bound = max_err * scale + 64 * eps * (scale + reference.abs().to(torch.float64) + 1)
        bound = bound + clamped * (1 + 64 * eps)
    error = (ours.to(torch.float64) - reference.to(torch.float64)).abs()
    if not bool((error <= bound).all()):
        raise NotImplementedError(
            f"{plan.name} ({type(plan.hf_experts).__name__}): the neuron-head experts differ "
            f"from the Hugging Face experts by {float(error.max()):.3g} on a random input "
            f"(bound {float(bound.max()):.3g}), so their forward is not the standard "
            f"sum of routing weight * down(act(gate x) * up x). {_SUPPORTED}"
        )


__all__ = [
    "ExpertsPlan",
    "build_experts",
    "check_experts",
    "check_experts_layout",
    "expert_coefficients",
    "is_bridge_component",
    "plan_experts",
]
