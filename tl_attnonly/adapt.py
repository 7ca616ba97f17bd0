"""The one door from a model to the analysis tools: :func:`analysis_model` picks the adapter.

:mod:`tl_attnonly.protocol` says what the tools read; the two adapters implement it
(:class:`~tl_attnonly.hooked.adapter.HookedAdapter`, :class:`~tl_attnonly.bridge.adapter.
BridgeAdapter`). This module only chooses between them and refuses, with directions, what neither
takes.
"""

from __future__ import annotations

from typing import Any

from tl_attnonly._compat import is_transformer_bridge
from tl_attnonly.bridge.adapter import BridgeAdapter
from tl_attnonly.hooked.adapter import HookedAdapter
from tl_attnonly.protocol import AttnOnlyModel, ModelLike


def analysis_model(
    model: Any, *, neuron_heads: bool = True, allow_experts: bool = False
) -> AttnOnlyModel:
    """``model`` as the analysis tools read it: an :class:`AttnOnlyModel`.

    Accepts an adapter (returned as is), an :class:`~tl_attnonly.AttnOnlyTransformer` /
    :class:`~tl_attnonly.AttnOnlyEncoder`, a ``TransformerBridge`` converted with
    :func:`tl_attnonly.convert`, and, with ``neuron_heads=False``, an unconverted
    ``HookedTransformer`` or bridge. Mixtures of experts are accepted, converted or not: their
    attention heads are read as a dense model's, and a converted expert layer is an
    :class:`~tl_attnonly.mlp_protocol.ExpertsMLP` at ``blocks[l].mlp``, whose dense members
    (``W_in``, ``W_O``, ...) refuse with directions; a tool that needs them refuses before any
    work (:func:`tl_attnonly.mlp_protocol.experts_refusal`).

    Args:
        model: The model (or an adapter).
        neuron_heads: Refuse a model without structured neuron-heads (the default).
        allow_experts: Ignored (kept for callers that pass it): mixtures of experts are always
            accepted.

    Raises:
        TypeError: For anything else, or a model that is not converted, saying what to do.
    """
    if isinstance(model, (HookedAdapter, BridgeAdapter)):
        adapted: AttnOnlyModel = model
    elif getattr(model, "is_literal_form", False):
        raise TypeError(
            "The analysis tools work on the structured form; a LiteralTransformer has no "
            "structured neuron-heads. Analyse tl_attnonly.convert(model) instead, or use the "
            "literal model's hooks (same names: blocks.{l}.mlp.hook_pattern, ...) with "
            "run_with_cache / run_with_hooks and the tl_attnonly.hooks presets."
        )
    elif is_transformer_bridge(model):
        adapted = BridgeAdapter(model)
    elif _is_hooked_root(model):
        adapted = HookedAdapter(model)
    else:
        raise TypeError(
            f"Expected a TransformerLens model (AttnOnlyTransformer, AttnOnlyEncoder, a "
            f"TransformerBridge converted with tl_attnonly.convert) or an ActivationCache of one, "
            f"got {type(model).__name__}."
        )
    if neuron_heads:
        _require_neuron_heads(adapted, allow_experts=True)
    return adapted


def model_of_cache(
    cache: Any, *, neuron_heads: bool = True, allow_experts: bool = False
) -> AttnOnlyModel:
    """The :func:`analysis_model` of the model whose ``run_with_cache`` made ``cache``.

    Raises:
        TypeError: If ``cache`` is not a TransformerLens ``ActivationCache`` (it has no model).
    """
    model = getattr(cache, "model", None)
    if model is None:
        raise TypeError(
            f"Expected a transformer_lens ActivationCache from run_with_cache, got "
            f"{type(cache).__name__}."
        )
    return analysis_model(model, neuron_heads=neuron_heads, allow_experts=allow_experts)


def _require_neuron_heads(model: AttnOnlyModel, allow_experts: bool = False) -> None:
    if not model.is_converted:
        raise TypeError(
            f"This {model.kind} has no neuron-heads: convert it first (tl_attnonly.convert(model)"
            + (", in place for a bridge" if model.kind == "TransformerBridge" else "")
            + ") and use the converted model (and its caches)."
        )
    if not allow_experts:
        _refuse_experts(model.neuron_heads)


def _bridge_layers(bridge: Any) -> list[Any]:
    """A converted bridge's neuron-head layers (none for an unconverted one)."""
    from tl_attnonly.bridge.convert import is_converted_bridge, neuron_head_layers

    return list(neuron_head_layers(bridge)) if is_converted_bridge(bridge) else []


def _refuse_experts(layers: list[Any]) -> None:
    """Refuse the first mixture-of-experts layer (``NeuronHeadMoE``, a bridge's
    ``BridgeNeuronHeadExperts``), by name."""
    for index, layer in enumerate(layers):
        if getattr(layer, "is_mixture_of_experts", False):
            raise NotImplementedError(
                f"blocks.{index}.mlp is a mixture of experts ({type(layer).__name__}): the "
                "analysis tools work on dense neuron-head layers, and an expert sees only the "
                "tokens routed to it. For experts use tl_attnonly.analysis.experts "
                "(expert_activation, get_act_patch_expert_neuron_heads, "
                "summarize_expert_neuron_heads), or the experts' hooks "
                "(blocks.{l}.mlp.experts.{e}.hook_pattern, hook_z, ...; router: "
                "blocks.{l}.mlp.hook_expert_weights / hook_expert_indices) with run_with_cache / "
                "run_with_hooks."
            )


def _is_hooked_root(model: object) -> bool:
    """A TransformerLens ``HookedTransformer`` / ``HookedEncoder`` (3.x), by its classes."""
    return any(
        cls.__name__ in ("HookedTransformer", "HookedEncoder")
        and cls.__module__.startswith("transformer_lens.")
        for cls in type(model).__mro__
    )


def require_additive_residual(model: ModelLike, what: str) -> None:
    """Refuse ``what``, a tool that needs the residual stream to be a plain sum of its components,
    on a model that normalises the residual stream itself after each sublayer (a residual
    post-LN).

    A BERT-style encoder (``LN(resid + sublayer_out)``, embeddings through ``embed.ln``) or a
    decoder that normalises the residual stream itself after each sublayer (GPT-1, OPT's
    ``do_layer_norm_before=False``) rescales everything written before, so its residual stream
    is no plain sum of head results. In one run, with each norm's scale taken from that run, it is
    an exact sum of components carried through the later norms: that decomposition
    (:func:`tl_attnonly.analysis.decompose_resid_heads`, and on a decoder
    :func:`~tl_attnonly.analysis.head_logit_attrs`, see :mod:`tl_attnonly.analysis.post_norm`)
    does not call this. Those left to refuse: ``incl_remainder``, the experts' decomposition, the
    IOI roles' direct logit attribution. A decoder that normalises only each sublayer's *output*
    before adding it (Gemma 2/3's ``ln1_post`` / ``ln2_post``, OLMo 2/3) passes: in a run, that
    norm is linear in the sublayer's heads once its scale is the run's.

    Args:
        model: A model :func:`analysis_model` takes.
        what: The tool, for the message.

    Raises:
        NotImplementedError: Naming the model's kind and what works instead.
    """
    from tl_attnonly.analysis.post_norm import residual_post_norm

    model = analysis_model(model, neuron_heads=False)
    if not residual_post_norm(model):
        return
    if model.is_encoder:
        reason = (
            "a BERT-style encoder normalises the residual stream after every sublayer "
            "(LN(resid + attn_out), LN(resid_mid + mlp_out)) and after the embeddings"
        )
        dla = ""
    else:
        name = model.cfg.original_architecture or "post-LN"
        reason = (
            f"this model ({name}) normalises the residual stream itself after each sublayer "
            "(LN(resid + sublayer_out))"
        )
        dla = " and head_logit_attrs"
    raise NotImplementedError(
        f"{what} needs a residual stream that is a plain sum of head outputs, but {reason}, so "
        f"it is not one. What works: decompose_resid_heads{dla} (in one run each norm is affine "
        "with its scale from the run, so the stream is a sum of components carried through the "
        "later norms), per-head results (stack_all_head_results without incl_remainder, "
        "get_neuron_head_results), activation patching, and attribution_patch with a metric on "
        "the output (for sentence embeddings: metric_input=the final hidden states, "
        "patching_metric=pooled_cosine_metric(mask))."
    )


__all__ = ["analysis_model", "model_of_cache", "require_additive_residual"]
