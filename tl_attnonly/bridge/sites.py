"""Neuron-head layers that run where the bridge does not call its MLP module.

The layers of :mod:`tl_attnonly.bridge.modules` replace the Hugging Face MLP module that a bridge
MLP component calls. Some bridge MLPs call no such module:

* TransformerLens's ``JointGateUpMLPBridge`` (Phi-3, GLM, GLM-4: a fused ``gate_up_proj``)
  computes ``out(act(gate x) * in x)`` itself, from its own projection components and the
  activation it took from the Hugging Face module (:mod:`tl_attnonly.bridge.joint`);
* a *containerless* ``MLPBridge`` (BERT, OPT, XGLM: the projections live in the decoder layer,
  with no MLP module around them) is never called: the Hugging Face layer calls the projections
  and its activation module itself (:mod:`tl_attnonly.bridge.containerless`).

There the neuron-head layer runs at the **activation site**: an :class:`ActivationSite` module
takes the place of the activation function (the Hugging Face module's, or the bridge's), so the
projections, their weights and every bridge hook stay as they are, and only the activation
between the projections runs as neuron-heads. :class:`OutputSiteMixin` delivers per-head result
edits (``hook_result``) to the ``out`` projection's output before its ``hook_out`` fires, so
``blocks.{l}.hook_mlp_out`` (which several adapters alias to ``mlp.out.hook_out``) sees them.

Nothing here patches a forward or swaps a class: the site is a submodule in the slot TL or Hugging
Face reads the activation from, and the edits reach the output through a torch forward pre-hook
on a hook point, both removed by :func:`tl_attnonly.bridge.unconvert_bridge`.

Also here, shared by the conversion (:mod:`tl_attnonly.bridge.convert`) and the layouts
(:mod:`tl_attnonly.bridge.layouts`): where a Hugging Face module keeps its activation
(:data:`ACTIVATION_ATTRIBUTES`, :func:`activation_child`), which activation it is, by value
(:func:`identify_activation`), and :func:`eval_mode` for the checks that run a module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from jaxtyping import Float

from tl_attnonly._compat import TL_ACTIVATIONS, has_hooks

#: Attribute names under which Hugging Face MLPs keep their activation function.
ACTIVATION_ATTRIBUTES = ("act_fn", "act", "activation_fn", "activation", "act_func")

#: TransformerLens ``act_fn`` names tried, in this order, against an MLP's activation function.
CANDIDATE_ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu")


def identify_activation(fn: Any, what: str) -> str:
    """The TransformerLens ``act_fn`` name of a Hugging Face activation function, by value.

    The function is evaluated in float64 on ``[-20, 20]`` and compared with TransformerLens's
    functions (``silu``, ``gelu``, ``gelu_new``, ...); the first within ``1e-12`` is its name. So a
    renamed class or a config that names one activation and runs another cannot mislead the
    conversion.

    Raises:
        ValueError: For an activation that is none of the supported ones (named).
    """
    x = torch.linspace(-20, 20, 4001, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = fn(x)
    except Exception as error:  # e.g. a module with float32 parameters
        raise ValueError(f"{what}: could not evaluate its activation {fn!r}: {error}") from error
    for name in CANDIDATE_ACTIVATIONS:
        reference = TL_ACTIVATIONS[name](x)
        if torch.allclose(y, reference, rtol=0, atol=1e-12):
            return name
    raise ValueError(
        f"{what}: its activation {type(fn).__name__} is not one neuron-heads can represent. "
        f"Supported: SiLU (exact), ReLU, and the GELU family ({', '.join(CANDIDATE_ACTIVATIONS)})."
    )


@contextlib.contextmanager
def eval_mode(*roots: nn.Module) -> Iterator[None]:
    """Every module under ``roots`` in eval mode (no dropout) inside, each back in its own mode
    after."""
    modes = {module: module.training for root in roots for module in root.modules()}
    for root in roots:
        root.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


class ActivationSite(nn.Module):
    """Stands in the slot where a module keeps its activation function; calling it runs the
    neuron-head layer's :meth:`activation_step` on the pre-activations.

    The layer is held as a plain attribute, not a submodule: it is registered once, as the bridge
    component's wrapped module, so the module tree has no cycle and no duplicate.

    Args:
        layer: The neuron-head layer (with an ``activation_step`` method).
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.__dict__["layer"] = layer

    def forward(self, x: Float[torch.Tensor, "... d_mlp"]) -> torch.Tensor:
        layer: Any = self.__dict__["layer"]
        return layer.activation_step(x)

    def extra_repr(self) -> str:
        return f"neuron-heads of {type(self.layer).__name__}"


class OutputSiteMixin:
    """Per-head result edits that reach the MLP's output through the ``out`` projection's
    ``hook_out``. A mixin of the bridge neuron-head layers.

    With ``use_neuron_result``, ``hook_result`` fires on ``z * W_O`` (``[batch, pos,
    n_neuron_heads, d_model]``); an edit of it (hooked minus unhooked, summed over the heads) is
    added to the ``out`` projection's output by a forward pre-hook on its ``hook_out``
    (:meth:`output_hooks`, mounted with the layer), before any hook there sees it.
    """

    #: The edit of the per-head results waiting for the ``out`` projection (``None``: none).
    _pending: torch.Tensor | None = None

    def _result_edit(
        self: Any, z: Float[torch.Tensor, "batch pos n_neuron_heads 1"] | None
    ) -> Float[torch.Tensor, "batch pos d_model"] | None:
        """Fire ``hook_result`` (with ``use_neuron_result``); the edit of the results, summed over
        the heads, or ``None`` when nothing can have changed them."""
        if z is None or not self.use_neuron_result:
            return None
        result = z * self.W_O.squeeze(1)  # [batch, pos, n_neuron_heads, d_model]
        if not has_hooks(self.hook_result):
            self.hook_result(result)
            return None
        before = result.clone()
        return (self.hook_result(result) - before).sum(-2)

    def _output(
        self: Any,
        post: Float[torch.Tensor, "batch pos d_mlp"],
        z: Float[torch.Tensor, "batch pos n_neuron_heads 1"] | None,
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        """The ``out`` projection of ``post`` (``hook_post`` and the projection's hooks fire);
        a result edit joins it before ``out.hook_out`` (or after, where no hook is mounted)."""
        self._pending = self._result_edit(z)
        out = self._projection("out")(post)
        if self._pending is not None:  # no pre-hook took it (the layer is not mounted)
            out = out + self._pending
            self._pending = None
        return out

    def _add_pending(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """Forward pre-hook on the ``out`` projection's ``hook_out``: add the pending result
        edit (reshaped to the projection's output: OPT's layers run on ``[batch * pos, ...]``)."""
        edit = self._pending
        if edit is None:
            return None
        self._pending = None
        return (args[0] + edit.reshape(args[0].shape), *args[1:])

    def output_hooks(self: Any) -> list[Any]:
        """Mount the result-edit pre-hook on the ``out`` projection's ``hook_out``; the torch
        handles (removed when the layer is unmounted)."""
        return [self._projection("out").hook_out.register_forward_pre_hook(self._add_pending)]


def class_in_mro(component: Any, name: str) -> type | None:
    """The class called ``name`` among ``component``'s classes (TransformerLens's bridge classes
    are matched by name, so neither TL version's module layout is imported)."""
    return next((cls for cls in type(component).__mro__ if cls.__name__ == name), None)


def activation_child(module: nn.Module, names: tuple[str, ...]) -> tuple[str, Any] | None:
    """Where ``module`` keeps its activation: the first of ``names`` that is a callable attribute,
    else its only child module with no parameters that is not a bridge component, a hook point or
    a dropout (BLOOM's ``gelu_impl``, BERT's ``intermediate_act_fn``); ``None`` if neither."""
    for name in names:
        fn = getattr(module, name, None)
        if callable(fn):
            return name, fn
    candidates = [
        (name, child)
        for name, child in module.named_children()
        if not any(True for _ in child.parameters())
        and not isinstance(child, nn.Dropout)
        and not hasattr(child, "original_component")  # a bridge component
        and type(child).__name__ != "HookPoint"
    ]
    return candidates[0] if len(candidates) == 1 else None


__all__ = [
    "ACTIVATION_ATTRIBUTES",
    "CANDIDATE_ACTIVATIONS",
    "ActivationSite",
    "OutputSiteMixin",
    "activation_child",
    "class_in_mro",
    "eval_mode",
    "identify_activation",
]
