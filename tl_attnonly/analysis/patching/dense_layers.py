"""Which layers' neuron-heads the dense patching tools reach on a model with mixtures of experts.

A mixture-of-experts layer has no dense neuron-heads (``blocks.{l}.mlp.hook_z``): each expert's
neuron-heads see only the tokens routed to it (:mod:`tl_attnonly.analysis.experts`).
:func:`~tl_attnonly.analysis.get_act_patch_neuron_heads` sweeps an expert layer through its
experts (:mod:`~tl_attnonly.analysis.patching.expert_sweeps`). The dense sweeps
(:func:`~tl_attnonly.analysis.get_act_patch_all_heads`,
:func:`~tl_attnonly.analysis.get_act_patch_outputs`,
:func:`~tl_attnonly.analysis.attribution_patch`) therefore sweep, by default, every attention
head and the neuron-heads of the dense layers only (DeepSeek's first layers; none in Mixtral);
naming an expert layer's neuron-head refuses before any work, with directions
(:func:`~tl_attnonly.mlp_protocol.experts_refusal`). Expert neuron-heads are patched by
:func:`~tl_attnonly.analysis.experts.get_act_patch_expert_neuron_heads`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tl_attnonly._types import Kinds
from tl_attnonly.hooks import HeadRef, all_head_refs
from tl_attnonly.mlp_protocol import expert_layer_indices, refuse_expert_layers
from tl_attnonly.protocol import AttnOnlyModel


def expert_layers(model: AttnOnlyModel) -> set[int]:
    """The layers of ``model`` whose MLP is a mixture of experts."""
    return set(expert_layer_indices([block.mlp for block in model.blocks]))


def dense_neuron_layers(model: AttnOnlyModel, layers: Iterable[int] | None, what: str) -> list[int]:
    """The layers whose dense neuron-heads ``what`` sweeps: ``layers`` (refused where one is a
    mixture of experts), or by default every layer that is not one.

    Raises:
        NotImplementedError: For a named expert layer, or (default) a model whose every layer is
            a mixture of experts; the message names what works.
    """
    mlps = [block.mlp for block in model.blocks]
    if layers is not None:
        chosen = [int(layer) for layer in layers]
        refuse_expert_layers(mlps, chosen, what)
        return chosen
    experts = expert_layers(model)
    dense = [layer for layer in range(model.cfg.n_layers) if layer not in experts]
    if not dense and experts:
        refuse_expert_layers(mlps, None, what)
    return dense


def head_refs(model: AttnOnlyModel, kinds: Kinds = ("attn", "neuron")) -> list[HeadRef]:
    """Every head the dense sweeps take by default: :func:`~tl_attnonly.hooks.all_head_refs`
    (attention heads first), without the neuron-heads of mixture-of-experts layers."""
    experts = expert_layers(model)
    refs = all_head_refs(model, kinds=kinds)
    return [ref for ref in refs if ref.kind == "attn" or ref.layer not in experts]


def refuse_expert_refs(model: AttnOnlyModel, refs: Sequence[HeadRef], what: str) -> None:
    """Refuse (before any work) neuron-heads named in a mixture-of-experts layer."""
    mlps = [block.mlp for block in model.blocks]
    refuse_expert_layers(mlps, [ref.layer for ref in refs if ref.kind == "neuron"], what)


def refuse_path_patching_experts(model: AttnOnlyModel, what: str) -> None:
    """Refuse path patching (before any work) on a model with mixtures of experts: a path patch
    freezes every head but the senders at its corrupted value, through the dense neuron-heads'
    ``hook_z``, which an expert layer does not have."""
    mlps = [block.mlp for block in model.blocks]
    refuse_expert_layers(mlps, None, f"{what} (path patching freezes every neuron-head's z)")


__all__ = [
    "dense_neuron_layers",
    "expert_layers",
    "head_refs",
    "refuse_expert_refs",
    "refuse_path_patching_experts",
]
