"""A ``TransformerBridge`` (converted by :func:`tl_attnonly.convert`, or not) as an
:class:`~tl_attnonly.protocol.AttnOnlyModel`: how the analysis tools read a bridge.

What differs from :class:`~tl_attnonly.hooked.adapter.HookedAdapter`, and how it is bridged:

* **Weights.** The bridge's attention components give TransformerLens-shaped ``W_Q`` ... ``W_O``
  (TL 3.9 and 4.x); :class:`BridgeAttention` fills absent biases with zeros and repeats grouped
  key/value heads per query head, as ``GroupedQueryAttention.W_K`` does. The neuron-head layers
  are the converted bridge's (:func:`tl_attnonly.bridge.neuron_head_layers`); an unconverted
  MLP is its Hugging Face module wrapped as an :class:`~tl_attnonly.mlp_protocol.UnconvertedMLP`.
* **Norms.** :class:`BridgeNorm` is the bridge's own normalisation maths (TransformerLens's
  python path: LayerNorm or RMSNorm, Gemma's ``1 + weight``), computed without firing hooks.
* **Facts** the bridge's config does not state are read from its structure: norms after each
  sublayer (Gemma 2's ``ln1_post`` / ``ln2_post``), parallel blocks, grouped-query attention.
* **Runs from a block** (:mod:`tl_attnonly.bridge.layer_runner`): the bridge's blocks from
  ``l`` on, called with the arguments a full pass of the batch gave them, then the final norm and
  the unembedding; where that is not exact, TransformerLens 4.x's ``start_at_layer`` or (3.x) a
  full pass with the residual stream entering block ``l`` replaced.
* **Hooks by name** (:mod:`tl_attnonly.bridge.hook_names`). ``run_with_hooks`` and ``hooks``
  resolve hook names once instead of once per hook as the bridge's own ``run_with_hooks`` does on
  TransformerLens 3.x (each read of a bridge's ``hook_dict`` rebuilds every alias), then call the
  bridge's ``forward``; hook functions see ``hook.name`` as the name they were added by.
* **Raw and compatibility mode.** Everything is read live from the components, so both work;
  in compatibility mode the weights are the processed ones (folded norms), exactly as the bridge
  runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn as nn
from jaxtyping import Float, Int

from tl_attnonly._compat import BRIDGE_STARTS_AT_LAYER, child_module
from tl_attnonly.bridge.attention_layout import check_z_layout
from tl_attnonly.bridge.experts import mounted_experts
from tl_attnonly.bridge.hook_names import RUN_OPTIONS, BridgeHooks, HookAs, named_hooks
from tl_attnonly.bridge.layer_runner import RESUMABLE, BridgeLayerRunner, blocks_can_be_called
from tl_attnonly.components.neuron_head_base import NeuronHeadBase
from tl_attnonly.mlp_protocol import ExpertsMLP
from tl_attnonly.protocol import (
    AdapterBase,
    Block,
    ConvertedMLP,
    ModelFacts,
    NeuronHeadLayerView,
    UnconvertedMLP,
)


class BridgeNorm:
    """A bridge normalisation component as a :class:`~tl_attnonly.protocol.Norm`.

    Calling it computes what the bridge's ``NormalizationBridge`` computes, without firing its
    hooks: the wrapped Hugging Face module where the bridge calls it (its native path, e.g.
    ``LlamaRMSNorm``, which works in float32 inside), else TransformerLens's python path: centre
    (LayerNorm), divide by ``sqrt(mean(x**2) + eps)``, times the weight (Gemma: ``1 + weight``),
    plus the bias (LayerNorm). ``centred``, ``eps``, ``w`` and ``b`` are that maths' parameters
    (what edge attribution linearises).

    Args:
        component: The bridge's ``NormalizationBridge`` (``blocks[l].ln1``, ``ln_final``, ...).
        config_eps: The bridge config's ``eps``.
    """

    def __init__(self, component: Any, config_eps: float):
        self.component = component
        self.centred = not bool(getattr(component, "uses_rms_norm", False))
        original = getattr(component, "original_component", None)
        eps = getattr(original, "eps", None)
        if eps is None:
            eps = getattr(original, "variance_epsilon", None)
        folding = bool(getattr(component.config, "layer_norm_folding", False))
        # The python path reads the config's eps; the folded (HF) path the module's own.
        self.eps = float(eps if folding and eps is not None else config_eps)

    @property
    def _offset(self) -> bool:
        offset = getattr(self.component, "uses_weight_offset", None)
        if offset is None:  # TransformerLens 3.x: the config says it for RMS norms
            offset = not self.centred and bool(
                getattr(self.component.config, "rmsnorm_uses_offset", False)
            )
        return bool(offset)

    @property
    def w(self) -> torch.Tensor | None:
        original = getattr(self.component, "original_component", None)
        weight = getattr(original, "weight", None)
        if not isinstance(weight, torch.Tensor):
            return None
        return 1.0 + weight if self._offset else weight

    @property
    def b(self) -> torch.Tensor | None:
        if not self.centred:
            return None
        original = getattr(self.component, "original_component", None)
        bias = getattr(original, "bias", None)
        return bias if isinstance(bias, torch.Tensor) else None

    @property
    def hook_scale(self) -> str | None:
        return getattr(getattr(self.component, "hook_scale", None), "name", None)

    def __call__(self, x: Float[torch.Tensor, "... d_model"]) -> Float[torch.Tensor, "... d_model"]:
        component = self.component
        if getattr(component, "use_native_layernorm_autograd", False) or getattr(
            component.config, "layer_norm_folding", False
        ):  # the bridge runs the Hugging Face module itself (e.g. float32 inside LlamaRMSNorm)
            return component.original_component(x)
        dtype = x.dtype
        h = x if dtype in (torch.float32, torch.float64) else x.float()
        if self.centred:
            h = h - h.mean(-1, keepdim=True)
        h = h / (h.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        w, b = self.w, self.b
        if w is not None:
            h = h * w
        if b is not None:
            h = h + b
        return h.to(dtype)


def n_key_value_heads(component: Any, n_heads: int) -> int:
    """Key/value heads of a bridge attention component (``W_K``'s first axis).

    TransformerLens's multi-head latent attention (DeepSeek-V2/V3's ``MLAAttentionBridge``) has
    no ``W_K``: reading it raises ``NotImplementedError``. Its keys and values are per query head
    (decompressed from a shared latent), so it has ``n_heads``; its weights stay unavailable
    (a tool that reads them gets TransformerLens's error), while the tools that only run the
    model and read its hooks (the expert tools) work.
    """
    try:
        return int(component.W_K.shape[0])
    except NotImplementedError:  # multi-head latent attention
        return n_heads


class BridgeAttention:
    """A bridge attention component's weights in TransformerLens's shapes
    (:class:`~tl_attnonly.protocol.AttentionWeights`).

    Args:
        component: The bridge's attention component (``blocks[l].attn``).
        n_heads: Query heads.
        d_model: Residual width (for an absent ``b_O``).
    """

    def __init__(self, component: Any, n_heads: int, d_model: int):
        self.component = component
        self.n_heads = n_heads
        self.d_model = d_model
        self.n_kv_heads = n_key_value_heads(component, n_heads)
        if self.n_kv_heads != n_heads:  # grouped-query attention: TL's per-kv-head names
            self._W_K = self._kv("W_K")
            self._W_V = self._kv("W_V")
            self._b_K = self._kv_bias("b_K")
            self._b_V = self._kv_bias("b_V")

    def _bias(self, name: str, like: torch.Tensor) -> torch.Tensor:
        bias = getattr(self.component, name)
        return (
            bias
            if isinstance(bias, torch.Tensor)
            else like.new_zeros(like.shape[0], like.shape[-1])
        )

    def _kv(self, name: str) -> torch.Tensor:
        return getattr(self.component, name)

    def _kv_bias(self, name: str) -> torch.Tensor:
        return self._bias(name, self._kv("W_" + name[-1]))

    def _per_query_head(self, t: torch.Tensor) -> torch.Tensor:
        if self.n_kv_heads == self.n_heads:
            return t
        return t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=0)

    @property
    def W_Q(self) -> Float[torch.Tensor, "n_heads d_model d_head"]:
        return self.component.W_Q

    @property
    def W_K(self) -> Float[torch.Tensor, "n_heads d_model d_head"]:
        return self._per_query_head(self.component.W_K)

    @property
    def W_V(self) -> Float[torch.Tensor, "n_heads d_model d_head"]:
        return self._per_query_head(self.component.W_V)

    @property
    def W_O(self) -> Float[torch.Tensor, "n_heads d_head d_model"]:
        return self.component.W_O

    @property
    def b_Q(self) -> Float[torch.Tensor, "n_heads d_head"]:
        return self._bias("b_Q", self.component.W_Q)

    @property
    def b_K(self) -> Float[torch.Tensor, "n_heads d_head"]:
        return self._per_query_head(self._kv_bias("b_K"))

    @property
    def b_V(self) -> Float[torch.Tensor, "n_heads d_head"]:
        return self._per_query_head(self._kv_bias("b_V"))

    @property
    def b_O(self) -> Float[torch.Tensor, " d_model"]:
        bias = self.component.b_O
        return bias if isinstance(bias, torch.Tensor) else self.W_O.new_zeros(self.d_model)


def _norm(component: Any, eps: float) -> BridgeNorm | None:
    if component is None:
        return None
    original = getattr(component, "original_component", None)
    if original is None or isinstance(original, torch.nn.Identity):
        return None
    return BridgeNorm(component, eps)


def bridge_mlp(component: Any, cfg: Any) -> NeuronHeadLayerView:
    """A block's MLP component as :attr:`~tl_attnonly.protocol.Block.mlp` holds it: the converted
    bridge's neuron-head layer (a mixture of experts: the neuron-head experts mounted in it); an
    unconverted one (or none) its Hugging Face module as an
    :class:`~tl_attnonly.mlp_protocol.UnconvertedMLP`, gated as the config says.

    Args:
        component: The bridge's MLP component (``blocks[l].mlp``), or ``None``.
        cfg: The bridge's config.
    """
    experts = None if component is None else mounted_experts(component)
    if experts is not None:
        return cast(NeuronHeadLayerView, experts)
    layer = getattr(component, "original_component", None)
    if isinstance(layer, NeuronHeadBase):
        return cast(NeuronHeadLayerView, layer)
    unconverted = UnconvertedMLP(
        layer,
        gated=layer is not None and bool(getattr(cfg, "gated_mlp", False)),
        is_mixture_of_experts=type(component).__name__ == "MoEBridge",
    )
    return cast(NeuronHeadLayerView, unconverted)  # its flags say what it is (Block.mlp)


#: Decoders that normalise the residual stream itself after each sublayer
#: (``LN(resid + sublayer_out)``, as BERT does) where their bridge config has no flag saying so
#: (OPT has one: ``do_layer_norm_before=False``). Their residual stream is no sum of components.
RESIDUAL_POST_LN = frozenset({"OpenAIGPTLMHeadModel"})


def _architecture(bridge: Any) -> str | None:
    cfg = bridge.cfg
    return getattr(cfg, "original_architecture", None) or getattr(cfg, "architecture", None)


#: The Hugging Face name of a norm after the MLP (Gemma 2/3, OLMo 2/3, EXAONE-4): a bridge whose
#: ``ln2`` wraps it has norms after its sublayers under the pre-norms' names.
POST_MLP_NORM = "post_feedforward_layernorm"


def _post_norm_blocks(bridge: Any) -> bool:
    """Whether the bridge's ``ln1`` / ``ln2`` normalise the sublayers' outputs, as on
    TransformerLens 3.9, whose bridge names them so for OLMo 2/3 (as its ``HookedTransformer``
    does: ``POST_NORM_ARCHITECTURES``) and EXAONE-4 (its ``ln2`` wraps the Hugging Face layer's
    ``post_feedforward_layernorm``); TransformerLens 4 names them ``ln1_post`` / ``ln2_post``."""
    from tl_attnonly._compat import POST_NORM_ARCHITECTURES

    if any(child_module(block, "ln1_post") is not None for block in bridge.blocks):
        return False
    ln2 = child_module(bridge.blocks[0], "ln2")
    return (
        _architecture(bridge) in POST_NORM_ARCHITECTURES
        or getattr(ln2, "name", None) == POST_MLP_NORM
    )


def _layer_width(mlps: list[NeuronHeadLayerView], cfg: Any) -> int | None:
    """``d_mlp`` as the converted dense layers hold it (one width for all), else the config's.

    The layers win: TransformerLens's bridge config can say ``4 * d_model`` where the model's
    MLP is narrower (OPT's and XGLM's ``ffn_dim``)."""
    widths = {int(mlp.d_mlp) for mlp in mlps if mlp.converted and not mlp.is_mixture_of_experts}
    return widths.pop() if len(widths) == 1 else getattr(cfg, "d_mlp", None)


def _facts(bridge: Any, gated_mlp: bool, d_mlp: int | None) -> ModelFacts:
    """The facts of ``bridge``; ``gated_mlp``: what its blocks' MLPs say (``gated``); ``d_mlp``:
    their width (:func:`_layer_width`)."""
    cfg = bridge.cfg
    blocks = list(bridge.blocks)
    first = blocks[0]
    attn: Any = child_module(first, "attn")
    post_norm = (
        bool(getattr(cfg, "use_normalization_before_and_after", False))
        or getattr(cfg, "do_layer_norm_before", True) is False  # OPT's post-LN (opt-350m)
        or _architecture(bridge) in RESIDUAL_POST_LN
        or _post_norm_blocks(bridge)
        or any(
            child_module(block, name) is not None
            for block in blocks
            for name in ("ln1_post", "ln2_post")
        )
    )
    qk_norm = bool(getattr(cfg, "use_qk_norm", False)) or any(
        child_module(cast(nn.Module, child_module(block, "attn")), name) is not None
        for block in blocks
        for name in ("q_norm", "k_norm")
    )
    n_kv = n_key_value_heads(attn, cfg.n_heads) if attn is not None else cfg.n_heads
    W_E = bridge.W_E
    return ModelFacts(
        n_layers=len(blocks),
        n_heads=cfg.n_heads,
        n_key_value_heads=n_kv if n_kv != cfg.n_heads else None,
        d_model=cfg.d_model,
        d_head=cfg.d_head,
        d_mlp=d_mlp,
        d_vocab=cfg.d_vocab,
        d_vocab_out=getattr(cfg, "d_vocab_out", cfg.d_vocab),
        n_ctx=cfg.n_ctx,
        act_fn=getattr(cfg, "act_fn", None),
        positional_embedding_type=cfg.positional_embedding_type,
        normalization_type=getattr(cfg, "normalization_type", None),
        attention_dir=getattr(cfg, "attention_dir", "causal"),
        parallel_attn_mlp=bool(getattr(cfg, "parallel_attn_mlp", False))
        or type(first).__name__ == "ParallelBlockBridge",
        post_norm=post_norm,
        use_qk_norm=qk_norm,
        attn_only=False,
        gated_mlp=gated_mlp,
        default_prepend_bos=bool(getattr(cfg, "default_prepend_bos", True)),
        device=W_E.device,
        dtype=W_E.dtype,
        original_architecture=getattr(cfg, "original_architecture", None)
        or getattr(cfg, "architecture", None),
    )


#: The embeddings of a bridge with an embedding norm (BERT's and BLOOM's ``embed_ln``), whose
#: ``hook_embed`` is that norm's output: the components' own hooks, before it (token types where
#: the model has them).
NORMED_EMBEDDING_HOOKS = (
    ("embed", "embed.hook_out"),
    ("pos_embed", "pos_embed.hook_out"),
    ("token_type_embed", "token_type_embed.hook_out"),
)


class BridgeAdapter(AdapterBase):
    """A ``TransformerBridge`` as an :class:`~tl_attnonly.protocol.AttnOnlyModel` (see the module
    docstring for what differs from a ``HookedTransformer`` and how).

    Args:
        bridge: The bridge; read live (weights, hooks, neuron-head layers), never copied.
    """

    kind = "TransformerBridge"

    def __init__(self, bridge: Any):
        self.model = bridge
        mlps = [bridge_mlp(child_module(block, "mlp"), bridge.cfg) for block in bridge.blocks]
        self.cfg = _facts(
            bridge, gated_mlp=any(mlp.gated for mlp in mlps), d_mlp=_layer_width(mlps, bridge.cfg)
        )
        #: A BERT-style encoder (post-LN, bidirectional): TL 4 says ``attention_dir``; TL 3.9's
        #: BERT bridge does not, but its Hugging Face model cannot generate (a masked LM).
        self.is_encoder = self.cfg.attention_dir == "bidirectional" or not bool(
            getattr(bridge.original_model, "can_generate", lambda: True)()
        )
        #: Runs from a block (output deltas, exact circuit runs) are decoder runs.
        self.can_resume = not self.is_encoder
        eps = float(getattr(bridge.cfg, "eps", 1e-5))
        # OLMo 2/3 on TL 3.9: the blocks' ln1 / ln2 are the norms after the sublayers
        pre: tuple[str, str] = ("ln1", "ln2")
        post: tuple[str, str] = ("ln1_post", "ln2_post")
        if _post_norm_blocks(bridge):
            pre, post = ("", ""), pre
        self.blocks: list[Block] = []
        for index, (block, mlp) in enumerate(zip(bridge.blocks, mlps)):
            if mlp.converted and mlp.is_mixture_of_experts:  # dense members refuse, by name
                mlp = cast(NeuronHeadLayerView, ExpertsMLP(mlp, index))
            check_z_layout(child_module(block, "attn"), index)  # per-head hook_z (MLA)
            self.blocks.append(
                Block(
                    attn=BridgeAttention(
                        child_module(block, "attn"), self.cfg.n_heads, self.cfg.d_model
                    ),
                    mlp=mlp,
                    ln1=_norm(child_module(block, pre[0]) if pre[0] else None, eps),
                    ln2=_norm(child_module(block, pre[1]) if pre[1] else None, eps),
                    ln1_post=_norm(child_module(block, post[0]), eps),
                    ln2_post=_norm(child_module(block, post[1]), eps),
                )
            )
        self.ln_final = _norm(getattr(bridge, "ln_final", None), eps)
        #: BERT's embeddings' LayerNorm (``embed_ln``); then ``hook_embed`` is its output.
        self.embed_norm = _norm(getattr(bridge, "embed_ln", None), eps)
        if self.embed_norm is not None:
            self.embedding_hooks = NORMED_EMBEDDING_HOOKS
        #: The bridge's hook names resolved once (:class:`~tl_attnonly.bridge.hook_names.
        #: BridgeHooks`): ``run_with_hooks``, ``hooks`` and the runs from a block add hooks
        #: through it.
        self.bridge_hooks = BridgeHooks(bridge)

    # ------------------------------------------------------------------ neuron-heads
    @property
    def is_converted(self) -> bool:
        from tl_attnonly.bridge.convert import is_converted_bridge

        return is_converted_bridge(self.model)

    @property
    def neuron_heads(self) -> list[ConvertedMLP]:
        from tl_attnonly.bridge.convert import neuron_head_layers

        return list(neuron_head_layers(self.model)) if self.is_converted else []

    @property
    def n_heads_per_neuron(self) -> int:
        layers = self.neuron_heads
        return layers[0].n_heads_per_neuron if layers else 0

    @property
    def n_neuron_heads(self) -> int:
        layers = self.neuron_heads
        return layers[0].n_neuron_heads if layers else 0

    def set_use_neuron_result(self, use_neuron_result: bool) -> None:
        from tl_attnonly.bridge.convert import set_use_neuron_result

        set_use_neuron_result(self.model, use_neuron_result)

    # ------------------------------------------------------------------ hooks by the names asked
    @property
    def hook_dict(self) -> dict[str, Any]:
        return dict(self.bridge_hooks.points())

    def run_with_hooks(self, *args: Any, fwd_hooks: Any = (), bwd_hooks: Any = (), **kwargs: Any):
        """The bridge's ``run_with_hooks``, its hooks added by :class:`BridgeHooks` (names resolved
        once, not once per hook): the hooks on, then the bridge's ``forward``, then the hooks off.
        Options only TransformerLens's ``run_with_hooks`` takes (``stop_at_layer``,
        ``reset_hooks_end``, ...) go to it as they are."""
        if kwargs.keys() & RUN_OPTIONS:
            return self.model.run_with_hooks(
                *args, fwd_hooks=named_hooks(fwd_hooks), bwd_hooks=named_hooks(bwd_hooks), **kwargs
            )
        with self.bridge_hooks.added(fwd_hooks, bwd_hooks, kwargs.get("start_at_layer")):
            return self.model.forward(*args, **kwargs)

    def hooks(self, fwd_hooks: Any = (), bwd_hooks: Any = (), **kwargs: Any) -> Any:
        if kwargs:  # reset_hooks_end / clear_contexts: TransformerLens's own context manager
            return self.model.hooks(
                fwd_hooks=named_hooks(fwd_hooks), bwd_hooks=named_hooks(bwd_hooks), **kwargs
            )
        return self.bridge_hooks.added(fwd_hooks, bwd_hooks)

    def mlp_input_hook(
        self, layer: int
    ) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]] | None:
        block = self.blocks[layer]
        if block.ln2 is None or not self.is_converted or block.mlp.is_mixture_of_experts:
            return None
        name = f"blocks.{layer}.mlp.hook_in"
        return (name, block.ln2) if name in self.hook_dict else None

    def layer_runs(self, tokens: Int[torch.Tensor, "batch pos"]) -> BridgeLayerRunner:
        if not self.can_resume:
            raise TypeError("An encoder bridge cannot start a forward pass at a layer.")
        # Where the blocks cannot be called again exactly: a 4.x bridge's start_at_layer
        # recomputes rotary and learned positions but not position biases given to every block
        # (ALiBi: BLOOM, MPT, Falcon), which then differ from the full pass: those run full
        # passes with the entering residual replaced.
        starts = BRIDGE_STARTS_AT_LAYER and self.cfg.positional_embedding_type in RESUMABLE
        return BridgeLayerRunner(
            self, tokens, self.cfg.n_layers, starts_at_layer=starts, hook_table=self.bridge_hooks
        )


__all__ = [
    "RESUMABLE",
    "BridgeAdapter",
    "BridgeAttention",
    "BridgeHooks",
    "BridgeLayerRunner",
    "BridgeNorm",
    "HookAs",
    "blocks_can_be_called",
    "bridge_mlp",
    "named_hooks",
]
