"""What analysis reads of a block's MLP: the neuron-head layer protocol.

Every block's MLP says what kind of layer it is (:class:`MLPLayer`: converted, gated, a mixture
of experts); the analysis tools ask that, never the layer's class, and read a converted dense
layer's weights through :class:`NeuronHeadLayerView` (:class:`GatedNeuronHeadLayerView` and
:class:`PlainNeuronHeadLayerView` for what only one kind has). The component classes
(:class:`~tl_attnonly.NeuronHeadMLP`, :class:`~tl_attnonly.GatedNeuronHeadMLP`,
:class:`~tl_attnonly.NeuronHeadMoE`, the bridge's layers) implement it as they are; an unconverted
model's MLP is wrapped (:class:`UnconvertedMLP`). :attr:`tl_attnonly.protocol.Block.mlp` holds one
per block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from jaxtyping import Float

if TYPE_CHECKING:
    from tl_attnonly.activations import NeuronHeadCoefficients


@runtime_checkable
class MLPLayer(Protocol):
    """What every block's MLP says of itself, converted or not: which kind of layer it is.

    The analysis tools ask these, never the layer's class. A converted model's dense layer is a
    :class:`NeuronHeadLayerView` (:class:`GatedNeuronHeadLayerView` where :attr:`gated`), a
    mixture of experts an :class:`ExpertsLayerView`, an unconverted model's MLP (or a block
    without one) an :class:`UnconvertedMLP`.
    """

    @property
    def converted(self) -> bool:
        """Whether the MLP runs as neuron-heads (a neuron-head layer, or experts made of them)."""
        ...

    @property
    def gated(self) -> bool:
        """Whether it is a gated MLP (SwiGLU, GeGLU, ...: ``act(x W_gate) * (x W_in)``), whose
        neurons read the residual stream twice (a mixture of experts: its experts)."""
        ...

    @property
    def is_mixture_of_experts(self) -> bool:
        """Whether it routes each token to some of its experts (:class:`ExpertsLayerView`)."""
        ...


@runtime_checkable
class NeuronHeadLayerView(MLPLayer, Protocol):
    """One dense neuron-head layer as analysis reads it (TransformerLens shapes).

    ``n_neuron_heads = d_mlp * n_heads_per_neuron`` heads of internal dimension 1, head
    ``i * K + k`` the ``k``-th of neuron ``i``, each attending to the token itself and a bias
    token. Implemented by :class:`~tl_attnonly.NeuronHeadMLP`,
    :class:`~tl_attnonly.GatedNeuronHeadMLP` and the bridge's layers. The value weights depend on
    :attr:`gated`: a plain layer's are ``W_V`` / ``b_V`` (:class:`PlainNeuronHeadLayerView`); a
    gated head's value is bilinear in the residual, so a gated layer has the value per unit of
    its linear branch instead, and ``W_gate`` (:class:`GatedNeuronHeadLayerView`).
    """

    @property
    def d_mlp(self) -> int: ...
    @property
    def n_heads_per_neuron(self) -> int: ...
    @property
    def n_neuron_heads(self) -> int: ...

    @property
    def coefficients(self) -> NeuronHeadCoefficients:
        """The per-head coefficients ``(b, d, f, e, g)`` (see :mod:`tl_attnonly.activations`)."""
        ...

    def coefficient_tensors(self, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(b, d, f, e, g)``, each ``[K]``, as tensors in ``like``'s dtype and device."""
        ...

    def self_weight(self, pre: torch.Tensor) -> torch.Tensor:
        """Each neuron's first head's weight on itself from ``hook_pre``, elementwise."""
        ...

    @property
    def use_neuron_result(self) -> bool:
        """Whether the layer computes and hooks per-head results (``hook_result``)."""
        ...

    @property
    def W_in(self) -> Float[torch.Tensor, "d_model d_mlp"]:
        """What each neuron reads (a gated layer: its linear branch ``u``)."""
        ...

    @property
    def b_in(self) -> Float[torch.Tensor, " d_mlp"]: ...
    @property
    def W_out(self) -> Float[torch.Tensor, "d_mlp d_model"]: ...
    @property
    def b_out(self) -> Float[torch.Tensor, " d_model"]: ...

    @property
    def out_matrix(self) -> Float[torch.Tensor, "d_mlp d_model"]:
        """Row ``i``: what neuron ``i`` writes per unit of ``hook_post``."""
        ...

    @property
    def b_post(self) -> Float[torch.Tensor, " d_mlp"]:
        """What ``hook_post`` adds to the sum of each neuron's head outputs."""
        ...

    @property
    def W_Q(self) -> Float[torch.Tensor, "n_neuron_heads d_model 1"]: ...
    @property
    def b_Q(self) -> Float[torch.Tensor, "n_neuron_heads 1"]: ...
    @property
    def W_K(self) -> Float[torch.Tensor, "n_neuron_heads d_model 1"]: ...
    @property
    def b_K(self) -> Float[torch.Tensor, "n_neuron_heads 1"]: ...
    @property
    def W_O(self) -> Float[torch.Tensor, "n_neuron_heads 1 d_model"]: ...

    @property
    def b_O(self) -> Float[torch.Tensor, " d_model"]:
        """The layer's output bias: ``out = sum_h result[h] + b_O``."""
        ...


class PlainNeuronHeadLayerView(NeuronHeadLayerView, Protocol):
    """A plain (not :attr:`~MLPLayer.gated`) neuron-head layer: its heads' values are linear.

    Not runtime-checkable: on Python 3.10 and 3.11 ``isinstance`` reads every member, and a gated
    layer's ``W_V`` refuses with a ``TypeError``. Ask :attr:`~MLPLayer.gated` instead.
    """

    @property
    def W_V(self) -> Float[torch.Tensor, "n_neuron_heads d_model 1"]: ...
    @property
    def b_V(self) -> Float[torch.Tensor, "n_neuron_heads 1"]: ...


@runtime_checkable
class GatedNeuronHeadLayerView(NeuronHeadLayerView, Protocol):
    """A gated neuron-head layer (:attr:`~MLPLayer.gated`): queries read the gate ``g = x W_gate``,
    values are ``(f_k g + e_k - g_k) * u`` with ``u = x W_in``."""

    @property
    def W_gate(self) -> Float[torch.Tensor, "d_model d_mlp"]: ...

    @property
    def W_V_per_unit_u(self) -> Float[torch.Tensor, "n_neuron_heads d_model 1"]:
        """Value weights per unit of the linear branch ``u``."""
        ...

    @property
    def b_V_per_unit_u(self) -> Float[torch.Tensor, "n_neuron_heads 1"]: ...


@runtime_checkable
class ExpertsLayerView(MLPLayer, Protocol):
    """A converted mixture of experts (:attr:`~MLPLayer.is_mixture_of_experts`): routed experts,
    each a gated neuron-head layer that sees only the tokens routed to it.
    Implemented by :class:`~tl_attnonly.NeuronHeadMoE` and the bridge's experts; read by
    :mod:`tl_attnonly.analysis.experts`. :attr:`tl_attnonly.protocol.Block.mlp` holds it as an
    :class:`ExpertsMLP`, which refuses the dense members by name (:func:`experts_refusal`)."""

    @property
    def coefficients(self) -> NeuronHeadCoefficients:
        """The per-head coefficients every expert's neurons use."""
        ...

    @property
    def n_heads_per_neuron(self) -> int: ...

    @property
    def n_neuron_heads(self) -> int:
        """Neuron-heads per expert."""
        ...

    @property
    def use_neuron_result(self) -> bool: ...

    def expert_list(self) -> list[Any]:
        """The routed experts, in order: gated neuron-head layers (:class:`MLPLayer`), their
        weights as the experts hold them (TransformerLens's: ``nn.Linear`` without biases)."""
        ...


#: A converted block's MLP: a dense neuron-head layer, or a mixture of experts.
ConvertedMLP = NeuronHeadLayerView | ExpertsLayerView

#: What runs on a model with mixtures of experts (the message of :func:`experts_refusal`).
EXPERT_TOOLS = (
    "attention heads as on a dense model (get_act_patch_all_heads and get_act_patch_outputs "
    "with attention heads, TransformerLens's transformer_lens.patching head sweeps, "
    "neuron_head_attention_view of the attention heads); head_logit_attrs and "
    "decompose_resid_heads, an expert layer's rows its experts' weighted contributions; "
    "discover_circuit on a converted bridge (each expert layer one node L{l}MLP), "
    "composition_scores, the HTML report and summarize_neuron_heads (an expert layer's heads "
    "its experts', each over the tokens routed to it); the "
    "expert layers through tl_attnonly.analysis.experts: "
    "decompose_resid_experts and expert_logit_attrs (each expert's weighted contribution, shared "
    "experts as their own components), experts_used (the experts each token was routed to), "
    "get_act_patch_experts (whole experts), get_act_patch_expert_neuron_heads, "
    "summarize_expert_neuron_heads, expert_activation; and "
    "the experts' hooks (blocks.{l}.mlp.experts.{e}.hook_z, ...; the router: "
    "blocks.{l}.mlp.hook_expert_indices, blocks.{l}.mlp.hook_routing_weights)"
)


class ExpertsRefusal(NotImplementedError, AttributeError):
    """A dense layer's member read of a mixture of experts (:class:`ExpertsMLP`): a
    ``NotImplementedError`` with directions, and an ``AttributeError`` (the layer has no such
    member: ``hasattr`` is false)."""


def experts_refusal(layer: int | str, what: str, kind: str | None = None) -> ExpertsRefusal:
    """The error of a tool that needs a dense neuron-head layer where ``layer`` is a mixture of
    experts: what is wrong and :data:`EXPERT_TOOLS`.

    Args:
        layer: The layer's index (or its hook prefix).
        what: What needs the dense layer (the tool, or the member read).
        kind: The layer's class name, for the message (``BridgeNeuronHeadExperts``, ...).
    """
    where = f"blocks.{layer}.mlp" if isinstance(layer, int) else layer
    kind = "" if kind is None else f" ({kind})"
    return ExpertsRefusal(
        f"{what} needs a dense neuron-head layer, but {where} is a mixture of experts{kind}: each "
        "expert sees only the tokens routed to it, so the layer has no per-neuron weights of its "
        f"own. What works on this model: {EXPERT_TOOLS}."
    )


def expert_layer_indices(mlps: Sequence[Any]) -> list[int]:
    """The indices of the mixtures of experts among a model's blocks' MLPs (``[block.mlp for
    block in model.blocks]``)."""
    return [i for i, mlp in enumerate(mlps) if getattr(mlp, "is_mixture_of_experts", False)]


def refuse_expert_layers(mlps: Sequence[Any], layers: Iterable[int] | None, what: str) -> None:
    """Refuse ``what`` (before any work) where one of ``layers`` (``None``: every layer) is a
    mixture of experts, with :func:`experts_refusal`'s directions.

    Args:
        mlps: The blocks' MLPs (``[block.mlp for block in model.blocks]``).
        layers: The layers ``what`` would read.
        what: The tool, for the message.

    Raises:
        ExpertsRefusal: A ``NotImplementedError``, naming the first such layer.
    """
    experts = set(expert_layer_indices(mlps))
    wanted = range(len(mlps)) if layers is None else layers
    for layer in wanted:
        if int(layer) in experts:
            mlp = mlps[int(layer)]
            raise experts_refusal(int(layer), what, type(getattr(mlp, "module", mlp)).__name__)


class ExpertsMLP:
    """A mixture of experts as :attr:`tl_attnonly.protocol.Block.mlp` holds it: the
    :class:`ExpertsLayerView` members (experts, shared experts, coefficients, flags) read from
    the layer itself; a dense layer's members (``W_in``, ``W_O``, ``b_O``, ``d_mlp``, ...) refuse
    with :func:`experts_refusal`, so that a tool written for dense layers stops with directions
    instead of reading something else.

    Args:
        layer: The experts container (:class:`ExpertsLayerView`).
        index: The block's index (for messages).
    """

    converted = True
    is_mixture_of_experts = True
    #: The members of a dense neuron-head layer that a mixture of experts has none of.
    DENSE_MEMBERS = frozenset(
        {
            "W_in", "b_in", "W_out", "b_out", "out_matrix", "b_post", "W_Q", "b_Q", "W_K", "b_K",
            "W_V", "b_V", "W_O", "b_O", "W_gate", "W_V_per_unit_u", "b_V_per_unit_u", "d_mlp",
            "coefficient_tensors",
        }
    )  # fmt: skip

    def __init__(self, layer: Any, index: int):
        self.__dict__["layer"] = layer
        self.__dict__["index"] = index

    @property
    def module(self) -> Any:
        """The experts container itself."""
        return self.__dict__["layer"]

    def __getattr__(self, name: str) -> Any:
        if name in ExpertsMLP.DENSE_MEMBERS:
            kind = type(self.__dict__["layer"]).__name__
            raise experts_refusal(self.__dict__["index"], f"Reading {name!r}", kind)
        return getattr(self.__dict__["layer"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.__dict__["layer"], name, value)

    def __repr__(self) -> str:
        return f"ExpertsMLP({type(self.__dict__['layer']).__name__})"


class UnconvertedMLP:
    """The MLP of a block that does not run as neuron-heads, as
    :attr:`tl_attnonly.protocol.Block.mlp` holds it: an unconverted model's (the tools that need
    no neuron-heads take those), or a block without an MLP (``module`` ``None``). It says the
    :class:`MLPLayer` facts (:attr:`converted` false) and has no neuron-head weights: reading one
    raises ``AttributeError``.

    Args:
        module: The model's own MLP module (``None``: the block has none).
        gated: Whether it is a gated MLP (the model's ``cfg.gated_mlp``).
        is_mixture_of_experts: Whether it routes tokens to experts.
    """

    converted = False

    def __init__(self, module: Any, gated: bool, is_mixture_of_experts: bool = False):
        self.module = module
        self.gated = gated
        self.is_mixture_of_experts = is_mixture_of_experts

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not set above: the neuron-head members of NeuronHeadLayerView.
        module = type(self.__dict__.get("module")).__name__
        raise AttributeError(
            f"This {module} does not run as neuron-heads, so it has no {name!r}: convert the "
            "model first (tl_attnonly.convert(model))."
        )

    def __repr__(self) -> str:
        return f"UnconvertedMLP({type(self.module).__name__}, gated={self.gated})"


__all__ = [
    "EXPERT_TOOLS",
    "ConvertedMLP",
    "ExpertsLayerView",
    "ExpertsMLP",
    "ExpertsRefusal",
    "GatedNeuronHeadLayerView",
    "MLPLayer",
    "NeuronHeadLayerView",
    "PlainNeuronHeadLayerView",
    "UnconvertedMLP",
    "expert_layer_indices",
    "experts_refusal",
    "refuse_expert_layers",
]
