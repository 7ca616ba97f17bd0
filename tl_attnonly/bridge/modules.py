"""Neuron-head layers that run a TransformerBridge's MLP in place of the Hugging Face module.

A ``TransformerBridge`` wraps each Hugging Face MLP (``LlamaMLP``, ``GPT2MLP``, ...) in a bridge
component (``MLPBridge`` / ``GatedMLPBridge``) whose forward calls the wrapped module, and wraps
the MLP's projections (``gate_proj``, ``up_proj``, ``down_proj``; GPT-2's ``c_fc``, ``c_proj``) in
``LinearBridge`` components that fire the MLP's hooks: ``hook_pre`` is the gate (or ``in``)
projection's output, ``hook_pre_linear`` the ``in`` (up) projection's output, ``hook_post`` the
``out`` (down) projection's input.

The modules here implement the Hugging Face MLP's forward contract (``hidden_states ->
hidden_states``) with the neuron-head maths of :class:`~tl_attnonly.NeuronHeadMLP` and
:class:`~tl_attnonly.GatedNeuronHeadMLP` (they *are* those classes, subclassed): they call the
bridge's own projection components, so the projections, their weights (shared, never copied) and
every bridge hook are the bridge's, and only the activation between them runs as neuron-heads,
through the hook points ``hook_q, hook_k, hook_v, hook_attn_scores, hook_pattern, hook_z,
hook_result``. :func:`tl_attnonly.bridge.convert_bridge` installs one per layer with the bridge's
``set_original_component``.

The weight properties (``W_in``, ``W_gate``, ``W_out``, ``b_in``, ``b_out`` and the derived
head weights ``W_Q``, ``W_V``, ``W_O``, ...) read the projections' current tensors, in
TransformerLens orientation (``W_in`` ``[d_model, d_mlp]``, ``W_out`` ``[d_mlp, d_model]``), so
they follow weight processing (``enable_compatibility_mode``) and edits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from jaxtyping import Float
from transformer_lens.hook_points import HookPoint

from tl_attnonly._compat import child_module, has_hooks
from tl_attnonly.activations import NeuronHeadCoefficients
from tl_attnonly.components.gated_neuron_heads import GatedNeuronHeadMLP
from tl_attnonly.components.neuron_heads import NeuronHeadMLP

#: The neuron-head hook points a bridge layer adds (``blocks.{l}.mlp.hook_{name}``).
BRIDGE_NEURON_HEAD_HOOKS = ("q", "k", "v", "attn_scores", "pattern", "z", "result")


def tl_matrix(projection: Any, what: str) -> torch.Tensor:
    """A bridge projection's weight in TransformerLens orientation ``[d_in, d_out]``.

    ``nn.Linear`` stores ``[out, in]`` (transposed here, a view); GPT-2's ``Conv1D`` stores
    ``[in, out]`` (returned as is).

    Args:
        projection: A bridge ``LinearBridge`` (or the module it wraps).
        what: Its name, for the error.

    Raises:
        NotImplementedError: For a projection that is neither (named).
    """
    module: Any = getattr(projection, "original_component", None) or projection
    if isinstance(module, nn.Linear):
        return module.weight.T
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight
    raise NotImplementedError(
        f"The MLP's {what} projection is a {type(module).__name__}; neuron-heads read nn.Linear "
        "or Conv1D (GPT-2) projections."
    )


def tl_bias(projection: Any, width: int, like: torch.Tensor) -> torch.Tensor:
    """A bridge projection's bias ``[d_out]``, or zeros (``width``) where it has none."""
    module = getattr(projection, "original_component", None) or projection
    bias = getattr(module, "bias", None)
    return bias if isinstance(bias, torch.Tensor) else like.new_zeros(width)


class _BridgeLayer:
    """What the plain and gated bridge layers share: the projections, the device and the
    per-head results path. A mixin of :class:`NeuronHeadBase` subclasses."""

    #: Marks a bridge's neuron-head layer for code that may not import this package
    #: (``tl_attnonly.adapt.analysis_model``).
    is_bridge_neuron_heads = True

    #: The projections, by the bridge's names (``gate``, ``in``, ``out``), as registered
    #: submodules under the Hugging Face names (so the module tree keeps its paths).
    _projection_names: dict[str, str]

    def __init__(
        self,
        mlp_bridge: nn.Module,
        projections: dict[str, str],
        cfg: Any,
        coefficients: NeuronHeadCoefficients,
    ):
        self._bridge_projections = {role: getattr(mlp_bridge, role) for role in projections}
        self._projection_names = dict(projections)
        super().__init__(cfg, coefficients)  # type: ignore[call-arg]

    def _init_parameters_and_hooks(self: Any) -> None:
        """No parameters (the bridge's projections hold them): the projections, registered
        under their Hugging Face names, and the neuron-head hook points."""
        for role, name in self._projection_names.items():
            self.add_module(name, self._bridge_projections[role])
        del self._bridge_projections
        self._add_neuron_head_hooks()
        #: Set by every forward pass (the bridge's bypass guard reads it).
        self._ran = False

    def _projection(self, role: str) -> Any:
        return getattr(self, self._projection_names[role])

    def _add_neuron_head_hooks(self) -> None:
        self.hook_q = HookPoint()  # [batch, pos, n_neuron_heads, 1]
        self.hook_k = HookPoint()  # [batch, pos, n_neuron_heads, 1] (keys of the real tokens)
        self.hook_v = HookPoint()  # [batch, pos, n_neuron_heads, 1] (values of the real tokens)
        self.hook_attn_scores = HookPoint()  # [batch, n_neuron_heads, query_pos, 2] (self, bias)
        self.hook_pattern = HookPoint()  # [batch, n_neuron_heads, query_pos, 2] (self, bias)
        self.hook_z = HookPoint()  # [batch, pos, n_neuron_heads, 1]
        self.hook_result = HookPoint()  # [batch, pos, n_neuron_heads, d_model]

    @property
    def device(self) -> torch.device:
        """The device of the MLP's weights (where this layer computes)."""
        return self._projection("out").weight.device

    def _output(
        self: Any,
        post: Float[torch.Tensor, "batch pos d_mlp"],
        z: Float[torch.Tensor, "batch pos n_neuron_heads 1"] | None,
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        """The ``out`` projection of ``post`` (through the bridge, so ``hook_post`` and the
        projection's hooks fire); with ``use_neuron_result``, ``hook_result`` fires on the
        per-head results and an edit of them reaches the output."""
        out = self._projection("out")(post)
        dropout = child_module(self, "dropout")
        if dropout is not None:  # GPT-2's MLP: dropout(c_proj(...)), identity in eval mode
            out = dropout(out)
        if z is None or not self.use_neuron_result:
            return out
        # [batch, pos, n_neuron_heads, d_model] (an edit reaches the output; not dropped out)
        result = z * self.W_O.squeeze(1)
        if not has_hooks(self.hook_result):
            self.hook_result(result)
            return out
        before = result.clone()
        return out + (self.hook_result(result) - before).sum(-2)


class BridgeNeuronHeadMLP(_BridgeLayer, NeuronHeadMLP):
    """A plain Hugging Face MLP (``out(act(in(x)))``, e.g. GPT-2's) as neuron-heads.

    The maths and hook points of :class:`~tl_attnonly.NeuronHeadMLP`; the projections are the
    bridge's (``blocks.{l}.mlp.in`` / ``out``), whose hooks give ``hook_pre`` and ``hook_post``.

    Args:
        mlp_bridge: The bridge's MLP component (``bridge.blocks[l].mlp``).
        projections: Hugging Face attribute name of each projection: ``{"in": "c_fc", "out":
            "c_proj"}``.
        cfg: ``d_model``, ``d_mlp``, ``act_fn``, ``dtype`` of the layer.
        coefficients: Per-head coefficients of ``cfg.act_fn``.
    """

    @property
    def hook_pre(self) -> HookPoint:  # type: ignore[override]
        """The ``in`` projection's output hook (the bridge's ``blocks.{l}.mlp.hook_pre``)."""
        return self._projection("in").hook_out

    @property
    def hook_post(self) -> HookPoint:  # type: ignore[override]
        """The ``out`` projection's input hook (the bridge's ``blocks.{l}.mlp.hook_post``)."""
        return self._projection("out").hook_in

    @property
    def W_in(self) -> Float[torch.Tensor, "d_model d_mlp"]:  # type: ignore[override]
        return tl_matrix(self._projection("in"), "in")

    @property
    def W_out(self) -> Float[torch.Tensor, "d_mlp d_model"]:  # type: ignore[override]
        return tl_matrix(self._projection("out"), "out")

    @property
    def b_in(self) -> Float[torch.Tensor, " d_mlp"]:  # type: ignore[override]
        return tl_bias(self._projection("in"), self.d_mlp, self.W_in)

    @property
    def b_out(self) -> Float[torch.Tensor, " d_model"]:  # type: ignore[override]
        return tl_bias(self._projection("out"), self.cfg.d_model, self.W_out)

    def forward(  # type: ignore[override]
        self, hidden_states: Float[torch.Tensor, "batch pos d_model"], *args: Any, **kwargs: Any
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        self._ran = True
        pre = self._projection("in")(hidden_states)  # [batch, pos, d_mlp], fires hook_pre
        if not self._uses_head_path():
            return self._output(self._fused_post(pre), None)
        z = self._head_z(pre)
        return self._output(self._sum_heads(z), z)


class GatedWeightViews:
    """``W_gate``, ``W_in`` and ``W_out`` of a gated neuron-head layer whose weights live
    elsewhere (a bridge's projections, a grouped experts module): the subclass's
    ``_gate_matrix``, ``_linear_matrix`` and ``_out_matrix``, read on each access (no copy)."""

    @property
    def W_gate(self) -> Float[torch.Tensor, "d_model d_mlp"]:
        return self._gate_matrix  # type: ignore[attr-defined]

    @property
    def W_in(self) -> Float[torch.Tensor, "d_model d_mlp"]:
        return self._linear_matrix  # type: ignore[attr-defined]

    @property
    def W_out(self) -> Float[torch.Tensor, "d_mlp d_model"]:
        return self._out_matrix  # type: ignore[attr-defined]


class BridgeGatedNeuronHeadMLP(GatedWeightViews, _BridgeLayer, GatedNeuronHeadMLP):  # type: ignore[misc,override]
    """A gated Hugging Face MLP (``down(act(gate(x)) * up(x))``: Llama, Qwen2, Gemma, ...) as
    gated neuron-heads.

    The maths and hook points of :class:`~tl_attnonly.GatedNeuronHeadMLP`; the projections are
    the bridge's (``blocks.{l}.mlp.gate`` / ``in`` / ``out``), whose hooks give ``hook_pre``
    (gate), ``hook_pre_linear`` (up) and ``hook_post``. Projection biases (where a model has
    them) are inside ``hook_pre`` / ``hook_pre_linear``; nothing is added after the product
    (``b_post`` is zero).

    Args:
        mlp_bridge: The bridge's MLP component (``bridge.blocks[l].mlp``).
        projections: Hugging Face attribute name of each projection: ``{"gate": "gate_proj",
            "in": "up_proj", "out": "down_proj"}``.
        cfg: ``d_model``, ``d_mlp``, ``act_fn``, ``dtype`` of the layer.
        coefficients: Per-head coefficients of ``cfg.act_fn``.
    """

    @property
    def hook_pre(self) -> HookPoint:  # type: ignore[override]
        """The gate projection's output hook (the bridge's ``blocks.{l}.mlp.hook_pre``)."""
        return self._projection("gate").hook_out

    @property
    def hook_pre_linear(self) -> HookPoint:  # type: ignore[override]
        """The up projection's output hook (``blocks.{l}.mlp.hook_pre_linear``)."""
        return self._projection("in").hook_out

    @property
    def hook_post(self) -> HookPoint:  # type: ignore[override]
        """The down projection's input hook (the bridge's ``blocks.{l}.mlp.hook_post``)."""
        return self._projection("out").hook_in

    @property
    def _gate_matrix(self) -> Float[torch.Tensor, "d_model d_mlp"]:
        return tl_matrix(self._projection("gate"), "gate")

    @property
    def _linear_matrix(self) -> Float[torch.Tensor, "d_model d_mlp"]:
        return tl_matrix(self._projection("in"), "in")

    @property
    def _out_matrix(self) -> Float[torch.Tensor, "d_mlp d_model"]:
        return tl_matrix(self._projection("out"), "out")

    @property
    def b_in(self) -> Float[torch.Tensor, " d_mlp"]:  # type: ignore[override]
        """Zero: a Hugging Face gated MLP adds nothing after the product (TL's ``b_in``)."""
        return self._out_matrix.new_zeros(self.d_mlp)

    @property
    def b_out(self) -> Float[torch.Tensor, " d_model"]:  # type: ignore[override]
        return tl_bias(self._projection("out"), self.cfg.d_model, self._out_matrix)

    @property
    def b_Q(self) -> Float[torch.Tensor, "n_neuron_heads 1"]:
        """Query biases: ``b_k * b_gate[i] + d_k`` (``b_gate`` zero where the gate has no
        bias)."""
        b_gate = tl_bias(self._projection("gate"), self.d_mlp, self._gate_matrix)
        b, d = self._coefs(self._gate_matrix)[:2]
        return (b_gate.unsqueeze(-1) * b + d).flatten().unsqueeze(-1)

    def forward(  # type: ignore[override]
        self, hidden_states: Float[torch.Tensor, "batch pos d_model"], *args: Any, **kwargs: Any
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        self._ran = True
        gate = self._projection("gate")(hidden_states)  # [batch, pos, d_mlp], fires hook_pre
        linear = self._projection("in")(hidden_states)  # [batch, pos, d_mlp], hook_pre_linear
        if not self._uses_head_path():
            return self._output(self._fused_sum(gate, linear), None)
        z = self._head_z(gate, linear)
        return self._output(self._sum_heads(z), z)


#: A neuron-head layer mounted in a bridge.
BridgeNeuronHeadLayer = BridgeNeuronHeadMLP | BridgeGatedNeuronHeadMLP


__all__ = [
    "BRIDGE_NEURON_HEAD_HOOKS",
    "BridgeGatedNeuronHeadMLP",
    "BridgeNeuronHeadLayer",
    "BridgeNeuronHeadMLP",
    "tl_matrix",
    "tl_bias",
]
