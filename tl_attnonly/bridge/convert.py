"""Convert a TransformerBridge in place: every MLP runs as neuron-heads (no weight copies).

:func:`convert_bridge` (what :func:`tl_attnonly.convert` calls for a bridge) checks every layer
first (component kind, projections, activation), builds one neuron-head layer per MLP
(:mod:`tl_attnonly.bridge.modules`), checks each against the Hugging Face module on a small
random input, and only then mounts them, with the bridge's own ``set_original_component``: the
bridge component (``blocks.{l}.mlp``), its hooks and its projections stay; what it calls is the
neuron-head layer instead of the Hugging Face MLP. The neuron-head hook points are registered on
the component, so they are ``blocks.{l}.mlp.hook_pattern`` etc. in ``hook_dict``,
``run_with_cache`` and ``run_with_hooks``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from tl_attnonly._compat import (
    bridge_bypasses_original,
    child_module,
    mlp_config,
    register_bridge_hooks,
    route_through_original,
    unmount_component_hook,
    unregister_bridge_hooks,
)
from tl_attnonly.activations import NeuronHeadCoefficients
from tl_attnonly.bridge.attention_layout import repair_z_layouts, restore_z_layouts
from tl_attnonly.bridge.experts import (
    BridgeNeuronHeadExperts,
    ExpertsPlan,
    SharedGatedNeuronHeadMLP,
    SharedNeuronHeadMLP,
    build_experts,
    check_experts,
    dense_moe_keys,
    expert_coefficients,
    is_bridge_component,
    mount_experts,
    mounted_experts,
    plan_experts,
    unmount_experts,
)
from tl_attnonly.bridge.layouts import Layout, plan_layout
from tl_attnonly.bridge.modules import (
    BRIDGE_NEURON_HEAD_HOOKS,
    BridgeGatedNeuronHeadMLP,
    BridgeNeuronHeadLayer,
    BridgeNeuronHeadMLP,
    tl_matrix,
)
from tl_attnonly.bridge.sites import ACTIVATION_ATTRIBUTES, eval_mode, identify_activation
from tl_attnonly.options import ConversionOptions

#: Bridge MLP components (class names) that are converted, and their projections.
PLAIN_BRIDGES = ("MLPBridge",)
GATED_BRIDGES = ("GatedMLPBridge",)

#: Attribute under which the component keeps the Hugging Face module it wrapped before
#: conversion (restored by :func:`unconvert_bridge`).
_ORIGINAL = "_tl_attnonly_original_mlp"
#: Attribute under which the component keeps the torch hook handles of the bypass guard.
_GUARD = "_tl_attnonly_guard_handles"


@dataclass
class _Plan:
    """What one layer's conversion will do."""

    layer: int
    mlp_bridge: Any
    hf_mlp: Any
    gated: bool
    projections: dict[str, str]
    act_fn: str
    #: The bridge component's child of each role where it is not named by the role (a dense
    #: layer of an interleaved MoE stack: ``dense_gate``, ``dense_in``, ``dense_out``).
    keys: dict[str, str] = field(default_factory=dict)
    #: A layout other than a module whose projections are its attributes (a fused gate/up, a
    #: containerless MLP, one that adds the residual): :mod:`tl_attnonly.bridge.layouts`.
    layout: Layout | None = None

    def projection(self, role: str) -> Any:
        """The bridge's projection component of ``role`` (``gate``, ``in``, ``out``)."""
        return self.mlp_bridge.get_submodule(self.keys.get(role, role))


@dataclass
class _MoEPlan:
    """What one mixture-of-experts layer's conversion will do: its routed experts
    (:mod:`tl_attnonly.bridge.experts`) and its shared experts (bridge MLPs inside the
    ``MoEBridge``, by their names there)."""

    layer: int
    mlp_bridge: Any
    experts: ExpertsPlan
    shared: dict[str, _Plan]


def _mlp_name(layer: int) -> str:
    return f"blocks.{layer}.mlp"


def _hf_activation(hf_mlp: Any, layer: int) -> tuple[Any, str]:
    for name in ACTIVATION_ATTRIBUTES:
        fn = getattr(hf_mlp, name, None)
        if callable(fn):
            return fn, name
    raise NotImplementedError(
        f"{_mlp_name(layer)} ({type(hf_mlp).__name__}) has no activation attribute "
        f"({', '.join(ACTIVATION_ATTRIBUTES)}); cannot tell which activation to rewrite."
    )


def _layout(layer: int, mlp_bridge: Any) -> Layout | None:
    """The layout of a bridge MLP converted by :mod:`tl_attnonly.bridge.layouts` (``None`` for
    the standard ones)."""
    hf_mlp = mlp_bridge.__dict__.get(_ORIGINAL, mlp_bridge.original_component)
    return plan_layout(layer, mlp_bridge, hf_mlp)


def _plan_layer(layer: int, mlp_bridge: Any, options: ConversionOptions) -> _Plan | _MoEPlan:
    """Check one layer and say how it will be converted (nothing is changed)."""
    kind = type(mlp_bridge).__name__
    name = _mlp_name(layer)
    keys: dict[str, str] = {}
    if kind == "MoEBridge":
        if not getattr(mlp_bridge, "bound_dense", False):
            return _plan_moe(layer, mlp_bridge, options)
        keys = dense_moe_keys(mlp_bridge)  # a dense layer of an interleaved MoE stack
    elif (layout := _layout(layer, mlp_bridge)) is not None:
        options.coefficients(layout.act_fn)  # refuses options that do not fit the activation
        return _Plan(
            layer,
            mlp_bridge,
            layout.hf_mlp,
            layout.gated,
            layout.projections,
            layout.act_fn,
            layout=layout,
        )
    elif kind not in PLAIN_BRIDGES + GATED_BRIDGES:
        raise NotImplementedError(
            f"{name} is a {kind}, which has no neuron-head form on a bridge yet. Supported bridge "
            "MLPs: MLPBridge (plain, e.g. GPT-2) and GatedMLPBridge (gated, e.g. Llama, Qwen2, "
            "Gemma)."
        )
    hf_mlp = mlp_bridge.__dict__[_ORIGINAL] if _ORIGINAL in mlp_bridge.__dict__ else None
    if hf_mlp is None:
        hf_mlp = mlp_bridge.original_component
    if hf_mlp is None:
        raise NotImplementedError(f"{name} ({kind}) wraps no module (containerless MLP).")
    gated = kind in GATED_BRIDGES or "gate" in keys
    roles = ("gate", "in", "out") if gated else ("in", "out")
    projections: dict[str, str] = {}
    for role in roles:
        projection = child_module(mlp_bridge, keys.get(role, role))
        if projection is None or getattr(projection, "name", None) is None:
            raise NotImplementedError(f"{name} ({kind}) has no '{role}' projection component.")
        remote = str(projection.name)
        if getattr(hf_mlp, remote, None) is not projection:
            raise NotImplementedError(
                f"{name}: the '{role}' projection ({remote}) is not a direct submodule of "
                f"{type(hf_mlp).__name__}; only MLPs whose projections are their own attributes "
                "are supported."
            )
        try:  # refuses projections that are not nn.Linear / Conv1D
            tl_matrix(projection, role)
        except NotImplementedError as err:
            raise NotImplementedError(f"{name} ({kind}): {err}") from err
        projections[role] = remote
    fn, _ = _hf_activation(hf_mlp, layer)
    act_fn = identify_activation(fn, f"{name} ({type(hf_mlp).__name__})")
    options.coefficients(act_fn)  # refuses options that do not fit the activation
    return _Plan(layer, mlp_bridge, hf_mlp, gated, projections, act_fn, keys)


def _plan_moe(layer: int, mlp_bridge: Any, options: ConversionOptions) -> _MoEPlan:
    """Check a sparse mixture-of-experts layer: its routed experts, every MLP of the block that
    the bridge wraps (a shared expert), and that no other MLP would stay unconverted."""
    name = _mlp_name(layer)
    hf_block = mlp_bridge.original_component
    experts = plan_experts(name, layer, hf_block, options.clamp)
    if experts.clamp is None:  # a clamped SwiGLU's activation is known from its values
        fn, _ = _hf_activation(experts.hf_experts, layer)
        experts.act_fn = identify_activation(
            fn, f"{experts.name} ({type(experts.hf_experts).__name__})"
        )
    expert_coefficients(experts, options)  # refuses options that do not fit the activation
    shared: dict[str, _Plan] = {}
    for key, component in mlp_bridge.named_children():
        if not type(component).__name__.endswith("MLPBridge"):
            continue  # the router, the shared expert's gate, hook points, the block itself
        try:
            plan = _plan_layer(layer, component, options)
        except (NotImplementedError, ValueError) as err:
            raise type(err)(f"{name}.{key} (a shared expert): {err}") from err
        assert isinstance(plan, _Plan)
        shared[key] = plan
    wrapped = {type(p.hf_mlp).__name__ for p in shared.values()}
    for key, child in hf_block.named_children():
        if key == "experts" or is_bridge_component(child):
            continue
        if any(callable(getattr(child, a, None)) for a in ACTIVATION_ATTRIBUTES):
            raise NotImplementedError(
                f"{name} ({type(hf_block).__name__}): its submodule '{key}' "
                f"({type(child).__name__}) has an activation but is not wrapped by the bridge, "
                "so it would stay an MLP. Supported: the routed experts and the MLPs the bridge "
                f"wraps in the block ({', '.join(sorted(wrapped)) or 'none here'})."
            )
    return _MoEPlan(layer, mlp_bridge, experts, shared)


def _build(
    plan: _Plan | _MoEPlan, options: ConversionOptions, *, shared: bool = False
) -> BridgeNeuronHeadLayer | BridgeNeuronHeadExperts:
    """The neuron-head layer of ``plan`` (``shared``: a MoE block's shared expert, which may be
    called on the block's flattened tokens)."""
    if isinstance(plan, _MoEPlan):
        coefs = expert_coefficients(plan.experts, options)
        experts = build_experts(plan.experts, coefs, fused=options.fused, compiled=options.compiled)
        experts.shared = {k: _build(p, options, shared=True) for k, p in plan.shared.items()}
        return experts
    W_out = tl_matrix(plan.projection("out"), "out")
    cfg = mlp_config(int(W_out.shape[1]), int(W_out.shape[0]), plan.act_fn, W_out.dtype)
    coefficients: NeuronHeadCoefficients = options.coefficients(plan.act_fn)
    layer: Any
    if plan.layout is not None:  # a layout of its own (layouts.py) builds its layer
        layer = plan.layout.build(cfg, coefficients)
    else:
        cls: type[BridgeNeuronHeadLayer]
        if shared:
            cls = SharedGatedNeuronHeadMLP if plan.gated else SharedNeuronHeadMLP
        else:
            cls = BridgeGatedNeuronHeadMLP if plan.gated else BridgeNeuronHeadMLP
        source: Any = plan.mlp_bridge
        if plan.keys:  # the projections by role (the layer reads source.gate, .in, .out)
            source = SimpleNamespace(**{role: plan.projection(role) for role in plan.projections})
        layer = cls(source, plan.projections, cfg, coefficients)
        dropout = getattr(plan.hf_mlp, "dropout", None)
        if isinstance(dropout, nn.Dropout):  # GPT-2: dropout(c_proj(...)), kept as it is
            layer.add_module("dropout", dropout)
    layer.fused = options.fused
    layer.compiled = options.compiled
    # the bridge component's mode, which train()/eval() keep current (the Hugging Face MLP is set
    # aside at the first conversion, where eval() no longer reaches it)
    layer.train(plan.mlp_bridge.training)
    return layer


#: Neurons per block of the self-check's error bound (bounds its float64 scratch memory).
_SELF_CHECK_BLOCK = 256


def _self_check(plan: _Plan | _MoEPlan, layer: Any) -> None:
    """Refuse a layer whose Hugging Face forward is not ``out(act(in x))`` / ``down(act(gate x)
    * up x)``: both run on a small random input, and must agree within the neuron-heads' error
    bound plus rounding (a structural difference is far outside it). A mixture of experts: its
    routed experts (:func:`~tl_attnonly.bridge.experts.check_experts`) and its shared ones."""
    if isinstance(plan, _MoEPlan):
        check_experts(plan.experts, layer)
        for key, sub in plan.shared.items():
            _self_check(sub, layer.shared[key])
        return
    W_out = layer.W_out
    if W_out.is_meta:
        return  # no values to compare (the meta device stands in for another device in tests)
    dtype, device = W_out.dtype, W_out.device
    generator = torch.Generator().manual_seed(plan.layer)
    x = torch.randn(1, 5, layer.cfg.d_model, generator=generator, dtype=torch.float64)
    x = x.to(device=device, dtype=dtype)
    fused = layer.fused
    # in eval mode: a bridge converted while training would otherwise compare two dropout draws
    args = (x,) if plan.layout is None else plan.layout.check_inputs(x)
    with torch.no_grad(), eval_mode(plan.hf_mlp, layer):
        try:
            reference = plan.hf_mlp(x) if plan.layout is None else plan.layout.reference(*args)
        except TypeError as err:  # e.g. MPT's MLP also takes the residual stream
            raise NotImplementedError(
                f"{_mlp_name(plan.layer)} ({type(plan.hf_mlp).__name__}): its forward does not "
                f"take the hidden states alone ({err}), so it is not the standard "
                f"{'down(act(gate x) * up x)' if plan.gated else 'out(act(in x))'}. This MLP is "
                "not supported; please report the architecture."
            ) from err
        layer.fused = True
        ours = layer(*args)
        layer.fused = fused
        # The bound: |act_K - act| <= max_err per neuron (times |u| when gated), through W_out.
        if plan.gated:
            u = plan.projection("in")(x).abs().to(torch.float64)
        else:
            u = torch.ones(*x.shape[:-1], layer.d_mlp, dtype=torch.float64, device=device)
        # sum_i u_i |W_out[i]| in float64, a block of neurons at a time: no float64 copy of the
        # whole W_out (it raised conversion's peak memory to ~1.2x the model)
        scale = torch.zeros(*u.shape[:-1], W_out.shape[1], dtype=torch.float64, device=device)
        for start in range(0, layer.d_mlp, _SELF_CHECK_BLOCK):
            rows = slice(start, start + _SELF_CHECK_BLOCK)
            scale += u[..., rows] @ W_out[rows].abs().to(torch.float64)
        eps = torch.finfo(dtype).eps
        # (plus the activation's distance from the one the heads fit: BLOOM's GELU)
        max_err = layer.coefficients.max_abs_error() + getattr(layer, "activation_deviation", 0)
        bound = max_err * scale + 64 * eps * (scale + reference.abs().to(torch.float64) + 1)
    error = (ours.to(torch.float64) - reference.to(torch.float64)).abs()
    if not bool((error <= bound).all()):
        raise NotImplementedError(
            f"{_mlp_name(plan.layer)} ({type(plan.hf_mlp).__name__}): the neuron-head layer "
            f"differs from the Hugging Face module by {float(error.max()):.3g} on a random input "
            f"(bound {float(bound.max()):.3g}), so its forward is not the standard "
            f"{'down(act(gate x) * up x)' if plan.gated else 'out(act(in x))'}. This MLP is not "
            "supported; please report the architecture."
        )


def _reset_ran(module: Any, args: Any) -> None:
    """Forward pre-hook of a converted bridge MLP: its neuron-head layer has not run yet."""
    module.original_component._ran = False


def _check_ran(module: Any, args: Any, output: Any, *, index: int) -> None:
    """Forward hook of a converted bridge MLP: raise if its neuron-head layer did not run."""
    if not module.original_component._ran:
        raise RuntimeError(
            f"{_mlp_name(index)} ran without its neuron-heads: the bridge computed this MLP "
            "itself (enable_compatibility_mode() after tl_attnonly.convert makes gated MLPs "
            "use processed weights directly). Call tl_attnonly.convert(bridge) again after "
            "enable_compatibility_mode()."
        )


def _guard(mlp_bridge: Any, index: int) -> list[Any]:
    """Torch hooks on the bridge component that raise if a forward pass bypassed the
    neuron-head layer (``enable_compatibility_mode()`` after conversion makes a gated bridge MLP
    compute itself from processed weights). They read the layer from the component they are
    called on (no closure over it), so a deep copy of the bridge guards its own layers."""
    return [
        mlp_bridge.register_forward_pre_hook(_reset_ran),
        mlp_bridge.register_forward_hook(functools.partial(_check_ran, index=index)),
    ]


def _mount(bridge: Any, plan: _Plan | _MoEPlan, layer: Any) -> None:
    mlp_bridge = plan.mlp_bridge
    _unmount(mlp_bridge)
    if isinstance(plan, _MoEPlan):  # the experts in the block; the block and router stay
        mount_experts(mlp_bridge, plan.experts, layer)
        for key, sub in plan.shared.items():
            _mount(bridge, sub, layer.shared[key])
        return
    mlp_bridge.__dict__[_ORIGINAL] = plan.hf_mlp
    mount_in = getattr(layer, "mount_in", None)  # a layout that runs elsewhere (layouts.py)
    handles = [] if mount_in is None else mount_in(mlp_bridge, plan.hf_mlp, plan.layer)
    if mount_in is None:
        mlp_bridge.set_original_component(layer)
    for name in BRIDGE_NEURON_HEAD_HOOKS:
        setattr(mlp_bridge, f"hook_{name}", getattr(layer, f"hook_{name}"))
    if bridge_bypasses_original(mlp_bridge):
        route_through_original(mlp_bridge)
    mlp_bridge.__dict__[_GUARD] = _guard(mlp_bridge, plan.layer) + handles


def _unmount(mlp_bridge: Any) -> Any:
    """Put the Hugging Face module back; returns it (``None`` if nothing was mounted). A
    mixture of experts: its experts and shared experts; returns the experts taken out."""
    experts = unmount_experts(mlp_bridge)
    if experts is not None:
        for key in experts.shared:
            _unmount(child_module(mlp_bridge, key))
        return experts
    hf_mlp = mlp_bridge.__dict__.pop(_ORIGINAL, None)
    if hf_mlp is None:
        return None
    for handle in mlp_bridge.__dict__.pop(_GUARD, []):
        handle.remove()
    for name in BRIDGE_NEURON_HEAD_HOOKS:
        hook_name = f"hook_{name}"
        unmount_component_hook(mlp_bridge, hook_name)
    hf_mlp.train(mlp_bridge.training)  # set aside since conversion: eval() did not reach it
    unmount_from = getattr(mlp_bridge.original_component, "unmount_from", None)
    if unmount_from is not None:
        unmount_from(mlp_bridge, hf_mlp)
    else:
        mlp_bridge.set_original_component(hf_mlp)
    return hf_mlp


def _hook_names(index: int, mlp_bridge: Any) -> list[str]:
    """The neuron-head hook names mounted on one block's MLP (none where it is not converted):
    ``blocks.{l}.mlp.hook_*``, or a mixture of experts' ``blocks.{l}.mlp.experts.{e}.hook_*``
    and its shared experts' ``blocks.{l}.mlp.{name}.hook_*``."""
    name = _mlp_name(index)
    experts = mounted_experts(mlp_bridge)
    if experts is not None:
        shared = [
            f"{name}.{key}.hook_{n}" for key in experts.shared for n in BRIDGE_NEURON_HEAD_HOOKS
        ]
        return experts.hook_names(f"{name}.experts") + shared
    if _ORIGINAL not in mlp_bridge.__dict__:
        return []
    return [f"{name}.hook_{n}" for n in BRIDGE_NEURON_HEAD_HOOKS]


def _mlp_bridges(bridge: Any) -> list[Any]:
    blocks = getattr(bridge, "blocks", None)
    if blocks is None:
        raise TypeError("This TransformerBridge has no blocks: nothing to convert.")
    mlps = []
    for index, block in enumerate(blocks):
        mlp = child_module(block, "mlp")
        if mlp is None:
            raise NotImplementedError(
                f"blocks.{index} has no mlp component; bridges whose blocks all have one are "
                "supported."
            )
        mlps.append(mlp)
    return mlps


def convert_bridge(
    bridge: Any,
    options: ConversionOptions | None = None,
    *,
    progress: bool = True,
) -> Any:
    """Make every MLP of a ``TransformerBridge`` run as neuron-heads, **in place**.

    The bridge is returned (the same object, the same class: no copy, no ``__class__`` swap).
    Weights are shared, not copied: each neuron-head layer calls the bridge's own projection
    components, whose parameters are the Hugging Face model's. The bridge's MLP hooks keep
    firing with the same values (``blocks.{l}.mlp.hook_pre``, ``hook_pre_linear``, ``hook_post``,
    ``hook_in``, ``hook_out``, ``blocks.{l}.hook_mlp_out``); the neuron-head hooks
    (``blocks.{l}.mlp.hook_q, hook_k, hook_v, hook_attn_scores, hook_pattern, hook_z,
    hook_result``) are added.

    Calling it again (e.g. after ``enable_compatibility_mode()``, which makes gated bridge MLPs
    compute themselves from processed weights) re-mounts every layer; a forward pass that would
    bypass the neuron-heads raises instead of silently running the original MLP.

    Args:
        bridge: A ``transformer_lens.model_bridge.TransformerBridge`` (TransformerLens 3.x or
            4.x).
        options: Conversion options (default :class:`~tl_attnonly.ConversionOptions`).
        progress: Show a progress bar over the layers.

    Returns:
        ``bridge``, converted.

    Raises:
        NotImplementedError, ValueError: Before anything is changed, for a layer that cannot be
            converted (named: a mixture of experts, an unsupported component or projection, an
            activation that is not SiLU, ReLU or GELU-family, a forward that is not the standard
            one).
    """
    options = options or ConversionOptions()
    mlps = _mlp_bridges(bridge)
    plans = [_plan_layer(index, mlp, options) for index, mlp in enumerate(mlps)]
    layers = [_build(plan, options) for plan in plans]
    for plan, layer in zip(plans, layers):
        _self_check(plan, layer)
    for plan, layer in tqdm(
        list(zip(plans, layers)), desc="neuron-heads", disable=not progress or len(plans) < 8
    ):
        _mount(bridge, plan, layer)
    names = [name for plan in plans for name in _hook_names(plan.layer, plan.mlp_bridge)]
    register_bridge_hooks(bridge, names)
    repair_z_layouts(bridge)  # multi-head latent attention: hook_z split into W_O's heads
    return bridge


def unconvert_bridge(bridge: Any) -> Any:
    """Undo :func:`convert_bridge` in place: every MLP runs its Hugging Face module again and the
    neuron-head hooks are gone. Returns ``bridge``."""
    names = []
    for index, mlp in enumerate(_mlp_bridges(bridge)):
        names += _hook_names(index, mlp)
        _unmount(mlp)
    unregister_bridge_hooks(bridge, names)
    restore_z_layouts(bridge)
    return bridge


def neuron_head_layers(bridge: Any) -> list[BridgeNeuronHeadLayer | BridgeNeuronHeadExperts]:
    """The neuron-head layer of every block of a converted bridge, in order (a mixture of
    experts: its :class:`~tl_attnonly.bridge.experts.BridgeNeuronHeadExperts`).

    Raises:
        TypeError: If some MLP of ``bridge`` is not converted.
    """
    layers: list[BridgeNeuronHeadLayer | BridgeNeuronHeadExperts] = []
    for index, mlp in enumerate(_mlp_bridges(bridge)):
        experts = mounted_experts(mlp)
        if experts is not None:
            layers.append(experts)
            continue
        layer = mlp.original_component
        if not isinstance(layer, (BridgeNeuronHeadMLP, BridgeGatedNeuronHeadMLP)):
            raise TypeError(
                f"{_mlp_name(index)} is not converted: call tl_attnonly.convert(bridge) first."
            )
        layers.append(layer)
    return layers


def set_use_neuron_result(bridge: Any, use_neuron_result: bool) -> None:
    """Turn per-head results (``blocks.{l}.mlp.hook_result``) on or off in every layer of a
    converted bridge (like ``AttnOnlyTransformer.set_use_neuron_result``)."""
    for layer in neuron_head_layers(bridge):
        layer.use_neuron_result = use_neuron_result


def is_converted_bridge(model: object) -> bool:
    """Whether ``model`` is a TransformerBridge whose every MLP runs as neuron-heads."""
    from tl_attnonly._compat import is_transformer_bridge

    if not is_transformer_bridge(model):
        return False
    try:
        neuron_head_layers(model)
    except (TypeError, NotImplementedError):
        return False
    return True


__all__ = [
    "convert_bridge",
    "identify_activation",
    "is_converted_bridge",
    "neuron_head_layers",
    "set_use_neuron_result",
    "unconvert_bridge",
]
