"""Bridge MLP layouts other than a module ``out(act(in x))`` / ``down(act(gate x) * up x)`` whose
projections are its own attributes: how each is checked, built and compared.

:func:`plan_layout` is called by the conversion's planning (``convert._plan_layer``) for every
bridge MLP component; it dispatches on the component's class and the Hugging Face module's
structure, never on a model's name:

==============================================  =================================================
component / module                              layout
==============================================  =================================================
``JointGateUpMLPBridge`` (a fused gate/up       :class:`~tl_attnonly.bridge.joint.
projection: Phi-3, Phi-4, GLM, GLM-4)           BridgeJointGateUpNeuronHeadMLP`
containerless ``MLPBridge`` (``name=None``:      :class:`~tl_attnonly.bridge.containerless.
the projections live in the layer: BERT, OPT,   BridgeContainerlessNeuronHeadMLP`
XGLM)
a module whose ``forward(hidden_states,         :class:`~tl_attnonly.bridge.residual.
residual)`` adds the residual (MPT's            BridgeResidualNeuronHeadMLP`
``MLPBridge``, BLOOM's ``BloomMLPBridge``)
==============================================  =================================================

Everything else returns ``None`` (the conversion's standard path, or its refusal). A layout that
cannot be built is refused here, before anything is changed, naming the layer and why.

Each :class:`Layout` says how its layer is built and what the conversion's self-check compares
it with on random inputs (``reference``): the Hugging Face module where it is what the bridge
runs (MPT, BLOOM: with a random residual), else the bridge's own formula from its projection
components (fused gate/up: ``out(act(gate x) * in x)``, as ``JointGateUpMLPBridge.forward``;
containerless: ``out(act(in x))``, after checking in a run of the layer that its activation
module sits exactly there).

Activations are identified by value, as everywhere (:func:`~tl_attnonly.bridge.
identify_activation`); BLOOM's GELU (``bloom_gelu_forward``: ``gelu_new`` with ``sqrt(2 / pi)``
rounded to ``0.79788456``) differs from ``gelu_new`` by at most :data:`BLOOM_GELU_DEVIATION`-sized
amounts, which :func:`identify_activation_near` accepts up to :data:`NEAR_ACTIVATION_TOLERANCE`
and adds to the layer's bound (``activation_deviation``).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from tl_attnonly._compat import TL_ACTIVATIONS, child_module
from tl_attnonly.activations import NeuronHeadCoefficients
from tl_attnonly.bridge.containerless import BridgeContainerlessNeuronHeadMLP
from tl_attnonly.bridge.joint import JOINT_GATE_UP_BRIDGE, BridgeJointGateUpNeuronHeadMLP
from tl_attnonly.bridge.modules import tl_matrix
from tl_attnonly.bridge.residual import BridgeResidualNeuronHeadMLP
from tl_attnonly.bridge.sites import (
    ACTIVATION_ATTRIBUTES,
    CANDIDATE_ACTIVATIONS,
    activation_child,
    class_in_mro,
    eval_mode,
    identify_activation,
)

#: Largest ``max |act(x) - act_TL(x)|`` on ``|x| <= 20`` (float64) with which an activation is
#: taken as TransformerLens's ``act_TL``; far below every fitted head's error (>= 1e-7), far above
#: float64 rounding.
NEAR_ACTIVATION_TOLERANCE = 1e-8

#: ``JointGateUpMLPBridge.set_original_component``'s order of activation attribute names.
_JOINT_ACTIVATION_ATTRIBUTES = ("activation_fn", "act_fn", "act", "activation")

#: A module's own name for a layer: ``blocks.{index}.mlp``.
_Builder = Callable[[Any, NeuronHeadCoefficients], nn.Module]


@dataclasses.dataclass
class Layout:
    """How one non-standard bridge MLP is converted (recorded in the conversion's plan).

    Attributes:
        hf_mlp: The module the component wraps (set aside at mounting, put back by
            ``unconvert_bridge``): the Hugging Face MLP, or the whole layer (containerless).
        gated: Gated neuron-heads (a gate and an up projection).
        projections: The component's projections by role (for the record).
        act_fn: The TransformerLens name of the activation.
        activation_deviation: ``max |act - act_fn|`` on ``|x| <= 20`` (0 when exact).
        build: ``(cfg, coefficients) -> layer``.
        check_inputs: The self-check's arguments from its random hidden states.
        reference: What the layer must equal on them (within the heads' bound).
    """

    hf_mlp: Any
    gated: bool
    projections: dict[str, str]
    act_fn: str
    activation_deviation: float
    build: _Builder
    check_inputs: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    reference: Callable[..., torch.Tensor]


def _name(index: int) -> str:
    return f"blocks.{index}.mlp"


def identify_activation_near(fn: Any, what: str) -> tuple[str, float]:
    """The TransformerLens ``act_fn`` name of ``fn`` and its deviation from it.

    :func:`~tl_attnonly.bridge.sites.identify_activation` (within ``1e-12``: deviation 0); else the
    nearest of its candidates if ``max |fn - candidate|`` on ``|x| <= 20`` (float64, 200,001
    points) is at most :data:`NEAR_ACTIVATION_TOLERANCE`, with that maximum.

    Raises:
        ValueError: As :func:`~tl_attnonly.bridge.sites.identify_activation`, for an activation no
            candidate is near (named).
    """
    try:
        return identify_activation(fn, what), 0.0
    except ValueError as error:
        x = torch.linspace(-20, 20, 200001, dtype=torch.float64)
        try:
            with torch.no_grad():
                y = fn(x)
        except Exception:
            raise error from None
        deviation, name = min(
            (float((TL_ACTIVATIONS[n](x) - y).abs().max()), n) for n in CANDIDATE_ACTIVATIONS
        )
        if deviation <= NEAR_ACTIVATION_TOLERANCE:
            return name, deviation
        raise


def _refuse(index: int, module: Any, why: str) -> NotImplementedError:
    return NotImplementedError(
        f"{_name(index)} ({type(module).__name__}): {why}. This MLP is not supported; supported "
        "bridge MLPs: MLPBridge and GatedMLPBridge modules, JointGateUpMLPBridge (fused gate/up), "
        "containerless MLPs (BERT, OPT, XGLM) and MLPs that add the residual (MPT, BLOOM)."
    )


def _projection(index: int, mlp_bridge: Any, role: str) -> Any:
    """The component's ``role`` projection, refused unless it is an ``nn.Linear`` / ``Conv1D``."""
    projection = child_module(mlp_bridge, role)
    if projection is None or getattr(projection, "name", None) is None:
        raise _refuse(index, mlp_bridge, f"it has no '{role}' projection component")
    try:
        tl_matrix(projection, role)
    except NotImplementedError as err:
        raise NotImplementedError(f"{_name(index)} ({type(mlp_bridge).__name__}): {err}") from err
    return projection


def _activation(index: int, module: Any, names: tuple[str, ...]) -> tuple[str, Any, str, float]:
    """``module``'s activation: ``(attribute, function, act_fn, deviation)``."""
    found = activation_child(module, names)
    if found is None:
        raise _refuse(index, module, "cannot tell which of its attributes is the activation")
    attribute, fn = found
    act_fn, deviation = identify_activation_near(fn, f"{_name(index)} ({type(module).__name__})")
    return attribute, fn, act_fn, deviation


def _set_deviation(builder: _Builder, deviation: float) -> _Builder:
    def build(cfg: Any, coefficients: NeuronHeadCoefficients) -> nn.Module:
        layer: Any = builder(cfg, coefficients)
        #: ``max |act - act_fn|`` (added to the heads' bound: BLOOM's GELU is not gelu_new).
        layer.activation_deviation = deviation
        return layer

    return build


# ---------------------------------------------------------------------- fused gate/up
def _joint(index: int, mlp_bridge: Any, hf_mlp: Any) -> Layout:
    gate: Any = _projection(index, mlp_bridge, "gate")
    up: Any = _projection(index, mlp_bridge, "in")
    out: Any = _projection(index, mlp_bridge, "out")
    fused_name = str(getattr(mlp_bridge, "fused_attr", "gate_up_proj"))
    fused: Any = getattr(hf_mlp, fused_name, None)
    if not isinstance(fused, nn.Module):
        raise _refuse(index, hf_mlp, f"it has no fused projection '{fused_name}'")
    if id(getattr(hf_mlp, str(out.name), None)) != id(out):  # (not `is`: it narrows `out`)
        raise _refuse(index, hf_mlp, f"its '{out.name}' is not the bridge's 'out' projection")
    _, fn, act_fn, deviation = _activation(index, hf_mlp, _JOINT_ACTIVATION_ATTRIBUTES)

    def build(cfg: Any, coefficients: NeuronHeadCoefficients) -> nn.Module:
        return BridgeJointGateUpNeuronHeadMLP(
            mlp_bridge, fused_name, fused, str(out.name), cfg, coefficients
        )

    def reference(x: torch.Tensor) -> torch.Tensor:  # JointGateUpMLPBridge.forward's formula
        return out(fn(gate(x)) * up(x))

    return Layout(
        hf_mlp,
        True,
        {
            "gate": f"{fused_name} (first half)",
            "in": f"{fused_name} (second half)",
            "out": out.name,
        },
        act_fn,
        deviation,
        _set_deviation(build, deviation),
        lambda x: (x,),
        reference,
    )


# ---------------------------------------------------------------------- containerless
def _observe(index: int, layer: Any, up: Any, act: nn.Module, out: Any, attribute: str) -> None:
    """Run the Hugging Face ``layer`` once on random hidden states (eval mode, no gradients) and
    refuse unless ``act`` is called once, on the ``in`` projection's output, and its output is
    what the ``out`` projection gets."""
    weight = tl_matrix(up, "in")
    if weight.is_meta:
        return  # no values (the meta device stands in for another device in tests)
    seen: dict[str, list[Any]] = {"in": [], "act": [], "out": []}
    handles = [
        up.register_forward_hook(lambda m, a, o: seen["in"].append(o)),
        act.register_forward_hook(lambda m, a, o: seen["act"].append((a[0], o))),
        out.register_forward_pre_hook(lambda m, a: seen["out"].append(a[0])),
    ]
    generator = torch.Generator().manual_seed(index)
    x = torch.randn(1, 5, weight.shape[0], generator=generator, dtype=torch.float64)
    try:
        with torch.no_grad(), eval_mode(layer):
            layer(x.to(device=weight.device, dtype=weight.dtype))
    except Exception as err:
        raise _refuse(
            index,
            layer,
            "could not run the layer on hidden states alone to check where its MLP's activation "
            f"runs ({type(err).__name__}: {err})",
        ) from err
    finally:
        for handle in handles:
            handle.remove()
    ok = [len(seen[key]) for key in ("in", "act", "out")] == [1, 1, 1]
    if ok:
        [(act_in, act_out)], [up_out], [out_in] = seen["act"], seen["in"], seen["out"]
        ok = torch.equal(act_in, up_out) and torch.equal(out_in, act_out)
    if not ok:
        raise _refuse(
            index,
            layer,
            f"its activation '{attribute}' is not applied once, between the 'in' projection "
            f"({up.name}) and the 'out' projection ({out.name}): out(act(in x)) is not its MLP",
        )


def _containerless(index: int, mlp_bridge: Any, layer: Any) -> Layout:
    if child_module(mlp_bridge, "gate") is not None:
        raise _refuse(index, layer, "a containerless gated MLP (no module calls its projections)")
    up, out = [_projection(index, mlp_bridge, role) for role in ("in", "out")]
    for projection in (up, out):
        try:
            found = layer.get_submodule(str(projection.name)) is projection
        except AttributeError:
            found = False
        if not found:
            raise _refuse(index, layer, f"'{projection.name}' is not the bridge's projection")
    owner_path = str(up.name).rpartition(".")[0]
    owner = layer.get_submodule(owner_path) if owner_path else layer
    attribute, fn, act_fn, deviation = _activation(index, owner, ACTIVATION_ATTRIBUTES)
    if not isinstance(fn, nn.Module):
        raise _refuse(index, owner, f"its activation '{attribute}' is a function, not a module")
    _observe(index, layer, up, fn, out, attribute)

    def build(cfg: Any, coefficients: NeuronHeadCoefficients) -> nn.Module:
        return BridgeContainerlessNeuronHeadMLP(mlp_bridge, owner, attribute, cfg, coefficients)

    return Layout(
        layer,
        False,
        {"in": str(up.name), "out": str(out.name)},
        act_fn,
        deviation,
        _set_deviation(build, deviation),
        lambda x: (x,),
        lambda x: out(fn(up(x))),
    )


# ---------------------------------------------------------------------- residual inside
def _takes_residual(module: Any) -> bool:
    """Whether ``module.forward`` takes exactly two required positional arguments, the second
    called ``residual`` (``MptMLP``, ``BloomMLP``)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in parameters if p.kind in positional and p.default is p.empty]
    return len(required) == 2 and required[1].name == "residual"


def _residual(index: int, mlp_bridge: Any, hf_mlp: Any) -> Layout:
    if child_module(mlp_bridge, "gate") is not None:
        raise _refuse(index, hf_mlp, "a gated MLP that adds the residual")
    up, out = [_projection(index, mlp_bridge, role) for role in ("in", "out")]
    for projection in (up, out):
        if getattr(hf_mlp, str(projection.name), None) is not projection:
            raise _refuse(index, hf_mlp, f"'{projection.name}' is not the bridge's projection")
    _, _, act_fn, deviation = _activation(index, hf_mlp, ACTIVATION_ATTRIBUTES)
    dropout = getattr(hf_mlp, "hidden_dropout", 0.0)
    projections = {"in": str(up.name), "out": str(out.name)}

    def build(cfg: Any, coefficients: NeuronHeadCoefficients) -> nn.Module:
        layer = BridgeResidualNeuronHeadMLP(mlp_bridge, projections, cfg, coefficients)
        layer.hidden_dropout = float(dropout or 0.0)
        return layer

    def check_inputs(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(x.shape[-1])
        residual = torch.randn(x.shape, generator=generator, dtype=torch.float64)
        return x, residual.to(device=x.device, dtype=x.dtype)

    return Layout(
        hf_mlp,
        False,
        projections,
        act_fn,
        deviation,
        _set_deviation(build, deviation),
        check_inputs,
        hf_mlp,
    )


def plan_layout(index: int, mlp_bridge: Any, hf_mlp: Any) -> Layout | None:
    """The :class:`Layout` of ``blocks.{index}.mlp``, or ``None`` for the standard ones (a
    ``MLPBridge`` / ``GatedMLPBridge`` module whose projections are its attributes) and for
    components this module does not know (the conversion's own checks refuse them).

    Args:
        index: The block.
        mlp_bridge: Its MLP component.
        hf_mlp: The module the component wraps (set aside, if the bridge is converted already).

    Raises:
        NotImplementedError, ValueError: For a layout recognised here that cannot be converted
            (named, with the reason), before anything is changed.
    """
    if hf_mlp is None:
        return None
    if class_in_mro(mlp_bridge, JOINT_GATE_UP_BRIDGE) is not None:
        return _joint(index, mlp_bridge, hf_mlp)
    if class_in_mro(mlp_bridge, "MLPBridge") is not None and mlp_bridge.name is None:
        return _containerless(index, mlp_bridge, hf_mlp)
    if class_in_mro(mlp_bridge, "MLPBridge") is not None and _takes_residual(hf_mlp):
        return _residual(index, mlp_bridge, hf_mlp)
    return None


__all__ = ["NEAR_ACTIVATION_TOLERANCE", "Layout", "identify_activation_near", "plan_layout"]
