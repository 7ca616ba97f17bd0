"""What the analysis tools read of a model: one small, typed interface, two adapters.

``tl_attnonly.analysis``, ``tl_attnonly.vis`` and the report never look at a model's class. They
call :func:`tl_attnonly.adapt.analysis_model` once, at their entry, and read everything through the
:class:`AttnOnlyModel` it returns (in the spirit of TransformerLens 4's
``transformer_lens.model_protocol``):

==============================  ==================================================================
``cfg``                         :class:`ModelFacts`: TransformerLens's config names for the few
                                facts analysis reads (sizes, positions, norms, parallel blocks)
``blocks[l]``                   :class:`Block`: ``attn`` (:class:`AttentionWeights`, TL shapes),
                                ``mlp`` (:class:`NeuronHeadLayerView`; every MLP says through
                                :class:`MLPLayer` whether it is converted, gated, experts),
                                ``ln1`` / ``ln2`` (:class:`Norm` or ``None``), the
                                sublayers' output norms ``ln1_post`` / ``ln2_post``
``ln_final``                    :class:`Norm` or ``None``
``embed_norm``                  the norm of the summed embeddings (BERT's), or ``None``
``W_E``, ``W_U``, ``b_U``       embedding and unembedding, TransformerLens orientation
``neuron_heads``                one neuron-head layer per block (:class:`NeuronHeadLayerView`;
                                a mixture of experts: :class:`ExpertsLayerView`)
``run_with_hooks`` / ``...``    the model's own ``__call__``, ``run_with_hooks``,
                                ``run_with_cache``, ``to_tokens``, ``to_str_tokens``, tokenizer
``tokenize`` / ``str_tokens``   a text's token ids with the forward arguments that go with them
                                (an encoder's), the string tokens of ids, an encoder's
                                ``encoder_output``
``layer_runs(tokens)``          runs that resume from a block's residual stream
                                (:class:`LayerRunner`)
``mlp_input_hook(layer)``       the hook holding a dense MLP's normalised input, and its value
                                for a residual input (exact runs patch it before projecting)
==============================  ==================================================================

:func:`tl_attnonly.adapt.analysis_model` picks the adapter. The adapters:

* :class:`tl_attnonly.hooked.adapter.HookedAdapter`: an :class:`~tl_attnonly.AttnOnlyTransformer`
  or :class:`~tl_attnonly.AttnOnlyEncoder` (TransformerLens 3.x), or an unconverted
  ``HookedTransformer`` for the tools that need no neuron-heads (IOI roles, datasets).
* :class:`tl_attnonly.bridge.adapter.BridgeAdapter`: a ``TransformerBridge`` converted with
  :func:`tl_attnonly.convert` (TransformerLens 3.9 and 4.x; raw or compatibility mode), or an
  unconverted one for the tools that need no neuron-heads.

Where the two kinds differ, the adapter says so through the interface (``can_resume``,
``prefix_reuse``, ``is_encoder``, ``cfg.post_norm``), never through its class; where layers differ
(plain or gated, dense or experts, converted or not), the layer says so (:class:`MLPLayer`), never
through its class either.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from jaxtyping import Float, Int

from tl_attnonly.mlp_protocol import (
    ConvertedMLP,
    ExpertsLayerView,
    GatedNeuronHeadLayerView,
    MLPLayer,
    NeuronHeadLayerView,
    PlainNeuronHeadLayerView,
    UnconvertedMLP,
)

Tensor = torch.Tensor
#: Forward hooks: ``(hook name or filter, function)`` pairs, as ``run_with_hooks`` takes them.
Hooks = Sequence[tuple[Any, Callable]]


@dataclass(frozen=True)
class ModelFacts:
    """The config facts analysis reads, under TransformerLens's ``HookedTransformerConfig`` names.

    Built by the adapters from the model's own config and structure (a bridge's config does not
    say everything: post-norms, for one, are read from the blocks).
    """

    n_layers: int
    n_heads: int
    n_key_value_heads: int | None
    d_model: int
    d_head: int
    d_mlp: int | None
    d_vocab: int
    d_vocab_out: int
    n_ctx: int
    act_fn: str | None
    positional_embedding_type: str
    normalization_type: str | None
    attention_dir: str
    parallel_attn_mlp: bool
    #: Norms after each sublayer (Gemma 2/3 ``use_normalization_before_and_after``, OLMo 2/3
    #: post-norm blocks), or of the residual stream itself after each sublayer's add (GPT-1,
    #: OPT's ``do_layer_norm_before=False``): the residual stream is then no plain sum of head
    #: outputs (:mod:`tl_attnonly.analysis.post_norm` says how it is one in a run).
    post_norm: bool
    use_qk_norm: bool
    attn_only: bool
    gated_mlp: bool
    default_prepend_bos: bool
    device: torch.device
    dtype: torch.dtype
    #: The model's own architecture name where it has one (for messages).
    original_architecture: str | None = None

    @property
    def use_normalization_before_and_after(self) -> bool:
        """TransformerLens's name of :attr:`post_norm`."""
        return self.post_norm


@runtime_checkable
class Norm(Protocol):
    """A normalisation as analysis needs it: its maths, and calling it fires no hook.

    ``norm(x) = (x - mean(x) if centred else x) / sqrt(mean(x_c ** 2) + eps) * w + b`` over the
    last axis (``w`` and ``b`` absent: 1 and 0).
    """

    @property
    def centred(self) -> bool:
        """Whether the mean is subtracted first (LayerNorm; RMSNorm: no)."""
        ...

    @property
    def eps(self) -> float: ...

    @property
    def w(self) -> torch.Tensor | None:
        """The gain actually applied ``[d_model]`` (Gemma's ``1 + weight``), or ``None``."""
        ...

    @property
    def b(self) -> torch.Tensor | None: ...

    @property
    def hook_scale(self) -> str | None:
        """The name of the hook that sees this norm's scale ``sqrt(mean(x_c ** 2) + eps)``
        ``[..., 1]`` in a run (``blocks.0.ln1_post.hook_scale``), or ``None`` where none does."""
        ...

    def __call__(
        self, x: Float[torch.Tensor, "... d_model"]
    ) -> Float[torch.Tensor, "... d_model"]: ...


@runtime_checkable
class AttentionWeights(Protocol):
    """One attention layer's weights in TransformerLens's shapes (biases zero where absent).

    ``W_K``, ``W_V``, ``b_K``, ``b_V`` are per query head (grouped-query attention: repeated, as
    TransformerLens's ``GroupedQueryAttention.W_K``); with grouped-query attention the per
    key/value head weights are ``_W_K``, ``_W_V``, ``_b_K``, ``_b_V`` too.
    """

    @property
    def W_Q(self) -> Float[torch.Tensor, "n_heads d_model d_head"]: ...
    @property
    def W_K(self) -> Float[torch.Tensor, "n_heads d_model d_head"]: ...
    @property
    def W_V(self) -> Float[torch.Tensor, "n_heads d_model d_head"]: ...
    @property
    def W_O(self) -> Float[torch.Tensor, "n_heads d_head d_model"]: ...
    @property
    def b_Q(self) -> Float[torch.Tensor, "n_heads d_head"]: ...
    @property
    def b_K(self) -> Float[torch.Tensor, "n_heads d_head"]: ...
    @property
    def b_V(self) -> Float[torch.Tensor, "n_heads d_head"]: ...
    @property
    def b_O(self) -> Float[torch.Tensor, " d_model"]: ...


@dataclass(frozen=True)
class Block:
    """One block as analysis reads it."""

    #: The attention layer's weights.
    attn: AttentionWeights
    #: The block's MLP: the dense neuron-head layer, which the tools read. Every MLP says what it
    #: is (:class:`MLPLayer`); two kinds have no dense neuron-heads and are refused by
    #: :func:`tl_attnonly.adapt.analysis_model` unless the tool asks for them, so a tool that took
    #: its model from it reads a :class:`NeuronHeadLayerView` here: a mixture of experts
    #: (``is_mixture_of_experts``: an :class:`ExpertsLayerView`, with ``allow_experts=True``) and
    #: an unconverted model's MLP (``converted`` false: an :class:`UnconvertedMLP`, with
    #: ``neuron_heads=False``).
    mlp: NeuronHeadLayerView
    #: The attention layer's input normalisation (``None``: none). On a residual post-LN
    #: (:func:`tl_attnonly.analysis.post_norm.residual_post_norm`: GPT-1, BERT), the norm of the
    #: residual stream after the attention's add, ``LN(resid_pre + attn_out)``, which the MLP
    #: reads.
    ln1: Norm | None
    #: The MLP's input normalisation (``None``: none). On a residual post-LN, the norm after the
    #: MLP's add, ``LN(mid + mlp_out)``: the block's output.
    ln2: Norm | None
    #: The normalisation of the attention layer's output before it is added to the residual
    #: stream (Gemma 2/3's ``ln1_post``, OLMo 2/3's post-norm; ``None``: none).
    ln1_post: Norm | None = None
    #: The same for the MLP's output (``ln2_post``).
    ln2_post: Norm | None = None


class LayerRunner(Protocol):
    """Runs of one token batch that start at a block, from a given residual stream."""

    #: Whether :meth:`run` may skip unchanged leading positions (``first_pos``).
    prefix_reuse: bool

    def recording(self) -> AbstractContextManager[None]:
        """A context in which the caller runs the full pass of the runner's batch; what the
        runs from a block need of that pass (a bridge: its blocks' other arguments) is taken
        from it instead of a pass of the runner's own."""
        ...

    def run(
        self,
        resid: Tensor,
        layer: int,
        hooks: Hooks,
        first_pos: int,
        prefix: Tensor | None,
        *,
        logit_positions: Tensor | None = None,
    ):
        """Logits ``[copies_batch, pos, d_vocab]`` of ``resid`` ``[copies_batch, pos, d_model]``
        (copies of the batch stacked on the batch axis) entering block ``layer`` (``n_layers``:
        only the final norm and the unembedding), with the forward ``hooks``. ``resid`` equals the
        batch's own residual stream before ``first_pos``, whose logits ``prefix``
        ``[batch, pos, d_vocab]`` are (where :attr:`prefix_reuse` holds, only positions
        ``first_pos..`` need to run). ``logit_positions`` ``[batch]``: the runner may compute
        only those positions' logits (one per row, the same for every copy), the others NaN."""
        ...


@runtime_checkable
class AttnOnlyModel(Protocol):
    """What analysis reads of a model (converted, or not for the tools that need no
    neuron-heads). Implemented by :class:`~tl_attnonly.hooked.adapter.HookedAdapter` and
    :class:`~tl_attnonly.bridge.adapter.BridgeAdapter`."""

    @property
    def model(self) -> Any:
        """The wrapped model (its ``run_with_cache`` makes the caches analysis reads)."""
        ...

    @property
    def kind(self) -> str:
        """``"HookedTransformer"`` or ``"TransformerBridge"`` (for messages only)."""
        ...

    @property
    def cfg(self) -> ModelFacts: ...
    @property
    def blocks(self) -> Sequence[Block]: ...
    @property
    def ln_final(self) -> Norm | None: ...

    @property
    def embed_norm(self) -> Norm | None:
        """The norm of the summed embeddings before block 0 (BERT's ``embed.ln``), or ``None``."""
        ...

    @property
    def embedding_hooks(self) -> tuple[tuple[str, str], ...]:
        """``(label, hook name)`` of each embedding the model sums before its :attr:`embed_norm`
        (without one: before block 0): ``("embed", ...)``, ``("pos_embed", ...)`` and an
        encoder's ``("token_type_embed", ...)``; a tool takes those its cache holds. (A bridge's
        ``hook_embed`` is the embedding norm's output where there is one, BERT's and BLOOM's.)"""
        ...

    @property
    def is_encoder(self) -> bool:
        """Whether the model is a BERT-style encoder (post-LN, bidirectional)."""
        ...

    @property
    def can_resume(self) -> bool:
        """Whether runs can start at a block (:meth:`layer_runs`)."""
        ...

    @property
    def is_converted(self) -> bool: ...
    @property
    def neuron_heads(self) -> list[ConvertedMLP]:
        """Every block's neuron-head layer (``[]`` for a model that is not converted)."""
        ...

    @property
    def n_heads_per_neuron(self) -> int: ...
    @property
    def n_neuron_heads(self) -> int: ...
    @property
    def W_E(self) -> Float[torch.Tensor, "d_vocab d_model"]: ...
    @property
    def W_U(self) -> Float[torch.Tensor, "d_model d_vocab_out"]: ...
    @property
    def b_U(self) -> Float[torch.Tensor, " d_vocab_out"]: ...
    @property
    def tokenizer(self) -> Any: ...
    @property
    def hook_dict(self) -> dict[str, Any]: ...
    @property
    def embed_hooks(self) -> tuple[str, ...]:
        """The hooks whose outputs sum to the residual stream entering block 0 (a decoder):
        ``hook_embed``, with ``hook_pos_embed`` for learned or sinusoidal positions; where such
        positions have no hook of their own (XGLM's sinusoidal embedding on a bridge), the block's
        input ``blocks.0.hook_resid_pre`` alone, which is then the embeddings' sum."""
        ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def run_with_hooks(self, *args: Any, **kwargs: Any) -> Any: ...
    def run_with_cache(self, *args: Any, **kwargs: Any) -> Any: ...
    def hooks(self, *args: Any, **kwargs: Any) -> Any: ...
    def to_tokens(self, *args: Any, **kwargs: Any) -> Any: ...
    def to_str_tokens(self, *args: Any, **kwargs: Any) -> Any: ...
    def to_single_token(self, string: str) -> int: ...

    def tokenize(
        self, text: str | list[str]
    ) -> tuple[Int[torch.Tensor, "batch pos"], dict[str, Any]]:
        """The token ids of ``text``, and the keyword arguments a forward pass of them takes
        with them (an encoder's ``token_type_ids`` and ``one_zero_attention_mask``; none for a
        decoder)."""
        ...

    def str_tokens(self, tokens: Int[torch.Tensor, " pos"]) -> list[str]:
        """The string token of each id (the id as text where the model has no tokenizer)."""
        ...

    def encoder_output(
        self,
        tokens: Int[torch.Tensor, "batch pos"],
        token_type_ids: Int[torch.Tensor, "batch pos"] | None = None,
        attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        """An encoder's final hidden states (``HookedEncoder.encoder_output``: its blocks'
        output, without the head), with the hooks in force."""
        ...

    def parameters(self) -> Any: ...
    def tokens_to_residual_directions(self, tokens: Any) -> torch.Tensor: ...
    def set_use_neuron_result(self, use_neuron_result: bool) -> None: ...
    def layer_runs(self, tokens: Int[torch.Tensor, "batch pos"]) -> LayerRunner: ...
    def mlp_input_hook(
        self, layer: int
    ) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]] | None:
        """Where a dense converted MLP's normalised input can be replaced before its projections:
        ``(hook name, value)``, ``value(x)`` being what that hook holds when the MLP's residual
        input is ``x [batch, pos, d_model]``, in the model's own arithmetic (an
        ``AttnOnlyTransformer``: ``blocks.{l}.ln2.hook_normalized``, the norm's value before its
        weight; a bridge: ``blocks.{l}.mlp.hook_in``, the norm's output). None where there is
        none (no norm before the MLP, a mixture of experts, a model not converted)."""
        ...


#: What a public analysis function takes as its model: an :class:`~tl_attnonly.AttnOnlyTransformer`,
#: an :class:`~tl_attnonly.AttnOnlyEncoder`, a ``TransformerBridge`` converted with
#: :func:`tl_attnonly.convert`, or an :class:`AttnOnlyModel` (what
#: :func:`tl_attnonly.adapt.analysis_model` makes of any of them).
ModelLike = Any


#: The hook of learned or sinusoidal position embeddings, and block 0's input (their sum with the
#: token embeddings): :attr:`AttnOnlyModel.embed_hooks`.
POS_EMBED_HOOK = "hook_pos_embed"
BLOCK_INPUT_HOOK = "blocks.0.hook_resid_pre"


class AdapterBase:
    """What both adapters share: the calls passed to the wrapped model as they are, and what
    follows from the weights alone. Subclasses set :attr:`model`, :attr:`cfg`, :attr:`blocks`,
    :attr:`ln_final` and the neuron-head properties."""

    model: Any
    kind: str
    cfg: ModelFacts
    blocks: list[Block]
    ln_final: Norm | None
    embed_norm: Norm | None = None
    is_encoder: bool

    #: The embeddings' hooks of a decoder (an encoder's adapter names its own).
    embedding_hooks: tuple[tuple[str, str], ...] = (
        ("embed", "hook_embed"),
        ("pos_embed", POS_EMBED_HOOK),
    )

    @property
    def W_E(self) -> Float[torch.Tensor, "d_vocab d_model"]:
        return self.model.W_E

    @property
    def W_U(self) -> Float[torch.Tensor, "d_model d_vocab_out"]:
        return self.model.W_U

    @property
    def b_U(self) -> Float[torch.Tensor, " d_vocab_out"]:
        bias = self.model.b_U
        if isinstance(bias, torch.Tensor):
            return bias
        return self.W_U.new_zeros(self.W_U.shape[-1])

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def hook_dict(self) -> dict[str, Any]:
        return self.model.hook_dict

    @functools.cached_property
    def embed_hooks(self) -> tuple[str, ...]:  # once: a bridge's hook_dict is built per read
        if self.cfg.positional_embedding_type != "standard":
            return ("hook_embed",)
        if POS_EMBED_HOOK in self.hook_dict:
            return ("hook_embed", POS_EMBED_HOOK)
        return (BLOCK_INPUT_HOOK,)

    def mlp_input_hook(
        self, layer: int
    ) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]] | None:
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def run_with_hooks(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.run_with_hooks(*args, **kwargs)

    def run_with_cache(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.run_with_cache(*args, **kwargs)

    def hooks(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.hooks(*args, **kwargs)

    def to_tokens(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.to_tokens(*args, **kwargs)

    def to_str_tokens(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.to_str_tokens(*args, **kwargs)

    def to_single_token(self, string: str) -> int:
        return self.model.to_single_token(string)

    def tokenize(
        self, text: str | list[str]
    ) -> tuple[Int[torch.Tensor, "batch pos"], dict[str, Any]]:
        """The model's ``to_tokens(text)``; a decoder's forward takes nothing else with them."""
        return self.model.to_tokens(text), {}

    def str_tokens(self, tokens: Int[torch.Tensor, " pos"]) -> list[str]:
        """The model's ``to_str_tokens``; an encoder (which has none): its tokenizer's
        ``convert_ids_to_tokens``; no tokenizer: the ids as text."""
        if self.tokenizer is None:
            return [str(int(t)) for t in tokens]
        if self.is_encoder:
            return list(self.tokenizer.convert_ids_to_tokens(tokens.tolist()))
        return list(self.to_str_tokens(tokens))

    def encoder_output(
        self,
        tokens: Int[torch.Tensor, "batch pos"],
        token_type_ids: Int[torch.Tensor, "batch pos"] | None = None,
        attention_mask: Int[torch.Tensor, "batch pos"] | None = None,
    ) -> Float[torch.Tensor, "batch pos d_model"]:
        """The model's own ``encoder_output`` (a ``HookedEncoder``'s; a decoder has none)."""
        return self.model.encoder_output(tokens, token_type_ids, attention_mask)

    def parameters(self) -> Any:
        return self.model.parameters()

    def tokens_to_residual_directions(
        self, tokens: Int[torch.Tensor, "..."]
    ) -> Float[torch.Tensor, "... d_model"]:
        """The unembedding columns of ``tokens``: ``W_U[:, tokens]`` moved to the last axis
        (TransformerLens's ``tokens_to_residual_directions`` for a tensor of tokens)."""
        tokens = torch.as_tensor(tokens, device=self.W_U.device)
        return self.W_U[:, tokens].movedim(0, -1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.model).__name__})"


__all__ = [
    "ModelLike",
    "AdapterBase",
    "AttentionWeights",
    "AttnOnlyModel",
    "Block",
    "ConvertedMLP",
    "ExpertsLayerView",
    "GatedNeuronHeadLayerView",
    "LayerRunner",
    "MLPLayer",
    "ModelFacts",
    "NeuronHeadLayerView",
    "Norm",
    "PlainNeuronHeadLayerView",
    "UnconvertedMLP",
]
